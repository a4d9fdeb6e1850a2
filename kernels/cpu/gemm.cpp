// CPU GEMM: row-major fp32 through oneDNN's dnnl_sgemm (ARCHITECTURE.md §2).
// oneDNN shares our OpenMP runtime: called from serial code it uses the
// process's thread count; called inside an OpenMP parallel region (attention
// tiles) it must run single-threaded on the calling thread. oneDNN 2.6 already
// does so (tests/test_kernels_ops.cpp watches the thread count with nesting
// enabled); sgemm_raw pins it anyway so no oneDNN version or OMP_* setting
// can oversubscribe the cores.
#include <omp.h>
#include <oneapi/dnnl/dnnl.h>

#include "kernels/cpu/ops.h"
#include "kernels/op_shapes.h"

namespace origami::cpu {

namespace {

// dnnl rejects K == 0 (lda must be >= 1 and the product is empty), so the
// degenerate case is done here: C = beta · C, with beta == 0 meaning "overwrite"
// (BLAS semantics: NaNs already in C must not survive).
void scale_c(int64_t M, int64_t N, float beta, float* C, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i) {
    float* __restrict c = C + i * ldc;
    if (beta == 0.0f) {
      for (int64_t j = 0; j < N; ++j) c[j] = 0.0f;
    } else {
      for (int64_t j = 0; j < N; ++j) c[j] *= beta;
    }
  }
}

}  // namespace

void sgemm_raw(Trans trans_a, Trans trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
               int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    scale_c(M, N, beta, C, ldc);
    return;
  }
  const char ta = trans_a == Trans::yes ? 'T' : 'N';
  const char tb = trans_b == Trans::yes ? 'T' : 'N';
  dnnl_status_t st;
  if (omp_in_parallel()) {
    // nthreads-var is per task: setting it to 1 here only affects this
    // thread's call, so oneDNN sizes its team to 1 and opens no nested team.
    const int saved = omp_get_max_threads();
    omp_set_num_threads(1);
    st = dnnl_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    omp_set_num_threads(saved);
  } else {
    st = dnnl_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
  ORIGAMI_CHECK(st == dnnl_success, "dnnl_sgemm(", ta, tb, ", M=", M, ", N=", N, ", K=", K, ", lda=", lda,
                ", ldb=", ldb, ", ldc=", ldc, ") returned status ", static_cast<int>(st));
}

void gemm(const ExecContext& ctx, const Tensor& A, Trans trans_a, const Tensor& B, Trans trans_b, Tensor& C,
          float alpha, float beta) {
  const auto [M, N, K] = gemm_shapes(A, trans_a, B, trans_b, C);
  ORIGAMI_CHECK(A.dtype() == DType::f32 && B.dtype() == DType::f32 && C.dtype() == DType::f32,
                "gemm is fp32 on CPU; got A ", to_string(A.dtype()), ", B ", to_string(B.dtype()), ", C ",
                to_string(C.dtype()));
  ORIGAMI_CHECK(A.device().is_host() && B.device().is_host() && C.device().is_host(),
                "CPU gemm on a device tensor");
  sgemm_raw(trans_a, trans_b, M, N, K, alpha, A.f32(), A.cols(), B.f32(), B.cols(), beta, C.f32(), C.cols());
}

}  // namespace origami::cpu

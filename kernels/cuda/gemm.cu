// CUDA GEMM (kernels/gemm.h) through cuBLASLt, the cuBLASLt plan cache of
// the context state (kernels/cuda/blas.h), the beta-scaling kernel the empty
// products need.
//
// Row-major to column-major: a row-major [r, c] matrix is a column-major
// [c, r] one with the same leading dimension c. So C = op(A)·op(B) is run as
// Cᵀ = op(B)ᵀ·op(A)ᵀ: cuBLAS's A is our B (same trans flag), its B is our A,
// m = N, n = M, k = K, and every leading dimension is the tensor's last dim.
//
// Precision: fp32 compute (CUBLAS_COMPUTE_32F) for both dtypes, never TF32,
// alpha and beta fp32; bf16 A/B write C in bf16 (rounded once, to nearest
// even, after alpha·acc + beta·C in fp32) or in f32. The fp32 path runs
// fp32 FMA kernels: it matches oneDNN's sgemm to rounding (~1e-6), not
// bitwise (the summation order is cuBLAS's, not the CPU's).
//
// Determinism: the heuristic is a pure function of the plan key (no timing),
// so a shape always gets the same algorithm; split-K is allowed only with
// the fp32 workspace reduction (CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE, a
// separate reduction kernel in a fixed order), never the in-place or
// output-type schemes, which would round partial sums to bf16. cuBLAS
// documents bitwise run-to-run results for a given toolkit, architecture and
// SM count when each stream has its own workspace, which the context gives.
#include <algorithm>
#include <vector>

#include "kernels/cuda/blas.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/op_shapes.h"

namespace origami::cuda {

namespace {

cudaDataType_t cuda_type(DType dt) { return dt == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F; }

// The largest power of two dividing the address, at most 256 (what
// cuBLASLt's alignment preferences take).
uint32_t alignment(const void* p) {
  const auto u = reinterpret_cast<uintptr_t>(p);
  const uintptr_t low = u & (~u + 1);
  return low == 0 || low > 256 ? 256u : static_cast<uint32_t>(low);
}

std::string describe(const LtMatmul& mm) {
  return detail::concat("m=", mm.m, " n=", mm.n, " k=", mm.k, " op_a=", mm.op_a == CUBLAS_OP_T ? "T" : "N",
                        " op_b=", mm.op_b == CUBLAS_OP_T ? "T" : "N", " lda=", mm.lda, " ldb=", mm.ldb, " ldc=", mm.ldc,
                        " ", to_string(mm.ab), " -> ", to_string(mm.c_type));
}

template <class V>
void set_desc(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const V& v) {
  CUBLAS_CHECK(cublas().lt_matmul_desc_set_attribute(d, attr, &v, sizeof(v)));
}
template <class V>
void set_pref(cublasLtMatmulPreference_t p, cublasLtMatmulPreferenceAttributes_t attr, const V& v) {
  CUBLAS_CHECK(cublas().lt_preference_set_attribute(p, attr, &v, sizeof(v)));
}

LtPlan build_plan(ExecContext::CudaState& s, const LtMatmul& mm, const LtKey& key) {
  const CublasLibrary& api = cublas();
  LtPlan plan;
  CUBLAS_CHECK(api.lt_matmul_desc_create(&plan.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  set_desc(plan.op, CUBLASLT_MATMUL_DESC_TRANSA, mm.op_a);
  set_desc(plan.op, CUBLASLT_MATMUL_DESC_TRANSB, mm.op_b);
  const bool ta = mm.op_a == CUBLAS_OP_T, tb = mm.op_b == CUBLAS_OP_T;
  CUBLAS_CHECK(api.lt_matrix_layout_create(&plan.a, cuda_type(mm.ab), ta ? mm.k : mm.m, ta ? mm.m : mm.k, mm.lda));
  CUBLAS_CHECK(api.lt_matrix_layout_create(&plan.b, cuda_type(mm.ab), tb ? mm.n : mm.k, tb ? mm.k : mm.n, mm.ldb));
  CUBLAS_CHECK(api.lt_matrix_layout_create(&plan.c, cuda_type(mm.c_type), mm.m, mm.n, mm.ldc));

  cublasLtMatmulPreference_t pref = nullptr;
  CUBLAS_CHECK(api.lt_preference_create(&pref));
  set_pref(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<uint64_t>(s.workspace_bytes));
  set_pref(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
           static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE));
  set_pref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_a);
  set_pref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_b);
  set_pref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_c);
  set_pref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_c);
  cublasLtMatmulHeuristicResult_t result{};
  int returned = 0;
  const cublasStatus_t st =
      api.lt_algo_get_heuristic(s.lt, plan.op, plan.a, plan.b, plan.c, plan.c, pref, 1, &result, &returned);
  api.lt_preference_destroy(pref);
  ORIGAMI_CHECK(st == CUBLAS_STATUS_SUCCESS && returned > 0 && result.state == CUBLAS_STATUS_SUCCESS,
                "cuBLASLt has no algorithm for ", describe(mm), " (alignments ", key.align_a, "/", key.align_b, "/",
                key.align_c, " bytes): ", api.status_name(st != CUBLAS_STATUS_SUCCESS ? st : result.state));
  plan.algo = result.algo;
  return plan;
}

// ---------------------------------------------------------------- C = beta · C

constexpr int kMaxScaleSlices = 512;
struct ScaleSlices {
  int64_t offset[kMaxScaleSlices];  // elements from the base
};

// One slice per blockIdx.y; a grid-stride loop over its elements (coalesced).
template <class T>
__global__ void scale_kernel(T* base, int64_t elems, const __grid_constant__ ScaleSlices s, float beta) {
  T* p = base + s.offset[blockIdx.y];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < elems; i += stride)
    p[i] = from_f32<T>(beta == 0.0f ? 0.0f : beta * to_f32(p[i]));
}

}  // namespace

size_t LtKeyHash::operator()(const LtKey& k) const {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the fields
  auto mix = [&](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
  mix(static_cast<uint64_t>(k.ab) | static_cast<uint64_t>(k.c_type) << 8 | static_cast<uint64_t>(k.op_a) << 16 |
      static_cast<uint64_t>(k.op_b) << 24);
  for (int64_t v : {k.m, k.n, k.k, k.lda, k.ldb, k.ldc}) mix(static_cast<uint64_t>(v));
  mix(static_cast<uint64_t>(k.align_a) | static_cast<uint64_t>(k.align_b) << 16 |
      static_cast<uint64_t>(k.align_c) << 32);
  return static_cast<size_t>(h);
}

void destroy_plan(LtPlan& plan) {
  const CublasLibrary& api = cublas();
  if (plan.a) api.lt_matrix_layout_destroy(plan.a);
  if (plan.b) api.lt_matrix_layout_destroy(plan.b);
  if (plan.c) api.lt_matrix_layout_destroy(plan.c);
  if (plan.op) api.lt_matmul_desc_destroy(plan.op);
  plan = LtPlan{};
}

void lt_matmul(ExecContext::CudaState& s, const LtMatmul& mm) {
  ORIGAMI_CHECK(mm.m > 0 && mm.n > 0 && mm.k > 0, "lt_matmul on an empty product: ", describe(mm));
  const LtKey key{static_cast<int32_t>(mm.ab), static_cast<int32_t>(mm.c_type), static_cast<int32_t>(mm.op_a),
                  static_cast<int32_t>(mm.op_b), mm.m, mm.n, mm.k, mm.lda, mm.ldb, mm.ldc,
                  alignment(mm.a), alignment(mm.b), alignment(mm.c)};
  std::lock_guard lock(s.plans_mu);
  auto it = s.plans.find(key);
  if (it == s.plans.end()) {
    if (s.plans.size() >= kMaxLtPlans) {
      // Descriptors are host objects read during cublasLtMatmul only, so
      // matmuls still queued on the stream do not need them.
      for (auto& [k, plan] : s.plans) destroy_plan(plan);
      s.plans.clear();
    }
    it = s.plans.emplace(key, build_plan(s, mm, key)).first;
  }
  const LtPlan& plan = it->second;
  CUBLAS_CHECK(cublas().lt_matmul(s.lt, plan.op, &mm.alpha, mm.a, plan.a, mm.b, plan.b, &mm.beta, mm.c, plan.c, mm.c,
                                  plan.c, &plan.algo, s.workspace, s.workspace_bytes, s.stream));
}

void scale_matrices(cudaStream_t stream, DType dt, void* base, int64_t elems, std::span<const int64_t> offsets,
                    float beta) {
  if (elems == 0) return;
  constexpr int kThreads = 256;
  for (size_t first = 0; first < offsets.size(); first += kMaxScaleSlices) {
    const size_t count = std::min<size_t>(kMaxScaleSlices, offsets.size() - first);
    ScaleSlices slices{};
    std::copy_n(offsets.begin() + first, count, slices.offset);
    // About 2048 blocks in all, at least one per slice.
    const dim3 grid(grid_for(elems, kThreads, std::max<int64_t>(1, 2048 / static_cast<int64_t>(count))),
                    static_cast<unsigned>(count));
    with_data_type(dt, [&]<class T>() {
      scale_kernel<T><<<grid, kThreads, 0, stream>>>(static_cast<T*>(base), elems, slices, beta);
      CUDA_CHECK_LAUNCH();
    });
  }
}

// ---------------------------------------------------------------- gemm

void gemm(const ExecContext& ctx, const Tensor& A, Trans trans_a, const Tensor& B, Trans trans_b, Tensor& C,
          float alpha, float beta) {
  const auto [M, N, K] = gemm_shapes(A, trans_a, B, trans_b, C);
  check_data_dtype("gemm", A, "A");
  check_same_dtype("gemm", A, "A", B, "B");
  ORIGAMI_CHECK(C.dtype() == A.dtype() || (A.dtype() == DType::bf16 && C.dtype() == DType::f32), "gemm: C is ",
                to_string(C.dtype()), " for ", to_string(A.dtype()), " A and B (C is ", to_string(A.dtype()),
                A.dtype() == DType::bf16 ? " or f32)" : ")");
  if (M == 0 || N == 0) return;
  if (K == 0) {  // the product is empty: C = beta · C, as the CPU does (cuBLASLt takes no k = 0)
    const int64_t whole = 0;
    if (beta != 1.0f) scale_matrices(stream_of(ctx), C.dtype(), C.address(), M * N, {&whole, 1}, beta);
    return;
  }
  LtMatmul mm;
  mm.op_a = trans_b == Trans::yes ? CUBLAS_OP_T : CUBLAS_OP_N;
  mm.op_b = trans_a == Trans::yes ? CUBLAS_OP_T : CUBLAS_OP_N;
  mm.m = N;
  mm.n = M;
  mm.k = K;
  mm.ab = A.dtype();
  mm.c_type = C.dtype();
  mm.a = B.address();
  mm.lda = B.cols();
  mm.b = A.address();
  mm.ldb = A.cols();
  mm.c = C.address();
  mm.ldc = N;
  mm.alpha = alpha;
  mm.beta = beta;
  lt_matmul(state_of(ctx), mm);
}

}  // namespace origami::cuda

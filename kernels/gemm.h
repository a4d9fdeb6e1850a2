// GEMM: C = alpha · op(A) · op(B) + beta · C on row-major matrices.
// CPU: oneDNN dnnl_sgemm (fp32). CUDA (later): cuBLAS.
// Tensors of rank > 2 are read as [prod(leading dims), last dim].
#pragma once
#include "kernels/tensor.h"

namespace origami {

enum class Trans { no, yes };

// op(A) is [M, K], op(B) is [K, N], C is [M, N]; all f32, contiguous.
void gemm(const Tensor& A, Trans trans_a, const Tensor& B, Trans trans_b, Tensor& C, float alpha = 1.0f,
          float beta = 0.0f);

// Raw-pointer form for kernels that tile (attention): row-major with leading
// dimensions, no shape checks. Single-threaded when called inside an OpenMP
// parallel region.
void sgemm_raw(Trans trans_a, Trans trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
               int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

}  // namespace origami

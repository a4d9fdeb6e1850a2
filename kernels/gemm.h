// GEMM: C = alpha · op(A) · op(B) + beta · C on row-major matrices.
// CPU: oneDNN dnnl_sgemm (fp32). CUDA (later): cuBLAS.
// Tensors of rank > 2 are read as [prod(leading dims), last dim].
#pragma once
#include "kernels/context.h"
#include "kernels/tensor.h"

namespace origami {

enum class Trans { no, yes };

// op(A) is [M, K], op(B) is [K, N], C is [M, N]; all f32, contiguous.
void gemm(const ExecContext& ctx, const Tensor& A, Trans trans_a, const Tensor& B, Trans trans_b, Tensor& C,
          float alpha = 1.0f, float beta = 0.0f);

}  // namespace origami

// Small elementwise and reduction ops used around the big kernels.
#pragma once
#include "kernels/context.h"
#include "kernels/tensor.h"

namespace origami {

void add_inplace(const ExecContext& ctx, Tensor& y, const Tensor& x);    // y += x
void axpy(const ExecContext& ctx, float a, const Tensor& x, Tensor& y);  // y += a·x
void scale_inplace(const ExecContext& ctx, Tensor& y, float a);          // y *= a
double sum_squares(const ExecContext& ctx, const Tensor& x);             // Σ x² in fp64
// acc (f64 [1] on ctx's device) += Σ x² in fp64, the same sum sum_squares
// returns, left on the device: no host wait per call, so the grad norm reads
// one total per step instead of one per parameter (each a stream sync on GPU).
void sum_squares_add(const ExecContext& ctx, const Tensor& x, Tensor& acc);
double sum(const ExecContext& ctx, const Tensor& x);                     // Σ x in fp64
// acc (f64 [1] on ctx's device) += Σ x in fp64, sum's total left on the
// device: the LM loss of every micro-batch adds up there and the host reads
// it once per step.
void sum_add(const ExecContext& ctx, const Tensor& x, Tensor& acc);
// dst = src converted to dst's dtype (same element count): f32 → bf16 rounds
// to nearest even (any NaN becomes the canonical 0x7FFF), bf16 → f32 is exact, equal dtypes
// copy. The one place precision changes (the bf16 recipe's working copies).
void cast(const ExecContext& ctx, const Tensor& src, Tensor& dst);
// src itself when it is `dtype` already, else a new tensor (src's shape and
// ledger category, on ctx's device) holding cast(src): an f32 gradient of
// f32 statistics (router, LM-head logits) entering a GEMM on bf16 data.
Tensor as_dtype(const ExecContext& ctx, const Tensor& src, DType dtype);

}  // namespace origami

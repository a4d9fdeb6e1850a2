// Small elementwise and reduction ops used around the big kernels.
#pragma once
#include "kernels/context.h"
#include "kernels/tensor.h"

namespace origami {

void add_inplace(const ExecContext& ctx, Tensor& y, const Tensor& x);    // y += x
void axpy(const ExecContext& ctx, float a, const Tensor& x, Tensor& y);  // y += a·x
void scale_inplace(const ExecContext& ctx, Tensor& y, float a);          // y *= a
double sum_squares(const ExecContext& ctx, const Tensor& x);             // Σ x² in fp64 (grad norm)
double sum(const ExecContext& ctx, const Tensor& x);                     // Σ x in fp64

}  // namespace origami

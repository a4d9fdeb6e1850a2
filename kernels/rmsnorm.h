// RMSNorm over the last dimension, in fp32:
//   y = x · rsqrt(mean(x²) + eps) · w
#pragma once
#include "kernels/tensor.h"

namespace origami {

// x_TD, y_TD: [T, D]; w_D: [D]; rstd_T: [T] (saved for backward).
void rmsnorm_forward(const Tensor& x_TD, const Tensor& w_D, float eps, Tensor& y_TD, Tensor& rstd_T);

// Workspace floats needed by rmsnorm_backward (per-thread partial dw).
int64_t rmsnorm_backward_workspace(int64_t T, int64_t D);
// dx_TD is overwritten; dw_D is accumulated into (+=).
void rmsnorm_backward(const Tensor& dy_TD, const Tensor& x_TD, const Tensor& w_D, const Tensor& rstd_T,
                      Tensor& dx_TD, Tensor& dw_D, Tensor& workspace);

}  // namespace origami

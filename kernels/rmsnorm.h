// RMSNorm over the last dimension, in fp32:
//   y = x · rsqrt(mean(x²) + eps) · w
#pragma once
#include "kernels/context.h"
#include "kernels/tensor.h"

namespace origami {

// x_TD, y_TD: [T, D]; w_D: [D]; rstd_T: [T] (saved for backward).
void rmsnorm_forward(const ExecContext& ctx, const Tensor& x_TD, const Tensor& w_D, float eps, Tensor& y_TD,
                     Tensor& rstd_T);

// Workspace bytes rmsnorm_backward needs under ctx (per-thread partial dw).
size_t rmsnorm_backward_workspace_bytes(const ExecContext& ctx, int64_t T, int64_t D);
// dx_TD is overwritten; dw_D is accumulated into (+=).
void rmsnorm_backward(const ExecContext& ctx, const Tensor& dy_TD, const Tensor& x_TD, const Tensor& w_D,
                      const Tensor& rstd_T, Tensor& dx_TD, Tensor& dw_D, Tensor& workspace);

// rmsnorm_backward in two kernels, for the backward split into an input and
// a deferred weight pass (kernels/deferred.h). Together they give bitwise
// rmsnorm_backward's dx and dw under the same context.
// The input half: dx_TD overwritten, no workspace.
void rmsnorm_backward_input(const ExecContext& ctx, const Tensor& dy_TD, const Tensor& x_TD, const Tensor& w_D,
                            const Tensor& rstd_T, Tensor& dx_TD);
// Workspace bytes rmsnorm_backward_weight needs under ctx.
size_t rmsnorm_backward_weight_workspace_bytes(const ExecContext& ctx, int64_t T, int64_t D);
// The weight half: dw_D += Σ_t dy ⊙ x · rstd (needs no w).
void rmsnorm_backward_weight(const ExecContext& ctx, const Tensor& dy_TD, const Tensor& x_TD, const Tensor& rstd_T,
                             Tensor& dw_D, Tensor& workspace);

}  // namespace origami

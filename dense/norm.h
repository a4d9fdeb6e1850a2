// RMSNorm module: forward/backward around the rmsnorm kernel with its saved
// activations (the input and the per-token reciprocal RMS).
#pragma once
#include "kernels/context.h"
#include "kernels/deferred.h"
#include "kernels/tensor.h"

namespace origami::dense {

struct RmsNormSaved {
  Tensor x_TD;    // input, [T, D]
  Tensor rstd_T;  // 1 / rms per token, [T]
};

// y_TD is allocated here ([T, D], activation).
Tensor rmsnorm_module_forward(const ExecContext& ctx, const Tensor& x_TD, const Tensor& w_D, float eps,
                              RmsNormSaved& saved);
// Returns dx_TD; accumulates dw_D. With defer (kernels/deferred.h): dx only
// now (rmsnorm_backward_input); dw_D += Σ dy ⊙ x·rstd is pushed, keeping dy,
// x and rstd, and dw_D is the binding it lands in.
Tensor rmsnorm_module_backward(const ExecContext& ctx, const Tensor& dy_TD, const Tensor& w_D,
                               const RmsNormSaved& saved, Tensor& dw_D, WeightGradQueue* defer = nullptr);

}  // namespace origami::dense

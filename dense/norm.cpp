// RMSNorm module (see norm.h).
#include "dense/norm.h"

#include "kernels/rmsnorm.h"

namespace origami::dense {

Tensor rmsnorm_module_forward(const ExecContext& ctx, const Tensor& x_TD, const Tensor& w_D, float eps,
                              RmsNormSaved& saved) {
  const int64_t T = x_TD.rows(), D = x_TD.cols();
  Tensor y = ctx.empty_data({T, D});
  saved.x_TD = x_TD.view({T, D});
  saved.rstd_T = ctx.empty({T}, DType::f32, MemCategory::activation);
  rmsnorm_forward(ctx, saved.x_TD, w_D, eps, y, saved.rstd_T);
  return y;
}

Tensor rmsnorm_module_backward(const ExecContext& ctx, const Tensor& dy_TD, const Tensor& w_D,
                               const RmsNormSaved& saved, Tensor& dw_D, WeightGradQueue* defer) {
  const int64_t T = saved.x_TD.rows(), D = saved.x_TD.cols();
  Tensor dx = ctx.empty_data({T, D});
  if (!defer) {
    Tensor ws = ctx.workspace(rmsnorm_backward_workspace_bytes(ctx, T, D));
    rmsnorm_backward(ctx, dy_TD.view({T, D}), saved.x_TD, w_D, saved.rstd_T, dx, dw_D, ws);
    return dx;
  }
  const Tensor dy = dy_TD.view({T, D});
  rmsnorm_backward_input(ctx, dy, saved.x_TD, w_D, saved.rstd_T, dx);
  defer->push(dw_D, [dy, x = saved.x_TD, rstd = saved.rstd_T](const ExecContext& c, Tensor& dw) {
    Tensor ws = c.workspace(rmsnorm_backward_weight_workspace_bytes(c, x.rows(), x.cols()));
    rmsnorm_backward_weight(c, dy, x, rstd, dw, ws);
  });
  return dx;
}

}  // namespace origami::dense

// LM head and cross-entropy loss (see lm_head.h).
#include "dense/lm_head.h"

#include "kernels/cross_entropy.h"
#include "kernels/elementwise.h"
#include "kernels/gemm.h"

namespace origami::dense {

double lm_head_forward(const ExecContext& ctx, const Tensor& w_VD, const Tensor& y_TD, const Tensor& targets_T,
                       LmHeadSaved& saved, Tensor* loss_T) {
  const int64_t T = y_TD.rows(), V = w_VD.rows();
  saved.y_TD = y_TD;
  saved.targets_T = targets_T;
  saved.logits_TV = ctx.empty({T, V}, DType::f32, MemCategory::activation);
  saved.lse_T = ctx.empty({T}, DType::f32, MemCategory::activation);
  gemm(ctx, y_TD, Trans::no, w_VD, Trans::yes, saved.logits_TV);  // (T, V)
  Tensor losses = ctx.empty({T}, DType::f32, MemCategory::activation);
  cross_entropy_forward(ctx, saved.logits_TV, targets_T, losses, saved.lse_T);
  if (loss_T) *loss_T = losses;
  return sum(ctx, losses);
}

Tensor lm_head_backward(const ExecContext& ctx, const Tensor& w_VD, LmHeadSaved& saved, float grad_scale,
                        Tensor& dw_VD, WeightGradQueue* defer) {
  const int64_t T = saved.y_TD.rows(), D = saved.y_TD.cols();
  Tensor& dlogits_f32 = saved.logits_TV;  // in place: the logits are not needed again
  cross_entropy_backward(ctx, saved.logits_TV, saved.targets_T, saved.lse_T, grad_scale, dlogits_f32);
  const Tensor dlogits = as_dtype(ctx, dlogits_f32, w_VD.dtype());  // the GEMMs' data dtype
  linear_weight_grad(ctx, defer, dlogits, saved.y_TD, dw_VD);       // (V, D)
  Tensor dy = ctx.empty_data({T, D});
  gemm(ctx, dlogits, Trans::no, w_VD, Trans::no, dy);  // (T, D)
  saved.logits_TV = Tensor();
  return dy;
}

}  // namespace origami::dense

// Dense SwiGLU MLP (see mlp.h).
#include "dense/mlp.h"

#include "kernels/gemm.h"
#include "kernels/swiglu.h"

namespace origami::dense {

namespace {
Tensor activation(const ExecContext& ctx, Shape shape) { return ctx.empty_data(std::move(shape)); }
}  // namespace

Tensor mlp_module_forward(const ExecContext& ctx, const MlpWeights& w, const Tensor& x_TD, MlpSaved& saved) {
  const int64_t T = x_TD.rows(), D = x_TD.cols(), F = w.gate.rows();
  saved.x_TD = x_TD;
  saved.gate_TF = activation(ctx, {T, F});
  saved.up_TF = activation(ctx, {T, F});
  saved.h_TF = activation(ctx, {T, F});
  gemm(ctx, x_TD, Trans::no, w.gate, Trans::yes, saved.gate_TF);
  gemm(ctx, x_TD, Trans::no, w.up, Trans::yes, saved.up_TF);
  swiglu_forward(ctx, saved.gate_TF, saved.up_TF, saved.h_TF);
  Tensor y = activation(ctx, {T, D});
  gemm(ctx, saved.h_TF, Trans::no, w.down, Trans::yes, y);
  return y;
}

Tensor mlp_module_backward(const ExecContext& ctx, const MlpWeights& w, const MlpSaved& saved, const Tensor& dy_TD,
                           MlpWeights& grad, WeightGradQueue* defer) {
  const int64_t T = saved.x_TD.rows(), D = saved.x_TD.cols(), F = w.gate.rows();
  Tensor dh = activation(ctx, {T, F});
  gemm(ctx, dy_TD, Trans::no, w.down, Trans::no, dh);            // (T, F)
  linear_weight_grad(ctx, defer, dy_TD, saved.h_TF, grad.down);  // (D, F)
  Tensor dgate = activation(ctx, {T, F}), dup = activation(ctx, {T, F});
  swiglu_backward(ctx, dh, saved.gate_TF, saved.up_TF, dgate, dup);
  linear_weight_grad(ctx, defer, dgate, saved.x_TD, grad.gate);  // (F, D)
  linear_weight_grad(ctx, defer, dup, saved.x_TD, grad.up);      // (F, D)
  Tensor dx = activation(ctx, {T, D});
  gemm(ctx, dgate, Trans::no, w.gate, Trans::no, dx);
  gemm(ctx, dup, Trans::no, w.up, Trans::no, dx, 1.0f, 1.0f);
  return dx;
}

}  // namespace origami::dense

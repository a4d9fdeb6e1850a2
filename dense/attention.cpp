// Self-attention block (see attention.h). Forward and backward are plain call
// sequences over the kernels; shapes are commented per buffer.
#include "dense/attention.h"

#include <cmath>

#include "kernels/gemm.h"
#include "kernels/rope.h"

namespace origami::dense {

namespace {
Tensor activation(const ExecContext& ctx, Shape shape) { return ctx.empty_data(std::move(shape)); }
}  // namespace

void attention_qkv_forward(const ExecContext& ctx, const AttentionOptions& opt, const AttentionWeights& w,
                           const Tensor& x_TD, const Tensor& pos_S, Tensor& q_BSHd, Tensor& k_BSHd, Tensor& v_BSHd) {
  const int64_t T = x_TD.rows(), hd = opt.head_dim;
  Tensor q_TE = q_BSHd.view({T, opt.num_heads * hd}), k_TE = k_BSHd.view({T, opt.num_kv_heads * hd}),
         v_TE = v_BSHd.view({T, opt.num_kv_heads * hd});
  gemm(ctx, x_TD, Trans::no, w.wq, Trans::yes, q_TE);  // (T, Hq·hd)
  gemm(ctx, x_TD, Trans::no, w.wk, Trans::yes, k_TE);  // (T, Hkv·hd)
  gemm(ctx, x_TD, Trans::no, w.wv, Trans::yes, v_TE);  // (T, Hkv·hd)
  rope_forward(ctx, q_BSHd, pos_S, opt.rope_theta);
  rope_forward(ctx, k_BSHd, pos_S, opt.rope_theta);
}

Tensor attention_output_backward(const ExecContext& ctx, const AttentionWeights& w, const Tensor& dy_TD,
                                 const Tensor& o_BSHd, AttentionWeights& grad, WeightGradQueue* defer) {
  const int64_t T = dy_TD.rows(), Eq = o_BSHd.size(2) * o_BSHd.size(3);
  Tensor do_BSHd = activation(ctx, o_BSHd.shape());
  Tensor do_TE = do_BSHd.view({T, Eq});
  gemm(ctx, dy_TD, Trans::no, w.wo, Trans::no, do_TE);                      // (T, Hq·hd)
  linear_weight_grad(ctx, defer, dy_TD, o_BSHd.view({T, Eq}), grad.wo);  // (D, Hq·hd)
  return do_BSHd;
}

Tensor attention_qkv_backward(const ExecContext& ctx, const AttentionOptions& opt, const AttentionWeights& w,
                              const Tensor& x_TD, const Tensor& pos_S, Tensor& dq_BSHd, Tensor& dk_BSHd,
                              const Tensor& dv_BSHd, AttentionWeights& grad, WeightGradQueue* defer) {
  const int64_t T = x_TD.rows(), Eq = opt.num_heads * opt.head_dim, Ekv = opt.num_kv_heads * opt.head_dim;
  rope_backward(ctx, dq_BSHd, pos_S, opt.rope_theta);
  rope_backward(ctx, dk_BSHd, pos_S, opt.rope_theta);
  const Tensor dq_TE = dq_BSHd.view({T, Eq}), dk_TE = dk_BSHd.view({T, Ekv}), dv_TE = dv_BSHd.view({T, Ekv});
  linear_weight_grad(ctx, defer, dq_TE, x_TD, grad.wq);  // (Hq·hd, D)
  linear_weight_grad(ctx, defer, dk_TE, x_TD, grad.wk);  // (Hkv·hd, D)
  linear_weight_grad(ctx, defer, dv_TE, x_TD, grad.wv);  // (Hkv·hd, D)
  Tensor dx = activation(ctx, x_TD.shape());
  gemm(ctx, dq_TE, Trans::no, w.wq, Trans::no, dx);
  gemm(ctx, dk_TE, Trans::no, w.wk, Trans::no, dx, 1.0f, 1.0f);
  gemm(ctx, dv_TE, Trans::no, w.wv, Trans::no, dx, 1.0f, 1.0f);
  return dx;
}

Tensor attention_module_forward(const ExecContext& ctx, const AttentionOptions& opt, const AttentionWeights& w,
                                const Tensor& x_TD, int64_t batch, const Tensor& pos_S, AttentionSaved& saved) {
  const int64_t T = x_TD.rows(), D = x_TD.cols(), S = T / batch;
  const int64_t Hq = opt.num_heads, Hkv = opt.num_kv_heads, hd = opt.head_dim;
  ORIGAMI_CHECK(S * batch == T && pos_S.numel() == S, "attention: T=", T, " batch=", batch, " positions=", pos_S.numel());
  saved.dims = AttentionDims{batch, S, S, Hq, Hkv, hd};
  saved.x_TD = x_TD;
  saved.pos_S = pos_S;
  saved.q_BSHd = activation(ctx, {batch, S, Hq, hd});
  saved.k_BSHd = activation(ctx, {batch, S, Hkv, hd});
  saved.v_BSHd = activation(ctx, {batch, S, Hkv, hd});
  attention_qkv_forward(ctx, opt, w, x_TD, pos_S, saved.q_BSHd, saved.k_BSHd, saved.v_BSHd);

  saved.o_BSHd = activation(ctx, {batch, S, Hq, hd});
  saved.lse_BHS = ctx.empty({batch, Hq, S}, DType::f32, MemCategory::activation);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  Tensor ws = ctx.workspace(attention_forward_workspace_bytes(ctx, saved.dims));
  attention_forward(ctx, saved.dims, saved.q_BSHd, saved.k_BSHd, saved.v_BSHd, pos_S, pos_S, scale, saved.o_BSHd,
                    saved.lse_BHS, ws);

  Tensor y = activation(ctx, {T, D});
  gemm(ctx, saved.o_BSHd.view({T, Hq * hd}), Trans::no, w.wo, Trans::yes, y);  // (T, D)
  return y;
}

Tensor attention_module_backward(const ExecContext& ctx, const AttentionOptions& opt, const AttentionWeights& w,
                                 const AttentionSaved& saved, const Tensor& dy_TD, AttentionWeights& grad,
                                 WeightGradQueue* defer) {
  const AttentionDims& d = saved.dims;
  const Tensor do_ = attention_output_backward(ctx, w, dy_TD, saved.o_BSHd, grad, defer);
  Tensor dq = activation(ctx, {d.batch, d.q_len, d.num_heads, d.head_dim});
  Tensor dk = activation(ctx, {d.batch, d.kv_len, d.num_kv_heads, d.head_dim});
  Tensor dv = activation(ctx, {d.batch, d.kv_len, d.num_kv_heads, d.head_dim});
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.head_dim));
  Tensor ws = ctx.workspace(attention_backward_workspace_bytes(ctx, d));
  attention_backward(ctx, d, saved.q_BSHd, saved.k_BSHd, saved.v_BSHd, saved.o_BSHd, saved.lse_BHS, do_, saved.pos_S,
                     saved.pos_S, scale, dq, dk, dv, ws);
  return attention_qkv_backward(ctx, opt, w, saved.x_TD, saved.pos_S, dq, dk, dv, grad, defer);
}

}  // namespace origami::dense

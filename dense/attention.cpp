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
  Tensor q_TE = saved.q_BSHd.view({T, Hq * hd}), k_TE = saved.k_BSHd.view({T, Hkv * hd}),
         v_TE = saved.v_BSHd.view({T, Hkv * hd});
  gemm(ctx, x_TD, Trans::no, w.wq, Trans::yes, q_TE);  // (T, Hq·hd)
  gemm(ctx, x_TD, Trans::no, w.wk, Trans::yes, k_TE);  // (T, Hkv·hd)
  gemm(ctx, x_TD, Trans::no, w.wv, Trans::yes, v_TE);  // (T, Hkv·hd)
  rope_forward(ctx, saved.q_BSHd, pos_S, opt.rope_theta);
  rope_forward(ctx, saved.k_BSHd, pos_S, opt.rope_theta);

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
  const int64_t T = saved.x_TD.rows(), D = saved.x_TD.cols();
  const int64_t Eq = d.num_heads * d.head_dim, Ekv = d.num_kv_heads * d.head_dim;
  // y = o·Woᵀ
  Tensor do_ = activation(ctx, {d.batch, d.q_len, d.num_heads, d.head_dim});
  Tensor do_TE = do_.view({T, Eq});
  gemm(ctx, dy_TD, Trans::no, w.wo, Trans::no, do_TE);                           // (T, Hq·hd)
  linear_weight_grad(ctx, defer, dy_TD, saved.o_BSHd.view({T, Eq}), grad.wo);  // (D, Hq·hd)

  Tensor dq = activation(ctx, {d.batch, d.q_len, d.num_heads, d.head_dim});
  Tensor dk = activation(ctx, {d.batch, d.kv_len, d.num_kv_heads, d.head_dim});
  Tensor dv = activation(ctx, {d.batch, d.kv_len, d.num_kv_heads, d.head_dim});
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.head_dim));
  Tensor ws = ctx.workspace(attention_backward_workspace_bytes(ctx, d));
  attention_backward(ctx, d, saved.q_BSHd, saved.k_BSHd, saved.v_BSHd, saved.o_BSHd, saved.lse_BHS, do_, saved.pos_S,
                     saved.pos_S, scale, dq, dk, dv, ws);
  rope_backward(ctx, dq, saved.pos_S, opt.rope_theta);
  rope_backward(ctx, dk, saved.pos_S, opt.rope_theta);

  const Tensor dq_TE = dq.view({T, Eq}), dk_TE = dk.view({T, Ekv}), dv_TE = dv.view({T, Ekv});
  linear_weight_grad(ctx, defer, dq_TE, saved.x_TD, grad.wq);  // (Hq·hd, D)
  linear_weight_grad(ctx, defer, dk_TE, saved.x_TD, grad.wk);  // (Hkv·hd, D)
  linear_weight_grad(ctx, defer, dv_TE, saved.x_TD, grad.wv);  // (Hkv·hd, D)
  Tensor dx = activation(ctx, {T, D});
  gemm(ctx, dq_TE, Trans::no, w.wq, Trans::no, dx);
  gemm(ctx, dk_TE, Trans::no, w.wk, Trans::no, dx, 1.0f, 1.0f);
  gemm(ctx, dv_TE, Trans::no, w.wv, Trans::no, dx, 1.0f, 1.0f);
  return dx;
}

}  // namespace origami::dense

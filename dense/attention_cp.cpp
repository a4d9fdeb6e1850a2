// Context-parallel attention (see attention_cp.h). It runs attention.h's
// stages around the kernel (attention_qkv_forward, attention_output_backward,
// attention_qkv_backward), with the K, V gather between RoPE and the kernel,
// and the dK, dV reduce-scatter between the kernel's backward and RoPE's; under the
// ring, its step loops (attention_ring.cpp) take the kernel's place. The
// zigzag positions, the token shard and the K/V wire packing are kernels ops
// (kernels/context_parallel.h, which documents the wire layout).
#include "dense/attention_cp.h"

#include <cmath>

#include "dense/attention_ring.h"
#include "kernels/context_parallel.h"
#include "kernels/gemm.h"

namespace origami::dense {

namespace {

Tensor activation(const ExecContext& ctx, Shape shape) { return ctx.empty_data(std::move(shape)); }
Tensor positions(const ExecContext& ctx, int64_t n) { return ctx.empty({n}, DType::i32, MemCategory::activation); }
Tensor comm_buffer(const ExecContext& ctx, int64_t n) { return ctx.empty_data({n}, MemCategory::comm); }

}  // namespace

CpPositions cp_positions(const ExecContext& ctx, int64_t seq_len, int64_t cp, int64_t rank) {
  ORIGAMI_CHECK(cp >= 1 && rank >= 0 && rank < cp, "cp_positions: rank ", rank, " of cp ", cp);
  ORIGAMI_CHECK(seq_len > 0 && seq_len % (2 * cp) == 0, "cp_positions: seq_len ", seq_len,
                " must be a positive multiple of 2·cp = ", 2 * cp);
  CpPositions out;
  out.pos_S_ = positions(ctx, seq_len / cp);
  cp_zigzag_positions(ctx, cp, rank, out.pos_S_);
  out.shard_seq_len_ = seq_len;
  out.shard_cp_ = cp;
  out.shard_rank_ = rank;
  return out;
}

CpTokens cp_shard_tokens(const ExecContext& ctx, const Tensor& tokens_BS1, int64_t cp, int64_t rank) {
  ORIGAMI_CHECK(tokens_BS1.dtype() == DType::i32 && tokens_BS1.dim() == 2 && tokens_BS1.size(1) >= 2,
                "cp_shard_tokens: windows must be i32 [B, S+1], got ", shape_string(tokens_BS1.shape()));
  const int64_t B = tokens_BS1.size(0), S = tokens_BS1.size(1) - 1;
  CpTokens out;
  out.pos_S = cp_positions(ctx, S, cp, rank);
  const int64_t Sl = out.pos_S.tensor().numel();
  out.ids_T = ctx.empty({B * Sl}, DType::i32, MemCategory::activation);
  out.targets_T = ctx.empty({B * Sl}, DType::i32, MemCategory::activation);
  cp_gather_tokens(ctx, tokens_BS1, out.pos_S.tensor(), out.ids_T, out.targets_T);
  return out;
}

Tensor cp_attention_forward(const ExecContext& ctx, const AttentionOptions& opt, const AttentionWeights& w,
                            const Tensor& x_TD, int64_t batch, const CpPositions& positions_local,
                            comm::Communicator* cp, CpComm method, CpAttentionSaved& saved) {
  const int n = comm::group_size(cp);
  const bool ring = n > 1 && method == CpComm::ring;
  const int64_t T = x_TD.rows(), D = x_TD.cols(), Sl = T / batch, S = Sl * n;
  const int64_t Hq = opt.num_heads, Hkv = opt.num_kv_heads, hd = opt.head_dim;
  const Tensor& pos_local_S = positions_local.tensor();
  ORIGAMI_CHECK(pos_local_S.defined() && Sl * batch == T && pos_local_S.numel() == Sl, "cp attention: T=", T,
                " batch=", batch, " positions=", pos_local_S.defined() ? pos_local_S.numel() : 0);
  if (n > 1)  // the gathered keys' positions are implied by the layout, so the layout must hold
    ORIGAMI_CHECK(positions_local.is_zigzag_shard(S, n, cp->rank()), "cp attention: cp rank ", cp->rank(), " of ", n,
                  " was given positions that are not its zigzag shard of S=", S);
  saved.dims = AttentionDims{batch, Sl, n > 1 && !ring ? S : Sl, Hq, Hkv, hd};
  saved.cp_size = n;
  saved.comm = method;
  saved.x_TD = x_TD;
  saved.q_pos_S = pos_local_S;
  saved.q_BSHd = activation(ctx, {batch, Sl, Hq, hd});
  // Local K and V: with a group they are computed straight into the send
  // buffer (the ring's is the saved block it sends first).
  const int64_t n_kv = batch * Sl * Hkv * hd;
  Tensor kv_send = ring ? activation(ctx, {2, batch, Sl, Hkv, hd}) : n > 1 ? comm_buffer(ctx, 2 * n_kv) : Tensor();
  Tensor k_local = n > 1 ? kv_send.flat_view(0, n_kv, {batch, Sl, Hkv, hd}) : activation(ctx, {batch, Sl, Hkv, hd});
  Tensor v_local = n > 1 ? kv_send.flat_view(n_kv, n_kv, {batch, Sl, Hkv, hd}) : activation(ctx, {batch, Sl, Hkv, hd});
  // RoPE before the gather, at the local rows' global positions.
  attention_qkv_forward(ctx, opt, w, x_TD, pos_local_S, saved.q_BSHd, k_local, v_local);

  if (n == 1 || ring) {
    saved.k_BSHd = k_local;
    saved.v_BSHd = v_local;
    saved.kv_pos_S = pos_local_S;
    if (ring) saved.kv_local = kv_send;
  } else {
    Tensor kv_recv = comm_buffer(ctx, n * 2 * n_kv);  // wire (cp, 2, B, S/cp, Hkv·hd)
    cp->all_gather(kv_send, kv_recv);
    saved.k_BSHd = activation(ctx, {batch, S, Hkv, hd});
    saved.v_BSHd = activation(ctx, {batch, S, Hkv, hd});
    cp_unpack_kv(ctx, kv_recv.view({n, 2, batch, Sl, Hkv * hd}), saved.k_BSHd, saved.v_BSHd);  // global order
    saved.kv_pos_S = positions(ctx, S);
    cp_zigzag_positions(ctx, 1, 0, saved.kv_pos_S);  // one rank's zigzag is the iota 0..S−1
  }

  saved.o_BSHd = activation(ctx, {batch, Sl, Hq, hd});
  saved.lse_BHS = ctx.empty({batch, Hq, Sl}, DType::f32, MemCategory::activation);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  Tensor ws;  // the kernel's (the ring's steps size their own)
  if (ring) {
    cp_ring_attention_forward(ctx, saved.dims, *cp, saved.q_BSHd, saved.kv_local, saved.q_pos_S, scale, saved.o_BSHd,
                              saved.lse_BHS);
  } else {
    ws = ctx.workspace(attention_forward_workspace_bytes(ctx, saved.dims));
    attention_forward(ctx, saved.dims, saved.q_BSHd, saved.k_BSHd, saved.v_BSHd, saved.q_pos_S, saved.kv_pos_S,
                      scale, saved.o_BSHd, saved.lse_BHS, ws);
  }

  Tensor y = activation(ctx, {T, D});
  gemm(ctx, saved.o_BSHd.view({T, Hq * hd}), Trans::no, w.wo, Trans::yes, y);  // (T, D)
  return y;
}

Tensor cp_attention_backward(const ExecContext& ctx, const AttentionOptions& opt, const AttentionWeights& w,
                             const CpAttentionSaved& saved, const Tensor& dy_TD, comm::Communicator* cp,
                             AttentionWeights& grad, WeightGradQueue* defer) {
  const AttentionDims& d = saved.dims;
  const int n = comm::group_size(cp);
  ORIGAMI_CHECK(n == saved.cp_size, "cp attention backward over a group of ", n, " ranks, forward used ",
                saved.cp_size);
  const int64_t Ekv = d.num_kv_heads * d.head_dim;
  const Tensor do_ = attention_output_backward(ctx, w, dy_TD, saved.o_BSHd, grad, defer);
  Tensor dq = activation(ctx, {d.batch, d.q_len, d.num_heads, d.head_dim});
  Tensor dk, dv, ws;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.head_dim));
  const int64_t n_kv = d.batch * d.q_len * Ekv;
  if (n > 1 && saved.comm == CpComm::ring) {  // dK, dV of the local keys arrive complete
    const Tensor dkv = cp_ring_attention_backward(ctx, d, *cp, saved.q_BSHd, saved.kv_local, saved.o_BSHd,
                                                  saved.lse_BHS, do_, saved.q_pos_S, scale, dq);
    dk = dkv.flat_view(0, n_kv, {d.batch, d.q_len, d.num_kv_heads, d.head_dim});
    dv = dkv.flat_view(n_kv, n_kv, {d.batch, d.q_len, d.num_kv_heads, d.head_dim});
  } else {
    // dK, dV of every gathered key (this rank's queries' share only).
    dk = activation(ctx, {d.batch, d.kv_len, d.num_kv_heads, d.head_dim});
    dv = activation(ctx, {d.batch, d.kv_len, d.num_kv_heads, d.head_dim});
    ws = ctx.workspace(attention_backward_workspace_bytes(ctx, d));
    attention_backward(ctx, d, saved.q_BSHd, saved.k_BSHd, saved.v_BSHd, saved.o_BSHd, saved.lse_BHS, do_,
                       saved.q_pos_S, saved.kv_pos_S, scale, dq, dk, dv, ws);
  }

  if (n > 1 && saved.comm == CpComm::all_gather) {  // sum every rank's share onto the keys' owners
    Tensor send = comm_buffer(ctx, n * 2 * n_kv);  // wire (cp, 2, B, S/cp, Hkv·hd): block r for rank r's keys
    Tensor send_wire = send.view({n, 2, d.batch, d.q_len, Ekv});
    cp_pack_kv(ctx, dk, dv, send_wire);
    Tensor recv = comm_buffer(ctx, 2 * n_kv);  // (2, B, S/cp, Hkv·hd)
    cp->reduce_scatter(send, recv);
    dk = recv.flat_view(0, n_kv, {d.batch, d.q_len, d.num_kv_heads, d.head_dim});
    dv = recv.flat_view(n_kv, n_kv, {d.batch, d.q_len, d.num_kv_heads, d.head_dim});
  }
  // The local keys sit at the local queries' positions.
  return attention_qkv_backward(ctx, opt, w, saved.x_TD, saved.q_pos_S, dq, dk, dv, grad, defer);
}

}  // namespace origami::dense

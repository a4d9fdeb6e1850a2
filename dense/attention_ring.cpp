// Ring attention (see attention_ring.h): the step loops. Everything that
// touches tensor data is a kernels op (attention forward/backward and merge,
// zigzag positions, axpy); this file only schedules them and the transfers.
#include "dense/attention_ring.h"

#include <algorithm>
#include <vector>

#include "kernels/context_parallel.h"
#include "kernels/elementwise.h"

namespace origami::dense {

namespace {

// Distinct tags keep a step's K, V and dK, dV messages apart on MPI; the
// send and receive order (attention_ring.h) pairs them on any backend.
constexpr int kKvTag = 31, kGradTag = 32;

Tensor activation(const ExecContext& ctx, Shape shape) { return ctx.empty_data(std::move(shape)); }
Tensor block_buffer(const ExecContext& ctx, int64_t n) { return ctx.empty_data({n}, MemCategory::comm); }

// The ring's neighbours and the block held at each step.
struct Ring {
  int n, rank, next, prev;
  explicit Ring(const comm::Communicator& cp)
      : n(cp.size()), rank(cp.rank()), next((cp.rank() + 1) % cp.size()), prev((cp.rank() + cp.size() - 1) % cp.size()) {}
  int owner(int step) const { return (rank - step + n) % n; }  // whose block is held at `step`
};

// K and V of a packed block [2, B, S/n, Hkv, hd].
Tensor part(const Tensor& kv, int which, const AttentionDims& d) {
  const int64_t n_kv = d.batch * d.kv_len * d.num_kv_heads * d.head_dim;
  return kv.flat_view(which * n_kv, n_kv, {d.batch, d.kv_len, d.num_kv_heads, d.head_dim});
}

void check_block(const AttentionDims& d, const comm::Communicator& cp, const Tensor& kv_local) {
  ORIGAMI_CHECK(cp.size() > 1, "ring attention over a group of ", cp.size(), " rank(s)");
  ORIGAMI_CHECK(d.q_len == d.kv_len, "ring attention: a block's queries and keys are one rank's rows, got q_len ",
                d.q_len, " kv_len ", d.kv_len);
  check_shape(kv_local, {2, d.batch, d.kv_len, d.num_kv_heads, d.head_dim}, "ring attention kv_local");
}

}  // namespace

void cp_ring_attention_forward(const ExecContext& ctx, const AttentionDims& d, comm::Communicator& cp,
                               const Tensor& q_BSHd, const Tensor& kv_local, const Tensor& q_pos_S, float scale,
                               Tensor& o_BSHd, Tensor& lse_BHS) {
  check_block(d, cp, kv_local);
  const Ring ring(cp);
  Tensor ws = ctx.workspace(attention_forward_workspace_bytes(ctx, d));
  Tensor kv_pos = ctx.empty({d.kv_len}, DType::i32, MemCategory::activation);  // the held block's positions
  Tensor o_part = activation(ctx, {d.batch, d.q_len, d.num_heads, d.head_dim});
  Tensor lse_part = ctx.empty({d.batch, d.num_heads, d.q_len}, DType::f32, MemCategory::activation);
  std::vector<Tensor> in_flight;  // a block received at step i is sent on at step i+1 while the next arrives
  for (int i = 0; i < std::min(2, ring.n - 1); ++i) in_flight.push_back(block_buffer(ctx, kv_local.numel()));

  Tensor held = kv_local;
  for (int step = 0; step < ring.n; ++step) {
    comm::Request send, recv;
    Tensor next;
    if (step + 1 < ring.n) {  // the next block's transfer first: it runs while this one is computed
      next = in_flight[step % in_flight.size()].view(kv_local.shape());
      send = cp.send_async(held, ring.next, kKvTag);
      recv = cp.recv_async(next, ring.prev, kKvTag);
    }
    cp_zigzag_positions(ctx, ring.n, ring.owner(step), kv_pos);
    const Tensor k = part(held, 0, d), v = part(held, 1, d);
    if (step == 0) {  // the diagonal block: every query sees itself, so lse starts finite
      attention_forward(ctx, d, q_BSHd, k, v, q_pos_S, kv_pos, scale, o_BSHd, lse_BHS, ws);
    } else {
      attention_forward(ctx, d, q_BSHd, k, v, q_pos_S, kv_pos, scale, o_part, lse_part, ws);
      attention_merge(ctx, o_part, lse_part, o_BSHd, lse_BHS);
    }
    cp.complete(send);  // CUDA: the compute stream waits for the ring's channels, not the host
    cp.complete(recv);
    held = next;
  }
}

Tensor cp_ring_attention_backward(const ExecContext& ctx, const AttentionDims& d, comm::Communicator& cp,
                                  const Tensor& q_BSHd, const Tensor& kv_local, const Tensor& o_BSHd,
                                  const Tensor& lse_BHS, const Tensor& do_BSHd, const Tensor& q_pos_S, float scale,
                                  Tensor& dq_BSHd) {
  check_block(d, cp, kv_local);
  const Ring ring(cp);
  const Shape kv_shape = kv_local.shape();
  const int64_t U = kv_local.numel();
  Tensor ws = ctx.workspace(attention_backward_workspace_bytes(ctx, d));
  Tensor kv_pos = ctx.empty({d.kv_len}, DType::i32, MemCategory::activation);
  Tensor dq_part = activation(ctx, dq_BSHd.shape());
  std::vector<Tensor> in_flight;  // K, V blocks, as in forward
  for (int i = 0; i < std::min(2, ring.n - 1); ++i) in_flight.push_back(block_buffer(ctx, U));
  // dK, dV accumulators: the one computed and sent at a step alternates
  // between two (the previous one may still be on the wire); `arrived`
  // receives the one from rank c−1.
  Tensor acc[2] = {block_buffer(ctx, U).view(kv_shape), block_buffer(ctx, U).view(kv_shape)};
  Tensor arrived = block_buffer(ctx, U).view(kv_shape);

  Tensor held = kv_local;
  comm::Request acc_send;
  for (int step = 0; step < ring.n; ++step) {
    comm::Request acc_recv, kv_send, kv_recv;
    Tensor next;
    // Receive order per step, matching the sender's: the previous step's dK, dV, then the next K, V.
    if (step > 0) acc_recv = cp.recv_async(arrived, ring.prev, kGradTag);
    if (step + 1 < ring.n) {
      next = in_flight[step % in_flight.size()].view(kv_shape);
      kv_send = cp.send_async(held, ring.next, kKvTag);
      kv_recv = cp.recv_async(next, ring.prev, kKvTag);
    }
    cp_zigzag_positions(ctx, ring.n, ring.owner(step), kv_pos);
    Tensor& out = acc[step % 2];
    Tensor dk = part(out, 0, d), dv = part(out, 1, d);
    attention_backward(ctx, d, q_BSHd, part(held, 0, d), part(held, 1, d), o_BSHd, lse_BHS, do_BSHd, q_pos_S, kv_pos,
                       scale, step == 0 ? dq_BSHd : dq_part, dk, dv, ws);
    if (step > 0) {
      axpy(ctx, 1.0f, dq_part, dq_BSHd);
      cp.complete(acc_recv);
      axpy(ctx, 1.0f, arrived, out);  // + the shares of ranks owner .. c−1
    }
    cp.complete(acc_send);  // the other accumulator, sent last step
    acc_send = cp.send_async(out, ring.next, kGradTag);
    cp.complete(kv_send);
    cp.complete(kv_recv);
    held = next;
  }
  // Block c's accumulator, complete, from rank c−1's last step.
  comm::Request last = cp.recv_async(arrived, ring.prev, kGradTag);
  cp.complete(last);
  cp.complete(acc_send);
  return arrived;
}

}  // namespace origami::dense

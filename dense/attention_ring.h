// Ring attention over a cp group (parallel.cp_comm = "ring"): the part of
// cp_attention_forward/backward (dense/attention_cp.h) between RoPE and the
// output projection, for cp > 1. Same zigzag layout, same math as the
// all_gather path up to fp32 summation order; what differs is what moves and
// what is kept.
//
// Blocks. Rank c of n owns block c: its queries and its keys, at its zigzag
// positions (chunks c and 2n−1−c). Its K and V travel packed, K then V,
// [2, B, S/n, Hkv, hd] (one message). At step i = 0..n−1 rank c holds block
// r = (c − i) mod n; it posts the send of that block to c+1 and the receive
// of the next one from c−1 BEFORE it computes on the current block, so the
// transfer overlaps the attention, then waits for both at the step's end.
//
// Forward. Per block the tiled kernel (kernels/attention.h) gives a partial
// output and log-sum-exp of the local queries over that block's keys
// (masking by global positions: kv_pos <= q_pos), and attention_merge folds
// it into the running result: o = Σ_i exp(lse_i − lse)·o_i,
// lse = logsumexp_i lse_i. Step 0 is the diagonal block, where every query
// sees itself, so the running lse is finite from the start. n − 1 sends per
// rank, of 2·B·(S/n)·Hkv·hd floats each: the all_gather's bytes.
//
// Which queries see which keys. Under zigzag no block is fully masked for a
// rank: its second chunk (2n−1−c ≥ n) follows every rank's first chunk.
// Half of each off-diagonal block is masked, though: for r < c no local
// query sees chunk 2n−1−r; for r > c the local chunk c sees none of block r
// (those rows get lse −inf, o 0, which the merge skips). The kernel spends no
// GEMM on either half (it skips key tiles past every query and trims rows
// before a tile's first key), so every rank does the same work at every step.
//
// Backward. With the saved global O and LSE, attention_backward on one block
// gives exactly that block's share of dQ and this rank's queries' share of
// the block's dK, dV. So K, V circulate again, and each block's dK, dV
// accumulator travels with them one hop behind: at step i rank c adds its
// share to the accumulator of block r it received from c−1 (which holds
// the shares of ranks r .. c−1) and sends it on to c+1. After step n−1 the
// accumulator of block r = c+1 holds every rank's share and its last hop
// delivers it to its owner. Per rank: n − 1 K, V sends and n dK, dV sends,
// 2n − 1 messages of 2·B·(S/n)·Hkv·hd floats (the all_gather path's
// reduce_scatter sends n − 1 of them). Every send of a step is posted
// together with its receive, and each pair of ranks sees its K, V and dK, dV
// messages in the same order on both sides (send: K,V then dK,dV per step;
// receive: dK,dV of the previous step then the next K,V), so a backend that
// matches by order rather than by tag pairs them right too. (NCCL needs a
// step's send and receive in one group call, which the Communicator does not
// offer yet; the CPU path runs over MPI.)
//
// Memory, U = 2·B·(S/n)·Hkv·hd floats (one packed block):
//   saved        U (the local K, V; the all_gather path saves n·U)
//   forward      + min(2, n−1)·U blocks in flight (comm), one partial output
//                  and lse (activation)
//   backward     + min(2, n−1)·U K, V blocks in flight and 3·U of dK, dV
//                  (the one being received, the one computed and summed, the
//                  one still being sent; comm), one partial dQ (activation)
// all allocated and freed per call. Blocks in flight are two, not one: a
// block received at step i is sent on at step i+1 while the next arrives.
#pragma once
#include "comm/communicator.h"
#include "kernels/attention.h"
#include "kernels/context.h"
#include "kernels/tensor.h"

namespace origami::dense {

// block: the dims of one block (q_len = kv_len = S/n). q_BSHd: local queries
// after RoPE, [B, S/n, Hq, hd]; kv_local: this rank's K then V after RoPE,
// [2, B, S/n, Hkv, hd]; q_pos_S: the rank's zigzag positions, i32 [S/n] (the
// keys of block r are at cp_zigzag_positions(n, r)). o_BSHd [B, S/n, Hq, hd]
// and lse_BHS [B, Hq, S/n] are overwritten with the attention over every
// rank's keys. cp: size > 1; every rank of it calls this with the same dims.
void cp_ring_attention_forward(const ExecContext& ctx, const AttentionDims& block, comm::Communicator& cp,
                               const Tensor& q_BSHd, const Tensor& kv_local, const Tensor& q_pos_S, float scale,
                               Tensor& o_BSHd, Tensor& lse_BHS);

// o_BSHd, lse_BHS: the forward's (global) results; do_BSHd: their gradient.
// dq_BSHd (overwritten): complete for the local queries. Returns this rank's
// keys' dK then dV [2, B, S/n, Hkv, hd], complete (every rank's queries'
// share), in a comm buffer.
Tensor cp_ring_attention_backward(const ExecContext& ctx, const AttentionDims& block, comm::Communicator& cp,
                                  const Tensor& q_BSHd, const Tensor& kv_local, const Tensor& o_BSHd,
                                  const Tensor& lse_BHS, const Tensor& do_BSHd, const Tensor& q_pos_S, float scale,
                                  Tensor& dq_BSHd);

}  // namespace origami::dense

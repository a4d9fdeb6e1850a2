// Context-parallel self-attention (ARCHITECTURE.md §5): the zigzag sequence
// layout and the attention block over a `cp` group, by one of two methods
// (CpComm, dense/cp_comm.h): Llama-3 style — K and V all-gathered in forward,
// dK and dV reduce-scattered in backward — or ring attention
// (dense/attention_ring.h), which keeps only the local K and V.
//
// Zigzag layout. A sequence of S tokens is cut into 2·cp chunks of
// C = S/(2·cp) tokens; cp rank c owns chunks c and 2·cp−1−c, stored in that
// order: local row i < C is global position c·C + i, local row C + i is
// (2·cp−1−c)·C + i. Local positions therefore ascend, and every rank does the
// same causal work (Σ over its queries of the keys each sees is equal).
// The cp rank is the communicator's rank, which for comm::Groups' cp group is
// the rank's cp coordinate (members ascend with it).
//
// Math is exactly dense::attention_module_forward's (attention.h) on the rows
// this rank owns; RoPE uses the global positions. After the gather, K and V
// are put in global position order, so the kernel sees keys at positions
// 0..S−1 in order (causal tile skipping stays exact) and local queries at
// their zigzag positions. The ring computes the same attention block by
// block and merges the partial results by log-sum-exp.
//
// Gradients. dx is complete for the local rows. Weight gradients are partial:
// each rank adds the terms of its own tokens (q, o for its queries; k, v for
// the keys it owns, whose dK, dV already hold every rank's queries' share), so
// the caller sums them over cp — in training over dp-cp together with the
// data-parallel reduction, which the ZeRO reduce-scatter does anyway.
//
// The index maps and copies (positions, token shard, the K/V wire layout)
// are kernels ops, kernels/context_parallel.h. Buffers are allocated on the
// host, like the rest of dense/ today.
#pragma once
#include <cstdint>

#include "comm/communicator.h"
#include "dense/attention.h"
#include "dense/cp_comm.h"
#include "kernels/context.h"
#include "kernels/tensor.h"

namespace origami::dense {

// The global positions of a rank's tokens, i32 [Sl], and what they are the
// positions of. cp_positions makes the zigzag shard of a sequence; the
// explicit constructor takes any positions, valid only without a group (or
// with a group of one). cp_attention_forward gathers K and V by the layout,
// so under a group it needs the shard of that group and rank, and checks it
// from these fields on the host: reading the positions back would stop the
// device's stream at every attention layer.
class CpPositions {
 public:
  CpPositions() = default;
  explicit CpPositions(Tensor pos_S) : pos_S_(std::move(pos_S)) {}
  const Tensor& tensor() const { return pos_S_; }
  // True when these are cp_positions(seq_len, cp, rank).
  bool is_zigzag_shard(int64_t seq_len, int64_t cp, int64_t rank) const {
    return shard_cp_ == cp && shard_rank_ == rank && shard_seq_len_ == seq_len;
  }

 private:
  friend CpPositions cp_positions(const ExecContext& ctx, int64_t seq_len, int64_t cp, int64_t rank);
  Tensor pos_S_;
  int64_t shard_seq_len_ = 0, shard_cp_ = 0, shard_rank_ = -1;  // cp 0: not made by cp_positions
};

// Global positions of cp rank `rank`'s tokens, i32 [S/cp]: chunk `rank`, then
// chunk 2·cp−1−rank (see above). Checks S % (2·cp) == 0 (a config rule that
// engine/plan.cpp validates at load) and 0 <= rank < cp. cp = 1: 0..S−1.
CpPositions cp_positions(const ExecContext& ctx, int64_t seq_len, int64_t cp, int64_t rank);

// One rank's share of a micro-batch of windows.
struct CpTokens {
  Tensor ids_T;      // i32 [B·S/cp]: ids_T[b·S/cp + i]     = window[b][pos_S[i]]
  Tensor targets_T;  // i32 [B·S/cp]: targets_T[b·S/cp + i] = window[b][pos_S[i] + 1]
  CpPositions pos_S;  // cp_positions(S, cp, rank)
};
// tokens_BS1: i32 [B, S+1] windows (inputs window[0, S), targets window[1, S]).
// Rows are batch-major, as every [T, ·] activation: the cp = 1 result is
// exactly the unsharded split of engine::Model::forward.
CpTokens cp_shard_tokens(const ExecContext& ctx, const Tensor& tokens_BS1, int64_t cp, int64_t rank);

struct CpAttentionSaved {
  AttentionDims dims;  // q_len = S/cp (local), kv_len = S (gathered; ring: S/cp, one block)
  int cp_size = 1;     // size of the group forward ran over (backward checks it)
  CpComm comm = CpComm::all_gather;  // the method forward used (backward follows it)
  Tensor x_TD;         // block input, [B·S/cp, D]
  Tensor q_pos_S;      // global positions of the local rows, i32 [S/cp]
  Tensor kv_pos_S;     // positions of the gathered keys, i32 [S]: 0..S−1 (cp = 1 or ring: q_pos_S)
  Tensor q_BSHd;       // local, after RoPE, [B, S/cp, Hq, hd]
  Tensor k_BSHd;       // gathered, after RoPE, global order, [B, S, Hkv, hd] (ring: local, [B, S/cp, Hkv, hd])
  Tensor v_BSHd;       // gathered, global order, [B, S, Hkv, hd] (ring: local)
  Tensor kv_local;     // ring only: the local K then V, [2, B, S/cp, Hkv, hd] (k_BSHd, v_BSHd view it)
  Tensor o_BSHd;       // attention output before Wo, [B, S/cp, Hq, hd]
  Tensor lse_BHS;      // [B, Hq, S/cp]
};

// x_TD: [B·S/cp, D], this rank's rows (batch-major); pos_local_S: [S/cp].
// cp: the cp group, or null. With cp of size > 1, pos_local_S must be
// cp_positions(S, cp->size(), cp->rank()) (checked), every rank of the group
// calls this with the same B and method, and with U = 2·B·(S/cp)·Hkv·hd
// floats (K and V packed):
//   all_gather: one all_gather of U per rank; saves the gathered K and V
//               (cp·U floats, the Llama-3 choice: no second gather in backward)
//   ring:       cp − 1 sends of U per rank, each overlapped with a block's
//               attention (attention_ring.h); saves the local U only
// Null or size 1: no communication, any positions, either method, and the
// result is bitwise that of attention_module_forward(ctx, opt, w, x_TD,
// batch, pos_local_S, ·). Returns y_TD [B·S/cp, D].
Tensor cp_attention_forward(const ExecContext& ctx, const AttentionOptions& opt, const AttentionWeights& w,
                            const Tensor& x_TD, int64_t batch, const CpPositions& pos_local_S,
                            comm::Communicator* cp, CpComm method, CpAttentionSaved& saved);
// dy_TD: [B·S/cp, D]. Returns dx_TD [B·S/cp, D] (complete); accumulates this
// rank's partial weight gradients into `grad` (sum them over cp, see above).
// cp must be the group forward used, and the method is forward's (saved).
// Size > 1: all_gather runs one reduce_scatter of the packed dK, dV (recv U
// floats); ring sends cp − 1 K, V blocks and cp dK, dV blocks of U per rank.
// Null or size 1: bitwise attention_module_backward.
// With defer (kernels/deferred.h) as there: dx and the dK, dV exchange now,
// the weight GEMMs pushed (keeping dy, o, dq, the local dk, dv — under cp the
// received buffer — and x).
Tensor cp_attention_backward(const ExecContext& ctx, const AttentionOptions& opt, const AttentionWeights& w,
                             const CpAttentionSaved& saved, const Tensor& dy_TD, comm::Communicator* cp,
                             AttentionWeights& grad, WeightGradQueue* defer = nullptr);

}  // namespace origami::dense

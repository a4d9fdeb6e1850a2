// Tensor parallelism with sequence parallelism for the dense modules
// (ARCHITECTURE.md §5 "TP with sequence parallelism" and "Vocab"). Every
// function takes the `tp` communicator; null or a group of one rank runs the
// single-rank module unchanged (no copies, no collectives, bitwise the same).
//
// Shard rules (r = rank in tp, n = tp size):
//  - Tokens (sequence parallelism): the residual stream of a micro-batch is
//    the flattened [T, D] rows, T = B·S_local (batch-major: row b·S + s). TP
//    rank r holds rows [r·T/n, (r+1)·T/n), so a shard may span sample
//    boundaries and SP works for any B. Requires T % n == 0. All-gathering the
//    shards in rank order rebuilds [T, D] with no reordering. (ARCHITECTURE.md
//    §5 writes the shard as [micro_batch, seq_len/(CP·TP), hidden]; that is
//    the same cut when B = 1, and the flattened one needs no S % n. CP's
//    per-sample chunking happens before and is unaffected.)
//  - Attention heads: rank r holds query heads [r·Hq/n, (r+1)·Hq/n) and kv
//    heads [r·Hkv/n, (r+1)·Hkv/n): rows [r·Hq/n·hd, +Hq/n·hd) of wq (and the
//    same COLUMNS of wo), rows [r·Hkv/n·hd, +Hkv/n·hd) of wk and wv. Requires
//    Hq % n == 0 and Hkv % n == 0; the GQA map (query head j reads kv head
//    j / (Hq/Hkv)) then stays inside the rank.
//  - Dense MLP: rank r holds rows [r·F/n, (r+1)·F/n) of gate and up ([F, D])
//    and the same COLUMNS of down ([D, F]). Requires F % n == 0.
//  - Vocabulary (embedding table and LM head, both [V, D]): c = ceil(V/n)
//    rows per rank; rank r holds rows [min(r·c, V), min((r+1)·c, V)), so the
//    last ranks hold fewer (possibly zero, e.g. V = 5, n = 4 gives 2, 2, 1, 0).
//
// Layout of the passes (x, y: this rank's SP shard [T/n, D]):
//   attention, MLP: all-gather x over tp → [T, D]; column-parallel q/k/v or
//     gate/up on the local heads / columns; row-parallel o or down gives a
//     partial [T, D]; reduce-scatter (sum) over tp → [T/n, D]. Backward is the
//     adjoint: all-gather dy, local backward, reduce-scatter dx. The GATHERED
//     input is kept in the saved struct (saved.x_TD is [T, D]), so backward
//     never re-gathers x: one all-gather and one reduce-scatter each way.
//   embedding: ids are replicated over tp (all T ids of the micro-batch on
//     every tp rank); each rank looks up all T ids in its vocab rows (zero rows
//     for ids it does not own) and reduce-scatters → [T/n, D]. Backward:
//     all-gather dx → [T, D], scatter-add into the local rows.
//   LM head + loss: all-gather y → [T, D] (saved); local logits [T, V_r];
//     vocab-parallel cross-entropy: per-token max all-reduced (MAX), then
//     Σ exp(logit − max) and the target logit (picked by the rank that owns
//     the target id, 0 elsewhere) all-reduced (SUM, one call); logits are
//     never gathered. Backward: local dlogits, dW_local += dlogitsᵀ·y, and the
//     partial dy = dlogits·W_local reduce-scattered → [T/n, D].
//
// What the caller must do:
//  - RMSNorm (and, later, the MoE router) runs on the SP shard with the
//    existing modules unchanged; their weights are replicated over tp, so
//    their weight GRADIENTS must be all-reduced (SUM) over tp by the caller
//    (tp_all_reduce_replicated_grad) — each rank only saw its T/n tokens.
//  - The loss returned by tp_lm_head_forward is Σ_t loss_t over ALL T tokens
//    of the micro-batch and is identical on every tp rank (it is computed from
//    all-reduced per-token values), so count it once per tp group.
//  - Sharded weight gradients (q/k/v/o, gate/up/down, embedding, head) are
//    complete on each rank for its slice: no tp reduction.
//
// Deferred weight gradients (kernels/deferred.h): every backward here takes
// an optional WeightGradQueue. Its collectives stay where they are (the
// gathers of dy and the reduce-scatters of dx run in B, in the same order);
// only the local weight-gradient calls are pushed, reading the gathered
// tensors they would have read (the embedding keeps the gathered [T, D] dx).
#pragma once
#include "comm/communicator.h"
#include "dense/attention.h"
#include "dense/lm_head.h"
#include "dense/mlp.h"
#include "kernels/context.h"
#include "kernels/deferred.h"
#include "kernels/tensor.h"

namespace origami::dense {

// [start, start + count) along one dimension.
struct TpRange {
  int64_t start = 0, count = 0;
};

// The shard rules above. Each checks its divisibility rule with a message
// naming the sizes.
TpRange tp_token_range(int64_t tokens, const comm::Communicator* tp);  // rows of the SP shard
TpRange tp_mlp_range(int64_t ffn_hidden, const comm::Communicator* tp);  // rows of gate/up, columns of down
TpRange tp_vocab_range(int64_t vocab, const comm::Communicator* tp);     // rows of the table / head (ceil rule)
TpRange tp_vocab_range(int64_t vocab, int rank, int size);               // the same for any rank (pure)

struct TpAttentionShard {
  AttentionOptions local;  // this rank's heads: Hq/n, Hkv/n (same head_dim, theta)
  TpRange q_rows;          // rows of wq = columns of wo
  TpRange kv_rows;         // rows of wk and wv
};
TpAttentionShard tp_attention_shard(const AttentionOptions& opt, const comm::Communicator* tp);

// SP collectives on token rows: [T/n, D] → [T, D] in rank order, and the
// partial sums [T, D] → this rank's summed rows [T/n, D]. With one rank both
// return their input.
Tensor tp_all_gather_tokens(const Tensor& shard_TD, comm::Communicator* tp);
Tensor tp_reduce_scatter_tokens(const Tensor& partial_TD, comm::Communicator* tp);
// Sums a replicated parameter's gradient over tp (norm weights, router).
void tp_all_reduce_replicated_grad(Tensor& grad, comm::Communicator* tp);

// ---- attention ----------------------------------------------------------------------------------
// opt: the GLOBAL head counts; w_local: this rank's slices (TpAttentionShard),
// wq [Hq/n·hd, D], wk, wv [Hkv/n·hd, D], wo [D, Hq/n·hd]. x_shard_TD:
// [T/n, D] with T = batch·S; pos_S: i32 [S] global positions (the same on
// every tp rank). Returns y_shard [T/n, D]. saved.x_TD is the gathered [T, D]
// input; saved.dims holds the local head counts.
Tensor tp_attention_forward(const ExecContext& ctx, const AttentionOptions& opt, const AttentionWeights& w_local,
                            const Tensor& x_shard_TD, int64_t batch, const Tensor& pos_S, comm::Communicator* tp,
                            AttentionSaved& saved);
// dy_shard_TD: [T/n, D]. Returns dx_shard [T/n, D]; accumulates into the
// local gradient slices grad_local (shaped like w_local).
Tensor tp_attention_backward(const ExecContext& ctx, const AttentionOptions& opt, const AttentionWeights& w_local,
                             const AttentionSaved& saved, const Tensor& dy_shard_TD, comm::Communicator* tp,
                             AttentionWeights& grad_local, WeightGradQueue* defer = nullptr);

// ---- dense SwiGLU MLP ---------------------------------------------------------------------------
// w_local: gate, up [F/n, D], down [D, F/n]. x_shard_TD: [T/n, D].
// Returns y_shard [T/n, D]; saved.x_TD is the gathered [T, D] input.
Tensor tp_mlp_forward(const ExecContext& ctx, const MlpWeights& w_local, const Tensor& x_shard_TD,
                      comm::Communicator* tp, MlpSaved& saved);
Tensor tp_mlp_backward(const ExecContext& ctx, const MlpWeights& w_local, const MlpSaved& saved,
                       const Tensor& dy_shard_TD, comm::Communicator* tp, MlpWeights& grad_local,
                       WeightGradQueue* defer = nullptr);

// ---- vocab-parallel embedding -------------------------------------------------------------------
// ids_T: i32 [T], ALL tokens of the micro-batch (replicated over tp);
// table_local: this rank's rows of the [vocab, D] table (tp_vocab_range).
// Returns x_shard [T/n, D].
Tensor tp_embedding_forward(const ExecContext& ctx, const Tensor& ids_T, const Tensor& table_local, int64_t vocab,
                            comm::Communicator* tp);
// dx_shard_TD: [T/n, D]; dtable_local += the scatter of the gathered rows.
void tp_embedding_backward(const ExecContext& ctx, const Tensor& ids_T, const Tensor& dx_shard_TD, int64_t vocab,
                           comm::Communicator* tp, Tensor& dtable_local, WeightGradQueue* defer = nullptr);

// ---- vocab-parallel LM head + cross-entropy -----------------------------------------------------
struct TpLmHeadSaved {
  Tensor y_TD;       // gathered normed final hidden state, [T, D]
  Tensor targets_T;  // i32 [T], all tokens (replicated over tp)
  Tensor logits_TV;  // local logits [T, V_r]; backward turns it into dlogits in place
  Tensor lse_T;      // GLOBAL log-sum-exp per token, [T]
  int64_t vocab_start = 0;
};

// w_local: this rank's head rows [V_r, D]; y_shard_TD: [T/n, D]; targets_T:
// i32 [T] in [0, vocab). Returns the per-token losses loss_T (f32 [T] on
// ctx's device), the same on every tp rank.
Tensor tp_lm_head_losses(const ExecContext& ctx, const Tensor& w_local, int64_t vocab, const Tensor& y_shard_TD,
                         const Tensor& targets_T, comm::Communicator* tp, TpLmHeadSaved& saved);
// The same forward, returning Σ_t loss_t over all T tokens (fp64) read on the
// host (a wait for ctx's stream on a device); per-token losses into loss_T
// if given. The training path adds the sum on the device instead (sum_add).
double tp_lm_head_forward(const ExecContext& ctx, const Tensor& w_local, int64_t vocab, const Tensor& y_shard_TD,
                          const Tensor& targets_T, comm::Communicator* tp, TpLmHeadSaved& saved,
                          Tensor* loss_T = nullptr);
// d(grad_scale · Σ loss)/dy for this rank's rows: returns dy_shard [T/n, D];
// accumulates dw_local [V_r, D]. Consumes saved.logits_TV.
Tensor tp_lm_head_backward(const ExecContext& ctx, const Tensor& w_local, TpLmHeadSaved& saved, float grad_scale,
                           comm::Communicator* tp, Tensor& dw_local, WeightGradQueue* defer = nullptr);

}  // namespace origami::dense

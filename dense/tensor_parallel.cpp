// Tensor + sequence parallel dense modules (see tensor_parallel.h). Each pass
// is gather → the single-rank module on the local slices → reduce-scatter;
// only the vocab-parallel cross-entropy has math of its own.
#include "dense/tensor_parallel.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <vector>

#include "kernels/cross_entropy.h"
#include "kernels/elementwise.h"
#include "kernels/embedding.h"
#include "kernels/gemm.h"

namespace origami::dense {

namespace {

Tensor activation(const ExecContext& ctx, Shape shape) { return ctx.empty_data(std::move(shape)); }

bool single(const comm::Communicator* tp) { return comm::group_size(tp) == 1; }

TpRange even_range(int64_t n, const comm::Communicator* tp, const char* what) {
  const int64_t size = comm::group_size(tp), rank = comm::group_rank(tp);
  ORIGAMI_CHECK(n % size == 0, what, " (", n, ") is not divisible by the tp size ", size);
  return {rank * (n / size), n / size};
}

void check_matrix(const Tensor& t, int64_t rows, int64_t cols, const char* name) {
  ORIGAMI_CHECK(t.defined() && (t.dtype() == DType::f32 || t.dtype() == DType::bf16), name,
                " must be a defined f32 or bf16 tensor");
  check_shape(t, {rows, cols}, name);
}

}  // namespace

TpRange tp_token_range(int64_t tokens, const comm::Communicator* tp) {
  return even_range(tokens, tp, "sequence parallelism: the micro-batch's token count B·S");
}

TpRange tp_mlp_range(int64_t ffn_hidden, const comm::Communicator* tp) {
  return even_range(ffn_hidden, tp, "tensor parallelism: the MLP hidden size F");
}

TpRange tp_vocab_range(int64_t vocab, const comm::Communicator* tp) {
  return tp_vocab_range(vocab, comm::group_rank(tp), comm::group_size(tp));
}

TpRange tp_vocab_range(int64_t vocab, int rank_, int size_) {
  const int64_t size = size_, rank = rank_;
  ORIGAMI_CHECK(size >= 1 && rank >= 0 && rank < size, "vocab-parallel: rank ", rank, " of ", size);
  ORIGAMI_CHECK(vocab > 0, "vocab-parallel: vocabulary size ", vocab, " must be positive");
  const int64_t per = (vocab + size - 1) / size;  // ceil(V / n)
  const int64_t start = std::min(rank * per, vocab), end = std::min((rank + 1) * per, vocab);
  return {start, end - start};
}

TpAttentionShard tp_attention_shard(const AttentionOptions& opt, const comm::Communicator* tp) {
  const TpRange heads = even_range(opt.num_heads, tp, "tensor parallelism: the query head count Hq");
  const TpRange kv = even_range(opt.num_kv_heads, tp, "tensor parallelism: the kv head count Hkv");
  TpAttentionShard s;
  s.local = opt;
  s.local.num_heads = heads.count;
  s.local.num_kv_heads = kv.count;
  s.q_rows = {heads.start * opt.head_dim, heads.count * opt.head_dim};
  s.kv_rows = {kv.start * opt.head_dim, kv.count * opt.head_dim};
  return s;
}

Tensor tp_all_gather_tokens(const Tensor& shard_TD, comm::Communicator* tp) {
  if (single(tp)) return shard_TD;
  const int64_t n = tp->size();
  // On the shard's device (these take no context: they only communicate).
  Tensor full = Tensor::empty({shard_TD.rows() * n, shard_TD.cols()}, shard_TD.dtype(), MemCategory::activation,
                              shard_TD.device());  // (T, D)
  tp->all_gather(shard_TD, full);
  return full;
}

Tensor tp_reduce_scatter_tokens(const Tensor& partial_TD, comm::Communicator* tp) {
  if (single(tp)) return partial_TD;
  const TpRange rows = tp_token_range(partial_TD.rows(), tp);
  Tensor shard = Tensor::empty({rows.count, partial_TD.cols()}, partial_TD.dtype(), MemCategory::activation,
                               partial_TD.device());  // (T/n, D)
  tp->reduce_scatter(partial_TD, shard);
  return shard;
}

void tp_all_reduce_replicated_grad(Tensor& grad, comm::Communicator* tp) {
  if (!single(tp)) tp->all_reduce(grad);
}

// ---- attention ----------------------------------------------------------------------------------

Tensor tp_attention_forward(const ExecContext& ctx, const AttentionOptions& opt, const AttentionWeights& w_local,
                            const Tensor& x_shard_TD, int64_t batch, const Tensor& pos_S, comm::Communicator* tp,
                            AttentionSaved& saved) {
  if (single(tp)) return attention_module_forward(ctx, opt, w_local, x_shard_TD, batch, pos_S, saved);
  const TpAttentionShard s = tp_attention_shard(opt, tp);
  const int64_t D = x_shard_TD.cols();
  check_matrix(w_local.wq, s.q_rows.count, D, "tp attention: local wq");
  check_matrix(w_local.wk, s.kv_rows.count, D, "tp attention: local wk");
  check_matrix(w_local.wv, s.kv_rows.count, D, "tp attention: local wv");
  check_matrix(w_local.wo, D, s.q_rows.count, "tp attention: local wo");
  const Tensor x_TD = tp_all_gather_tokens(x_shard_TD, tp);                                  // (T, D), saved
  const Tensor y_partial = attention_module_forward(ctx, s.local, w_local, x_TD, batch, pos_S, saved);  // (T, D)
  return tp_reduce_scatter_tokens(y_partial, tp);                                            // (T/n, D)
}

Tensor tp_attention_backward(const ExecContext& ctx, const AttentionOptions& opt, const AttentionWeights& w_local,
                             const AttentionSaved& saved, const Tensor& dy_shard_TD, comm::Communicator* tp,
                             AttentionWeights& grad_local, WeightGradQueue* defer) {
  if (single(tp)) return attention_module_backward(ctx, opt, w_local, saved, dy_shard_TD, grad_local, defer);
  const TpAttentionShard s = tp_attention_shard(opt, tp);
  const Tensor dy_TD = tp_all_gather_tokens(dy_shard_TD, tp);  // (T, D)
  const Tensor dx_partial =
      attention_module_backward(ctx, s.local, w_local, saved, dy_TD, grad_local, defer);  // (T, D)
  return tp_reduce_scatter_tokens(dx_partial, tp);                                          // (T/n, D)
}

// ---- dense SwiGLU MLP ---------------------------------------------------------------------------

Tensor tp_mlp_forward(const ExecContext& ctx, const MlpWeights& w_local, const Tensor& x_shard_TD,
                      comm::Communicator* tp, MlpSaved& saved) {
  if (single(tp)) return mlp_module_forward(ctx, w_local, x_shard_TD, saved);
  const int64_t D = x_shard_TD.cols(), F_local = w_local.gate.rows();
  check_matrix(w_local.gate, F_local, D, "tp mlp: local gate");
  check_matrix(w_local.up, F_local, D, "tp mlp: local up");
  check_matrix(w_local.down, D, F_local, "tp mlp: local down");
  const Tensor x_TD = tp_all_gather_tokens(x_shard_TD, tp);             // (T, D), saved
  const Tensor y_partial = mlp_module_forward(ctx, w_local, x_TD, saved);  // (T, D)
  return tp_reduce_scatter_tokens(y_partial, tp);                       // (T/n, D)
}

Tensor tp_mlp_backward(const ExecContext& ctx, const MlpWeights& w_local, const MlpSaved& saved,
                       const Tensor& dy_shard_TD, comm::Communicator* tp, MlpWeights& grad_local,
                       WeightGradQueue* defer) {
  if (single(tp)) return mlp_module_backward(ctx, w_local, saved, dy_shard_TD, grad_local, defer);
  const Tensor dy_TD = tp_all_gather_tokens(dy_shard_TD, tp);                                   // (T, D)
  const Tensor dx_partial = mlp_module_backward(ctx, w_local, saved, dy_TD, grad_local, defer);  // (T, D)
  return tp_reduce_scatter_tokens(dx_partial, tp);                                              // (T/n, D)
}

// ---- vocab-parallel embedding -------------------------------------------------------------------

Tensor tp_embedding_forward(const ExecContext& ctx, const Tensor& ids_T, const Tensor& table_local, int64_t vocab,
                            comm::Communicator* tp) {
  const TpRange v = tp_vocab_range(vocab, tp);
  ORIGAMI_CHECK(table_local.dim() == 2 && table_local.rows() == v.count, "tp embedding: local table ",
                shape_string(table_local.shape()), " should hold ", v.count, " rows (vocab ", vocab, ", tp rank ",
                comm::group_rank(tp), " of ", comm::group_size(tp), ")");
  tp_token_range(ids_T.numel(), tp);  // checks T % n
  Tensor partial = activation(ctx, {ids_T.numel(), table_local.cols()});  // (T, D): zero rows for ids not owned
  embedding_forward(ctx, ids_T, table_local, v.start, partial);
  return tp_reduce_scatter_tokens(partial, tp);  // (T/n, D)
}

void tp_embedding_backward(const ExecContext& ctx, const Tensor& ids_T, const Tensor& dx_shard_TD, int64_t vocab,
                           comm::Communicator* tp, Tensor& dtable_local, WeightGradQueue* defer) {
  const TpRange v = tp_vocab_range(vocab, tp);
  auto check = [v](const Tensor& dtable) {
    ORIGAMI_CHECK(dtable.dim() == 2 && dtable.rows() == v.count, "tp embedding: local table gradient ",
                  shape_string(dtable.shape()), " should hold ", v.count, " rows");
  };
  if (!defer) check(dtable_local);  // deferred: unbound until W, checked there
  const Tensor dx_TD = tp_all_gather_tokens(dx_shard_TD, tp);  // (T, D), gathered in B when deferred
  weight_grad(ctx, defer, dtable_local, [check, v, ids_T, dx_TD](const ExecContext& c, Tensor& dtable) {
    check(dtable);
    embedding_backward(c, ids_T, dx_TD, v.start, dtable);
  });
}

// ---- vocab-parallel LM head + cross-entropy -----------------------------------------------------

Tensor tp_lm_head_losses(const ExecContext& ctx, const Tensor& w_local, int64_t vocab, const Tensor& y_shard_TD,
                         const Tensor& targets_T, comm::Communicator* tp, TpLmHeadSaved& saved) {
  const TpRange v = tp_vocab_range(vocab, tp);
  check_matrix(w_local, v.count, y_shard_TD.cols(), "tp lm head: local head weight");
  saved.y_TD = tp_all_gather_tokens(y_shard_TD, tp);  // (T, D)
  const int64_t T = saved.y_TD.rows(), Vr = v.count;
  ORIGAMI_CHECK(targets_T.dtype() == DType::i32 && targets_T.numel() == T, "tp lm head: targets ",
                shape_string(targets_T.shape()), " should be i32 [", T, "] (all tokens of the micro-batch)");
  saved.targets_T = targets_T;
  saved.vocab_start = v.start;
  // f32 statistics whatever the data dtype (a bf16 GEMM writes f32 logits).
  saved.logits_TV = ctx.empty({T, Vr}, DType::f32, MemCategory::activation);
  saved.lse_T = ctx.empty({T}, DType::f32, MemCategory::activation);
  gemm(ctx, saved.y_TD, Trans::no, w_local, Trans::yes, saved.logits_TV);  // (T, V_r)
  Tensor losses = ctx.empty({T}, DType::f32, MemCategory::activation);

  if (single(tp)) {
    // The whole vocabulary is here: the single-rank kernel, bitwise as lm_head_forward.
    cross_entropy_forward(ctx, saved.logits_TV, targets_T, losses, saved.lse_T);
  } else {
    // Per-token max over the local columns (−inf on a rank without vocab
    // rows), MAX over tp; then [Σ exp(logit − max) | target logit or 0] in
    // fp64, SUM over tp; then the log-sum-exp and loss of every token.
    Tensor mx = ctx.empty({T}, DType::f32, MemCategory::comm);
    cross_entropy_local_max(ctx, saved.logits_TV, mx);
    tp->all_reduce(mx, comm::ReduceOp::max);
    Tensor sums = ctx.empty({2, T}, DType::f64, MemCategory::comm);
    cross_entropy_local_sums(ctx, saved.logits_TV, targets_T, mx, v.start, vocab, sums);
    tp->all_reduce(sums);
    cross_entropy_finish(ctx, mx, sums, losses, saved.lse_T);
  }
  return losses;
}

double tp_lm_head_forward(const ExecContext& ctx, const Tensor& w_local, int64_t vocab, const Tensor& y_shard_TD,
                          const Tensor& targets_T, comm::Communicator* tp, TpLmHeadSaved& saved, Tensor* loss_T) {
  const Tensor losses = tp_lm_head_losses(ctx, w_local, vocab, y_shard_TD, targets_T, tp, saved);
  if (loss_T) *loss_T = losses;
  return sum(ctx, losses);
}

Tensor tp_lm_head_backward(const ExecContext& ctx, const Tensor& w_local, TpLmHeadSaved& saved, float grad_scale,
                           comm::Communicator* tp, Tensor& dw_local, WeightGradQueue* defer) {
  const int64_t T = saved.y_TD.rows(), D = saved.y_TD.cols();
  Tensor& dlogits_f32 = saved.logits_TV;  // in place: the logits are not needed again
  if (single(tp)) {
    cross_entropy_backward(ctx, saved.logits_TV, saved.targets_T, saved.lse_T, grad_scale, dlogits_f32);
  } else {
    // dlogits = (softmax − onehot(target)) · scale on the local columns; the
    // one-hot lands only on the rank that owns the target.
    cross_entropy_local_backward(ctx, saved.logits_TV, saved.targets_T, saved.lse_T, saved.vocab_start, grad_scale,
                                 dlogits_f32);
  }
  const Tensor dlogits = as_dtype(ctx, dlogits_f32, w_local.dtype());  // the GEMMs' data dtype
  linear_weight_grad(ctx, defer, dlogits, saved.y_TD, dw_local);  // (V_r, D)
  Tensor dy_partial = activation(ctx, {T, D});
  gemm(ctx, dlogits, Trans::no, w_local, Trans::no, dy_partial);  // (T, D): this rank's vocab columns only
  saved.logits_TV = Tensor();
  return tp_reduce_scatter_tokens(dy_partial, tp);  // (T/n, D)
}

}  // namespace origami::dense

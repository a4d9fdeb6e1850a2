// Token cross-entropy over the vocabulary in fp32:
//   loss_t = logsumexp(logits_t) − logits_t[target_t]
#pragma once
#include "kernels/context.h"
#include "kernels/tensor.h"

namespace origami {

// logits_TV: [T, V]; targets_T: i32 [T], each in [0, V); loss_T, lse_T: [T].
void cross_entropy_forward(const ExecContext& ctx, const Tensor& logits_TV, const Tensor& targets_T, Tensor& loss_T,
                           Tensor& lse_T);
// dlogits_TV = (softmax(logits) − onehot(target)) · grad_scale, per row.
// dlogits_TV may alias logits_TV (in place, to save the [T, V] buffer).
void cross_entropy_backward(const ExecContext& ctx, const Tensor& logits_TV, const Tensor& targets_T,
                            const Tensor& lse_T, float grad_scale, Tensor& dlogits_TV);

// Vocab-parallel pieces (Megatron's VocabParallelCrossEntropy): this rank's
// logits_TV hold vocabulary columns [vocab_start, vocab_start + V_r) of a
// vocabulary of `vocab`. The caller reduces between the steps — max_T with
// MAX over the tensor-parallel group, sums_2T with SUM — so every rank ends
// with the whole row's log-sum-exp. Sums are fp64: V_r terms per rank, then
// tp partial sums, must not lose the small ones.
//   max_T (f32 [T]) = max of the local columns (−inf when V_r = 0).
void cross_entropy_local_max(const ExecContext& ctx, const Tensor& logits_TV, Tensor& max_T);
//   sums_2T (f64 [2, T]): row 0 = Σ_i exp(logit_ti − max_t), row 1 = the
//   target's logit when this rank holds its column, else 0. Every target
//   must lie in [0, vocab).
void cross_entropy_local_sums(const ExecContext& ctx, const Tensor& logits_TV, const Tensor& targets_T,
                              const Tensor& max_T, int64_t vocab_start, int64_t vocab, Tensor& sums_2T);
//   lse_T = max + log(row 0), loss_T = lse − row 1 (both f32 [T]), from the
//   reduced max and sums.
void cross_entropy_finish(const ExecContext& ctx, const Tensor& max_T, const Tensor& sums_2T, Tensor& loss_T,
                          Tensor& lse_T);
//   dlogits_TV = (exp(logit − lse) − [target column here]) · grad_scale on
//   the local columns; may alias logits_TV.
void cross_entropy_local_backward(const ExecContext& ctx, const Tensor& logits_TV, const Tensor& targets_T,
                                  const Tensor& lse_T, int64_t vocab_start, float grad_scale, Tensor& dlogits_TV);

}  // namespace origami

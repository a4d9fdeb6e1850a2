// Token cross-entropy over the vocabulary in fp32:
//   loss_t = logsumexp(logits_t) − logits_t[target_t]
#pragma once
#include "kernels/tensor.h"

namespace origami {

// logits_TV: [T, V]; targets_T: i32 [T], each in [0, V); loss_T, lse_T: [T].
void cross_entropy_forward(const Tensor& logits_TV, const Tensor& targets_T, Tensor& loss_T, Tensor& lse_T);
// dlogits_TV = (softmax(logits) − onehot(target)) · grad_scale, per row.
// dlogits_TV may alias logits_TV (in place, to save the [T, V] buffer).
void cross_entropy_backward(const Tensor& logits_TV, const Tensor& targets_T, const Tensor& lse_T,
                            float grad_scale, Tensor& dlogits_TV);

}  // namespace origami

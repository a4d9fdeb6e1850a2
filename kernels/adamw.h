// AdamW exactly as torch.optim.AdamW (decoupled weight decay, bias correction):
//   p  -= lr · wd · p
//   m   = β1·m + (1−β1)·g ;  v = β2·v + (1−β2)·g²
//   p  -= lr · (m / (1−β1^t)) / (sqrt(v / (1−β2^t)) + eps)
// on a flat fp32 shard (master weights = params on CPU).
#pragma once
#include "kernels/context.h"
#include "kernels/tensor.h"

namespace origami {

struct AdamWStep {
  float lr = 0, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0;
  int64_t step = 1;  // 1-based, for bias correction
};

// All tensors [N] f32; grad is read-only.
void adamw_update(const ExecContext& ctx, Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                  const AdamWStep& s);

}  // namespace origami

// AdamW exactly as torch.optim.AdamW (decoupled weight decay, bias correction):
//   p  -= lr · wd · p
//   m   = β1·m + (1−β1)·g ;  v = β2·v + (1−β2)·g²
//   p  -= lr · (m / (1−β1^t)) / (sqrt(v / (1−β2^t)) + eps)
// on a flat fp32 shard (master weights = params on CPU).
#pragma once
#include <span>

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

// A run of a unit's elements that share one weight decay (a parameter, or
// adjacent parameters decayed alike).
struct AdamWSegment {
  int64_t begin = 0, numel = 0;  // elements into every tensor of the call
  float weight_decay = 0;
};

// The optimizer step of one parameter unit's owned elements, fused: per
// element
//   grad  *= grad_scale     as scale_inplace leaves it (rounded to grad's
//                           dtype; 1 leaves grad untouched)
//   adamw_update of master, exp_avg, exp_avg_sq from that gradient, with the
//                           weight decay of the element's segment (s.weight_decay
//                           is not read)
//   param  = cast(master)   the bf16 recipe's working copy; undefined in fp32,
//                           where master is the parameter itself
// Bitwise those calls one after another: the CPU makes them; CUDA makes one
// pass, reading the gradient and the master once each where the calls read
// each twice (bf16: 30 bytes per parameter against 36; the step is
// memory-bound, and with 7.5B parameters to 2.2B active in the Mixtral-like
// GPU config a visible share of a training step), with one launch per unit
// instead of up to three per parameter.
// segments tile [0, n) in order; master, exp_avg, exp_avg_sq f32 [n]; grad
// f32 or bf16 [n]; param undefined, or bf16 [n] beside a bf16 grad (the
// bf16 recipe: one data dtype per call).
void adamw_update_fused(const ExecContext& ctx, Tensor& master, Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                        Tensor& param, std::span<const AdamWSegment> segments, float grad_scale, const AdamWStep& s);

}  // namespace origami

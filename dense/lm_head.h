// LM head and loss: logits = y·Whᵀ, loss_t = CE(logits_t, target_t). The
// final RMSNorm before it is the norm module. The loss is returned as a SUM
// over tokens; the caller scales gradients by 1 / (global token count), which
// keeps loss normalization independent of the layout (ARCHITECTURE.md §6).
#pragma once
#include "kernels/context.h"
#include "kernels/deferred.h"
#include "kernels/tensor.h"

namespace origami::dense {

struct LmHeadSaved {
  Tensor y_TD;       // normed final hidden state, [T, D]
  Tensor targets_T;  // i32 [T]
  Tensor logits_TV;  // [T, V]; backward turns it into dlogits in place
  Tensor lse_T;      // [T]
};

// Returns Σ_t loss_t (fp64 accumulation); per-token losses into loss_T if defined.
double lm_head_forward(const ExecContext& ctx, const Tensor& w_VD, const Tensor& y_TD, const Tensor& targets_T,
                       LmHeadSaved& saved, Tensor* loss_T = nullptr);
// d(grad_scale · Σ loss)/dy; accumulates dW. Consumes saved.logits_TV. With
// defer (kernels/deferred.h) dy only now; dW += dlogitsᵀ·y is pushed, keeping
// dlogits (the logits buffer) and y, and dw_VD is the binding it lands in.
Tensor lm_head_backward(const ExecContext& ctx, const Tensor& w_VD, LmHeadSaved& saved, float grad_scale,
                        Tensor& dw_VD, WeightGradQueue* defer = nullptr);

}  // namespace origami::dense

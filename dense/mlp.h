// Dense SwiGLU MLP (ARCHITECTURE.md §4): y = (silu(x·Wgᵀ) ⊙ x·Wuᵀ)·Wdᵀ.
// The expert MLPs of moe/ are the same math over token groups; this module
// is the dense layer's.
#pragma once
#include "kernels/context.h"
#include "kernels/deferred.h"
#include "kernels/tensor.h"

namespace origami::dense {

struct MlpWeights {
  Tensor gate;  // [F, D]
  Tensor up;    // [F, D]
  Tensor down;  // [D, F]
};

struct MlpSaved {
  Tensor x_TD;     // [T, D]
  Tensor gate_TF;  // x·Wgᵀ, [T, F]
  Tensor up_TF;    // x·Wuᵀ, [T, F]
  Tensor h_TF;     // silu(gate) ⊙ up, [T, F]
};

Tensor mlp_module_forward(const ExecContext& ctx, const MlpWeights& w, const Tensor& x_TD, MlpSaved& saved);
// Returns dx_TD; accumulates into `grad`. With defer (kernels/deferred.h) dx
// only now; the three weight GEMMs are pushed, keeping dy and h (down), dgate,
// dup and x (gate, up) — not the saved gate and up — and `grad` is the
// binding they land in.
Tensor mlp_module_backward(const ExecContext& ctx, const MlpWeights& w, const MlpSaved& saved, const Tensor& dy_TD,
                           MlpWeights& grad, WeightGradQueue* defer = nullptr);

}  // namespace origami::dense

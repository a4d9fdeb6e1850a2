// Grouped SwiGLU experts: rows grouped by expert (Permutation layout) run
// y = (silu(x·W1ᵀ) ⊙ x·W3ᵀ)·W2ᵀ with their expert's weights; one GEMM per
// non-empty expert on CPU. The shared expert is the same module with one
// expert over all tokens. Names follow HF Mixtral: w1 = gate, w3 = up, w2 = down.
#pragma once
#include <vector>

#include "kernels/tensor.h"

namespace origami::moe {

struct ExpertWeights {
  Tensor w1_EFD;  // [E, F, D] gate
  Tensor w3_EFD;  // [E, F, D] up
  Tensor w2_EDF;  // [E, D, F] down
  int64_t num_experts() const { return w1_EFD.size(0); }
};

// x_ND is the caller's tensor, not a copy: keep it unchanged until backward.
struct ExpertsSaved {
  std::vector<int64_t> rows_per_expert;
  Tensor x_ND, gate_NF, up_NF, h_NF;
};

// x_ND [N, D]: expert e owns the next rows_per_expert[e] rows (Σ = N, padding
// rows included; a zero row gives a zero output row). Returns y_ND [N, D].
Tensor experts_forward(const ExpertWeights& w, const Tensor& x_ND, const std::vector<int64_t>& rows_per_expert,
                       ExpertsSaved& saved);
// Returns dx_ND; accumulates into `grad`.
Tensor experts_backward(const ExpertWeights& w, const ExpertsSaved& saved, const Tensor& dy_ND, ExpertWeights& grad);

}  // namespace origami::moe

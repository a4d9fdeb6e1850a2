// SwiGLU activation: h = silu(g) ⊙ u, silu(g) = g · σ(g).
// The projections around it are GEMMs owned by the modules.
#pragma once
#include "kernels/context.h"
#include "kernels/tensor.h"

namespace origami {

// gate_TF, up_TF, h_TF: [T, F].
void swiglu_forward(const ExecContext& ctx, const Tensor& gate_TF, const Tensor& up_TF, Tensor& h_TF);
// dgate, dup overwritten.
void swiglu_backward(const ExecContext& ctx, const Tensor& dh_TF, const Tensor& gate_TF, const Tensor& up_TF,
                     Tensor& dgate_TF, Tensor& dup_TF);

}  // namespace origami

// Rotary position embedding, rotate-half convention (Hugging Face Llama):
//   inv_freq_i = theta^(-2i/hd), i < hd/2; angle = pos · inv_freq_i
//   x'[i]      = x[i]·cos − x[i + hd/2]·sin
//   x'[i+hd/2] = x[i + hd/2]·cos + x[i]·sin
// Positions are global token positions (context parallelism hands each rank
// non-contiguous chunks, so positions are explicit, never implied).
#pragma once
#include "kernels/context.h"
#include "kernels/tensor.h"

namespace origami {

// x_BSHd: [B, S, H, hd], rotated in place; pos_S: i32 [S], shared across B.
void rope_forward(const ExecContext& ctx, Tensor& x_BSHd, const Tensor& pos_S, float theta);
// The gradient of a rotation is the inverse rotation: rotates dx in place by −angle.
void rope_backward(const ExecContext& ctx, Tensor& dx_BSHd, const Tensor& pos_S, float theta);

}  // namespace origami

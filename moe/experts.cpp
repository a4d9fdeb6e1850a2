// Grouped SwiGLU experts on CPU (see experts.h). Each segment is a contiguous
// row block of x_ND owned by one expert, so every product is one
// dnnl_sgemm on a row-block view of the activations and an [F, D] / [D, F]
// view of the stacked weights: no gather, no copy, no per-row loop. The SwiGLU
// nonlinearity is elementwise, so it runs once over all N rows rather than per
// expert. Gate and up stay two GEMMs: w1 and w3 are separate tensors (HF
// layout), so fusing them would need a weight copy every step.
#include "moe/experts.h"

#include "kernels/gemm.h"
#include "kernels/swiglu.h"

namespace origami::moe {

namespace {

Tensor activation(Shape shape) { return Tensor::empty(std::move(shape), DType::f32, MemCategory::activation); }

// Expert e's [rows, cols] matrix inside a stacked [E, rows, cols] weight.
Tensor expert_matrix(const Tensor& w, int64_t e) {
  const int64_t r = w.size(1), c = w.size(2);
  return w.flat_view(e * r * c, r * c, {r, c});
}

void check_weights(const ExpertWeights& w, const char* what) {
  ORIGAMI_CHECK(w.w1_EFD.defined() && w.w3_EFD.defined() && w.w2_EDF.defined(), what, ": undefined expert weight");
  ORIGAMI_CHECK(w.w1_EFD.dim() == 3, what, ": w1 must be [E, F, D], got ", shape_string(w.w1_EFD.shape()));
  const int64_t E = w.w1_EFD.size(0), F = w.w1_EFD.size(1), D = w.w1_EFD.size(2);
  check_shape(w.w3_EFD, {E, F, D}, "experts w3");
  check_shape(w.w2_EDF, {E, D, F}, "experts w2");
}

// The segments must tile x_ND exactly (padding rows belong to a segment too).
void check_segments(const ExpertSegments& segments, int64_t E, int64_t N) {
  int64_t total = 0;
  for (const ExpertSegment& s : segments) {
    ORIGAMI_CHECK(s.expert >= 0 && s.expert < E, "segment expert ", s.expert, " outside [0, ", E, ")");
    ORIGAMI_CHECK(s.rows >= 0, "negative segment of ", s.rows, " rows");
    total += s.rows;
  }
  ORIGAMI_CHECK(total == N, "expert segments cover ", total, " rows but x_ND has ", N);
}

}  // namespace

ExpertSegments segments_of(const std::vector<int64_t>& rows_per_expert) {
  ExpertSegments s;
  for (size_t e = 0; e < rows_per_expert.size(); ++e)
    if (rows_per_expert[e] != 0) s.push_back({static_cast<int64_t>(e), rows_per_expert[e]});
  return s;
}

Tensor experts_forward(const ExecContext& ctx, const ExpertWeights& w, const Tensor& x_ND,
                       const ExpertSegments& segments, ExpertsSaved& saved) {
  check_weights(w, "experts_forward");
  const int64_t E = w.num_experts(), F = w.w1_EFD.size(1), D = w.w1_EFD.size(2);
  ORIGAMI_CHECK(x_ND.dim() == 2 && x_ND.size(1) == D, "experts_forward: x_ND ", shape_string(x_ND.shape()),
                " should be [N, ", D, "]");
  const int64_t N = x_ND.size(0);
  check_segments(segments, E, N);

  saved.segments = segments;
  saved.x_ND = x_ND;
  saved.gate_NF = activation({N, F});  // x·W1ᵀ per expert
  saved.up_NF = activation({N, F});    // x·W3ᵀ per expert
  saved.h_NF = activation({N, F});     // silu(gate) ⊙ up
  Tensor y_ND = activation({N, D});

  int64_t off = 0;
  for (const auto [e, n] : segments) {
    if (n == 0) continue;
    const Tensor x = x_ND.slice(off, n);  // (n, D)
    Tensor g = saved.gate_NF.slice(off, n), u = saved.up_NF.slice(off, n);
    gemm(ctx, x, Trans::no, expert_matrix(w.w1_EFD, e), Trans::yes, g);  // (n, F)
    gemm(ctx, x, Trans::no, expert_matrix(w.w3_EFD, e), Trans::yes, u);  // (n, F)
    off += n;
  }
  // Every row belongs to some segment (segments tile N), so gate/up are fully
  // written and one elementwise pass covers all experts.
  swiglu_forward(ctx, saved.gate_NF, saved.up_NF, saved.h_NF);
  off = 0;
  for (const auto [e, n] : segments) {
    if (n == 0) continue;
    Tensor y = y_ND.slice(off, n);
    gemm(ctx, saved.h_NF.slice(off, n), Trans::no, expert_matrix(w.w2_EDF, e), Trans::yes, y);  // (n, D)
    off += n;
  }
  return y_ND;
}

Tensor experts_backward(const ExecContext& ctx, const ExpertWeights& w, const ExpertsSaved& saved, const Tensor& dy_ND,
                        ExpertWeights& grad) {
  check_weights(w, "experts_backward");
  check_weights(grad, "experts_backward grad");
  const int64_t E = w.num_experts(), F = w.w1_EFD.size(1), D = w.w1_EFD.size(2);
  check_shape(grad.w1_EFD, w.w1_EFD.shape(), "experts grad w1");
  const int64_t N = saved.x_ND.size(0);
  check_shape(dy_ND, {N, D}, "experts dy_ND");
  check_segments(saved.segments, E, N);

  // dh = dy·W2 and dW2 += dyᵀ·h, per expert.
  Tensor dh_NF = activation({N, F});
  int64_t off = 0;
  for (const auto [e, n] : saved.segments) {
    if (n == 0) continue;
    const Tensor dy = dy_ND.slice(off, n);  // (n, D)
    Tensor dh = dh_NF.slice(off, n);
    Tensor dw2 = expert_matrix(grad.w2_EDF, e);
    gemm(ctx, dy, Trans::no, expert_matrix(w.w2_EDF, e), Trans::no, dh);              // (n, F)
    gemm(ctx, dy, Trans::yes, saved.h_NF.slice(off, n), Trans::no, dw2, 1.0f, 1.0f);  // (D, F)
    off += n;
  }
  Tensor dgate_NF = activation({N, F}), dup_NF = activation({N, F});
  swiglu_backward(ctx, dh_NF, saved.gate_NF, saved.up_NF, dgate_NF, dup_NF);

  // dW1 += dgateᵀ·x, dW3 += dupᵀ·x, dx = dgate·W1 + dup·W3, per expert.
  Tensor dx_ND = activation({N, D});
  off = 0;
  for (const auto [e, n] : saved.segments) {
    if (n == 0) continue;
    const Tensor x = saved.x_ND.slice(off, n);
    const Tensor dg = dgate_NF.slice(off, n), du = dup_NF.slice(off, n);
    Tensor dw1 = expert_matrix(grad.w1_EFD, e), dw3 = expert_matrix(grad.w3_EFD, e);
    Tensor dx = dx_ND.slice(off, n);
    gemm(ctx, dg, Trans::yes, x, Trans::no, dw1, 1.0f, 1.0f);             // (F, D)
    gemm(ctx, du, Trans::yes, x, Trans::no, dw3, 1.0f, 1.0f);             // (F, D)
    gemm(ctx, dg, Trans::no, expert_matrix(w.w1_EFD, e), Trans::no, dx);  // (n, D)
    gemm(ctx, du, Trans::no, expert_matrix(w.w3_EFD, e), Trans::no, dx, 1.0f, 1.0f);
    off += n;
  }
  return dx_ND;
}

}  // namespace origami::moe

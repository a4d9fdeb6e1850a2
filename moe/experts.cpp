// Grouped SwiGLU experts on CPU (see experts.h). Each segment is a contiguous
// row block of x_ND owned by one expert, so each projection is one grouped
// GEMM (kernels/grouped_gemm.h) over the segments and the stacked weights: no
// gather, no copy, no per-row loop. The SwiGLU nonlinearity is elementwise, so
// it runs once over all N rows rather than per expert. Gate and up stay two
// GEMMs: w1 and w3 are separate tensors (HF layout), so fusing them would need
// a weight copy every step.
#include "moe/experts.h"

#include "kernels/grouped_gemm.h"
#include "kernels/swiglu.h"

namespace origami::moe {

namespace {

Tensor activation(const ExecContext& ctx, Shape shape) { return ctx.empty_data(std::move(shape)); }

// The segments as the grouped GEMM reads them (group = expert).
std::vector<GemmSegment> gemm_segments(const ExpertSegments& segments) {
  std::vector<GemmSegment> g;
  g.reserve(segments.size());
  for (const auto [e, n] : segments) g.push_back({e, n});
  return g;
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
  saved.gate_NF = activation(ctx, {N, F});  // x·W1ᵀ per expert
  saved.up_NF = activation(ctx, {N, F});    // x·W3ᵀ per expert
  saved.h_NF = activation(ctx, {N, F});     // silu(gate) ⊙ up
  Tensor y_ND = activation(ctx, {N, D});

  const std::vector<GemmSegment> groups = gemm_segments(segments);
  grouped_gemm(ctx, x_ND, w.w1_EFD, Trans::yes, groups, saved.gate_NF);  // (N, F) = x·W1ᵀ per segment
  grouped_gemm(ctx, x_ND, w.w3_EFD, Trans::yes, groups, saved.up_NF);    // (N, F) = x·W3ᵀ
  // Every row belongs to some segment (segments tile N), so gate/up are fully
  // written and one elementwise pass covers all experts.
  swiglu_forward(ctx, saved.gate_NF, saved.up_NF, saved.h_NF);
  grouped_gemm(ctx, saved.h_NF, w.w2_EDF, Trans::yes, groups, y_ND);  // (N, D) = h·W2ᵀ
  return y_ND;
}

Tensor experts_backward(const ExecContext& ctx, const ExpertWeights& w, const ExpertsSaved& saved, const Tensor& dy_ND,
                        ExpertWeights& grad, WeightGradQueue* defer) {
  check_weights(w, "experts_backward");
  const int64_t E = w.num_experts(), F = w.w1_EFD.size(1), D = w.w1_EFD.size(2);
  if (!defer) {  // deferred: unbound until W
    check_weights(grad, "experts_backward grad");
    check_shape(grad.w1_EFD, w.w1_EFD.shape(), "experts grad w1");
  }
  const int64_t N = saved.x_ND.size(0);
  check_shape(dy_ND, {N, D}, "experts dy_ND");
  check_segments(saved.segments, E, N);

  const std::vector<GemmSegment> groups = gemm_segments(saved.segments);
  // dW += dYᵀ·X per group, into one of grad's three views (deferred: the
  // grouped GEMM checks the bound view's shape).
  auto wgrad = [&](Tensor& dst, const Tensor& dY, const Tensor& X) {
    weight_grad(ctx, defer, dst, [groups, dY, X](const ExecContext& c, Tensor& dW) {
      grouped_gemm_wgrad(c, dY, X, groups, dW, 1.0f);
    });
  };
  // dh = dy·W2 and dW2 += dyᵀ·h, per segment.
  Tensor dh_NF = activation(ctx, {N, F});
  grouped_gemm(ctx, dy_ND, w.w2_EDF, Trans::no, groups, dh_NF);  // (N, F)
  wgrad(grad.w2_EDF, dy_ND, saved.h_NF);                         // (E, D, F)
  Tensor dgate_NF = activation(ctx, {N, F}), dup_NF = activation(ctx, {N, F});
  swiglu_backward(ctx, dh_NF, saved.gate_NF, saved.up_NF, dgate_NF, dup_NF);

  // dW1 += dgateᵀ·x, dW3 += dupᵀ·x, dx = dgate·W1 + dup·W3, per segment.
  wgrad(grad.w1_EFD, dgate_NF, saved.x_ND);  // (E, F, D)
  wgrad(grad.w3_EFD, dup_NF, saved.x_ND);    // (E, F, D)
  Tensor dx_ND = activation(ctx, {N, D});
  grouped_gemm(ctx, dgate_NF, w.w1_EFD, Trans::no, groups, dx_ND);       // (N, D)
  grouped_gemm(ctx, dup_NF, w.w3_EFD, Trans::no, groups, dx_ND, 1.0f);  // (N, D) +=
  return dx_ND;
}

}  // namespace origami::moe

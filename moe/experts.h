// Grouped SwiGLU experts: rows in runs of one expert each (segments) run
// y = (silu(x·W1ᵀ) ⊙ x·W3ᵀ)·W2ᵀ with their expert's weights; one grouped
// GEMM per projection (kernels/grouped_gemm.h). The one-rank layout
// (Permutation) is one segment per expert; the expert-parallel layout is
// whatever order the exchange delivered (source rank, then expert), consumed
// in place rather than sorted.
// The shared expert is the same module with one expert over all tokens.
// Under expert tensor parallelism the weights are this rank's F-slice and y
// is a partial sum over F. Names follow HF Mixtral: w1 = gate, w3 = up, w2 = down.
#pragma once
#include <vector>

#include "kernels/context.h"
#include "kernels/deferred.h"
#include "kernels/tensor.h"

namespace origami::moe {

struct ExpertWeights {
  Tensor w1_EFD;  // [E, F, D] gate
  Tensor w3_EFD;  // [E, F, D] up
  Tensor w2_EDF;  // [E, D, F] down
  int64_t num_experts() const { return w1_EFD.size(0); }
};

// `rows` consecutive rows that all belong to expert `expert` (an index into
// the weights' E).
struct ExpertSegment {
  int64_t expert = 0;
  int64_t rows = 0;
  bool operator==(const ExpertSegment&) const = default;
};
using ExpertSegments = std::vector<ExpertSegment>;

// One segment per expert, in expert order (empty experts left out).
ExpertSegments segments_of(const std::vector<int64_t>& rows_per_expert);

// x_ND is the caller's tensor, not a copy: keep it unchanged until backward.
struct ExpertsSaved {
  ExpertSegments segments;
  Tensor x_ND, gate_NF, up_NF, h_NF;
};

// x_ND [N, D]: the segments tile its rows in order (Σ rows = N, padding rows
// included; a zero row gives a zero output row). Returns y_ND [N, D].
Tensor experts_forward(const ExecContext& ctx, const ExpertWeights& w, const Tensor& x_ND,
                       const ExpertSegments& segments, ExpertsSaved& saved);
// Expert e owns the next rows_per_expert[e] rows.
inline Tensor experts_forward(const ExecContext& ctx, const ExpertWeights& w, const Tensor& x_ND,
                              const std::vector<int64_t>& rows_per_expert, ExpertsSaved& saved) {
  ORIGAMI_CHECK(static_cast<int64_t>(rows_per_expert.size()) == w.num_experts(), "rows_per_expert has ",
                rows_per_expert.size(), " entries for ", w.num_experts(), " experts");
  return experts_forward(ctx, w, x_ND, segments_of(rows_per_expert), saved);
}
// Returns dx_ND; accumulates into `grad`. With defer (kernels/deferred.h)
// dx only now; the three weight grouped GEMMs are pushed, keeping dy and h
// (w2), dgate, dup and x (w1, w3) and the segments — not the saved gate and
// up — and `grad` is the binding they land in.
Tensor experts_backward(const ExecContext& ctx, const ExpertWeights& w, const ExpertsSaved& saved, const Tensor& dy_ND,
                        ExpertWeights& grad, WeightGradQueue* defer = nullptr);

}  // namespace origami::moe

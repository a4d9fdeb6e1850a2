// Capacity, dropping and the local permutation (ARCHITECTURE.md §4, §5).
// Permuted rows are grouped by expert (expert 0's rows first); within an
// expert, rows keep token order (then slot order), so the layout is a pure
// function of the routing and the dispatcher can exchange it as is.
#pragma once
#include <vector>

#include "kernels/context.h"
#include "kernels/tensor.h"
#include "moe/options.h"

namespace origami::moe {

// C = ceil(T·k/E · capacity_factor); -1 when dropless.
int64_t expert_capacity(const CapacityOptions& opt, int64_t num_tokens, int64_t top_k, int64_t num_experts);

// kept_TK (u8 [T, k]): 1 where the slot survives capacity. "probs" keeps each
// expert's C highest weights (ties: lower token index, then lower slot);
// "position" keeps its first C slots in token order.
Tensor apply_capacity(const ExecContext& ctx, const CapacityOptions& opt, const Tensor& expert_TK,
                      const Tensor& weight_TK, int64_t num_experts, int64_t capacity);

// The per-expert counts are host vectors (the all-to-all sizes its messages
// with them; the metrics log them): make_permutation copies them from the
// device once, in counts_to_host (moe/permutation.cpp), the dispatcher path's
// one device-to-host point.
struct Permutation {
  int64_t num_experts = 0;
  std::vector<int64_t> rows_per_expert;     // [E]: rows of each expert in the permuted buffer
  std::vector<int64_t> routed_per_expert;   // [E]: slots routed before dropping
  std::vector<int64_t> kept_per_expert;     // [E]: slots kept (the non-padding rows of each expert)
  Tensor row_token_N;                       // i32 [N]: source token, −1 for padding rows
  Tensor row_slot_N;                        // i32 [N]: slot j in [0, k), −1 for padding rows
  Tensor row_of_TK;                         // i32 [T, k]: permuted row of slot (t, j), −1 if dropped
  int64_t num_rows() const { return row_token_N.numel(); }
};

// capacity < 0: dropless. pad_to_capacity: every expert gets exactly C rows.
// kept_TK undefined: every slot is kept.
Permutation make_permutation(const ExecContext& ctx, const Tensor& expert_TK, const Tensor& kept_TK,
                             int64_t num_experts, int64_t capacity, bool pad_to_capacity);

// x_ND[n] = x_TD[row_token[n]] (padding rows zero).
Tensor permute_rows(const ExecContext& ctx, const Tensor& x_TD, const Permutation& perm);
// dx_TD += Σ over rows of token t of dx_ND[row].
void permute_rows_backward(const ExecContext& ctx, const Tensor& dx_ND, const Permutation& perm, Tensor& dx_TD);
// out_TD[t] = Σ_j p[t, j] · y_ND[row(t, j)] over kept slots (dropped slots add nothing).
Tensor unpermute_rows(const ExecContext& ctx, const Tensor& y_ND, const Permutation& perm, const Tensor& weight_TK,
                      int64_t num_tokens);
// dy_ND[row] = p[t, j] · dout_TD[t];  dweight_TK[t, j] = <dout_TD[t], y_ND[row]> (0 for dropped slots).
// Both outputs are overwritten (padding rows of dy_ND zero); undefined ones are allocated.
void unpermute_rows_backward(const ExecContext& ctx, const Tensor& dout_TD, const Tensor& y_ND, const Permutation& perm,
                             const Tensor& weight_TK, Tensor& dy_ND, Tensor& dweight_TK);

}  // namespace origami::moe

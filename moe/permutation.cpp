// Capacity, dropping and the local permutation (see permutation.h). This
// file sizes and allocates; the loops live in kernels/moe_ops (CUDA twins
// later). make_permutation is a counting sort: histograms give each expert's
// row range, one token-major walk places the slots, so it is O(T·k) and the
// row order (expert, then token, then slot) needs no comparison sort.
#include "moe/permutation.h"

#include <cmath>
#include <cstdint>

#include "kernels/moe_ops.h"

namespace origami::moe {

namespace {

void check_routing(const Tensor& expert_TK, int64_t num_experts) {
  ORIGAMI_CHECK(expert_TK.defined() && expert_TK.dtype() == DType::i32 && expert_TK.dim() == 2,
                "expert_TK must be i32 [T, k]");
  ORIGAMI_CHECK(num_experts > 0, "num_experts must be positive, got ", num_experts);
}

Tensor i32(const ExecContext& ctx, Shape shape) { return ctx.empty(std::move(shape), DType::i32, MemCategory::activation); }

// Rows of the counts tensor of make_permutation.
enum CountRow : int64_t { kRouted = 0, kKept = 1, kRows = 2, kCountRows = 3 };

// The named device-to-host point of the dispatcher path: the per-expert
// counts [routed | kept | rows] (i64 [3, E]) in one copy, as host vectors;
// the host waits for the compute stream only.
void counts_to_host(const ExecContext& ctx, const Tensor& count_3E, Permutation& perm) {
  const Tensor host = count_3E.device() == Device::cpu() ? count_3E : ctx.to(count_3E, Device::cpu());
  const int64_t E = count_3E.size(1);
  const int64_t* c = host.data<int64_t>();
  perm.routed_per_expert.assign(c + kRouted * E, c + (kRouted + 1) * E);
  perm.kept_per_expert.assign(c + kKept * E, c + (kKept + 1) * E);
  perm.rows_per_expert.assign(c + kRows * E, c + (kRows + 1) * E);
}

}  // namespace

int64_t expert_capacity(const CapacityOptions& opt, int64_t num_tokens, int64_t top_k, int64_t num_experts) {
  if (!opt.capacity_factor) return -1;
  const double cf = *opt.capacity_factor;
  ORIGAMI_CHECK(cf > 0 && std::isfinite(cf), "capacity_factor must be positive, got ", cf);
  ORIGAMI_CHECK(num_experts > 0 && num_tokens >= 0 && top_k > 0, "expert_capacity(T=", num_tokens, ", k=", top_k,
                ", E=", num_experts, ")");
  // Megatron's get_capacity: ceil((T·k / E) · cf), in the same double order.
  const double per_expert = static_cast<double>(num_tokens * top_k) / static_cast<double>(num_experts);
  return static_cast<int64_t>(std::ceil(per_expert * cf));
}

Tensor apply_capacity(const ExecContext& ctx, const CapacityOptions& opt, const Tensor& expert_TK,
                      const Tensor& weight_TK, int64_t num_experts, int64_t capacity) {
  check_routing(expert_TK, num_experts);
  Tensor kept = ctx.empty(expert_TK.shape(), DType::u8, MemCategory::activation);
  // capacity < 0 (dropless): the kernel keeps every slot.
  moe_capacity_mask(ctx, expert_TK, weight_TK, num_experts, capacity, opt.drop_policy, kept);
  return kept;
}

Permutation make_permutation(const ExecContext& ctx, const Tensor& expert_TK, const Tensor& kept_TK,
                             int64_t num_experts, int64_t capacity, bool pad_to_capacity) {
  check_routing(expert_TK, num_experts);
  ORIGAMI_CHECK(!pad_to_capacity || capacity >= 0, "pad_to_capacity needs a capacity (set capacity_factor)");
  const int64_t T = expert_TK.rows(), K = expert_TK.cols(), E = num_experts;
  Permutation perm;
  perm.num_experts = E;
  // Per-expert counts on the routing's device, one row each.
  Tensor count_3E = ctx.empty({kCountRows, E}, DType::i64, MemCategory::workspace);
  Tensor routed_E = count_3E.flat_view(kRouted * E, E, {E});
  Tensor kept_E = count_3E.flat_view(kKept * E, E, {E});
  Tensor rows_E = count_3E.flat_view(kRows * E, E, {E});
  moe_expert_histogram(ctx, expert_TK, Tensor(), E, routed_E);
  moe_expert_histogram(ctx, expert_TK, kept_TK, E, kept_E);
  moe_expert_rows(ctx, kept_E, pad_to_capacity ? capacity : -1, rows_E);
  counts_to_host(ctx, count_3E, perm);
  int64_t N = 0;
  for (int64_t e = 0; e < E; ++e) {
    ORIGAMI_CHECK(!pad_to_capacity || perm.kept_per_expert[e] <= capacity, "expert ", e, " keeps ",
                  perm.kept_per_expert[e], " slots, over its capacity ", capacity, "; apply_capacity first");
    N += perm.rows_per_expert[e];
  }
  ORIGAMI_CHECK(N <= INT32_MAX, "permuted buffer of ", N, " rows exceeds i32 row indices");
  perm.row_of_TK = i32(ctx, {T, K});
  perm.row_token_N = i32(ctx, {N});
  perm.row_slot_N = i32(ctx, {N});
  moe_permutation_maps(ctx, expert_TK, kept_TK, rows_E, perm.row_of_TK, perm.row_token_N, perm.row_slot_N);
  return perm;
}

Tensor permute_rows(const ExecContext& ctx, const Tensor& x_TD, const Permutation& perm) {
  ORIGAMI_CHECK(x_TD.defined(), "permute_rows on an undefined tensor");
  Tensor x_ND = ctx.empty({perm.num_rows(), x_TD.cols()}, x_TD.dtype(), MemCategory::activation);
  moe_permute_rows(ctx, x_TD, perm.row_token_N, x_ND);
  return x_ND;
}

void permute_rows_backward(const ExecContext& ctx, const Tensor& dx_ND, const Permutation& perm, Tensor& dx_TD) {
  check_shape(dx_ND, {perm.num_rows(), dx_TD.cols()}, "permute_rows_backward dx_ND");
  moe_permute_rows_backward(ctx, dx_ND, perm.row_of_TK, dx_TD);
}

Tensor unpermute_rows(const ExecContext& ctx, const Tensor& y_ND, const Permutation& perm, const Tensor& weight_TK,
                      int64_t num_tokens) {
  ORIGAMI_CHECK(y_ND.defined(), "unpermute_rows on an undefined tensor");
  check_shape(y_ND, {perm.num_rows(), y_ND.cols()}, "unpermute_rows y_ND");
  check_shape(perm.row_of_TK, {num_tokens, perm.row_of_TK.cols()}, "unpermute_rows: permutation token count");
  Tensor out = ctx.empty({num_tokens, y_ND.cols()}, y_ND.dtype(), MemCategory::activation);
  moe_unpermute_rows(ctx, y_ND, perm.row_of_TK, weight_TK, out);
  return out;
}

void unpermute_rows_backward(const ExecContext& ctx, const Tensor& dout_TD, const Tensor& y_ND, const Permutation& perm,
                             const Tensor& weight_TK, Tensor& dy_ND, Tensor& dweight_TK) {
  ORIGAMI_CHECK(y_ND.defined() && weight_TK.defined(), "unpermute_rows_backward on an undefined tensor");
  check_shape(y_ND, {perm.num_rows(), y_ND.cols()}, "unpermute_rows_backward y_ND");
  if (!dy_ND.defined()) dy_ND = ctx.empty(y_ND.shape(), y_ND.dtype(), MemCategory::activation);
  if (!dweight_TK.defined()) dweight_TK = ctx.empty(weight_TK.shape(), DType::f32, MemCategory::activation);
  moe_unpermute_rows_backward(ctx, dout_TD, y_ND, perm.row_of_TK, perm.row_token_N, weight_TK, dy_ND, dweight_TK);
}

}  // namespace origami::moe

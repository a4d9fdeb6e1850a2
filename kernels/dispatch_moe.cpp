// The dispatch of the MoE routing and permutation ops and of the
// context-parallel ops (kernels/moe_ops.h, kernels/context_parallel.h): the
// device rule, then the CPU or the CUDA implementation, as in dispatch.cpp.
#include "kernels/dispatch.h"

#include "kernels/dispatch_detail.h"

namespace origami {

using namespace dispatch_detail;

void moe_topk_forward(const ExecContext& ctx, const Tensor& logits_TE, const Tensor& bias_E, const MoeTopkParams& p,
                      Tensor& scores_TE, Tensor& expert_TK, Tensor& weight_TK, Tensor& lse_T) {
  if (on_cuda(ctx, "moe_topk_forward",
              {{"logits_TE", &logits_TE},
               {"bias_E", &bias_E},
               {"scores_TE", &scores_TE},
               {"expert_TK", &expert_TK},
               {"weight_TK", &weight_TK},
               {"lse_T", &lse_T}}))
    return ORIGAMI_ON_CUDA(moe_topk_forward)(ctx, logits_TE, bias_E, p, scores_TE, expert_TK, weight_TK, lse_T);
  const CpuThreads threads(ctx);
  return cpu::moe_topk_forward(ctx, logits_TE, bias_E, p, scores_TE, expert_TK, weight_TK, lse_T);
}

void moe_routing_stats(const ExecContext& ctx, const Tensor& scores_TE, const Tensor& expert_TK, const Tensor& lse_T,
                       MoeScore score, int64_t num_segments, Tensor& stats_N) {
  if (on_cuda(ctx, "moe_routing_stats",
              {{"scores_TE", &scores_TE}, {"expert_TK", &expert_TK}, {"lse_T", &lse_T}, {"stats_N", &stats_N}}))
    return ORIGAMI_ON_CUDA(moe_routing_stats)(ctx, scores_TE, expert_TK, lse_T, score, num_segments, stats_N);
  const CpuThreads threads(ctx);
  return cpu::moe_routing_stats(ctx, scores_TE, expert_TK, lse_T, score, num_segments, stats_N);
}

void moe_routing_totals(const ExecContext& ctx, const Tensor& stats_N, int64_t num_segments, int64_t num_experts,
                        int64_t top_k, Tensor& totals_3) {
  ORIGAMI_CHECK(totals_3.defined() && totals_3.dtype() == DType::f64 && totals_3.numel() == 3,
                "router totals_3 must be f64 [3]");
  if (on_cuda(ctx, "moe_routing_totals", {{"stats_N", &stats_N}, {"totals_3", &totals_3}}))
    return ORIGAMI_ON_CUDA(moe_routing_totals)(ctx, stats_N, num_segments, num_experts, top_k, totals_3);
  const CpuThreads threads(ctx);
  return cpu::moe_routing_totals(ctx, stats_N, num_segments, num_experts, top_k, totals_3);
}

void moe_aux_coefficients(const ExecContext& ctx, const Tensor& stats_N, double scale, Tensor& aux_SE) {
  if (on_cuda(ctx, "moe_aux_coefficients", {{"stats_N", &stats_N}, {"aux_SE", &aux_SE}}))
    return ORIGAMI_ON_CUDA(moe_aux_coefficients)(ctx, stats_N, scale, aux_SE);
  const CpuThreads threads(ctx);
  return cpu::moe_aux_coefficients(ctx, stats_N, scale, aux_SE);
}

void moe_topk_backward(const ExecContext& ctx, const Tensor& logits_TE, const Tensor& scores_TE,
                       const Tensor& expert_TK, const Tensor& dweight_TK, const Tensor& aux_SE, int64_t seg_len,
                       float z_coef, const MoeTopkParams& p, Tensor& dlogits_TE) {
  if (on_cuda(ctx, "moe_topk_backward",
              {{"logits_TE", &logits_TE},
               {"scores_TE", &scores_TE},
               {"expert_TK", &expert_TK},
               {"dweight_TK", &dweight_TK},
               {"aux_SE", &aux_SE},
               {"dlogits_TE", &dlogits_TE}}))
    return ORIGAMI_ON_CUDA(moe_topk_backward)(ctx, logits_TE, scores_TE, expert_TK, dweight_TK, aux_SE, seg_len, z_coef,
                                              p, dlogits_TE);
  const CpuThreads threads(ctx);
  return cpu::moe_topk_backward(ctx, logits_TE, scores_TE, expert_TK, dweight_TK, aux_SE, seg_len, z_coef, p,
                                dlogits_TE);
}

void moe_expert_histogram(const ExecContext& ctx, const Tensor& expert_TK, const Tensor& kept_TK, int64_t num_experts,
                          Tensor& count_E) {
  if (on_cuda(ctx, "moe_expert_histogram", {{"expert_TK", &expert_TK}, {"kept_TK", &kept_TK}, {"count_E", &count_E}}))
    return ORIGAMI_ON_CUDA(moe_expert_histogram)(ctx, expert_TK, kept_TK, num_experts, count_E);
  const CpuThreads threads(ctx);
  return cpu::moe_expert_histogram(ctx, expert_TK, kept_TK, num_experts, count_E);
}

void moe_capacity_mask(const ExecContext& ctx, const Tensor& expert_TK, const Tensor& weight_TK, int64_t num_experts,
                       int64_t capacity, MoeDrop policy, Tensor& kept_TK) {
  if (on_cuda(ctx, "moe_capacity_mask", {{"expert_TK", &expert_TK}, {"weight_TK", &weight_TK}, {"kept_TK", &kept_TK}}))
    return ORIGAMI_ON_CUDA(moe_capacity_mask)(ctx, expert_TK, weight_TK, num_experts, capacity, policy, kept_TK);
  const CpuThreads threads(ctx);
  return cpu::moe_capacity_mask(ctx, expert_TK, weight_TK, num_experts, capacity, policy, kept_TK);
}

void moe_expert_rows(const ExecContext& ctx, const Tensor& kept_E, int64_t pad_rows, Tensor& rows_E) {
  if (on_cuda(ctx, "moe_expert_rows", {{"kept_E", &kept_E}, {"rows_E", &rows_E}}))
    return ORIGAMI_ON_CUDA(moe_expert_rows)(ctx, kept_E, pad_rows, rows_E);
  const CpuThreads threads(ctx);
  return cpu::moe_expert_rows(ctx, kept_E, pad_rows, rows_E);
}

void moe_permutation_maps(const ExecContext& ctx, const Tensor& expert_TK, const Tensor& kept_TK, const Tensor& rows_E,
                          Tensor& row_of_TK, Tensor& row_token_N, Tensor& row_slot_N) {
  if (on_cuda(ctx, "moe_permutation_maps",
              {{"expert_TK", &expert_TK},
               {"kept_TK", &kept_TK},
               {"rows_E", &rows_E},
               {"row_of_TK", &row_of_TK},
               {"row_token_N", &row_token_N},
               {"row_slot_N", &row_slot_N}}))
    return ORIGAMI_ON_CUDA(moe_permutation_maps)(ctx, expert_TK, kept_TK, rows_E, row_of_TK, row_token_N, row_slot_N);
  const CpuThreads threads(ctx);
  return cpu::moe_permutation_maps(ctx, expert_TK, kept_TK, rows_E, row_of_TK, row_token_N, row_slot_N);
}

void moe_permute_rows(const ExecContext& ctx, const Tensor& x_TD, const Tensor& row_token_N, Tensor& x_ND) {
  if (on_cuda(ctx, "moe_permute_rows", {{"x_TD", &x_TD}, {"row_token_N", &row_token_N}, {"x_ND", &x_ND}}))
    return ORIGAMI_ON_CUDA(moe_permute_rows)(ctx, x_TD, row_token_N, x_ND);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "moe_permute_rows");
  return cpu::moe_permute_rows(ctx, h.in(x_TD), row_token_N, h.out(x_ND));
}

void moe_permute_rows_backward(const ExecContext& ctx, const Tensor& dx_ND, const Tensor& row_of_TK, Tensor& dx_TD) {
  if (on_cuda(ctx, "moe_permute_rows_backward", {{"dx_ND", &dx_ND}, {"row_of_TK", &row_of_TK}, {"dx_TD", &dx_TD}}))
    return ORIGAMI_ON_CUDA(moe_permute_rows_backward)(ctx, dx_ND, row_of_TK, dx_TD);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "moe_permute_rows_backward");
  return cpu::moe_permute_rows_backward(ctx, h.in(dx_ND), row_of_TK, h.out(dx_TD));
}

void moe_unpermute_rows(const ExecContext& ctx, const Tensor& y_ND, const Tensor& row_of_TK, const Tensor& weight_TK,
                        Tensor& out_TD) {
  if (on_cuda(ctx, "moe_unpermute_rows",
              {{"y_ND", &y_ND}, {"row_of_TK", &row_of_TK}, {"weight_TK", &weight_TK}, {"out_TD", &out_TD}}))
    return ORIGAMI_ON_CUDA(moe_unpermute_rows)(ctx, y_ND, row_of_TK, weight_TK, out_TD);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "moe_unpermute_rows");
  return cpu::moe_unpermute_rows(ctx, h.in(y_ND), row_of_TK, weight_TK, h.out(out_TD));
}

void moe_unpermute_rows_backward(const ExecContext& ctx, const Tensor& dout_TD, const Tensor& y_ND,
                                 const Tensor& row_of_TK, const Tensor& row_token_N, const Tensor& weight_TK,
                                 Tensor& dy_ND, Tensor& dweight_TK) {
  if (on_cuda(ctx, "moe_unpermute_rows_backward",
              {{"dout_TD", &dout_TD},
               {"y_ND", &y_ND},
               {"row_of_TK", &row_of_TK},
               {"row_token_N", &row_token_N},
               {"weight_TK", &weight_TK},
               {"dy_ND", &dy_ND},
               {"dweight_TK", &dweight_TK}}))
    return ORIGAMI_ON_CUDA(moe_unpermute_rows_backward)(ctx, dout_TD, y_ND, row_of_TK, row_token_N, weight_TK, dy_ND,
                                                        dweight_TK);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "moe_unpermute_rows_backward");
  return cpu::moe_unpermute_rows_backward(ctx, h.in(dout_TD), h.in(y_ND), row_of_TK, row_token_N, weight_TK,
                                          h.out(dy_ND), dweight_TK);
}

void cp_zigzag_positions(const ExecContext& ctx, int64_t cp, int64_t rank, Tensor& pos_S) {
  if (on_cuda(ctx, "cp_zigzag_positions", {{"pos_S", &pos_S}}))
    return ORIGAMI_ON_CUDA(cp_zigzag_positions)(ctx, cp, rank, pos_S);
  const CpuThreads threads(ctx);
  return cpu::cp_zigzag_positions(ctx, cp, rank, pos_S);
}

void cp_gather_tokens(const ExecContext& ctx, const Tensor& tokens_BS1, const Tensor& pos_S, Tensor& ids_T,
                      Tensor& targets_T) {
  if (on_cuda(ctx, "cp_gather_tokens",
              {{"tokens_BS1", &tokens_BS1}, {"pos_S", &pos_S}, {"ids_T", &ids_T}, {"targets_T", &targets_T}}))
    return ORIGAMI_ON_CUDA(cp_gather_tokens)(ctx, tokens_BS1, pos_S, ids_T, targets_T);
  const CpuThreads threads(ctx);
  return cpu::cp_gather_tokens(ctx, tokens_BS1, pos_S, ids_T, targets_T);
}

void cp_pack_kv(const ExecContext& ctx, const Tensor& k_BSHd, const Tensor& v_BSHd, Tensor& wire) {
  if (on_cuda(ctx, "cp_pack_kv", {{"k_BSHd", &k_BSHd}, {"v_BSHd", &v_BSHd}, {"wire", &wire}}))
    return ORIGAMI_ON_CUDA(cp_pack_kv)(ctx, k_BSHd, v_BSHd, wire);
  const CpuThreads threads(ctx);
  // Moves bytes, any element size (bf16 bitwise, NaN payloads included): no widening.
  return cpu::cp_pack_kv(ctx, k_BSHd, v_BSHd, wire);
}

void cp_unpack_kv(const ExecContext& ctx, const Tensor& wire, Tensor& k_BSHd, Tensor& v_BSHd) {
  if (on_cuda(ctx, "cp_unpack_kv", {{"wire", &wire}, {"k_BSHd", &k_BSHd}, {"v_BSHd", &v_BSHd}}))
    return ORIGAMI_ON_CUDA(cp_unpack_kv)(ctx, wire, k_BSHd, v_BSHd);
  const CpuThreads threads(ctx);
  return cpu::cp_unpack_kv(ctx, wire, k_BSHd, v_BSHd);  // bytes, like cp_pack_kv
}

void moe_expert_bias_update(const ExecContext& ctx, Tensor& bias_E, std::span<const int64_t> load_E, float rate) {
  if (on_cuda(ctx, "moe_expert_bias_update", {{"bias_E", &bias_E}}))
    return ORIGAMI_ON_CUDA(moe_expert_bias_update)(ctx, bias_E, load_E, rate);
  const CpuThreads threads(ctx);
  return cpu::moe_expert_bias_update(ctx, bias_E, load_E, rate);
}

}  // namespace origami

// CUDA ops not written yet: each fails at run time naming the op, so a
// model that reaches one on a CUDA context stops with a clear message. The
// CUDA issue moves each op from here into its own kernels/cuda/<op>.cu.
#include "kernels/cuda/ops.h"

namespace origami::cuda {

namespace {
[[noreturn]] void pending(const char* op) {
  ORIGAMI_CHECK(false, op, " has no CUDA implementation yet (kernels/cuda/", op, ".cu); run it on a CPU context");
  __builtin_unreachable();
}
}  // namespace

void gemm(const ExecContext& ctx, const Tensor& A, Trans trans_a, const Tensor& B, Trans trans_b, Tensor& C,
          float alpha, float beta) {
  pending("gemm");
}
void grouped_gemm(const ExecContext& ctx, const Tensor& X_NK, const Tensor& W, Trans trans_w,
                  std::span<const GemmSegment> segments, Tensor& Y_NM, float beta) {
  pending("grouped_gemm");
}
void grouped_gemm_wgrad(const ExecContext& ctx, const Tensor& dY_NM, const Tensor& X_NK,
                        std::span<const GemmSegment> segments, Tensor& dW_GMK, float beta) {
  pending("grouped_gemm_wgrad");
}
void axpy(const ExecContext& ctx, float a, const Tensor& x, Tensor& y) { pending("axpy"); }
void scale_inplace(const ExecContext& ctx, Tensor& y, float a) { pending("scale_inplace"); }
double sum_squares(const ExecContext& ctx, const Tensor& x) { pending("sum_squares"); }
double sum(const ExecContext& ctx, const Tensor& x) { pending("sum"); }
void cast(const ExecContext& ctx, const Tensor& src, Tensor& dst) { pending("cast"); }
void rmsnorm_forward(const ExecContext& ctx, const Tensor& x_TD, const Tensor& w_D, float eps, Tensor& y_TD,
                     Tensor& rstd_T) {
  pending("rmsnorm_forward");
}
size_t rmsnorm_backward_workspace_bytes(const ExecContext& ctx, int64_t T, int64_t D) {
  pending("rmsnorm_backward_workspace_bytes");
}
void rmsnorm_backward(const ExecContext& ctx, const Tensor& dy_TD, const Tensor& x_TD, const Tensor& w_D,
                      const Tensor& rstd_T, Tensor& dx_TD, Tensor& dw_D, Tensor& workspace) {
  pending("rmsnorm_backward");
}
void rmsnorm_backward_input(const ExecContext& ctx, const Tensor& dy_TD, const Tensor& x_TD, const Tensor& w_D,
                            const Tensor& rstd_T, Tensor& dx_TD) {
  pending("rmsnorm_backward_input");
}
size_t rmsnorm_backward_weight_workspace_bytes(const ExecContext& ctx, int64_t T, int64_t D) {
  pending("rmsnorm_backward_weight_workspace_bytes");
}
void rmsnorm_backward_weight(const ExecContext& ctx, const Tensor& dy_TD, const Tensor& x_TD, const Tensor& rstd_T,
                             Tensor& dw_D, Tensor& workspace) {
  pending("rmsnorm_backward_weight");
}
void rope_forward(const ExecContext& ctx, Tensor& x_BSHd, const Tensor& pos_S, float theta) { pending("rope_forward"); }
void rope_backward(const ExecContext& ctx, Tensor& dx_BSHd, const Tensor& pos_S, float theta) {
  pending("rope_backward");
}
size_t attention_forward_workspace_bytes(const ExecContext& ctx, const AttentionDims& dims) {
  pending("attention_forward_workspace_bytes");
}
void attention_forward(const ExecContext& ctx, const AttentionDims& dims, const Tensor& q, const Tensor& k,
                       const Tensor& v, const Tensor& q_pos_S, const Tensor& kv_pos_S, float scale, Tensor& o,
                       Tensor& lse_BHS, Tensor& workspace) {
  pending("attention_forward");
}
size_t attention_backward_workspace_bytes(const ExecContext& ctx, const AttentionDims& dims) {
  pending("attention_backward_workspace_bytes");
}
void attention_backward(const ExecContext& ctx, const AttentionDims& dims, const Tensor& q, const Tensor& k,
                        const Tensor& v, const Tensor& o, const Tensor& lse_BHS, const Tensor& do_,
                        const Tensor& q_pos_S, const Tensor& kv_pos_S, float scale, Tensor& dq, Tensor& dk, Tensor& dv,
                        Tensor& workspace) {
  pending("attention_backward");
}
void attention_merge(const ExecContext& ctx, const Tensor& o_part, const Tensor& lse_part, Tensor& o_acc,
                     Tensor& lse_acc) {
  pending("attention_merge");
}
void swiglu_forward(const ExecContext& ctx, const Tensor& gate_TF, const Tensor& up_TF, Tensor& h_TF) {
  pending("swiglu_forward");
}
void swiglu_backward(const ExecContext& ctx, const Tensor& dh_TF, const Tensor& gate_TF, const Tensor& up_TF,
                     Tensor& dgate_TF, Tensor& dup_TF) {
  pending("swiglu_backward");
}
void embedding_forward(const ExecContext& ctx, const Tensor& ids_T, const Tensor& table_VD, int64_t vocab_start,
                       Tensor& out_TD) {
  pending("embedding_forward");
}
void embedding_backward(const ExecContext& ctx, const Tensor& ids_T, const Tensor& dout_TD, int64_t vocab_start,
                        Tensor& dtable_VD) {
  pending("embedding_backward");
}
void cross_entropy_forward(const ExecContext& ctx, const Tensor& logits_TV, const Tensor& targets_T, Tensor& loss_T,
                           Tensor& lse_T) {
  pending("cross_entropy_forward");
}
void cross_entropy_backward(const ExecContext& ctx, const Tensor& logits_TV, const Tensor& targets_T,
                            const Tensor& lse_T, float grad_scale, Tensor& dlogits_TV) {
  pending("cross_entropy_backward");
}
void cross_entropy_local_max(const ExecContext& ctx, const Tensor& logits_TV, Tensor& max_T) {
  pending("cross_entropy_local_max");
}
void cross_entropy_local_sums(const ExecContext& ctx, const Tensor& logits_TV, const Tensor& targets_T,
                              const Tensor& max_T, int64_t vocab_start, int64_t vocab, Tensor& sums_2T) {
  pending("cross_entropy_local_sums");
}
void cross_entropy_finish(const ExecContext& ctx, const Tensor& max_T, const Tensor& sums_2T, Tensor& loss_T,
                          Tensor& lse_T) {
  pending("cross_entropy_finish");
}
void cross_entropy_local_backward(const ExecContext& ctx, const Tensor& logits_TV, const Tensor& targets_T,
                                  const Tensor& lse_T, int64_t vocab_start, float grad_scale, Tensor& dlogits_TV) {
  pending("cross_entropy_local_backward");
}
void adamw_update(const ExecContext& ctx, Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                  const AdamWStep& s) {
  pending("adamw_update");
}
void init_normal(const ExecContext& ctx, Tensor& out, uint64_t seed, std::string_view name, int64_t global_offset,
                 float std) {
  pending("init_normal");
}
void init_constant(const ExecContext& ctx, Tensor& out, float value) { pending("init_constant"); }
void moe_topk_forward(const ExecContext& ctx, const Tensor& logits_TE, const Tensor& bias_E, const MoeTopkParams& p,
                      Tensor& scores_TE, Tensor& expert_TK, Tensor& weight_TK, Tensor& lse_T) {
  pending("moe_topk_forward");
}
void moe_routing_stats(const ExecContext& ctx, const Tensor& scores_TE, const Tensor& expert_TK, const Tensor& lse_T,
                       MoeScore score, int64_t num_segments, Tensor& stats_N) {
  pending("moe_routing_stats");
}
MoeRoutingTotals moe_routing_totals(const ExecContext& ctx, const Tensor& stats_N, int64_t num_segments,
                                    int64_t num_experts, int64_t top_k) {
  pending("moe_routing_totals");
}
void moe_aux_coefficients(const ExecContext& ctx, const Tensor& stats_N, double scale, Tensor& aux_SE) {
  pending("moe_aux_coefficients");
}
void moe_topk_backward(const ExecContext& ctx, const Tensor& logits_TE, const Tensor& scores_TE,
                       const Tensor& expert_TK, const Tensor& dweight_TK, const Tensor& aux_SE, int64_t seg_len,
                       float z_coef, const MoeTopkParams& p, Tensor& dlogits_TE) {
  pending("moe_topk_backward");
}
void moe_expert_histogram(const ExecContext& ctx, const Tensor& expert_TK, const Tensor& kept_TK, int64_t num_experts,
                          Tensor& count_E) {
  pending("moe_expert_histogram");
}
void moe_capacity_mask(const ExecContext& ctx, const Tensor& expert_TK, const Tensor& weight_TK, int64_t num_experts,
                       int64_t capacity, MoeDrop policy, Tensor& kept_TK) {
  pending("moe_capacity_mask");
}
void moe_expert_rows(const ExecContext& ctx, const Tensor& kept_E, int64_t pad_rows, Tensor& rows_E) {
  pending("moe_expert_rows");
}
void moe_permutation_maps(const ExecContext& ctx, const Tensor& expert_TK, const Tensor& kept_TK, const Tensor& rows_E,
                          Tensor& row_of_TK, Tensor& row_token_N, Tensor& row_slot_N) {
  pending("moe_permutation_maps");
}
void moe_permute_rows(const ExecContext& ctx, const Tensor& x_TD, const Tensor& row_token_N, Tensor& x_ND) {
  pending("moe_permute_rows");
}
void moe_permute_rows_backward(const ExecContext& ctx, const Tensor& dx_ND, const Tensor& row_of_TK, Tensor& dx_TD) {
  pending("moe_permute_rows_backward");
}
void moe_unpermute_rows(const ExecContext& ctx, const Tensor& y_ND, const Tensor& row_of_TK, const Tensor& weight_TK,
                        Tensor& out_TD) {
  pending("moe_unpermute_rows");
}
void moe_unpermute_rows_backward(const ExecContext& ctx, const Tensor& dout_TD, const Tensor& y_ND,
                                 const Tensor& row_of_TK, const Tensor& row_token_N, const Tensor& weight_TK,
                                 Tensor& dy_ND, Tensor& dweight_TK) {
  pending("moe_unpermute_rows_backward");
}
void cp_zigzag_positions(const ExecContext& ctx, int64_t cp, int64_t rank, Tensor& pos_S) {
  pending("cp_zigzag_positions");
}
bool cp_zigzag_positions_match(const ExecContext& ctx, const Tensor& pos_S, int64_t cp, int64_t rank) {
  pending("cp_zigzag_positions_match");
}
void cp_gather_tokens(const ExecContext& ctx, const Tensor& tokens_BS1, const Tensor& pos_S, Tensor& ids_T,
                      Tensor& targets_T) {
  pending("cp_gather_tokens");
}
void cp_pack_kv(const ExecContext& ctx, const Tensor& k_BSHd, const Tensor& v_BSHd, Tensor& wire) {
  pending("cp_pack_kv");
}
void cp_unpack_kv(const ExecContext& ctx, const Tensor& wire, Tensor& k_BSHd, Tensor& v_BSHd) {
  pending("cp_unpack_kv");
}
void moe_expert_bias_update(const ExecContext& ctx, Tensor& bias_E, std::span<const int64_t> load_E, float rate) {
  pending("moe_expert_bias_update");
}

}  // namespace origami::cuda

// The shape rules of ops that both backends implement (kernels/<op>.h says
// what each call means). Each function checks every shape of a call and
// returns the problem's dimensions, so the CPU and CUDA implementations accept
// the same shapes and refuse a wrong one with the same message. Which data
// dtypes an op takes stays with each backend (the CPU's kernels are f32;
// CUDA's rule is in kernels/cuda/README.md); what is checked here is dtype
// agreement that is part of a layout (the K/V wire is k's dtype) and the
// arguments that are never data (router statistics, indices, positions).
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>

#include "kernels/attention.h"
#include "kernels/gemm.h"
#include "kernels/grouped_gemm.h"
#include "kernels/moe_ops.h"
#include "kernels/tensor.h"

namespace origami {

// C = op(A)·op(B): C [M, N], op(A) [M, K], op(B) [K, N]. Operands read as
// matrices (rows() × cols()); K = 0 is legal (C = beta·C).
struct GemmDims {
  int64_t M, N, K;
};
GemmDims gemm_shapes(const Tensor& A, Trans trans_a, const Tensor& B, Trans trans_b, const Tensor& C);

// grouped_gemm: X [N, K], W [G, M, K] (trans_w) or [G, K, M], Y [N, M];
// grouped_gemm_wgrad: dY [N, M], X [N, K], dW [G, M, K]. The segments tile
// the N rows and name groups in [0, G).
struct GroupedGemmDims {
  int64_t G, M, K, N;
};
GroupedGemmDims grouped_gemm_shapes(const Tensor& X_NK, const Tensor& W, Trans trans_w,
                                    std::span<const GemmSegment> segments, const Tensor& Y_NM);
GroupedGemmDims grouped_gemm_wgrad_shapes(const Tensor& dY_NM, const Tensor& X_NK, std::span<const GemmSegment> segments,
                                          const Tensor& dW_GMK);

// Positive dims, Hq a multiple of Hkv.
void attention_dims_check(const AttentionDims& d);
// q, k, v and the i32 positions of a forward or backward call.
void attention_input_shapes(const AttentionDims& d, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& q_pos_S, const Tensor& kv_pos_S);
// Forward's outputs, which backward reads: o [B, Sq, Hq, hd], lse [B, Hq, Sq].
void attention_output_shapes(const AttentionDims& d, const Tensor& o, const Tensor& lse_BHS);
// Backward's: do and dq as q, dk and dv as k, besides forward's outputs.
void attention_grad_shapes(const AttentionDims& d, const Tensor& o, const Tensor& lse_BHS, const Tensor& do_,
                           const Tensor& dq, const Tensor& dk, const Tensor& dv);

// cp_pack_kv / cp_unpack_kv: k, v [B, S, Hkv, hd] and the wire
// [cp, 2, B, S/cp, Hkv·hd] (kernels/context_parallel.h), one dtype.
struct CpKvLayout {
  int64_t cp, B, S, C, E;  // C = S/(2·cp) rows per run, E = Hkv·hd elements per row
  size_t elem_bytes;
};
CpKvLayout cp_kv_shapes(const char* op, const Tensor& wire, const Tensor& k_BSHd, const Tensor& v_BSHd);

// moe_topk_forward's and moe_topk_backward's f32 and i32 arguments (all of
// them router statistics; the params checked by check_moe_topk_params).
void moe_topk_forward_shapes(const Tensor& logits_TE, const Tensor& bias_E, const MoeTopkParams& p,
                             const Tensor& scores_TE, const Tensor& expert_TK, const Tensor& weight_TK,
                             const Tensor& lse_T);
void moe_topk_backward_shapes(const Tensor& logits_TE, const Tensor& scores_TE, const Tensor& expert_TK,
                              const Tensor& dweight_TK, const Tensor& aux_SE, int64_t seg_len, const MoeTopkParams& p,
                              const Tensor& dlogits_TE);

// RMSNorm (kernels/rmsnorm.h): x [T, D] read as a matrix (rows × cols), w
// and dw [D], y, dy and dx as x, rstd any shape of T f32 values.
struct RmsnormDims {
  int64_t T, D;
};
RmsnormDims rmsnorm_forward_shapes(const Tensor& x_TD, const Tensor& w_D, const Tensor& y_TD, const Tensor& rstd_T);
// The three backward ops: dy, x and rstd always; w, dx and dw where the op
// takes them. op names the op in messages.
struct RmsnormBackwardArgs {
  const Tensor* w_D = nullptr;
  const Tensor* dx_TD = nullptr;
  const Tensor* dw_D = nullptr;
};
RmsnormDims rmsnorm_backward_shapes(const char* op, const Tensor& dy_TD, const Tensor& x_TD, const Tensor& rstd_T,
                                    RmsnormBackwardArgs takes);

// Cross-entropy (kernels/cross_entropy.h): logits [T, V] read as a matrix
// (V_r columns: a vocab-parallel rank's slice), targets i32 [T], the
// per-token statistics (loss, lse, max) any shape of T f32 values, the
// vocab-parallel sums f64 [2, T] in any shape, dlogits as logits. The whole-
// row ops need a column when there are rows (every target would be outside
// [0, 0)).
struct CrossEntropyDims {
  int64_t T, V;
};
CrossEntropyDims cross_entropy_forward_shapes(const Tensor& logits_TV, const Tensor& targets_T, const Tensor& loss_T,
                                              const Tensor& lse_T);
CrossEntropyDims cross_entropy_backward_shapes(const Tensor& logits_TV, const Tensor& targets_T, const Tensor& lse_T,
                                               const Tensor& dlogits_TV);
CrossEntropyDims cross_entropy_local_max_shapes(const Tensor& logits_TV, const Tensor& max_T);
CrossEntropyDims cross_entropy_local_sums_shapes(const Tensor& logits_TV, const Tensor& targets_T, const Tensor& max_T,
                                                 const Tensor& sums_2T);
int64_t cross_entropy_finish_shapes(const Tensor& max_T, const Tensor& sums_2T, const Tensor& loss_T,
                                    const Tensor& lse_T);  // returns T
CrossEntropyDims cross_entropy_local_backward_shapes(const Tensor& logits_TV, const Tensor& targets_T,
                                                     const Tensor& lse_T, const Tensor& dlogits_TV);

}  // namespace origami

// Shape rules shared by the CPU and CUDA backends (see op_shapes.h).
#include "kernels/op_shapes.h"

#include <string>
#include <utility>

#include "kernels/check.h"

namespace origami {

GemmDims gemm_shapes(const Tensor& A, Trans trans_a, const Tensor& B, Trans trans_b, const Tensor& C) {
  ORIGAMI_CHECK(A.defined() && B.defined() && C.defined(), "gemm on an undefined tensor");
  const int64_t a_rows = A.rows(), b_rows = B.rows();
  const int64_t M = trans_a == Trans::yes ? A.cols() : a_rows;
  const int64_t K = trans_a == Trans::yes ? a_rows : A.cols();
  const int64_t Kb = trans_b == Trans::yes ? B.cols() : b_rows;
  const int64_t N = trans_b == Trans::yes ? b_rows : B.cols();
  ORIGAMI_CHECK(K == Kb, "gemm inner dimensions differ: op(A) is [", M, ", ", K, "] (A ", shape_string(A.shape()),
                "), op(B) is [", Kb, ", ", N, "] (B ", shape_string(B.shape()), ")");
  ORIGAMI_CHECK(C.rows() == M && C.cols() == N, "gemm output C ", shape_string(C.shape()), " should read as [", M, ", ",
                N, "]");
  return {M, N, K};
}

namespace {
void check_segments(std::span<const GemmSegment> segments, int64_t G, int64_t N, const char* op) {
  int64_t total = 0;
  for (const GemmSegment& s : segments) {
    ORIGAMI_CHECK(s.group >= 0 && s.group < G, op, ": segment group ", s.group, " outside [0, ", G, ")");
    ORIGAMI_CHECK(s.rows >= 0, op, ": negative segment of ", s.rows, " rows");
    total += s.rows;
  }
  ORIGAMI_CHECK(total == N, op, ": segments cover ", total, " rows but the operand has ", N);
}
}  // namespace

GroupedGemmDims grouped_gemm_shapes(const Tensor& X_NK, const Tensor& W, Trans trans_w,
                                    std::span<const GemmSegment> segments, const Tensor& Y_NM) {
  constexpr const char* op = "grouped_gemm";
  ORIGAMI_CHECK(X_NK.defined() && W.defined() && Y_NM.defined(), op, " on an undefined tensor");
  ORIGAMI_CHECK(W.dim() == 3, op, ": W must be [G, rows, cols], got ", shape_string(W.shape()));
  const int64_t G = W.size(0);
  const int64_t M = trans_w == Trans::yes ? W.size(1) : W.size(2);
  const int64_t K = trans_w == Trans::yes ? W.size(2) : W.size(1);
  const int64_t N = X_NK.rows();
  ORIGAMI_CHECK(X_NK.cols() == K, op, ": X ", shape_string(X_NK.shape()), " should be [N, ", K, "] for W ",
                shape_string(W.shape()), trans_w == Trans::yes ? " (transposed)" : "");
  ORIGAMI_CHECK(Y_NM.rows() == N && Y_NM.cols() == M, op, ": Y ", shape_string(Y_NM.shape()), " should be [", N,
                ", ", M, "]");
  check_segments(segments, G, N, op);
  return {G, M, K, N};
}

GroupedGemmDims grouped_gemm_wgrad_shapes(const Tensor& dY_NM, const Tensor& X_NK, std::span<const GemmSegment> segments,
                                          const Tensor& dW_GMK) {
  constexpr const char* op = "grouped_gemm_wgrad";
  ORIGAMI_CHECK(dY_NM.defined() && X_NK.defined() && dW_GMK.defined(), op, " on an undefined tensor");
  ORIGAMI_CHECK(dW_GMK.dim() == 3, op, ": dW must be [G, M, K], got ", shape_string(dW_GMK.shape()));
  const int64_t G = dW_GMK.size(0), M = dW_GMK.size(1), K = dW_GMK.size(2);
  const int64_t N = dY_NM.rows();
  ORIGAMI_CHECK(dY_NM.cols() == M, op, ": dY ", shape_string(dY_NM.shape()), " should be [N, ", M, "] for dW ",
                shape_string(dW_GMK.shape()));
  ORIGAMI_CHECK(X_NK.rows() == N && X_NK.cols() == K, op, ": X ", shape_string(X_NK.shape()), " should be [", N,
                ", ", K, "]");
  check_segments(segments, G, N, op);
  return {G, M, K, N};
}

void attention_dims_check(const AttentionDims& d) {
  ORIGAMI_CHECK(d.batch > 0 && d.q_len > 0 && d.kv_len > 0 && d.num_heads > 0 && d.num_kv_heads > 0 &&
                    d.head_dim > 0,
                "attention dims must be positive");
  ORIGAMI_CHECK(d.num_heads % d.num_kv_heads == 0, "num_heads ", d.num_heads, " is not a multiple of num_kv_heads ",
                d.num_kv_heads);
}

void attention_input_shapes(const AttentionDims& d, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& q_pos_S, const Tensor& kv_pos_S) {
  attention_dims_check(d);
  check_shape(q, {d.batch, d.q_len, d.num_heads, d.head_dim}, "attention q");
  check_shape(k, {d.batch, d.kv_len, d.num_kv_heads, d.head_dim}, "attention k");
  check_shape(v, {d.batch, d.kv_len, d.num_kv_heads, d.head_dim}, "attention v");
  check_shape(q_pos_S, {d.q_len}, "attention q_pos");
  check_shape(kv_pos_S, {d.kv_len}, "attention kv_pos");
  ORIGAMI_CHECK(q_pos_S.dtype() == DType::i32 && kv_pos_S.dtype() == DType::i32, "attention positions are i32");
}

void attention_output_shapes(const AttentionDims& d, const Tensor& o, const Tensor& lse_BHS) {
  check_shape(o, {d.batch, d.q_len, d.num_heads, d.head_dim}, "attention o");
  check_shape(lse_BHS, {d.batch, d.num_heads, d.q_len}, "attention lse");
}

void attention_grad_shapes(const AttentionDims& d, const Tensor& o, const Tensor& lse_BHS, const Tensor& do_,
                           const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  attention_output_shapes(d, o, lse_BHS);
  const Shape q_shape{d.batch, d.q_len, d.num_heads, d.head_dim};
  const Shape kv_shape{d.batch, d.kv_len, d.num_kv_heads, d.head_dim};
  check_shape(do_, q_shape, "attention do");
  check_shape(dq, q_shape, "attention dq");
  check_shape(dk, kv_shape, "attention dk");
  check_shape(dv, kv_shape, "attention dv");
}

CpKvLayout cp_kv_shapes(const char* op, const Tensor& wire, const Tensor& k_BSHd, const Tensor& v_BSHd) {
  ORIGAMI_CHECK(k_BSHd.defined() && v_BSHd.defined() && wire.defined(), op, ": undefined tensor");
  ORIGAMI_CHECK(k_BSHd.dim() == 4, op, ": k must be [B, S, Hkv, hd], got ", shape_string(k_BSHd.shape()));
  ORIGAMI_CHECK(v_BSHd.shape() == k_BSHd.shape(), op, ": v ", shape_string(v_BSHd.shape()), " differs from k ",
                shape_string(k_BSHd.shape()));
  ORIGAMI_CHECK(k_BSHd.dtype() == v_BSHd.dtype() && wire.dtype() == k_BSHd.dtype(), op, ": dtypes differ (k ",
                to_string(k_BSHd.dtype()), ", v ", to_string(v_BSHd.dtype()), ", wire ", to_string(wire.dtype()), ")");
  ORIGAMI_CHECK(wire.dim() == 5 && wire.size(0) >= 1, op, ": wire must be [cp, 2, B, S/cp, Hkv·hd], got ",
                shape_string(wire.shape()));
  CpKvLayout l{
      wire.size(0), k_BSHd.size(0), k_BSHd.size(1), 0, k_BSHd.size(2) * k_BSHd.size(3), dtype_size(k_BSHd.dtype())};
  ORIGAMI_CHECK(l.S > 0 && l.S % (2 * l.cp) == 0, op, ": S = ", l.S,
                " is not a positive multiple of 2·cp = ", 2 * l.cp);
  l.C = l.S / (2 * l.cp);
  check_shape(wire, {l.cp, 2, l.B, l.S / l.cp, l.E}, (std::string(op) + ": wire").c_str());
  return l;
}

void moe_topk_forward_shapes(const Tensor& logits_TE, const Tensor& bias_E, const MoeTopkParams& p,
                             const Tensor& scores_TE, const Tensor& expert_TK, const Tensor& weight_TK,
                             const Tensor& lse_T) {
  ORIGAMI_CHECK(logits_TE.defined() && logits_TE.dtype() == DType::f32, "router logits must be f32");
  const int64_t T = logits_TE.rows(), E = logits_TE.cols(), K = p.top_k;
  check_moe_topk_params(p, E);
  check_f32(scores_TE, {T, E}, "router scores_TE");
  check_i32(expert_TK, {T, K}, "router expert_TK");
  check_f32(weight_TK, {T, K}, "router weight_TK");
  if (bias_E.defined()) check_f32(bias_E, {E}, "router bias_E");
  if (lse_T.defined()) check_f32(lse_T, {T}, "router lse_T");
}

void moe_topk_backward_shapes(const Tensor& logits_TE, const Tensor& scores_TE, const Tensor& expert_TK,
                              const Tensor& dweight_TK, const Tensor& aux_SE, int64_t seg_len, const MoeTopkParams& p,
                              const Tensor& dlogits_TE) {
  ORIGAMI_CHECK(logits_TE.defined() && logits_TE.dtype() == DType::f32, "router logits must be f32");
  const int64_t T = logits_TE.rows(), E = logits_TE.cols(), K = p.top_k;
  check_f32(scores_TE, {T, E}, "router scores_TE");
  check_i32(expert_TK, {T, K}, "router expert_TK");
  check_f32(dlogits_TE, {T, E}, "router dlogits_TE");
  if (dweight_TK.defined()) check_f32(dweight_TK, {T, K}, "router dweight_TK");
  if (aux_SE.defined()) {
    ORIGAMI_CHECK(seg_len > 0 && T % seg_len == 0, "router backward: ", T, " tokens do not split into segments of ",
                  seg_len);
    check_f32(aux_SE, {T / seg_len, E}, "router aux_SE");
  }
}

namespace {
// n values of dtype dt in any shape (a per-token statistic: [T], [B, S]).
void check_count(const char* op, const Tensor& t, int64_t n, DType dt, const char* name) {
  ORIGAMI_CHECK(t.defined() && t.dtype() == dt && t.numel() == n, op, ": ", name, " has ",
                t.defined() ? shape_string(t.shape()) + " " + std::string(to_string(t.dtype())) : std::string("(none)"),
                ", expected ", n, " ", to_string(dt), " elements");
}

// A matrix operand [T, V] (rows × cols) that must be defined.
void check_matrix(const char* op, const Tensor& t, const char* name) {
  ORIGAMI_CHECK(t.defined() && t.dim() >= 1, op, ": ", name, " must be a defined [rows, cols] tensor, got ",
                t.defined() ? shape_string(t.shape()) : std::string("(none)"));
}

// A vector [n].
void check_vector(const char* op, const Tensor& t, int64_t n, const char* name) {
  ORIGAMI_CHECK(t.defined() && t.shape() == Shape{n}, op, ": ", name, " has ",
                t.defined() ? shape_string(t.shape()) : std::string("(none)"), ", expected [", n, "]");
}

// Output `out` shaped as `like`.
void check_like(const char* op, const Tensor& out, const Tensor& like, const char* name) {
  ORIGAMI_CHECK(out.defined() && out.shape() == like.shape(), op, ": ", name, " has ",
                out.defined() ? shape_string(out.shape()) : std::string("(none)"), ", expected ",
                shape_string(like.shape()));
}
}  // namespace

RmsnormDims rmsnorm_forward_shapes(const Tensor& x_TD, const Tensor& w_D, const Tensor& y_TD, const Tensor& rstd_T) {
  constexpr const char* op = "rmsnorm_forward";
  check_matrix(op, x_TD, "x");
  const int64_t T = x_TD.rows(), D = x_TD.cols();
  check_vector(op, w_D, D, "weight");
  check_like(op, y_TD, x_TD, "y");
  check_count(op, rstd_T, T, DType::f32, "rstd");
  return {T, D};
}

RmsnormDims rmsnorm_backward_shapes(const char* op, const Tensor& dy_TD, const Tensor& x_TD, const Tensor& rstd_T,
                                    RmsnormBackwardArgs takes) {
  check_matrix(op, x_TD, "x");
  const int64_t T = x_TD.rows(), D = x_TD.cols();
  check_like(op, dy_TD, x_TD, "dy");
  check_count(op, rstd_T, T, DType::f32, "rstd");
  for (auto [t, name] : {std::pair{takes.w_D, "weight"}, {takes.dw_D, "dw"}})
    if (t) check_vector(op, *t, D, name);
  if (takes.dx_TD) check_like(op, *takes.dx_TD, x_TD, "dx");
  return {T, D};
}

namespace {
CrossEntropyDims rows_and_targets(const char* op, const Tensor& logits_TV, const Tensor& targets_T) {
  check_matrix(op, logits_TV, "logits");
  const int64_t T = logits_TV.rows(), V = logits_TV.cols();
  check_count(op, targets_T, T, DType::i32, "targets");
  return {T, V};
}

// The whole-row ops: a target per row must name a column.
void check_vocabulary(const char* op, const CrossEntropyDims& d) {
  ORIGAMI_CHECK(d.T == 0 || d.V > 0, op, ": no vocabulary columns (every target would be outside [0, 0))");
}
}  // namespace

CrossEntropyDims cross_entropy_forward_shapes(const Tensor& logits_TV, const Tensor& targets_T, const Tensor& loss_T,
                                              const Tensor& lse_T) {
  constexpr const char* op = "cross_entropy_forward";
  const CrossEntropyDims d = rows_and_targets(op, logits_TV, targets_T);
  check_count(op, loss_T, d.T, DType::f32, "loss");
  check_count(op, lse_T, d.T, DType::f32, "lse");
  check_vocabulary(op, d);
  return d;
}

CrossEntropyDims cross_entropy_backward_shapes(const Tensor& logits_TV, const Tensor& targets_T, const Tensor& lse_T,
                                               const Tensor& dlogits_TV) {
  constexpr const char* op = "cross_entropy_backward";
  const CrossEntropyDims d = rows_and_targets(op, logits_TV, targets_T);
  check_count(op, lse_T, d.T, DType::f32, "lse");
  check_like(op, dlogits_TV, logits_TV, "dlogits");
  check_vocabulary(op, d);
  return d;
}

CrossEntropyDims cross_entropy_local_max_shapes(const Tensor& logits_TV, const Tensor& max_T) {
  constexpr const char* op = "cross_entropy_local_max";
  check_matrix(op, logits_TV, "logits");
  const int64_t T = logits_TV.rows();
  check_count(op, max_T, T, DType::f32, "max");
  return {T, logits_TV.cols()};
}

CrossEntropyDims cross_entropy_local_sums_shapes(const Tensor& logits_TV, const Tensor& targets_T, const Tensor& max_T,
                                                 const Tensor& sums_2T) {
  constexpr const char* op = "cross_entropy_local_sums";
  const CrossEntropyDims d = rows_and_targets(op, logits_TV, targets_T);
  check_count(op, max_T, d.T, DType::f32, "max");
  check_count(op, sums_2T, 2 * d.T, DType::f64, "sums");
  return d;
}

int64_t cross_entropy_finish_shapes(const Tensor& max_T, const Tensor& sums_2T, const Tensor& loss_T,
                                    const Tensor& lse_T) {
  constexpr const char* op = "cross_entropy_finish";
  ORIGAMI_CHECK(max_T.defined() && max_T.dtype() == DType::f32, op, ": max must be a defined f32 tensor");
  const int64_t T = max_T.numel();
  check_count(op, sums_2T, 2 * T, DType::f64, "sums");
  check_count(op, loss_T, T, DType::f32, "loss");
  check_count(op, lse_T, T, DType::f32, "lse");
  return T;
}

CrossEntropyDims cross_entropy_local_backward_shapes(const Tensor& logits_TV, const Tensor& targets_T,
                                                     const Tensor& lse_T, const Tensor& dlogits_TV) {
  constexpr const char* op = "cross_entropy_local_backward";
  const CrossEntropyDims d = rows_and_targets(op, logits_TV, targets_T);
  check_count(op, lse_T, d.T, DType::f32, "lse");
  check_like(op, dlogits_TV, logits_TV, "dlogits");
  return d;
}

}  // namespace origami

// The dispatch layer (CUB's API → dispatch → implementation): each public op
// of kernels/<op>.h checks that every tensor of the call is on the
// context's device, then calls the CPU implementation (kernels/cpu/, under
// the context's thread count) or the CUDA one (kernels/cuda/). A CPU build
// has no CUDA branch to take: its contexts and tensors are all host ones.
// The dense and elementwise ops are here; the MoE routing and permutation
// and the context-parallel ops in dispatch_moe.cpp; the helpers both use in
// dispatch_detail.h.
#include "kernels/dispatch.h"

#include "kernels/dispatch_detail.h"

namespace origami {

namespace {
template <class Args, class DeviceOf>
std::string mismatch(const char* op, Device device, const Args& args, DeviceOf device_of) {
  std::string problem;
  for (const auto& a : args) {
    const std::optional<Device> d = device_of(a);
    if (!d || *d == device) continue;
    problem += (problem.empty() ? std::string(op) + ": the context runs on " + to_string(device) + " but " : ", ");
    problem += std::string(a.name) + " is on " + to_string(*d);
  }
  return problem;
}
}  // namespace

std::string device_mismatch(const char* op, Device device, std::initializer_list<NamedDevice> args) {
  return mismatch(op, device, args, [](const NamedDevice& a) { return std::optional<Device>(a.device); });
}

std::string device_mismatch(const char* op, Device device, std::initializer_list<OpArg> args) {
  return mismatch(op, device, args, [](const OpArg& a) {
    return a.tensor->defined() ? std::optional<Device>(a.tensor->device()) : std::nullopt;
  });
}

using namespace dispatch_detail;

namespace {

// The f64 [1] that sum_add and sum_squares_add add into (either backend).
void check_accumulator(const char* op, const Tensor& acc) {
  ORIGAMI_CHECK(acc.defined(), op, " into an undefined tensor");
  ORIGAMI_CHECK(acc.dtype() == DType::f64 && acc.numel() == 1, op, " accumulates into an f64 [1], got ",
                to_string(acc.dtype()), " ", shape_string(acc.shape()));
}

}  // namespace

void add_inplace(const ExecContext& ctx, Tensor& y, const Tensor& x) { axpy(ctx, 1.0f, x, y); }

Tensor as_dtype(const ExecContext& ctx, const Tensor& src, DType dtype) {
  if (src.dtype() == dtype) return src;
  Tensor dst = ctx.empty(src.shape(), dtype, src.category());
  cast(ctx, src, dst);
  return dst;
}

void gemm(const ExecContext& ctx, const Tensor& A, Trans trans_a, const Tensor& B, Trans trans_b, Tensor& C,
          float alpha, float beta) {
  if (on_cuda(ctx, "gemm", {{"A", &A}, {"B", &B}, {"C", &C}}))
    return ORIGAMI_ON_CUDA(gemm)(ctx, A, trans_a, B, trans_b, C, alpha, beta);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "gemm");
  return cpu::gemm(ctx, h.in(A), trans_a, h.in(B), trans_b, h.wide_out(C), alpha, beta);
}

void grouped_gemm(const ExecContext& ctx, const Tensor& X_NK, const Tensor& W, Trans trans_w,
                  std::span<const GemmSegment> segments, Tensor& Y_NM, float beta, GroupedGemmSchedule schedule) {
  if (on_cuda(ctx, "grouped_gemm", {{"X_NK", &X_NK}, {"W", &W}, {"Y_NM", &Y_NM}}))
    return ORIGAMI_ON_CUDA(grouped_gemm)(ctx, X_NK, W, trans_w, segments, Y_NM, beta, schedule);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "grouped_gemm");
  return cpu::grouped_gemm(ctx, h.in(X_NK), h.in(W), trans_w, segments, h.wide_out(Y_NM), beta, schedule);
}

void grouped_gemm_wgrad(const ExecContext& ctx, const Tensor& dY_NM, const Tensor& X_NK,
                        std::span<const GemmSegment> segments, Tensor& dW_GMK, float beta,
                        GroupedGemmSchedule schedule) {
  if (on_cuda(ctx, "grouped_gemm_wgrad", {{"dY_NM", &dY_NM}, {"X_NK", &X_NK}, {"dW_GMK", &dW_GMK}}))
    return ORIGAMI_ON_CUDA(grouped_gemm_wgrad)(ctx, dY_NM, X_NK, segments, dW_GMK, beta, schedule);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "grouped_gemm_wgrad");
  return cpu::grouped_gemm_wgrad(ctx, h.in(dY_NM), h.in(X_NK), segments, h.wide_out(dW_GMK), beta, schedule);
}

void cast(const ExecContext& ctx, const Tensor& src, Tensor& dst) {
  if (on_cuda(ctx, "cast", {{"src", &src}, {"dst", &dst}})) return ORIGAMI_ON_CUDA(cast)(ctx, src, dst);
  const CpuThreads threads(ctx);
  return cpu::cast(ctx, src, dst);
}

void axpy(const ExecContext& ctx, float a, const Tensor& x, Tensor& y) {
  if (on_cuda(ctx, "axpy", {{"x", &x}, {"y", &y}})) return ORIGAMI_ON_CUDA(axpy)(ctx, a, x, y);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "axpy");
  return cpu::axpy(ctx, a, h.in(x), h.out(y));
}

void scale_inplace(const ExecContext& ctx, Tensor& y, float a) {
  if (on_cuda(ctx, "scale_inplace", {{"y", &y}})) return ORIGAMI_ON_CUDA(scale_inplace)(ctx, y, a);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "scale_inplace");
  return cpu::scale_inplace(ctx, h.out(y), a);
}

double sum_squares(const ExecContext& ctx, const Tensor& x) {
  if (on_cuda(ctx, "sum_squares", {{"x", &x}})) return ORIGAMI_ON_CUDA(sum_squares)(ctx, x);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "sum_squares");
  return cpu::sum_squares(ctx, h.in(x));
}

void sum_squares_add(const ExecContext& ctx, const Tensor& x, Tensor& acc) {
  check_accumulator("sum_squares_add", acc);
  if (on_cuda(ctx, "sum_squares_add", {{"x", &x}, {"acc", &acc}}))
    return ORIGAMI_ON_CUDA(sum_squares_add)(ctx, x, acc);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "sum_squares_add");
  return cpu::sum_squares_add(ctx, h.in(x), acc);
}

double sum(const ExecContext& ctx, const Tensor& x) {
  if (on_cuda(ctx, "sum", {{"x", &x}})) return ORIGAMI_ON_CUDA(sum)(ctx, x);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "sum");
  return cpu::sum(ctx, h.in(x));
}

void sum_add(const ExecContext& ctx, const Tensor& x, Tensor& acc) {
  check_accumulator("sum_add", acc);
  if (on_cuda(ctx, "sum_add", {{"x", &x}, {"acc", &acc}})) return ORIGAMI_ON_CUDA(sum_add)(ctx, x, acc);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "sum_add");
  return cpu::sum_add(ctx, h.in(x), acc);
}

void rmsnorm_forward(const ExecContext& ctx, const Tensor& x_TD, const Tensor& w_D, float eps, Tensor& y_TD,
                     Tensor& rstd_T) {
  if (on_cuda(ctx, "rmsnorm_forward", {{"x_TD", &x_TD}, {"w_D", &w_D}, {"y_TD", &y_TD}, {"rstd_T", &rstd_T}}))
    return ORIGAMI_ON_CUDA(rmsnorm_forward)(ctx, x_TD, w_D, eps, y_TD, rstd_T);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "rmsnorm_forward");
  return cpu::rmsnorm_forward(ctx, h.in(x_TD), h.in(w_D), eps, h.out(y_TD), rstd_T);
}

size_t rmsnorm_backward_workspace_bytes(const ExecContext& ctx, int64_t T, int64_t D) {
  if (on_cuda(ctx, "rmsnorm_backward_workspace_bytes", {}))
    return ORIGAMI_ON_CUDA(rmsnorm_backward_workspace_bytes)(ctx, T, D);
  const CpuThreads threads(ctx);
  return cpu::rmsnorm_backward_workspace_bytes(ctx, T, D);
}

void rmsnorm_backward(const ExecContext& ctx, const Tensor& dy_TD, const Tensor& x_TD, const Tensor& w_D,
                      const Tensor& rstd_T, Tensor& dx_TD, Tensor& dw_D, Tensor& workspace) {
  if (on_cuda(ctx, "rmsnorm_backward",
              {{"dy_TD", &dy_TD},
               {"x_TD", &x_TD},
               {"w_D", &w_D},
               {"rstd_T", &rstd_T},
               {"dx_TD", &dx_TD},
               {"dw_D", &dw_D},
               {"workspace", &workspace}}))
    return ORIGAMI_ON_CUDA(rmsnorm_backward)(ctx, dy_TD, x_TD, w_D, rstd_T, dx_TD, dw_D, workspace);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "rmsnorm_backward");
  return cpu::rmsnorm_backward(ctx, h.in(dy_TD), h.in(x_TD), h.in(w_D), rstd_T, h.out(dx_TD), h.wide_out(dw_D),
                               workspace);
}

void rmsnorm_backward_input(const ExecContext& ctx, const Tensor& dy_TD, const Tensor& x_TD, const Tensor& w_D,
                            const Tensor& rstd_T, Tensor& dx_TD) {
  if (on_cuda(ctx, "rmsnorm_backward_input",
              {{"dy_TD", &dy_TD}, {"x_TD", &x_TD}, {"w_D", &w_D}, {"rstd_T", &rstd_T}, {"dx_TD", &dx_TD}}))
    return ORIGAMI_ON_CUDA(rmsnorm_backward_input)(ctx, dy_TD, x_TD, w_D, rstd_T, dx_TD);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "rmsnorm_backward_input");
  return cpu::rmsnorm_backward_input(ctx, h.in(dy_TD), h.in(x_TD), h.in(w_D), rstd_T, h.out(dx_TD));
}

size_t rmsnorm_backward_weight_workspace_bytes(const ExecContext& ctx, int64_t T, int64_t D) {
  if (on_cuda(ctx, "rmsnorm_backward_weight_workspace_bytes", {}))
    return ORIGAMI_ON_CUDA(rmsnorm_backward_weight_workspace_bytes)(ctx, T, D);
  const CpuThreads threads(ctx);
  return cpu::rmsnorm_backward_weight_workspace_bytes(ctx, T, D);
}

void rmsnorm_backward_weight(const ExecContext& ctx, const Tensor& dy_TD, const Tensor& x_TD, const Tensor& rstd_T,
                             Tensor& dw_D, Tensor& workspace) {
  if (on_cuda(ctx, "rmsnorm_backward_weight",
              {{"dy_TD", &dy_TD}, {"x_TD", &x_TD}, {"rstd_T", &rstd_T}, {"dw_D", &dw_D}, {"workspace", &workspace}}))
    return ORIGAMI_ON_CUDA(rmsnorm_backward_weight)(ctx, dy_TD, x_TD, rstd_T, dw_D, workspace);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "rmsnorm_backward_weight");
  return cpu::rmsnorm_backward_weight(ctx, h.in(dy_TD), h.in(x_TD), rstd_T, h.wide_out(dw_D), workspace);
}

void rope_forward(const ExecContext& ctx, Tensor& x_BSHd, const Tensor& pos_S, float theta) {
  if (on_cuda(ctx, "rope_forward", {{"x_BSHd", &x_BSHd}, {"pos_S", &pos_S}}))
    return ORIGAMI_ON_CUDA(rope_forward)(ctx, x_BSHd, pos_S, theta);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "rope_forward");
  return cpu::rope_forward(ctx, h.out(x_BSHd), pos_S, theta);
}

void rope_backward(const ExecContext& ctx, Tensor& dx_BSHd, const Tensor& pos_S, float theta) {
  if (on_cuda(ctx, "rope_backward", {{"dx_BSHd", &dx_BSHd}, {"pos_S", &pos_S}}))
    return ORIGAMI_ON_CUDA(rope_backward)(ctx, dx_BSHd, pos_S, theta);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "rope_backward");
  return cpu::rope_backward(ctx, h.out(dx_BSHd), pos_S, theta);
}

size_t attention_forward_workspace_bytes(const ExecContext& ctx, const AttentionDims& dims) {
  if (on_cuda(ctx, "attention_forward_workspace_bytes", {}))
    return ORIGAMI_ON_CUDA(attention_forward_workspace_bytes)(ctx, dims);
  const CpuThreads threads(ctx);
  return cpu::attention_forward_workspace_bytes(ctx, dims);
}

void attention_forward(const ExecContext& ctx, const AttentionDims& dims, const Tensor& q, const Tensor& k,
                       const Tensor& v, const Tensor& q_pos_S, const Tensor& kv_pos_S, float scale, Tensor& o,
                       Tensor& lse_BHS, Tensor& workspace) {
  if (on_cuda(ctx, "attention_forward",
              {{"q", &q},
               {"k", &k},
               {"v", &v},
               {"q_pos_S", &q_pos_S},
               {"kv_pos_S", &kv_pos_S},
               {"o", &o},
               {"lse_BHS", &lse_BHS},
               {"workspace", &workspace}}))
    return ORIGAMI_ON_CUDA(attention_forward)(ctx, dims, q, k, v, q_pos_S, kv_pos_S, scale, o, lse_BHS, workspace);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "attention_forward");
  return cpu::attention_forward(ctx, dims, h.in(q), h.in(k), h.in(v), q_pos_S, kv_pos_S, scale, h.out(o), lse_BHS,
                                workspace);
}

size_t attention_backward_workspace_bytes(const ExecContext& ctx, const AttentionDims& dims) {
  if (on_cuda(ctx, "attention_backward_workspace_bytes", {}))
    return ORIGAMI_ON_CUDA(attention_backward_workspace_bytes)(ctx, dims);
  const CpuThreads threads(ctx);
  return cpu::attention_backward_workspace_bytes(ctx, dims);
}

void attention_backward(const ExecContext& ctx, const AttentionDims& dims, const Tensor& q, const Tensor& k,
                        const Tensor& v, const Tensor& o, const Tensor& lse_BHS, const Tensor& do_,
                        const Tensor& q_pos_S, const Tensor& kv_pos_S, float scale, Tensor& dq, Tensor& dk, Tensor& dv,
                        Tensor& workspace) {
  if (on_cuda(ctx, "attention_backward",
              {{"q", &q},
               {"k", &k},
               {"v", &v},
               {"o", &o},
               {"lse_BHS", &lse_BHS},
               {"do_", &do_},
               {"q_pos_S", &q_pos_S},
               {"kv_pos_S", &kv_pos_S},
               {"dq", &dq},
               {"dk", &dk},
               {"dv", &dv},
               {"workspace", &workspace}}))
    return ORIGAMI_ON_CUDA(attention_backward)(ctx, dims, q, k, v, o, lse_BHS, do_, q_pos_S, kv_pos_S, scale, dq, dk,
                                               dv, workspace);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "attention_backward");
  return cpu::attention_backward(ctx, dims, h.in(q), h.in(k), h.in(v), h.in(o), lse_BHS, h.in(do_), q_pos_S, kv_pos_S,
                                 scale, h.out(dq), h.out(dk), h.out(dv), workspace);
}

void attention_merge(const ExecContext& ctx, const Tensor& o_part, const Tensor& lse_part, Tensor& o_acc,
                     Tensor& lse_acc) {
  if (on_cuda(ctx, "attention_merge",
              {{"o_part", &o_part}, {"lse_part", &lse_part}, {"o_acc", &o_acc}, {"lse_acc", &lse_acc}}))
    return ORIGAMI_ON_CUDA(attention_merge)(ctx, o_part, lse_part, o_acc, lse_acc);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "attention_merge");
  return cpu::attention_merge(ctx, h.in(o_part), lse_part, h.out(o_acc), lse_acc);
}

void swiglu_forward(const ExecContext& ctx, const Tensor& gate_TF, const Tensor& up_TF, Tensor& h_TF) {
  if (on_cuda(ctx, "swiglu_forward", {{"gate_TF", &gate_TF}, {"up_TF", &up_TF}, {"h_TF", &h_TF}}))
    return ORIGAMI_ON_CUDA(swiglu_forward)(ctx, gate_TF, up_TF, h_TF);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "swiglu_forward");
  return cpu::swiglu_forward(ctx, h.in(gate_TF), h.in(up_TF), h.out(h_TF));
}

void swiglu_backward(const ExecContext& ctx, const Tensor& dh_TF, const Tensor& gate_TF, const Tensor& up_TF,
                     Tensor& dgate_TF, Tensor& dup_TF) {
  if (on_cuda(
          ctx, "swiglu_backward",
          {{"dh_TF", &dh_TF}, {"gate_TF", &gate_TF}, {"up_TF", &up_TF}, {"dgate_TF", &dgate_TF}, {"dup_TF", &dup_TF}}))
    return ORIGAMI_ON_CUDA(swiglu_backward)(ctx, dh_TF, gate_TF, up_TF, dgate_TF, dup_TF);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "swiglu_backward");
  return cpu::swiglu_backward(ctx, h.in(dh_TF), h.in(gate_TF), h.in(up_TF), h.out(dgate_TF), h.out(dup_TF));
}

void embedding_forward(const ExecContext& ctx, const Tensor& ids_T, const Tensor& table_VD, int64_t vocab_start,
                       Tensor& out_TD) {
  if (on_cuda(ctx, "embedding_forward", {{"ids_T", &ids_T}, {"table_VD", &table_VD}, {"out_TD", &out_TD}}))
    return ORIGAMI_ON_CUDA(embedding_forward)(ctx, ids_T, table_VD, vocab_start, out_TD);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "embedding_forward");
  return cpu::embedding_forward(ctx, ids_T, h.in(table_VD), vocab_start, h.out(out_TD));
}

void embedding_backward(const ExecContext& ctx, const Tensor& ids_T, const Tensor& dout_TD, int64_t vocab_start,
                        Tensor& dtable_VD) {
  if (on_cuda(ctx, "embedding_backward", {{"ids_T", &ids_T}, {"dout_TD", &dout_TD}, {"dtable_VD", &dtable_VD}}))
    return ORIGAMI_ON_CUDA(embedding_backward)(ctx, ids_T, dout_TD, vocab_start, dtable_VD);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "embedding_backward");
  return cpu::embedding_backward(ctx, ids_T, h.in(dout_TD), vocab_start, h.out(dtable_VD));
}

void cross_entropy_forward(const ExecContext& ctx, const Tensor& logits_TV, const Tensor& targets_T, Tensor& loss_T,
                           Tensor& lse_T) {
  if (on_cuda(ctx, "cross_entropy_forward",
              {{"logits_TV", &logits_TV}, {"targets_T", &targets_T}, {"loss_T", &loss_T}, {"lse_T", &lse_T}}))
    return ORIGAMI_ON_CUDA(cross_entropy_forward)(ctx, logits_TV, targets_T, loss_T, lse_T);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "cross_entropy_forward");
  return cpu::cross_entropy_forward(ctx, h.in(logits_TV), targets_T, loss_T, lse_T);
}

void cross_entropy_backward(const ExecContext& ctx, const Tensor& logits_TV, const Tensor& targets_T,
                            const Tensor& lse_T, float grad_scale, Tensor& dlogits_TV) {
  if (on_cuda(ctx, "cross_entropy_backward",
              {{"logits_TV", &logits_TV}, {"targets_T", &targets_T}, {"lse_T", &lse_T}, {"dlogits_TV", &dlogits_TV}}))
    return ORIGAMI_ON_CUDA(cross_entropy_backward)(ctx, logits_TV, targets_T, lse_T, grad_scale, dlogits_TV);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "cross_entropy_backward");
  return cpu::cross_entropy_backward(ctx, h.in(logits_TV), targets_T, lse_T, grad_scale, h.out(dlogits_TV));
}

void cross_entropy_local_max(const ExecContext& ctx, const Tensor& logits_TV, Tensor& max_T) {
  if (on_cuda(ctx, "cross_entropy_local_max", {{"logits_TV", &logits_TV}, {"max_T", &max_T}}))
    return ORIGAMI_ON_CUDA(cross_entropy_local_max)(ctx, logits_TV, max_T);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "cross_entropy_local_max");
  return cpu::cross_entropy_local_max(ctx, h.in(logits_TV), max_T);
}

void cross_entropy_local_sums(const ExecContext& ctx, const Tensor& logits_TV, const Tensor& targets_T,
                              const Tensor& max_T, int64_t vocab_start, int64_t vocab, Tensor& sums_2T) {
  if (on_cuda(ctx, "cross_entropy_local_sums",
              {{"logits_TV", &logits_TV}, {"targets_T", &targets_T}, {"max_T", &max_T}, {"sums_2T", &sums_2T}}))
    return ORIGAMI_ON_CUDA(cross_entropy_local_sums)(ctx, logits_TV, targets_T, max_T, vocab_start, vocab, sums_2T);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "cross_entropy_local_sums");
  return cpu::cross_entropy_local_sums(ctx, h.in(logits_TV), targets_T, max_T, vocab_start, vocab, sums_2T);
}

void cross_entropy_finish(const ExecContext& ctx, const Tensor& max_T, const Tensor& sums_2T, Tensor& loss_T,
                          Tensor& lse_T) {
  if (on_cuda(ctx, "cross_entropy_finish",
              {{"max_T", &max_T}, {"sums_2T", &sums_2T}, {"loss_T", &loss_T}, {"lse_T", &lse_T}}))
    return ORIGAMI_ON_CUDA(cross_entropy_finish)(ctx, max_T, sums_2T, loss_T, lse_T);
  const CpuThreads threads(ctx);
  return cpu::cross_entropy_finish(ctx, max_T, sums_2T, loss_T, lse_T);
}

void cross_entropy_local_backward(const ExecContext& ctx, const Tensor& logits_TV, const Tensor& targets_T,
                                  const Tensor& lse_T, int64_t vocab_start, float grad_scale, Tensor& dlogits_TV) {
  if (on_cuda(ctx, "cross_entropy_local_backward",
              {{"logits_TV", &logits_TV}, {"targets_T", &targets_T}, {"lse_T", &lse_T}, {"dlogits_TV", &dlogits_TV}}))
    return ORIGAMI_ON_CUDA(cross_entropy_local_backward)(ctx, logits_TV, targets_T, lse_T, vocab_start, grad_scale,
                                                         dlogits_TV);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "cross_entropy_local_backward");
  return cpu::cross_entropy_local_backward(ctx, h.in(logits_TV), targets_T, lse_T, vocab_start, grad_scale,
                                           h.out(dlogits_TV));
}

void adamw_update(const ExecContext& ctx, Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                  const AdamWStep& s) {
  if (on_cuda(ctx, "adamw_update",
              {{"param", &param}, {"grad", &grad}, {"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}}))
    return ORIGAMI_ON_CUDA(adamw_update)(ctx, param, grad, exp_avg, exp_avg_sq, s);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "adamw_update");
  return cpu::adamw_update(ctx, param, h.in(grad), exp_avg, exp_avg_sq, s);
}

void adamw_update_fused(const ExecContext& ctx, Tensor& master, Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                        Tensor& param, std::span<const AdamWSegment> segments, float grad_scale, const AdamWStep& s) {
  const int64_t n = master.defined() ? master.numel() : 0;
  const Tensor* moments[] = {&master, &exp_avg, &exp_avg_sq};
  for (const Tensor* t : moments)
    ORIGAMI_CHECK(t->defined() && t->dtype() == DType::f32 && t->numel() == n,
                  "adamw_update_fused: master, exp_avg and exp_avg_sq must be f32 with ", n, " elements; got ",
                  t->defined() ? shape_string(t->shape()) + " " + std::string(to_string(t->dtype())) : "undefined");
  ORIGAMI_CHECK(grad.defined() && (grad.dtype() == DType::f32 || grad.dtype() == DType::bf16) && grad.numel() == n,
                "adamw_update_fused: grad must be f32 or bf16 with ", n, " elements");
  ORIGAMI_CHECK(
      !param.defined() || (param.dtype() == DType::bf16 && grad.dtype() == DType::bf16 && param.numel() == n),
                "adamw_update_fused: param is undefined or the bf16 working copy (", n,
                " elements) beside a bf16 grad; got ", param.defined() ? to_string(param.dtype()) : "undefined", " [",
                param.defined() ? param.numel() : 0, "] beside a ", to_string(grad.dtype()), " grad");
  int64_t next = 0;
  for (const AdamWSegment& seg : segments) {
    ORIGAMI_CHECK(seg.begin == next && seg.numel >= 0, "adamw_update_fused: segments must tile [0, ", n,
                  ") in order; one is [", seg.begin, ", +", seg.numel, ") after ", next);
    next += seg.numel;
  }
  ORIGAMI_CHECK(next == n, "adamw_update_fused: the segments cover [0, ", next, ") of [0, ", n, ")");
  ORIGAMI_CHECK(s.step >= 1, "adamw step is 1-based, got ", s.step);
  if (on_cuda(ctx, "adamw_update_fused",
              {{"master", &master},
               {"grad", &grad},
               {"exp_avg", &exp_avg},
               {"exp_avg_sq", &exp_avg_sq},
               {"param", &param}}))
    return ORIGAMI_ON_CUDA(adamw_update_fused)(ctx, master, grad, exp_avg, exp_avg_sq, param, segments, grad_scale, s);
  const CpuThreads threads(ctx);
  if (grad.dtype() == DType::bf16 && grad_scale != 1.0f) {
    // Scaled in bf16 first, as scale_inplace rounds it: the widened copy
    // would carry the unrounded product into the update.
    HostBf16 h(ctx, "adamw_update_fused");
    cpu::scale_inplace(ctx, h.out(grad), grad_scale);
    grad_scale = 1.0f;
  }
  HostBf16 h(ctx, "adamw_update_fused");
  return cpu::adamw_update_fused(ctx, master, h.out(grad), exp_avg, exp_avg_sq, h.out(param), segments, grad_scale,
                                 s);
}

void init_normal(const ExecContext& ctx, Tensor& out, uint64_t seed, std::string_view name, int64_t global_offset,
                 float std) {
  if (on_cuda(ctx, "init_normal", {{"out", &out}}))
    return ORIGAMI_ON_CUDA(init_normal)(ctx, out, seed, name, global_offset, std);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "init_normal");
  return cpu::init_normal(ctx, h.out(out), seed, name, global_offset, std);
}

void init_constant(const ExecContext& ctx, Tensor& out, float value) {
  if (on_cuda(ctx, "init_constant", {{"out", &out}})) return ORIGAMI_ON_CUDA(init_constant)(ctx, out, value);
  const CpuThreads threads(ctx);
  HostBf16 h(ctx, "init_constant");
  return cpu::init_constant(ctx, h.out(out), value);
}

}  // namespace origami

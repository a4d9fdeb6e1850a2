// Deferred weight gradients: the zero-bubble split of a backward pass into B
// (the input gradient dX = dY·Wᵀ and everything the layer below waits for)
// and W (the weight gradients dW += dYᵀ·X, the norms' Σ dy ⊙ x̂, the
// embedding's scatter-add), so that a pipeline schedule (ZB-H1) can run B
// passes at once and W passes later.
//
// Every module backward takes an optional `WeightGradQueue* defer`. Null:
// the fused backward, the same kernel calls in the same order as without the
// split. A queue: the module computes its input gradient now and pushes each
// weight-gradient call instead of making it. A pushed call is the call the
// fused backward makes — same kernel, same operands, the same accumulation
// into the same destination — so B then W gives bitwise the fused gradients.
// It is a second kernel call, never a recompute (rmsnorm has its two halves
// as two kernels: kernels/rmsnorm.h).
//
// What an item keeps. A pushed call holds the operands it reads by value
// (Tensors are refcounted views: keeping X and dY alive costs no copy, only
// the memory B would otherwise have freed; engine/plan.h states it,
// ActivationBytes::weight_pending_*). It holds no parameter: W needs no
// weights, so ZeRO-3 gathers nothing for it.
//
// Where it lands. An item holds the ADDRESS of its destination view, not the
// view: under ZeRO 2-3 a unit's whole gradient buffer exists only around the
// unit's W (engine/zero.h, before_weight / after_weight), so B cannot capture
// it. Under defer a module's grad argument (`Tensor& dw`, `AttentionWeights&
// grad`, ...) is therefore a binding: the caller keeps it at a fixed address
// for as long as the queue holds items, may leave it unbound (undefined
// tensors) during B, assigns the destination views right before run() and
// may clear them after. run() checks that every destination is bound; the
// kernel checks its shape. engine/model.h's WeightPass owns these bindings.
//
// Communication stays in B: a module's collectives (tp gathers and
// reduce-scatters, the cp and ep exchanges) run where the fused backward
// runs them, so B issues exactly the fused backward's collectives in the same
// order and the items are local computation only.
#pragma once
#include <functional>
#include <utility>
#include <vector>

#include "kernels/context.h"
#include "kernels/gemm.h"
#include "kernels/tensor.h"

namespace origami {

class WeightGradQueue {
 public:
  // One weight-gradient call: accumulates into dst, the view bound at the
  // address it was pushed with.
  using Call = std::function<void(const ExecContext& ctx, Tensor& dst)>;

  // Defers `call` into the view bound at `dst` when run() runs (see above:
  // `dst` must stay at its address until then).
  void push(Tensor& dst, Call call) { items_.push_back({&dst, std::move(call)}); }
  // Makes every call in push order, each into its bound view, then empties
  // the queue (the operands it kept are released).
  void run(const ExecContext& ctx);
  bool empty() const { return items_.empty(); }
  size_t size() const { return items_.size(); }
  void clear() { items_.clear(); }

 private:
  struct Item {
    Tensor* dst;
    Call call;
  };
  std::vector<Item> items_;
};

// A module's weight-gradient call: made now into dst when defer is null (the
// fused backward), else pushed. `call(ctx, dst)` captures its operands by value.
template <class F>
void weight_grad(const ExecContext& ctx, WeightGradQueue* defer, Tensor& dst, F&& call) {
  if (defer)
    defer->push(dst, std::forward<F>(call));
  else
    call(ctx, dst);
}

// A linear layer's weight gradient (y = x·Wᵀ): dW += dYᵀ·X with dY [T, out],
// X [T, in], dW [out, in]; one gemm, now or deferred.
inline void linear_weight_grad(const ExecContext& ctx, WeightGradQueue* defer, const Tensor& dY, const Tensor& X,
                               Tensor& dW) {
  weight_grad(ctx, defer, dW, [dY, X](const ExecContext& c, Tensor& dst) {
    gemm(c, dY, Trans::yes, X, Trans::no, dst, 1.0f, 1.0f);
  });
}

}  // namespace origami

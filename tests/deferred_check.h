// The check the split-backward tests share (kernels/deferred.h): a module's
// backward run fused, and again as B (input gradient now, its gradient
// binding left unbound, weight-gradient calls pushed) then W (the weights
// poisoned with NaN, since W must read no parameter; the binding filled with
// the same starting gradients; the queue run). dx and every gradient must
// agree bitwise, and every gradient must have moved from its start (a check
// of a call that never ran would pass on equal zeros).
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/deferred.h"
#include "test_context.h"

namespace origami::testing {

inline Tensor copy_of(const Tensor& t) {
  Tensor c = Tensor::empty(t.shape(), t.dtype(), MemCategory::grad);
  c.copy_from(t);
  return c;
}

inline void poison(const Tensor& t) {
  std::fill(t.f32(), t.f32() + t.numel(), std::numeric_limits<float>::quiet_NaN());
}

inline bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::equal(static_cast<const char*>(a.raw()), static_cast<const char*>(a.raw()) + a.nbytes(),
                    static_cast<const char*>(b.raw()));
}

// The tensors of a gradient struct, for copying and comparing.
template <class G>
using ViewsOf = std::vector<Tensor*> (*)(G&);
inline std::vector<Tensor*> tensor_views(Tensor& t) { return {&t}; }

template <class G>
G clone(G g, ViewsOf<G> views) {
  for (Tensor* t : views(g)) *t = copy_of(*t);
  return g;
}

// backward(grad, defer) runs the module's backward (its forward too when
// backward consumes what forward saved) and returns dx (undefined if none).
// start: the gradients both runs accumulate onto; weights: the parameters the
// module read; calls: the weight-gradient calls B must push.
template <class G, class Backward>
void expect_split_is_fused(const char* what, const G& start, std::type_identity_t<ViewsOf<G>> views,
                           const std::vector<Tensor>& weights, size_t calls, Backward backward) {
  SCOPED_TRACE(what);
  const ExecContext& ctx = test_context();
  G fused = clone(start, views);
  const Tensor dx_fused = backward(fused, nullptr);

  WeightGradQueue queue;
  G binding{};  // unbound through B: the calls cannot have captured a gradient
  const Tensor dx_split = backward(binding, &queue);
  EXPECT_EQ(queue.size(), calls);
  for (const Tensor& w : weights) poison(w);
  binding = clone(start, views);
  queue.run(ctx);
  EXPECT_TRUE(queue.empty());

  ASSERT_EQ(dx_fused.defined(), dx_split.defined());
  if (dx_fused.defined()) {
    EXPECT_TRUE(bitwise_equal(dx_split, dx_fused)) << what << ": dx";
  }
  G begin = start;
  const std::vector<Tensor*> got = views(binding), want = views(fused), from = views(begin);
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(*got[i], *want[i])) << what << ": gradient " << i;
    EXPECT_FALSE(bitwise_equal(*want[i], *from[i])) << what << ": gradient " << i << " never accumulated";
  }
}

}  // namespace origami::testing

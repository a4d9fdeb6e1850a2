// Deferred weight gradients (see deferred.h).
#include "kernels/deferred.h"

namespace origami {

void WeightGradQueue::run(const ExecContext& ctx) {
  for (size_t i = 0; i < items_.size(); ++i)
    ORIGAMI_CHECK(items_[i].dst->defined(), "deferred weight gradient ", i, " of ", items_.size(),
                  ": its destination is not bound (bind the gradient views before running the queue)");
  std::vector<Item> items = std::move(items_);
  items_.clear();
  for (Item& item : items) {
    item.call(ctx, *item.dst);
    item.call = nullptr;  // release the operands as soon as they are used
  }
}

}  // namespace origami

// Token embedding module: rows of the (vocab-sharded) table gathered by id;
// backward scatter-adds into the table's gradient.
#pragma once
#include "kernels/context.h"
#include "kernels/deferred.h"
#include "kernels/tensor.h"

namespace origami::dense {

// ids_T: i32 [T]; table_VD: [V, D]. Returns x_TD [T, D] (activation).
Tensor embedding_module_forward(const ExecContext& ctx, const Tensor& ids_T, const Tensor& table_VD);
// All of it is a weight gradient: with defer (kernels/deferred.h) the
// scatter-add is pushed, keeping ids and dx, and dtable_VD is its binding.
void embedding_module_backward(const ExecContext& ctx, const Tensor& ids_T, const Tensor& dx_TD, Tensor& dtable_VD,
                               WeightGradQueue* defer = nullptr);

}  // namespace origami::dense

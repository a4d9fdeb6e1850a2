// Token embedding module (see embedding.h). Vocab sharding arrives with TP;
// until then the table starts at token 0.
#include "dense/embedding.h"

#include "kernels/embedding.h"

namespace origami::dense {

Tensor embedding_module_forward(const ExecContext& ctx, const Tensor& ids_T, const Tensor& table_VD) {
  Tensor x = ctx.empty_data({ids_T.numel(), table_VD.cols()});
  embedding_forward(ctx, ids_T, table_VD, /*vocab_start=*/0, x);
  return x;
}

void embedding_module_backward(const ExecContext& ctx, const Tensor& ids_T, const Tensor& dx_TD, Tensor& dtable_VD,
                               WeightGradQueue* defer) {
  weight_grad(ctx, defer, dtable_VD, [ids_T, dx_TD](const ExecContext& c, Tensor& dtable) {
    embedding_backward(c, ids_T, dx_TD, /*vocab_start=*/0, dtable);
  });
}

}  // namespace origami::dense

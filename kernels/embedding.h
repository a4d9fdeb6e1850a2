// Embedding gather / scatter-add, vocab-sharded-ready: this table holds rows
// [vocab_start, vocab_start + V_local); ids outside that range give zero rows
// in forward and no gradient in backward (vocab-parallel embedding sums the
// partial outputs over tp).
#pragma once
#include "kernels/context.h"
#include "kernels/tensor.h"

namespace origami {

// ids_T: i32 [T]; table_VD: [V_local, D]; out_TD: [T, D] (overwritten).
void embedding_forward(const ExecContext& ctx, const Tensor& ids_T, const Tensor& table_VD, int64_t vocab_start,
                       Tensor& out_TD);
// dtable_VD += scatter of dout_TD rows by id. Deterministic (no float atomics).
void embedding_backward(const ExecContext& ctx, const Tensor& ids_T, const Tensor& dout_TD, int64_t vocab_start,
                        Tensor& dtable_VD);

}  // namespace origami

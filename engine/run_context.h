// What training and evaluation both set up per rank (trainer.cpp,
// evaluate.cpp): the execution context the config places the rank on, and
// a micro-batch's token windows on that context's device. Internal to
// engine/.
#pragma once
#include <cstdint>

#include "engine/config.h"
#include "engine/dataset.h"
#include "kernels/context.h"
#include "kernels/tensor.h"

namespace origami {

// The rank's execution context on the device runtime.device resolves to
// (resolve_placement), with runtime.threads (or the per-rank default) OpenMP
// threads for host work. ORIGAMI_HOST_STAND_IN=1 trains a CPU run on the
// stand-in device cpu:1 (ExecContext::host_stand_in): the test that every
// buffer of the training path is allocated on the context's device, that
// host code touches none of their elements, and (make_groups) that the
// communication keeps NCCL's rules.
ExecContext make_context(const Config& cfg);

// Fills tokens_BS1 [mb, S+1] with the samples given by `index_of(i)`.
template <class IndexFn>
inline void load_micro_batch(const GptDataset& data, int64_t mb, int64_t seq_len, IndexFn index_of,
                             Tensor& tokens_BS1) {
  for (int64_t i = 0; i < mb; ++i) data.get(index_of(i), tokens_BS1.i32() + i * (seq_len + 1));
}

// The micro-batch's token windows on the compute device: written on the host
// (the data loader's named host point), then copied once in the compute
// stream's order.
template <class IndexFn>
inline Tensor device_micro_batch(const ExecContext& ctx, const GptDataset& data, int64_t mb, int64_t seq_len,
                          IndexFn index_of) {
  Tensor host = Tensor::empty({mb, seq_len + 1}, DType::i32, MemCategory::activation);
  load_micro_batch(data, mb, seq_len, index_of, host);
  return host.device() == ctx.device() ? host : ctx.to(host, ctx.device());
}

}  // namespace origami

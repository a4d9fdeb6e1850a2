// The Tensor overloads of Communicator: each turns its tensors into the
// Buffers of the one call path (comm/communicator.cpp) through memory_of, so a
// Tensor call and the span call over the same elements check, count and start
// exactly the same way; only the element type comes from the dtype and the
// memory from the tensor's device.
#include "comm/communicator.h"
#include "comm/tensor_memory.h"
#include "kernels/check.h"

namespace origami::comm {

Communicator::Buffer Communicator::buffer(const Tensor& t, const char* op, const char* which,
                                          const std::string& group) {
  ORIGAMI_CHECK(t.defined(), "group ", group, " ", op, ": ", which, " tensor is undefined");
  const TensorMemory m = memory_of(t);
  ORIGAMI_CHECK(m.type.has_value(), "group ", group, " ", op, ": ", which, " tensor is ", to_string(t.dtype()),
                ", which collectives do not move (f32, f64, i32, i64, bf16 only)");
  return {m.data, m.count, *m.type, m.device};
}

Request Communicator::all_reduce_async(const Tensor& data, ReduceOp op) {
  return start_all_reduce(buffer(data, "all_reduce", "data", name_), op);
}

Request Communicator::all_gather_async(const Tensor& send, const Tensor& recv) {
  return start_all_gather(buffer(send, "all_gather", "send", name_), buffer(recv, "all_gather", "recv", name_), {});
}

Request Communicator::reduce_scatter_async(const Tensor& send, const Tensor& recv, ReduceOp op) {
  return start_reduce_scatter(buffer(send, "reduce_scatter", "send", name_),
                              buffer(recv, "reduce_scatter", "recv", name_), {}, op);
}

Request Communicator::all_gather_v_async(const Tensor& send, const Tensor& recv,
                                         std::span<const int64_t> recv_counts) {
  return start_all_gather(buffer(send, "all_gather_v", "send", name_), buffer(recv, "all_gather_v", "recv", name_),
                          recv_counts);
}

Request Communicator::reduce_scatter_v_async(const Tensor& send, const Tensor& recv, std::span<const int64_t> counts,
                                             ReduceOp op) {
  return start_reduce_scatter(buffer(send, "reduce_scatter_v", "send", name_),
                              buffer(recv, "reduce_scatter_v", "recv", name_), counts, op);
}

Request Communicator::all_to_all_v_async(const Tensor& send, std::span<const int64_t> send_counts,
                                         const Tensor& recv, std::span<const int64_t> recv_counts) {
  return start_all_to_all_v(buffer(send, "all_to_all_v", "send", name_), send_counts,
                            buffer(recv, "all_to_all_v", "recv", name_), recv_counts);
}

Request Communicator::send_async(const Tensor& data, int peer, int tag) {
  return start_send(buffer(data, "send", "data", name_), peer, tag);
}

Request Communicator::recv_async(const Tensor& data, int peer, int tag) {
  return start_recv(buffer(data, "recv", "data", name_), peer, tag);
}

Request Communicator::broadcast_async(const Tensor& data, int root) {
  return start_broadcast(buffer(data, "broadcast", "data", name_), root);
}

}  // namespace origami::comm

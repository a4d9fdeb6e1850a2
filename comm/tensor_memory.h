// comm's one view of a Tensor's memory: the pointer, element count, comm
// element type and device that every Tensor overload of Communicator sends
// from. Reading the pointer in one place keeps the switch to a device-safe
// accessor (a Tensor whose host pointer check would refuse device memory) a
// one-line change; mapping DType to ElemType in one place keeps the two enums
// from drifting.
#pragma once
#include <cstdint>
#include <optional>

#include "comm/communicator.h"
#include "kernels/tensor.h"

namespace origami::comm {

// The comm element type of a dtype, or empty for one that is never
// communicated (u8) or that comm does not know yet: callers refuse it with a
// message naming the dtype, so a new DType fails loudly until mapped here.
std::optional<ElemType> comm_elem_type(DType dt);

struct TensorMemory {
  void* data = nullptr;
  int64_t count = 0;             // elements
  std::optional<ElemType> type;  // empty: not communicable (comm_elem_type)
  Device device;
};

// Of a defined tensor (checked).
TensorMemory memory_of(const Tensor& t);

}  // namespace origami::comm

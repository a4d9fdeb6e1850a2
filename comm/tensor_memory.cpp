// DType → ElemType and the single read of a Tensor's pointer for comm.
#include "comm/tensor_memory.h"

#include "kernels/check.h"

namespace origami::comm {

std::optional<ElemType> comm_elem_type(DType dt) {
  switch (dt) {
    case DType::f32: return ElemType::f32;
    case DType::bf16: return ElemType::bf16;
    case DType::i32: return ElemType::i32;
    case DType::i64: return ElemType::i64;
    case DType::f64: return ElemType::f64;
    default: return std::nullopt;  // u8, and any dtype not mapped yet
  }
}

TensorMemory memory_of(const Tensor& t) {
  ORIGAMI_CHECK(t.defined(), "a collective on an undefined tensor");
  // address(): the view's first element wherever the storage lives (raw()
  // is for host reads only).
  return {t.address(), t.numel(), comm_elem_type(t.dtype()), t.device()};
}

}  // namespace origami::comm

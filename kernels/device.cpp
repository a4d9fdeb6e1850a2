// Device names and what this build and machine offer.
#include "kernels/device.h"

#include "kernels/cuda/memory.h"

namespace origami {

// The host is "cpu"; cpu:1 is the host stand-in of ExecContext::host_stand_in.
std::string to_string(Device d) {
  if (d.is_host()) return d.index == 0 ? "cpu" : "cpu:" + std::to_string(d.index);
  return "cuda:" + std::to_string(d.index);
}

bool built_with_cuda() {
#if ORIGAMI_WITH_CUDA
  return true;
#else
  return false;
#endif
}

int cuda_device_count() {
#if ORIGAMI_WITH_CUDA
  static const int count = cuda::device_count();
  return count;
#else
  return 0;
#endif
}

size_t cuda_device_memory(int index) {
#if ORIGAMI_WITH_CUDA
  if (index >= 0 && index < cuda_device_count()) return cuda::device_memory_bytes(index);
#endif
  (void)index;
  return 0;
}

}  // namespace origami

// Device names and what this build and machine offer.
#include "kernels/device.h"

#include "kernels/cuda/memory.h"

namespace origami {

std::string to_string(Device d) { return d.is_host() ? "cpu" : "cuda:" + std::to_string(d.index); }

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

}  // namespace origami

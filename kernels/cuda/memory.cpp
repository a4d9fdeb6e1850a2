// CUDA memory primitives (see memory.h). Allocation failures return null so
// the tracked allocator can report the ledger beside the failure; every
// other runtime error is a CUDA_CHECK.
#include "kernels/cuda/check.h"
#include "kernels/cuda/memory.h"

namespace origami::cuda {

namespace {

void* device_allocate(size_t bytes, int device_index) {
  CUDA_CHECK(cudaSetDevice(device_index));
  void* ptr = nullptr;
  const cudaError_t rc = cudaMalloc(&ptr, bytes);
  if (rc == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // clear it so the next call's report is its own
    return nullptr;
  }
  CUDA_CHECK(rc);  // a fault (illegal address, ECC, a lost device) is no out-of-memory
  return ptr;
}

void device_release(void* ptr, int device_index) {
  // At process exit the runtime may already be unloading; a free then is moot.
  const cudaError_t rc = cudaFree(ptr);
  if (rc == cudaErrorCudartUnloading) return;
  CUDA_CHECK(rc);
}

}  // namespace

MemorySource device_memory_source() { return MemorySource{device_allocate, device_release}; }

namespace {

struct DeviceCount {
  int count = 0;
  std::string problem;
};

const DeviceCount& counted() {
  static const DeviceCount c = [] {
    DeviceCount out;
    const cudaError_t rc = cudaGetDeviceCount(&out.count);
    if (rc != cudaSuccess) {
      (void)cudaGetLastError();
      out.count = 0;
      out.problem = std::string("cudaGetDeviceCount: ") + cudaGetErrorName(rc) + ": " + cudaGetErrorString(rc);
    } else if (out.count == 0) {
      out.problem = "cudaGetDeviceCount: 0 devices";
    }
    return out;
  }();
  return c;
}

}  // namespace

int device_count() { return counted().count; }

std::string device_count_problem() { return counted().problem; }

size_t device_memory_bytes(int device_index) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device_index) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return prop.totalGlobalMem;
}

size_t device_shared_memory_per_block(int device_index) {
  int optin = 0;
  if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device_index) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return static_cast<size_t>(optin);
}

std::string device_uuid(int device_index) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device_index) != cudaSuccess) {
    (void)cudaGetLastError();
    return "";
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "GPU-";
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out += '-';
    const auto byte = static_cast<unsigned char>(prop.uuid.bytes[i]);
    out += kHex[byte >> 4];
    out += kHex[byte & 15];
  }
  return out;
}

// Tensor::to / copy_from / fill_zero are synchronous with respect to every
// stream: the contexts' streams are non-blocking, so the legacy stream that
// cudaMemcpy and cudaMemset use would not wait for an op still writing the
// memory, nor would an op wait for the fill. Hence a device sync before and
// after: correct anywhere, and kept off the training step's hot path, which
// moves data with ops on its context's stream.
void copy(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  CUDA_CHECK(cudaSetDevice(dst_device.is_host() ? src_device.index : dst_device.index));
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
  CUDA_CHECK(cudaDeviceSynchronize());
}

void copy_on(void* dst, const void* src, size_t bytes, void* stream, bool wait_stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s));
  if (wait_stream) CUDA_CHECK(cudaStreamSynchronize(s));
}

void fill_zero(void* dst, size_t bytes, int device_index) {
  CUDA_CHECK(cudaSetDevice(device_index));
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaMemset(dst, 0, bytes));
  CUDA_CHECK(cudaDeviceSynchronize());
}

void fill_zero_on(void* dst, size_t bytes, void* stream) {
  CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, static_cast<cudaStream_t>(stream)));
}

}  // namespace origami::cuda

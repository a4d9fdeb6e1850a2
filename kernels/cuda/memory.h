// The CUDA backend's memory primitives (kernels/cuda/memory.cpp): device
// memory for the tracked allocator, copies between any two devices, fills,
// and the device count. Declared in every build, defined only when
// ORIGAMI_WITH_CUDA; host code calls them only behind that macro.
#pragma once
#include <cstddef>
#include <string>

#include "kernels/allocator.h"
#include "kernels/device.h"

namespace origami::cuda {

// cudaMalloc / cudaFree on the given device.
MemorySource device_memory_source();
// Visible CUDA devices; 0 when there is no driver or no device (never fails).
int device_count();
// Why device_count() is 0: "" when it is not, else what cudaGetDeviceCount
// said ("cudaErrorNoDevice: no CUDA-capable device is detected", a driver
// too old for the runtime, ...): a driver that does not start must not read
// as a machine without a GPU.
std::string device_count_problem();
// Total memory of device `device_index` in bytes; 0 when it cannot be asked.
size_t device_memory_bytes(int device_index);
// The most shared memory one block may opt in to on the device, in bytes;
// 0 when it cannot be asked.
size_t device_shared_memory_per_block(int device_index);
// The device's UUID as nvidia-smi prints it ("GPU-xxxxxxxx-xxxx-..."): one
// physical GPU has one, whichever index CUDA_VISIBLE_DEVICES gives it in a
// process; "" when it cannot be asked.
std::string device_uuid(int device_index);
// Synchronous copy of `bytes` between host and/or device memory
// (cudaMemcpyDefault: unified addressing tells the directions apart).
void copy(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);
// Copy of `bytes` queued on `stream` (a cudaStream_t, any directions); with
// `wait_stream` the host then waits for that stream (not the device).
void copy_on(void* dst, const void* src, size_t bytes, void* stream, bool wait_stream);
// Synchronous zero fill of device memory.
void fill_zero(void* dst, size_t bytes, int device_index);
// Zero fill queued on `stream` (a cudaStream_t): ordered with that stream's
// ops, no synchronization.
void fill_zero_on(void* dst, size_t bytes, void* stream);

}  // namespace origami::cuda

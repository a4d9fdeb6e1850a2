// Devices: where a tensor's memory lives and where an op runs (cpu, cuda:N).
// The CPU build knows only the host; a CUDA build adds cuda:N, N < the
// visible device count.
#pragma once
#include <cstddef>
#include <string>

namespace origami {

enum class DeviceKind : int { cpu, cuda };

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;
  static Device cpu() { return {}; }
  static Device cuda(int index) { return {DeviceKind::cuda, index}; }
  bool is_host() const { return kind == DeviceKind::cpu; }
  bool operator==(const Device&) const = default;
};

// "cpu" or "cuda:N".
std::string to_string(Device d);

// True when this binary was built with the CUDA backend (ORIGAMI_WITH_CUDA).
bool built_with_cuda();
// CUDA devices this process can use: 0 without the backend, a driver or a
// device.
int cuda_device_count();
// Total memory of CUDA device `index` in bytes; 0 without the backend or the
// device.
size_t cuda_device_memory(int index);

}  // namespace origami

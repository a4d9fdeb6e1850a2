// Device names and what this build and machine offer.
#include "kernels/device.h"

#include <algorithm>
#include <cstdlib>

#include "kernels/check.h"
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

std::string cuda_unavailable_reason() {
#if ORIGAMI_WITH_CUDA
  return cuda::device_count_problem();
#else
  return "this origami was built without the CUDA backend";
#endif
}

size_t cuda_device_memory(int index) {
#if ORIGAMI_WITH_CUDA
  if (index >= 0 && index < cuda_device_count()) return cuda::device_memory_bytes(index);
#endif
  (void)index;
  return 0;
}

size_t cuda_device_shared_memory_per_block(int index) {
#if ORIGAMI_WITH_CUDA
  if (index >= 0 && index < cuda_device_count()) return cuda::device_shared_memory_per_block(index);
#endif
  (void)index;
  return 0;
}

std::string cuda_device_uuid(int index) {
#if ORIGAMI_WITH_CUDA
  if (index >= 0 && index < cuda_device_count()) return cuda::device_uuid(index);
#endif
  (void)index;
  return "";
}

int launcher_world_size() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"})
    if (const char* v = std::getenv(var); v && *v) return std::max(0, std::atoi(v));
  return 0;
}

std::string choose_cuda_module_loading() {
  if (const char* user = std::getenv("CUDA_MODULE_LOADING"); user && *user) return user;
  const bool launched = launcher_world_size() > 0 || std::getenv("PMIX_RANK") || std::getenv("PMI_RANK");
  if (!launched || launcher_world_size() == 1) return "";
  ORIGAMI_CHECK(setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0) == 0, "setenv CUDA_MODULE_LOADING");
  return "EAGER";
}

std::string choose_cuda_device_max_connections() {
  if (const char* user = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS"); user && *user) return user;
  const bool launched = launcher_world_size() > 0 || std::getenv("PMIX_RANK") || std::getenv("PMI_RANK");
  if (!launched || launcher_world_size() == 1) return "";
  ORIGAMI_CHECK(setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0) == 0,
                "setenv CUDA_DEVICE_MAX_CONNECTIONS");
  return "32";
}

std::string cuda_stream_serialization_rule(const char* max_connections, const char* launch_order_implicit,
                                           bool point_to_point_channels) {
  if (!point_to_point_channels) return "";
  auto is_one = [](const char* v) {
    if (!v) return false;
    std::string t(v);
    t.erase(0, t.find_first_not_of(" \t"));
    t.erase(t.find_last_not_of(" \t") + 1);
    return t == "1";
  };
  if (is_one(max_connections))
    return "CUDA_DEVICE_MAX_CONNECTIONS=1 gives the GPU one hardware queue for every stream";
  if (is_one(launch_order_implicit))
    return "NCCL_LAUNCH_ORDER_IMPLICIT=1 runs each NCCL kernel only after the one launched before it";
  return "";
}

}  // namespace origami

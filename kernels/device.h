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
// Why cuda_device_count() is 0, for messages: "" when it is not; without the
// backend, that; else what the CUDA runtime said (no device, a driver that
// does not start or does not match the runtime).
std::string cuda_unavailable_reason();
// Total memory of CUDA device `index` in bytes; 0 without the backend or the
// device.
size_t cuda_device_memory(int index);
// The most shared memory a block may opt in to on CUDA device `index`, in
// bytes (227 KiB on Hopper); 0 without the backend or the device.
size_t cuda_device_shared_memory_per_block(int index);
// The UUID of CUDA device `index` (one per physical GPU, the same in every
// process however CUDA_VISIBLE_DEVICES numbers it); "" without the backend or
// the device.
std::string cuda_device_uuid(int index);

// Ranks in this job as its launcher tells them (OMPI_COMM_WORLD_SIZE, PMI_SIZE,
// srun's SLURM_STEP_NUM_TASKS, the first set), before MPI starts; 0 when no
// launcher says. (Not SLURM_NTASKS: a batch script's own processes have it.)
int launcher_world_size();

// Sets CUDA_MODULE_LOADING=EAGER in this process's environment when the job
// has more than one rank (or a launcher that does not say how many) and the
// user has not chosen a mode; returns the mode in effect ("" for the driver's
// default, lazy). Call it first thing in main: the driver reads the variable
// once, when CUDA starts, and MPI_Init may start it.
//
// Why: with lazy loading (CUDA's default since 12.2) a kernel's module loads
// at its first launch, and the load may wait for the whole device to go idle
// (CUDA Programming Guide, "Lazy Loading: Potential Hazards"). A rank whose
// NCCL receive is already spinning on the device, waiting for a peer that
// needs this rank's next kernel first — pipeline stages post their
// receives ahead of compute — would wait forever at step 1 (or later, at a
// cuBLAS algorithm's first use). Eager loading puts every load at start-up,
// before any NCCL op exists. One rank issues no NCCL op, and keeps the
// lazy default's faster start and smaller context.
std::string choose_cuda_module_loading();

// Sets CUDA_DEVICE_MAX_CONNECTIONS=32 (the driver's most) under the same
// condition as choose_cuda_module_loading, unless the user set it; returns the
// value in effect ("" for the driver's default, 8). Call it first thing in main.
//
// Why: the device runs each hardware work queue in order, and with more
// streams than queues streams share one. A rank holds a compute stream, one
// stream per NCCL communicator and one per pipeline or ring-attention
// channel, well over the default 8. A receive posted ahead that waits behind
// an earlier receive of its channel then holds up whatever stream shares its
// queue; if that is the compute stream whose output the peer needs first, the
// two ranks wait on each other (NCCL gives no guarantee that two streams
// progress independently). More queues make the sharing less likely; a user's
// 1 makes it certain, which cuda_stream_serialization_rule refuses.
std::string choose_cuda_device_max_connections();

// The rule broken when a multi-rank CUDA job's pipeline or ring attention
// (pp > 1, or cp > 1 with cp_comm ring, over NCCL's point-to-point channels)
// would run on a device whose streams are serialised, or "": given the values
// of CUDA_DEVICE_MAX_CONNECTIONS and NCCL_LAUNCH_ORDER_IMPLICIT (nullptr when
// unset). One hardware queue (Megatron's CUDA_DEVICE_MAX_CONNECTIONS=1 for its
// TP overlap) or NCCL's implicit launch order puts a receive posted ahead in
// front of the compute its peer waits for: a deadlock at the first step.
std::string cuda_stream_serialization_rule(const char* max_connections, const char* launch_order_implicit,
                                           bool point_to_point_channels);

}  // namespace origami

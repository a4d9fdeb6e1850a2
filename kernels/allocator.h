// Tracked allocators and the measured memory ledger (ARCHITECTURE.md §2).
// One allocator per device, reached through the device
// (TrackedAllocator::of): the host one always, one per CUDA device in a CUDA
// build. Every buffer is tagged with a ledger category; each allocator keeps
// current and peak bytes per category for its device in this process (one
// process = one rank). Invariant: current[c] equals the sum of live buffer
// sizes tagged c on that device.
// Large freed blocks are cached and reused: a training step allocates the
// same activation shapes every micro-batch, and handing them back (to the
// OS, or to cudaFree, which synchronizes the device) would cost a page fault
// per 4 KiB on every step (measured: ~15% of a bench-dense step). A request
// takes the smallest cached block that holds it with at most 12.5% to
// spare; else the source gives a block of its size rounded up to a class
// (eight per power of two, at most 2 MiB apart: a buffer of gigabytes
// wastes at most 2 MiB). The dispatcher's buffers follow the routing, a new
// size every micro-batch: cached by exact size they never met a block
// again, faulted fresh pages each time (np 4 EP 4 tiny-moe, all four ranks:
// 15k page faults a step, ~3.5k now) and piled up in the cache for the
// whole run; with classes they meet blocks of a bounded set of sizes.
// When the source refuses an allocation, the smallest cached block that
// holds the request serves it, whatever it wastes; failing that, the cache
// goes back to the source and the allocation is tried once more — except on
// a GPU while communication is in flight there (holds, below), where
// cudaFree would wait for ops that may wait for this rank. An allocation
// that still fails ends the job as out of memory (exit kExitUserError: the
// settings must change) with the rank's ledger and, when the cache stayed,
// the oldest op in flight. Cached bytes are reported apart from the
// ledger, which counts live tensors (requested bytes) only.
// Holds: a range of memory an operation in flight still reads or writes
// (every device communication op until the host sees it complete or hands it
// to the compute stream; host ops under the communicators' in-flight check,
// comm/in_flight_check.h) may be held;
// releasing a buffer that overlaps a held range is an internal error naming
// the holder. On a GPU the cache hands a freed block out again at once, so
// a buffer freed under a communication op in flight would be overwritten
// while the op still moves it; the holds find such a free on the host.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>

#include "kernels/device.h"

namespace origami {

enum class MemCategory : int { param = 0, grad, optim, activation, comm, workspace };
inline constexpr int kNumMemCategories = 6;
std::string_view to_string(MemCategory c);

struct LedgerSnapshot {
  std::array<int64_t, kNumMemCategories> current{};
  std::array<int64_t, kNumMemCategories> peak{};
  int64_t current_total = 0;
  int64_t peak_total = 0;  // peak of the sum, not the sum of peaks
  int64_t cached = 0;      // freed blocks held for reuse (not in any category)
};

// Where an allocator's bytes come from: aligned host memory, or cudaMalloc on
// one device (kernels/cuda/memory.cpp).
struct MemorySource {
  void* (*allocate)(size_t bytes, int device_index) = nullptr;  // null on failure
  void (*release)(void* ptr, int device_index) = nullptr;
};

class TrackedAllocator {
 public:
  TrackedAllocator(Device device, MemorySource source);
  ~TrackedAllocator();
  TrackedAllocator(const TrackedAllocator&) = delete;
  TrackedAllocator& operator=(const TrackedAllocator&) = delete;

  // Host allocations are 64-byte aligned (one cache line, an AVX-512
  // vector); CUDA ones 256-byte (cudaMalloc's own).
  void* allocate(size_t bytes, MemCategory category);
  void release(void* ptr, size_t bytes, MemCategory category);
  LedgerSnapshot snapshot() const;
  // Peaks restart from the current values (per-step peak activation, say).
  void reset_peaks();
  // Returns every cached block to its source.
  void release_cached();
  // Marks [ptr, ptr + bytes) as in use by `holder` (named in the error a
  // release of an overlapping buffer raises) until unhold(id). Ranges of
  // several holds may overlap; zero bytes hold nothing.
  int64_t hold(const void* ptr, size_t bytes, std::string holder);
  void unhold(int64_t id);
  Device device() const { return device_; }

  // The allocator of `device`: the process's host allocator for cpu; for
  // cuda:N, that device's (created on first use). A CUDA device in a CPU
  // build, or past the device count, is an internal error naming it.
  // Allocators own no model state, only byte counts.
  static TrackedAllocator& of(Device device);
  static TrackedAllocator& host() { return of(Device::cpu()); }

 private:
  Device device_;
  MemorySource source_;
  mutable std::mutex mu_;
  LedgerSnapshot ledger_;
  void release_cached_locked();
  [[noreturn]] void fail_out_of_memory_locked(size_t bytes, MemCategory category, const std::string& cache_note);
  std::multimap<size_t, void*> cache_;         // block bytes -> free block
  std::unordered_map<void*, size_t> blocks_;  // live cached-size block -> its bytes
  struct Held {
    uintptr_t begin = 0, end = 0;
    std::string holder;
  };
  std::map<int64_t, Held> holds_;  // by id
  int64_t next_hold_ = 0;
};

}  // namespace origami

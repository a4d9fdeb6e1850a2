// Tracked allocator and the measured memory ledger (ARCHITECTURE.md §2).
// Every buffer is tagged with a ledger category; the allocator keeps current
// and peak bytes per category for this process (one process = one rank).
// Invariant: current[c] equals the sum of live buffer sizes tagged c.
// Large freed blocks are cached by exact size and reused: a training step
// allocates the same activation shapes every micro-batch, and handing them
// back to the OS would cost a page fault per 4 KiB on every step (measured:
// ~15% of a bench-dense step). Cached bytes are reported apart from the
// ledger, which counts live tensors only.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string_view>
#include <unordered_map>

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

class TrackedAllocator {
 public:
  // Host allocations are 64-byte aligned (one cache line, an AVX-512 vector).
  void* allocate_host(size_t bytes, MemCategory category);
  void release_host(void* ptr, size_t bytes, MemCategory category);
  LedgerSnapshot snapshot() const;
  // Peaks restart from the current values (per-step peak activation, say).
  void reset_peaks();
  // Returns every cached block to the system.
  void release_cached();
  ~TrackedAllocator();

  // The process's allocator. Tensors allocate through it; it owns no model
  // state, only byte counts.
  static TrackedAllocator& host();

 private:
  mutable std::mutex mu_;
  LedgerSnapshot ledger_;
  std::unordered_multimap<size_t, void*> cache_;  // rounded size -> free block
};

}  // namespace origami

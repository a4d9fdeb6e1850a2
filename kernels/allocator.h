// Tracked allocator and the measured memory ledger (ARCHITECTURE.md §2).
// Every buffer is tagged with a ledger category; the allocator keeps current
// and peak bytes per category for this process (one process = one rank).
// Invariant: current[c] equals the sum of live buffer sizes tagged c.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string_view>

namespace origami {

enum class MemCategory : int { param = 0, grad, optim, activation, comm, workspace };
inline constexpr int kNumMemCategories = 6;
std::string_view to_string(MemCategory c);

struct LedgerSnapshot {
  std::array<int64_t, kNumMemCategories> current{};
  std::array<int64_t, kNumMemCategories> peak{};
  int64_t current_total = 0;
  int64_t peak_total = 0;  // peak of the sum, not the sum of peaks
};

class TrackedAllocator {
 public:
  // Host allocations are 64-byte aligned (one cache line, an AVX-512 vector).
  void* allocate_host(size_t bytes, MemCategory category);
  void release_host(void* ptr, size_t bytes, MemCategory category);
  LedgerSnapshot snapshot() const;
  // Peaks restart from the current values (per-step peak activation, say).
  void reset_peaks();

  // The process's allocator. Tensors allocate through it; it owns no model
  // state, only byte counts.
  static TrackedAllocator& host();

 private:
  mutable std::mutex mu_;
  LedgerSnapshot ledger_;
};

}  // namespace origami

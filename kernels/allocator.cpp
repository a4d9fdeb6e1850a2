// Tracked host allocator: aligned allocations with per-category byte counts.
#include "kernels/allocator.h"

#include <cstdlib>
#include <new>

#include "kernels/check.h"

namespace origami {

std::string_view to_string(MemCategory c) {
  switch (c) {
    case MemCategory::param: return "param";
    case MemCategory::grad: return "grad";
    case MemCategory::optim: return "optim";
    case MemCategory::activation: return "activation";
    case MemCategory::comm: return "comm";
    case MemCategory::workspace: return "workspace";
  }
  return "?";
}

void* TrackedAllocator::allocate_host(size_t bytes, MemCategory category) {
  constexpr size_t kAlign = 64;
  size_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
  void* ptr = rounded == 0 ? nullptr : std::aligned_alloc(kAlign, rounded);
  ORIGAMI_CHECK(rounded == 0 || ptr != nullptr, "host allocation of ", bytes, " bytes (", to_string(category),
                ") failed");
  std::lock_guard<std::mutex> lock(mu_);
  int c = static_cast<int>(category);
  ledger_.current[c] += static_cast<int64_t>(bytes);
  ledger_.current_total += static_cast<int64_t>(bytes);
  if (ledger_.current[c] > ledger_.peak[c]) ledger_.peak[c] = ledger_.current[c];
  if (ledger_.current_total > ledger_.peak_total) ledger_.peak_total = ledger_.current_total;
  return ptr;
}

void TrackedAllocator::release_host(void* ptr, size_t bytes, MemCategory category) {
  std::free(ptr);
  std::lock_guard<std::mutex> lock(mu_);
  int c = static_cast<int>(category);
  ledger_.current[c] -= static_cast<int64_t>(bytes);
  ledger_.current_total -= static_cast<int64_t>(bytes);
  ORIGAMI_CHECK(ledger_.current[c] >= 0, "ledger underflow in ", to_string(category));
}

LedgerSnapshot TrackedAllocator::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ledger_;
}

void TrackedAllocator::reset_peaks() {
  std::lock_guard<std::mutex> lock(mu_);
  ledger_.peak = ledger_.current;
  ledger_.peak_total = ledger_.current_total;
}

TrackedAllocator& TrackedAllocator::host() {
  static TrackedAllocator allocator;
  return allocator;
}

}  // namespace origami

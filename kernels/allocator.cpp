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

namespace {
constexpr size_t kAlign = 64;
// Blocks from this size up are cached on free; smaller ones go straight back
// to malloc, which already recycles them without page faults.
constexpr size_t kCacheMinBytes = size_t{64} << 10;
size_t round_up(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }
}  // namespace

void* TrackedAllocator::allocate_host(size_t bytes, MemCategory category) {
  const size_t rounded = round_up(bytes);
  void* ptr = nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  if (rounded >= kCacheMinBytes) {
    auto it = cache_.find(rounded);
    if (it != cache_.end()) {
      ptr = it->second;
      cache_.erase(it);
      ledger_.cached -= static_cast<int64_t>(rounded);
    }
  }
  if (ptr == nullptr && rounded > 0) {
    ptr = std::aligned_alloc(kAlign, rounded);
    ORIGAMI_CHECK(ptr != nullptr, "host allocation of ", bytes, " bytes (", to_string(category), ") failed");
  }
  int c = static_cast<int>(category);
  ledger_.current[c] += static_cast<int64_t>(bytes);
  ledger_.current_total += static_cast<int64_t>(bytes);
  if (ledger_.current[c] > ledger_.peak[c]) ledger_.peak[c] = ledger_.current[c];
  if (ledger_.current_total > ledger_.peak_total) ledger_.peak_total = ledger_.current_total;
  return ptr;
}

void TrackedAllocator::release_host(void* ptr, size_t bytes, MemCategory category) {
  const size_t rounded = round_up(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  if (ptr != nullptr && rounded >= kCacheMinBytes) {
    cache_.emplace(rounded, ptr);
    ledger_.cached += static_cast<int64_t>(rounded);
  } else {
    std::free(ptr);
  }
  int c = static_cast<int>(category);
  ledger_.current[c] -= static_cast<int64_t>(bytes);
  ledger_.current_total -= static_cast<int64_t>(bytes);
  ORIGAMI_CHECK(ledger_.current[c] >= 0, "ledger underflow in ", to_string(category));
}

void TrackedAllocator::release_cached() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [size, ptr] : cache_) std::free(ptr);
  cache_.clear();
  ledger_.cached = 0;
}

TrackedAllocator::~TrackedAllocator() { release_cached(); }

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

// Tracked allocators: per-device byte counts over a memory source (host
// aligned_alloc here; cudaMalloc in kernels/cuda/memory.cpp).
#include "kernels/allocator.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstdlib>
#include <memory>

#include "kernels/check.h"
#include "kernels/cuda/memory.h"

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

// Blocks from this size up are cached on free; smaller host ones go straight
// back to malloc, which already recycles them without page faults.
constexpr size_t kCacheMinBytes = size_t{64} << 10;

size_t alignment_of(Device d) { return d.is_host() ? 64 : 256; }
size_t round_up(size_t bytes, size_t align) { return (bytes + align - 1) / align * align; }

// The bytes the source gives for an aligned request from kCacheMinBytes up
// (allocator.h): the next of eight steps per power of two, steps of at most
// 2 MiB.
size_t block_bytes(size_t aligned) {
  return round_up(aligned, std::min(std::bit_floor(aligned) / 8, size_t{2} << 20));
}

void* host_allocate(size_t bytes, int) { return std::aligned_alloc(64, bytes); }
void host_release(void* ptr, int) { std::free(ptr); }

}  // namespace

TrackedAllocator::TrackedAllocator(Device device, MemorySource source) : device_(device), source_(source) {}

void* TrackedAllocator::allocate(size_t bytes, MemCategory category) {
  const size_t rounded = round_up(bytes, alignment_of(device_));
  const bool cached = rounded >= kCacheMinBytes || !device_.is_host();
  void* ptr = nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  if (cached) {
    auto it = cache_.lower_bound(rounded);  // the smallest block that holds it
    if (it != cache_.end() && it->first <= rounded + rounded / 8) {
      ptr = it->second;
      blocks_.emplace(ptr, it->first);
      ledger_.cached -= static_cast<int64_t>(it->first);
      cache_.erase(it);
    }
  }
  if (ptr == nullptr && rounded > 0) {
    size_t block = rounded >= kCacheMinBytes ? block_bytes(rounded) : rounded;
    ptr = source_.allocate(block, device_.index);
    if (ptr == nullptr && cached) {
      // The source is full: a cached block that holds the request serves it
      // however much it wastes, before any cached memory goes back.
      auto it = cache_.lower_bound(rounded);
      if (it != cache_.end()) {
        ptr = it->second;
        block = it->first;
        ledger_.cached -= static_cast<int64_t>(block);
        cache_.erase(it);
      }
    }
    if (ptr == nullptr && !cache_.empty()) {
      // cudaFree waits for all work on the device, communication kernels
      // included, and an op in flight may wait on this rank's next moves (a
      // pipeline receive posted ahead waits for the peer, which waits for the
      // activation this rank has yet to send): with device communication in
      // flight the cache stays, and the job ends out of memory naming an op.
      if (!device_.is_host() && !holds_.empty())
        fail_out_of_memory_locked(
            bytes, category,
            detail::concat(" in smaller blocks, which cannot go back to CUDA while communication is in flight on ",
                           holds_.size(), " held range(s), the oldest ", holds_.begin()->second.holder,
                           " (cudaFree would wait for it, and it may wait for this rank)"));
      release_cached_locked();
      ptr = source_.allocate(block, device_.index);
    }
    if (ptr == nullptr) fail_out_of_memory_locked(bytes, category, "");
    if (cached) blocks_.emplace(ptr, block);
  }
  int c = static_cast<int>(category);
  ledger_.current[c] += static_cast<int64_t>(bytes);
  ledger_.current_total += static_cast<int64_t>(bytes);
  if (ledger_.current[c] > ledger_.peak[c]) ledger_.peak[c] = ledger_.current[c];
  if (ledger_.current_total > ledger_.peak_total) ledger_.peak_total = ledger_.current_total;
  return ptr;
}

// Running out of memory is the settings' doing, not a bug: the job ends at
// once (a rank's unwinding could wait on its peers' collectives) with the
// user-error status and the rank's ledger.
void TrackedAllocator::fail_out_of_memory_locked(size_t bytes, MemCategory category, const std::string& cache_note) {
  std::string live;
  for (int c = 0; c < kNumMemCategories; ++c)
    live += detail::concat(c ? ", " : "", to_string(static_cast<MemCategory>(c)), " ", ledger_.current[c]);
  abort_job(kExitUserError,
            detail::concat("error [rank ", world_rank_for_diagnostics(), "]: out of memory on ", to_string(device_),
                           ": an allocation of ", bytes, " bytes (", to_string(category), ") failed with ",
                           ledger_.current_total, " bytes live (", live, ") and ", ledger_.cached, " cached",
                           cache_note,
                           "; the run needs less memory per rank: a smaller training.micro_batch, "
                           "training.recompute, a higher parallel.zero_stage or more ranks (origami plan "
                           "estimates each layout's peak)"));
}

void TrackedAllocator::release(void* ptr, size_t bytes, MemCategory category) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto begin = reinterpret_cast<uintptr_t>(ptr), end = begin + bytes;
  for (const auto& [id, h] : holds_)
    ORIGAMI_CHECK(end <= h.begin || h.end <= begin, to_string(device_), " buffer of ", bytes, " bytes (",
                  to_string(category), ") freed while ", h.holder,
                  " was in flight on it (free a buffer only after its op completes: wait, or complete for the stream)");
  if (ptr != nullptr) {
    const auto block = blocks_.find(ptr);
    if (block != blocks_.end()) {
      cache_.emplace(block->second, ptr);
      ledger_.cached += static_cast<int64_t>(block->second);
      blocks_.erase(block);
    } else {
      source_.release(ptr, device_.index);
    }
  }
  int c = static_cast<int>(category);
  ledger_.current[c] -= static_cast<int64_t>(bytes);
  ledger_.current_total -= static_cast<int64_t>(bytes);
  ORIGAMI_CHECK(ledger_.current[c] >= 0, "ledger underflow in ", to_string(category), " on ", to_string(device_));
}

int64_t TrackedAllocator::hold(const void* ptr, size_t bytes, std::string holder) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t id = next_hold_++;
  if (bytes > 0) {
    const auto begin = reinterpret_cast<uintptr_t>(ptr);
    holds_.emplace(id, Held{begin, begin + bytes, std::move(holder)});
  }
  return id;
}

void TrackedAllocator::unhold(int64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  holds_.erase(id);
}

void TrackedAllocator::release_cached() {
  std::lock_guard<std::mutex> lock(mu_);
  release_cached_locked();
}

void TrackedAllocator::release_cached_locked() {
  for (auto& [size, ptr] : cache_) source_.release(ptr, device_.index);
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

TrackedAllocator& TrackedAllocator::of(Device device) {
  if (device.is_host()) {
    static TrackedAllocator host_allocator(Device::cpu(), MemorySource{host_allocate, host_release});
    return host_allocator;
  }
  // Device allocators live as long as the process; they are created under a
  // lock on first use so that no CUDA call happens in a CPU-only run.
  constexpr int kMaxDevices = 64;
  static std::mutex mu;
  static std::array<std::unique_ptr<TrackedAllocator>, kMaxDevices> device_allocators;
  ORIGAMI_CHECK(built_with_cuda(), "an allocation on ", to_string(device), ": built without CUDA");
  ORIGAMI_CHECK(device.index >= 0 && device.index < cuda_device_count() && device.index < kMaxDevices,
                "an allocation on ", to_string(device), " but this process sees ", cuda_device_count(),
                " CUDA device(s)");
  std::lock_guard<std::mutex> lock(mu);
  std::unique_ptr<TrackedAllocator>& a = device_allocators[device.index];
#if ORIGAMI_WITH_CUDA
  if (!a) a = std::make_unique<TrackedAllocator>(device, cuda::device_memory_source());
#endif
  return *a;
}

}  // namespace origami

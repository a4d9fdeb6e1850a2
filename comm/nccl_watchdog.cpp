// The NCCL backend's call scope, bounded abort and watchdog (nccl_watchdog.h).
#include "comm/communicator.h"

#if ORIGAMI_WITH_NCCL
#include "comm/nccl_watchdog.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <future>

namespace origami::comm::nccl {

namespace {

std::atomic<bool> nccl_aborting{false};
std::shared_mutex& nccl_calls() {
  static std::shared_mutex m;
  return m;
}
[[noreturn]] void park_forever() {
  for (;;) ::pause();
}

std::mutex& instance_mutex() {
  static std::mutex m;
  return m;
}
std::unique_ptr<Watchdog>& instance() {
  static std::unique_ptr<Watchdog> w;
  return w;
}
int& users() {
  static int n = 0;
  return n;
}

}  // namespace

NcclCallScope::NcclCallScope() : lock_(nccl_calls()) {
  if (nccl_aborting.load()) {
    lock_.unlock();
    park_forever();
  }
}

// It frees the communicator's device memory, and cudaFree waits for every
// kernel on the device: a kernel of another communicator spinning on the
// same dead peer, or a compute stream stuck in front of the op, would keep
// it, and the job, from ever ending; so would a thread stuck inside an NCCL
// call, which keeps its scope. The process exits right after, which ends
// its kernels anyway; the abort only lets NCCL stop its own first.
void abort_nccl_comm_bounded(ncclComm_t comm) {
  if (nccl_aborting.exchange(true)) park_forever();  // another thread aborts the job
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> aborted = done->get_future();
  std::thread([comm, done] {
    std::unique_lock<std::shared_mutex> alone(nccl_calls());  // no call is inside the communicator
    ncclCommAbort(comm);
    done->set_value();
  }).detach();
  (void)aborted.wait_for(std::chrono::seconds(2));
}

ncclResult_t poll_async_error(ncclComm_t comm, ncclResult_t simulated, ncclResult_t* async) {
  const NcclCallScope scope;  // ends before an abort, which needs the calls alone
  const ncclResult_t rc = ncclCommGetAsyncError(comm, async);
  if (rc == ncclSuccess && simulated != ncclSuccess) *async = simulated;
  return rc;
}

void Watchdog::attach() {
  std::lock_guard<std::mutex> lock(instance_mutex());
  if (users()++ == 0) instance() = std::make_unique<Watchdog>();
}
void Watchdog::detach(const void* owner) {
  std::lock_guard<std::mutex> lock(instance_mutex());
  instance()->forget(owner);
  if (--users() == 0) instance().reset();
}
void Watchdog::watch(Entry e) {
  std::lock_guard<std::mutex> lock(instance_mutex());
  instance()->add(std::move(e));
}

uint64_t Watchdog::enter_call(Entry e) {
  std::lock_guard<std::mutex> lock(instance_mutex());
  Watchdog& w = *instance();
  std::lock_guard<std::mutex> entries(w.mutex_);
  e.done = nullptr;
  e.call = w.next_call_++;
  e.issued = std::chrono::steady_clock::now();
  const uint64_t call = e.call;
  w.entries_.push_back(std::move(e));
  return call;
}
void Watchdog::leave_call(uint64_t call) {
  std::lock_guard<std::mutex> lock(instance_mutex());
  Watchdog& w = *instance();
  std::lock_guard<std::mutex> entries(w.mutex_);
  std::erase_if(w.entries_, [&](const Entry& e) { return e.call == call; });
}

Watchdog::Watchdog() : thread_([this] { run(); }) {}
Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
  for (Entry& e : entries_)
    if (e.done) cudaEventDestroy(e.done);
}

void Watchdog::add(Entry e) {
  std::lock_guard<std::mutex> lock(mutex_);
  entries_.push_back(std::move(e));
}

void Watchdog::forget(const void* owner) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::erase_if(entries_, [&](Entry& e) {
    if (e.owner != owner) return false;
    if (e.done) cudaEventDestroy(e.done);
    return true;
  });
}

// The message goes out first: an abort that stalls must not swallow it.
void Watchdog::fail(const Entry& e, const char* what, int exit_status) {
  std::fprintf(stderr, "[rank %d] %s: group %s op %s%s seq %lld bytes %lld%s\n", world_rank_for_diagnostics(),
               exit_status == kExitTimeout ? "collective timeout (NCCL watchdog)" : "NCCL error (watchdog)",
               e.group.c_str(), std::string(op_name(e.op)).c_str(), e.peer_note.c_str(), static_cast<long long>(e.seq),
               static_cast<long long>(e.bytes), what);
  std::fflush(stderr);
  abort_nccl_comm_bounded(e.comm);
  abort_job(exit_status, "");
}

void Watchdog::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  RunningClock running;
  while (!stop_) {
    wake_.wait_for(lock, std::chrono::milliseconds(100));
    const auto now = std::chrono::steady_clock::now();
    // Time the process did not run (a suspended job) is no op's waiting.
    if (const auto gap = running.poll_gap(now); gap.count() > 0)
      for (Entry& e : entries_) e.issued += gap;
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (int current = -1; cudaGetDevice(&current) != cudaSuccess || current != it->device) cudaSetDevice(it->device);
      // An op's entry goes once its stream has passed it; a host call's when
      // the call returns (leave_call).
      const cudaError_t rc = it->done ? cudaEventQuery(it->done) : cudaErrorNotReady;
      if (rc != cudaErrorNotReady) {  // done, or an error the main thread reports at its next CUDA call
        cudaEventDestroy(it->done);
        it = entries_.erase(it);
        continue;
      }
      // A failed peer or network shows first as NCCL's asynchronous error
      // (thread-safe to poll from here, as ncclCommAbort is).
      ncclResult_t async = ncclSuccess;
      if (poll_async_error(it->comm, it->simulated, &async) == ncclSuccess && is_failure(async)) {
        const std::string why = origami::detail::concat(
            ": ", ncclGetErrorString(async), " (",
            it->simulated != ncclSuccess ? "simulated: CommOptions::simulated_nccl_error" : ncclGetLastError(it->comm),
            ")");
        fail(*it, why.c_str(), kExitInternal);
      }
      const double waited = std::chrono::duration<double>(now - it->issued).count();
      if (waited > it->timeout_s) {
        char why[160];
        if (it->done)
          std::snprintf(why, sizeof why, " not done %.1f s after it was issued", waited);
        else
          std::snprintf(why, sizeof why,
                        " still being issued after %.1f s (the host inside NCCL's call: a peer that never made "
                        "its own, while NCCL connects them)",
                        waited);
        fail(*it, why, kExitTimeout);
      }
      ++it;
    }
  }
}

}  // namespace origami::comm::nccl

#endif  // ORIGAMI_WITH_NCCL

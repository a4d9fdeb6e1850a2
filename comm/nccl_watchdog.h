// The NCCL backend's safety net, shared by comm/nccl_communicator.cpp and
// nothing else (built only with ORIGAMI_WITH_NCCL):
//  - NcclCallScope: every NCCL call runs inside one; once a thread aborts a
//    communicator (which frees it) no thread enters NCCL again, it parks
//    until the process is gone (abort_job's own rule for a second failing
//    thread).
//  - abort_nccl_comm_bounded: ncclCommAbort on the way out of a failed job,
//    given at most two seconds.
//  - poll_async_error: NCCL's asynchronous error, where a failed peer or
//    network shows first, or the one CommOptions::simulated_nccl_error
//    stands in for (a one-rank world cannot provoke a real one).
//  - Watchdog: a thread that polls every issued op until its stream has
//    passed it, and ends the job naming rank, group, op and sequence on a
//    timeout (exit kExitTimeout) or an asynchronous error (kExitInternal).
//    It also times the host's own NCCL enqueue calls (HostCallWatch): NCCL
//    connects a communicator's peers on its first use of an algorithm or
//    peer, inside that call, which then blocks until each peer reaches its
//    own; a peer that never does would hold the host there for good, before
//    any event exists to poll.
#pragma once
#if ORIGAMI_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"

namespace origami::comm::nccl {

// Holds the NCCL calls shared; an abort holds them alone. A flag checked
// before the call would not do: a thread past the check could still read
// the communicator the abort frees (the main thread's poll in a wait,
// ncclCommGetAsyncError), turning exit status 5 into a segfault.
class NcclCallScope {
 public:
  NcclCallScope();

 private:
  std::shared_lock<std::shared_mutex> lock_;
};

// ncclCommAbort from a helper thread holding the calls alone; the caller
// waits at most two seconds for it. A second caller parks forever (the
// first ends the job).
void abort_nccl_comm_bounded(ncclComm_t comm);

// ncclCommGetAsyncError's own result; when that is ncclSuccess, *async is
// NCCL's asynchronous error for `comm`, or `simulated` in its place when
// that is not ncclSuccess. Takes an NcclCallScope itself: call it outside
// one.
ncclResult_t poll_async_error(ncclComm_t comm, ncclResult_t simulated, ncclResult_t* async);

// An asynchronous error that ends the job (ncclInProgress is a
// nonblocking communicator's "not yet", not an error).
inline bool is_failure(ncclResult_t async) { return async != ncclSuccess && async != ncclInProgress; }

class Watchdog {
 public:
  struct Entry {
    cudaEvent_t done = nullptr;  // recorded after the op on its stream; the watchdog's own (null: a host call)
    uint64_t call = 0;           // a host call's id (HostCallWatch), else 0
    int device = 0;              // the event's
    std::chrono::steady_clock::time_point issued;
    double timeout_s = 0;
    ncclComm_t comm = nullptr;
    ncclResult_t simulated = ncclSuccess;  // CommOptions::simulated_nccl_error
    const void* owner = nullptr;           // the NcclCommunicator
    std::string group;
    CommOp op = CommOp::barrier;
    int64_t seq = 0, bytes = 0;
    std::string peer_note;  // PendingOp::peer_note
  };
  // The communicators' count keeps the thread: started with the first,
  // stopped (joined) with the last.
  static void attach();
  // The owner's entries go (its ops are done: it synchronized its streams).
  static void detach(const void* owner);
  static void watch(Entry e);
  // A host call's entry (e.done null), timed from now until left.
  static uint64_t enter_call(Entry e);
  static void leave_call(uint64_t call);

  Watchdog();
  ~Watchdog();

 private:
  void add(Entry e);
  void forget(const void* owner);
  void run();
  [[noreturn]] void fail(const Entry& e, const char* what, int exit_status);

  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::vector<Entry> entries_;
  uint64_t next_call_ = 1;
  std::thread thread_;  // last: starts once the members above exist
};

// The watchdog's entry for the enqueue calls of one op, for their duration.
class HostCallWatch {
 public:
  explicit HostCallWatch(Watchdog::Entry e) : call_(Watchdog::enter_call(std::move(e))) {}
  ~HostCallWatch() { Watchdog::leave_call(call_); }
  HostCallWatch(const HostCallWatch&) = delete;
  HostCallWatch& operator=(const HostCallWatch&) = delete;

 private:
  uint64_t call_;
};

}  // namespace origami::comm::nccl

#endif  // ORIGAMI_WITH_NCCL

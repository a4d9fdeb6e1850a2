// SetupDeadline: a bound on blocking set-up calls that have no timeout of
// their own — MPI_Comm_split, which waits for every rank of the parent, and
// NCCL's communicator creation, which waits for every member and their
// connections. Held around them, it ends the job from a timer thread (exit
// kExitTimeout) naming this rank and what was being set up, when the guard
// still stands `timeout_s` after it was made: a member that never arrives
// (stuck elsewhere, or its host unreachable) then ends the job as a stuck
// collective does, rather than hanging it before the first step. Released
// (destroyed) in time, it does nothing. `setting` names what sets the
// timeout in the message; `bench comm` bounds its bare MPI calls with it too.
#pragma once
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

namespace origami::comm {

class SetupDeadline {
 public:
  SetupDeadline(double timeout_s, std::string what, std::string kind = "set-up",
                std::string setting = "runtime.collective_timeout_s");
  ~SetupDeadline();
  SetupDeadline(const SetupDeadline&) = delete;
  SetupDeadline& operator=(const SetupDeadline&) = delete;

 private:
  std::mutex mutex_;
  std::condition_variable released_;
  bool done_ = false;
  std::thread timer_;  // last: starts once the members above exist
};

}  // namespace origami::comm

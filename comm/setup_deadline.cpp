// SetupDeadline (setup_deadline.h).
#include "comm/setup_deadline.h"

#include <chrono>
#include <cstdio>

#include "kernels/check.h"

namespace origami::comm {

SetupDeadline::SetupDeadline(double timeout_s, std::string what, std::string kind, std::string setting)
    : timer_([this, timeout_s, what = std::move(what), kind = std::move(kind), setting = std::move(setting)] {
        std::unique_lock<std::mutex> lock(mutex_);
        // In short waits, so that time the job was suspended does not count (RunningClock).
        RunningClock running;
        while (running.seconds() <= timeout_s)
          if (released_.wait_for(lock, std::chrono::milliseconds(100), [this] { return done_; })) return;
        // The message goes out first: the abort must not swallow it.
        std::fprintf(stderr,
                     "[rank %d] %s timeout: %s not done %.1f s after it began (%s): "
                     "a member never joined, or cannot reach the others\n",
                     world_rank_for_diagnostics(), kind.c_str(), what.c_str(), timeout_s, setting.c_str());
        std::fflush(stderr);
        abort_job(kExitTimeout, "");
      }) {}

SetupDeadline::~SetupDeadline() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
  }
  released_.notify_all();
  timer_.join();
}

}  // namespace origami::comm

// Preemption signal handlers (see stop_signals.h).
#include "engine/stop_signals.h"

#include <atomic>

#include "kernels/threads.h"

namespace origami {

namespace {
// Signal handlers can only reach globals.
std::atomic<int> g_stop_signal{0};
// catch_stop_signals_from_start's: whether its note is still to be taken
// over, and the actions it replaced (restored when a StopSignals ends).
bool g_from_start = false;
std::array<struct sigaction, stop_signals().size()> g_original{};
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler's store must be async-signal-safe");
}  // namespace

extern "C" void origami_note_stop_signal(int sig) {
  int none = 0;
  g_stop_signal.compare_exchange_strong(none, sig);  // lock-free: async-signal-safe
}

int first_stop_signal() { return g_stop_signal.load(); }

std::string stop_signal_name(int sig) {
  switch (sig) {
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    case SIGUSR1: return "SIGUSR1";
    case SIGUSR2: return "SIGUSR2";
    default: return "signal " + std::to_string(sig);
  }
}

// SA_RESETHAND: the second signal of a kind finds the default action and
// kills at once. SA_ONSTACK: a signal that lands in oneDNN's JIT GEMM, whose
// rsp points into the heap, must not push its frame there (it corrupted the
// heap about one run in six of the SIGTERM test before); install_signal_stacks
// gives the threads that run kernels the stack to use.
namespace {
void install_note_handlers(std::array<struct sigaction, stop_signals().size()>& old) {
  struct sigaction sa {};
  sa.sa_handler = origami_note_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART | SA_RESETHAND | SA_ONSTACK;
  for (size_t i = 0; i < stop_signals().size(); ++i) sigaction(stop_signals()[i], &sa, &old[i]);
}
}  // namespace

void catch_stop_signals_from_start() {
  g_stop_signal.store(0);
  install_note_handlers(g_original);
  g_from_start = true;
}

StopSignals::StopSignals() {
  if (!g_from_start) g_stop_signal.store(0);
  install_signal_stacks();
  install_note_handlers(old_);
  if (g_from_start) {
    old_ = g_original;  // at the end, the actions before start-up's
    // A signal start-up noted has had its one noting (SA_RESETHAND): its
    // second still kills at once.
    if (const int noted = g_stop_signal.load(); noted != 0) {
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      sigemptyset(&dfl.sa_mask);
      sigaction(noted, &dfl, nullptr);
    }
  }
  g_from_start = false;
}

StopSignals::~StopSignals() {
  for (size_t i = 0; i < stop_signals().size(); ++i) sigaction(stop_signals()[i], &old_[i], nullptr);
}

}  // namespace origami

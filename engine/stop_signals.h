// Preemption signals: which signals stop a run, the handlers a Trainer
// installs for its lifetime, and the first such signal this process got.
// The trainer reads first_stop_signal() once per step and agrees on it with
// every rank, so all stop after the same step (engine/trainer.h).
#pragma once
#include <signal.h>

#include <array>
#include <string>

namespace origami {

// The signals a run treats as preemption: SIGTERM (what schedulers send),
// SIGINT (Ctrl-C), SIGUSR1 and SIGUSR2 (SLURM's --signal=USR1@<s> warning
// before a time limit). Open MPI's mpirun forwards USR1 and USR2 to the
// ranks and sends them TERM on TERM or INT.
inline constexpr std::array<int, 4> stop_signals() { return {SIGTERM, SIGINT, SIGUSR1, SIGUSR2}; }
// "SIGTERM" etc. for one of stop_signals(); "signal N" otherwise.
std::string stop_signal_name(int sig);

// The first of stop_signals() this process received since the last
// StopSignals was installed; 0: none.
int first_stop_signal();

// Installs the preemption handlers for the process's start-up (before MPI_Init,
// which on a large job waits for every rank): a scheduler's signal in that
// window is noted, for the first StopSignals to act on, instead of killing
// the rank by the default action. The first StopSignals takes over, and at
// its end the default actions come back.
void catch_stop_signals_from_start();

// Installs the preemption handlers for its lifetime (and clears the signal
// noted before, except one caught since catch_stop_signals_from_start). The first signal is noted only; the second of the same
// kind kills at once, and one of another kind is noted only: SLURM's USR1
// warning followed by its TERM at the limit must not kill a run that is
// saving.
class StopSignals {
 public:
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  std::array<struct sigaction, stop_signals().size()> old_{};
};

}  // namespace origami

// One error family for the whole engine.
//  - ORIGAMI_CHECK(cond, msg...): an internal invariant. On failure it prints
//    "file:line [rank R] check failed: cond: msg" and aborts the whole job
//    (MPI_Abort when MPI is up, exit status kExitInternal), so a broken rank
//    never leaves others hanging. The abort path is single-entry: when several
//    threads fail at once (a check inside an OpenMP region), one reports and
//    aborts, the others wait for the process to go down.
//  - UserError: bad config, data, checkpoint or CLI input, or a run the user's
//    settings made diverge. Thrown with a message naming the file, key or
//    offset and the rule; the CLI prints it and exits with its status
//    (kExitUserError, or kExitDiverged).
// Exit statuses of `origami` (README "Reliability"):
//   0 success, 2 bad input, 3 training diverged, 4 internal check failed
//   (a bug), 5 a collective timed out (a rank stopped answering).
#pragma once
#include <chrono>
#include <cstdint>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace origami {

inline constexpr int kExitUserError = 2;
inline constexpr int kExitDiverged = 3;
inline constexpr int kExitInternal = 4;
inline constexpr int kExitTimeout = 5;

class UserError : public std::runtime_error {
 public:
  explicit UserError(const std::string& what, int exit_status = kExitUserError)
      : std::runtime_error(what), exit_status_(exit_status) {}
  int exit_status() const { return exit_status_; }

 private:
  int exit_status_;
};

// A failure every rank of the job already knows about (comm/agreement.h
// shares it): what() is the report as the user reads it, one or more
// "error: ..." lines, printed once by rank 0; every rank exits with
// exit_status().
class JobError : public UserError {
 public:
  using UserError::UserError;
};

// Starts MPI for the process (origami and every MPI test), asking for
// MPI_THREAD_MULTIPLE: threads other than the main one end the job and name
// their rank (the NCCL watchdog, the groups' set-up deadline, a check failing
// on an OpenMP or checkpoint-writer thread), and MPI allows that only at that
// level. Records the level granted and the world rank, so the abort path
// makes no MPI call but the abort itself, and makes none at all from another
// thread when the library grants less (see abort_job). Where MPI is already
// up, records the same from it. `required` is lower only in the test of the
// fallback. Outside a launcher (launched_by_mpi) it starts OpenMPI
// isolated: a singleton never spawns processes, and without that it forks an
// orted first (~0.4 s; from a relocated OpenMPI, one that must find its
// install prefix, as the GPU check's bundle is).
void start_mpi(int* argc, char*** argv, int required = 3 /* MPI_THREAD_MULTIPLE */);

// Whether an MPI launcher started this process: OpenMPI's mpirun (and PMIx
// launchers such as srun), or MPICH's hydra.
bool launched_by_mpi();

// The thread level MPI granted (MPI_THREAD_*), -1 before start_mpi.
int mpi_thread_level();

// This rank's index among the ranks of its node and their count (MPI's
// MPI_COMM_TYPE_SHARED split at start_mpi); none before start_mpi.
std::optional<std::pair<int, int>> mpi_node_placement();

// Rank of this process in MPI_COMM_WORLD, or 0 before MPI_Init / without MPI.
int world_rank_for_diagnostics();

[[noreturn]] void fail_check(const char* file, int line, const char* cond, const std::string& msg);

// Prints `message` (one line, as given; nothing when empty) and ends the whole job with
// `exit_status`: MPI_Abort when MPI is up, else exit. Single-entry: a second
// caller (another thread) blocks until the process is gone, so concurrent
// failures never race inside MPI's error path. Off the main thread, when MPI
// granted less than MPI_THREAD_MULTIPLE, the process exits without calling
// MPI, and the launcher ends the other ranks (mpirun aborts a job one of
// whose processes exits non-zero without finalizing).
[[noreturn]] void abort_job(int exit_status, const std::string& message);

// A user-supplied value for a message: as is when short, else its first and
// last characters around "...", with the full length, so a 10,000-character
// value cannot bury the rule it broke.
std::string shorten(std::string_view value, size_t max_chars = 80);

// Seconds a process ran since a start: wall time less every gap of over
// 1 s between two polls, which is time it did not run (SIGSTOP, a scheduler
// suspending the whole job: `scontrol suspend`). Every timeout counts this
// (collective waits, meetings, set-up and start-up deadlines, the NCCL
// watchdog), so a job suspended past one and resumed trains on instead of
// ending as a timeout. The owner polls far more often than once a second.
class RunningClock {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr Clock::duration kNotRunning = std::chrono::seconds(1);
  explicit RunningClock(Clock::time_point start = Clock::now()) : start_(start), last_(start) {}
  // The gap since the last poll when it counts as not running, else zero.
  Clock::duration poll_gap(Clock::time_point now = Clock::now()) {
    const Clock::duration gap = now - last_ > kNotRunning ? now - last_ : Clock::duration{};
    not_running_ += gap;
    last_ = now;
    return gap;
  }
  // Seconds run until `now` (a poll).
  double seconds(Clock::time_point now = Clock::now()) {
    poll_gap(now);
    return std::chrono::duration<double>(now - start_ - not_running_).count();
  }

 private:
  Clock::time_point start_, last_;
  Clock::duration not_running_{};
};

namespace detail {
template <class... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

// a · b and a + b for sizes, or false when the result leaves int64.
inline bool checked_mul(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }
inline bool checked_add(int64_t a, int64_t b, int64_t* out) { return !__builtin_add_overflow(a, b, out); }

}  // namespace origami

#define ORIGAMI_CHECK(cond, ...)                                                           \
  do {                                                                                     \
    if (!(cond)) [[unlikely]]                                                              \
      ::origami::fail_check(__FILE__, __LINE__, #cond, ::origami::detail::concat("" __VA_OPT__(, ) __VA_ARGS__)); \
  } while (0)

#define MPI_CHECK(call)                                                                    \
  do {                                                                                     \
    int origami_mpi_rc_ = (call);                                                          \
    if (origami_mpi_rc_ != 0) [[unlikely]]                                                 \
      ::origami::fail_check(__FILE__, __LINE__, #call,                                     \
                            ::origami::detail::concat("MPI error code ", origami_mpi_rc_)); \
  } while (0)

// Throws UserError with the concatenated message.
#define ORIGAMI_USER_ERROR(...) throw ::origami::UserError(::origami::detail::concat(__VA_ARGS__))

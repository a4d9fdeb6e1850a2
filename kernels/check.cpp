// Implementation of the check family: diagnostics carry file:line and rank, and
// a failed invariant takes the whole MPI job down instead of hanging peers.
#include "kernels/check.h"
#include "kernels/mpi_diagnostics.h"

#include <mpi.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

namespace origami {

namespace {
// The process-wide state of the abort path, global deliberately: it must be
// reachable from any thread of any module. g_aborting only ever goes from
// false to true; the others are set once, by start_mpi on the main thread,
// before any other thread exists (as is this rank's place on its node).
std::atomic<bool> g_aborting{false};
std::atomic<int> g_thread_level{-1};
std::atomic<int> g_world_rank{-1};
std::thread::id g_main_thread;
std::atomic<int> g_node_rank{-1}, g_node_size{-1};
MPI_Comm g_diagnostics = MPI_COMM_NULL;  // kernels/mpi_diagnostics.h; set once, by start_mpi

bool mpi_up() {
  // Both may be called from any thread, before MPI_Init and after MPI_Finalize.
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}
}  // namespace

namespace {
// This rank's index from the launcher's environment, for messages before
// MPI knows it ("?" when no launcher set one). Read before MPI starts: MPI
// may set variables while it does, and getenv racing setenv is undefined.
std::string launcher_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"})
    if (const char* v = std::getenv(name); v && *v) return v;
  return "?";
}

// ORIGAMI_MPI_INIT_TIMEOUT_S, or 300 s when unset or empty. A bad value is
// the user's error; MPI is not up to agree on one message, so each rank
// reports it (every rank reads the same value) and exits 2.
double mpi_init_timeout_s() {
  const char* text = std::getenv("ORIGAMI_MPI_INIT_TIMEOUT_S");
  if (!text || !*text) return 300.0;
  char* end = nullptr;
  const double s = std::strtod(text, &end);
  if (end == text || *end != '\0' || !std::isfinite(s) || s < 1 || s > 1e6) {
    std::fprintf(stderr, "error [rank %s]: ORIGAMI_MPI_INIT_TIMEOUT_S='%s': must be seconds in [1, 1e6]\n",
                 launcher_rank().c_str(), text);
    std::_Exit(kExitUserError);
  }
  return s;
}

// MPI_Init waits for every rank of the job and has no timeout of its own: a
// rank that never reaches it (its node, file system or GPU driver stalled
// it before MPI started) would hold the rest in it for good. While one of
// these lives, a thread ends this rank after the timeout, and the launcher
// then ends the job (the stalled rank included).
class InitWatchdog {
 public:
  explicit InitWatchdog(double seconds) : rank_(launcher_rank()), thread_([this, seconds] { watch(seconds); }) {}
  ~InitWatchdog() {
    {
      std::lock_guard lock(mu_);
      done_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  InitWatchdog(const InitWatchdog&) = delete;
  InitWatchdog& operator=(const InitWatchdog&) = delete;

 private:
  void watch(double seconds) {
    std::unique_lock lock(mu_);
    RunningClock running;  // time the job was suspended does not count
    while (running.seconds() <= seconds)
      if (cv_.wait_for(lock, std::chrono::milliseconds(100), [this] { return done_; })) return;
    std::fprintf(stderr,
                 "[rank %s] start-up timeout: MPI_Init not done %g s after it began (ORIGAMI_MPI_INIT_TIMEOUT_S): it "
                 "waits for every rank of the job, and one has not reached it\n",
                 rank_.c_str(), seconds);
    std::fflush(stderr);
    std::_Exit(kExitTimeout);
  }

  const std::string rank_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;  // last: starts once the members it reads exist
};
}  // namespace

static_assert(MPI_THREAD_MULTIPLE == 3, "start_mpi's default names MPI_THREAD_MULTIPLE by value (check.h has no mpi.h)");

bool launched_by_mpi() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"})
    if (std::getenv(var)) return true;
  return false;
}

void start_mpi(int* argc, char*** argv, int required) {
  if (!launched_by_mpi()) setenv("OMPI_MCA_ess_singleton_isolated", "1", /*overwrite=*/0);
  int initialized = 0, provided = MPI_THREAD_SINGLE;
  MPI_Initialized(&initialized);
  // Through the node split below too: the first collective over the world,
  // which an MPI whose init does not wait for every rank would hang in instead.
  std::optional<InitWatchdog> watchdog;
  if (initialized)
    MPI_Query_thread(&provided);
  else {
    watchdog.emplace(mpi_init_timeout_s());
    if (MPI_Init_thread(argc, argv, required, &provided) != MPI_SUCCESS)
      std::_Exit(kExitInternal);  // MPI's own handler has reported it (errors are fatal by default)
  }
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  // The ranks sharing this node's memory, from MPI itself: any launcher
  // (mpirun, srun, hydra), not one launcher's environment variables.
  MPI_Comm node = MPI_COMM_NULL;
  int node_rank = 0, node_size = 1;
  if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node) == MPI_SUCCESS) {
    MPI_Comm_rank(node, &node_rank);
    MPI_Comm_size(node, &node_size);
    MPI_Comm_free(&node);
  }
  // A collective over the world as the split is, on every rank that starts MPI.
  if (g_diagnostics == MPI_COMM_NULL && MPI_Comm_dup(MPI_COMM_WORLD, &g_diagnostics) == MPI_SUCCESS)
    MPI_Comm_set_errhandler(g_diagnostics, MPI_ERRORS_RETURN);
  watchdog.reset();
  g_main_thread = std::this_thread::get_id();
  g_world_rank.store(rank);
  g_thread_level.store(provided);
  g_node_rank.store(node_rank);
  g_node_size.store(node_size);
}

std::optional<std::pair<int, int>> mpi_node_placement() {
  const int rank = g_node_rank.load(), size = g_node_size.load();
  if (rank < 0) return std::nullopt;
  return std::pair{rank, size};
}

int mpi_thread_level() { return g_thread_level.load(); }

MPI_Comm diagnostics_comm() { return g_diagnostics; }

int world_rank_for_diagnostics() {
  const int cached = g_world_rank.load();
  if (cached >= 0) return cached;
  if (!mpi_up()) return 0;
  int rank = 0;  // MPI started without start_mpi: only from the thread that started it
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

void abort_job(int exit_status, const std::string& message) {
  if (g_aborting.exchange(true)) {
    // Another thread is reporting and aborting; it takes this one down too.
    for (;;) ::pause();
  }
  if (!message.empty()) {
    std::fprintf(stderr, "%s\n", message.c_str());
    std::fflush(stderr);
  }
  // Level -1: MPI was started by other code than start_mpi (none of
  // Origami's mains): the level is unknown, so abort through MPI.
  const int level = g_thread_level.load();
  const bool may_call_mpi =
      level == -1 || level == MPI_THREAD_MULTIPLE || std::this_thread::get_id() == g_main_thread;
  if (may_call_mpi && mpi_up()) MPI_Abort(MPI_COMM_WORLD, exit_status);
  std::_Exit(exit_status);
}

void fail_check(const char* file, int line, const char* cond, const std::string& msg) {
  abort_job(kExitInternal, detail::concat(file, ":", line, " [rank ", world_rank_for_diagnostics(),
                                          "] check failed: ", cond, msg.empty() ? "" : ": ", msg));
}

std::string shorten(std::string_view value, size_t max_chars) {
  if (value.size() <= max_chars) return std::string(value);
  const size_t keep = max_chars > 16 ? max_chars - 16 : max_chars / 2;
  const size_t head = keep * 2 / 3, tail = keep - head;
  return detail::concat(value.substr(0, head), "...", value.substr(value.size() - tail), " (", value.size(),
                        " characters)");
}

}  // namespace origami

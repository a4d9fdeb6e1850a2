// `origami bench checkpoint --config C [--dir D] [--repeat N] [--set k=v]...
// [--json]`: save and load throughput of sharded checkpoints for the
// configured model and layout (under mpirun: the layout of [parallel] at the
// job's world size), beside the disk's own rate measured in the same run.
//
// Each repeat, every rank (after a barrier; times are the slowest rank's):
//   1. saves a checkpoint synchronously (its files written and fsync'ed,
//      metadata.json, rename: what `checkpoint.interval` costs a step);
//   2. writes the same number of bytes as its checkpoint files with plain
//      write(2) + fsync into one file in the same directory (the baseline);
//   3. evicts both from the page cache (fsync, then POSIX_FADV_DONTNEED), then
//      loads the checkpoint (digests verified, each rank's byte ranges
//      copied) and reads the baseline file back with read(2);
//   4. saves with checkpoint.async: the time the step is blocked (copying the
//      rank's pieces) and, after wait, the time to complete.
// Reported: medians, GB/s over all ranks' bytes, and the ratios save/disk
// write, load/disk read and async blocked / synchronous save.
#include <fcntl.h>
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <vector>

#include "comm/groups.h"
#include "comm/mpi_communicator.h"
#include "engine/checkpoint.h"
#include "engine/config.h"
#include "engine/metrics.h"
#include "engine/model.h"
#include "engine/optimizer.h"
#include "kernels/threads.h"
#include "tools/commands.h"

namespace origami::tools {

namespace {

using Clock = std::chrono::steady_clock;

// Seconds of `fn` on the slowest rank, every rank starting together.
template <class Fn>
double timed(comm::Communicator& world, Fn&& fn) {
  world.barrier();
  const auto t0 = Clock::now();
  fn();
  double s = std::chrono::duration<double>(Clock::now() - t0).count();
  world.all_reduce(std::span<double>(&s, 1), comm::ReduceOp::max);
  return s;
}

int open_or_fail(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC, 0644);
  if (fd < 0) ORIGAMI_USER_ERROR(path, ": cannot open: ", std::strerror(errno));
  return fd;
}

// Drops a file's pages from the page cache, so the next read comes from disk.
void evict(const std::string& path) {
  const int fd = open_or_fail(path, O_RDONLY);
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

void write_plain(const std::string& path, const std::vector<char>& buf) {
  const int fd = open_or_fail(path, O_WRONLY | O_CREAT | O_TRUNC);
  size_t done = 0;
  while (done < buf.size()) {
    const ssize_t n = ::write(fd, buf.data() + done, buf.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) ORIGAMI_USER_ERROR(path, ": write failed: ", std::strerror(errno));
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) ORIGAMI_USER_ERROR(path, ": fsync failed: ", std::strerror(errno));
  ::close(fd);
}

void read_plain(const std::string& path, std::vector<char>& buf) {
  const int fd = open_or_fail(path, O_RDONLY);
  size_t done = 0;
  while (done < buf.size()) {
    const ssize_t n = ::read(fd, buf.data() + done, buf.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) ORIGAMI_USER_ERROR(path, ": read failed: ", std::strerror(errno));
    done += static_cast<size_t>(n);
  }
  ::close(fd);
}

struct Args {
  std::string config, dir;
  std::vector<std::string> overrides;
  int repeat = 3;
  bool json = false;
};

void run(const Args& a) {
  Config cfg = load_config(a.config, a.overrides);
  require_host_engine(cfg, "bench checkpoint");
  int world_size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  validate_for_world(cfg, world_size);
  validate_for_machine(cfg, world_size, ranks_on_this_node(), /*trains=*/false);  // it holds the state, no activations
  auto everyone = comm::whole_mpi(MPI_COMM_WORLD, "everyone", comm::CommOptions{cfg.runtime.collective_timeout_s});
  const ParallelConfig& p = cfg.parallel;
  const comm::Layout layout(world_size, comm::LayoutOptions{p.tp, p.cp, p.pp, p.ep, p.etp, p.order,
                                                            cfg.moe.router.num_experts});
  const comm::Groups groups = comm::Groups::create(layout, MPI_COMM_WORLD, comm::Backend::mpi,
                                                   comm::CommOptions{cfg.runtime.collective_timeout_s});
  const int threads = cfg.runtime.threads > 0 ? static_cast<int>(cfg.runtime.threads) : default_threads_per_rank();
  set_num_threads(threads);
  const ExecContext ctx = ExecContext::cpu(threads);
  Model model(ctx, cfg.model, cfg.training.seed, cfg.moe,
              ModelPlacement{.groups = &groups, .zero_stage = static_cast<int>(p.zero_stage), .pp_layers = p.pp_layers});
  const int rank = groups.world_rank();
  const std::string dir = a.dir.empty() ? std::string("bench-checkpoint") : a.dir;
  if (rank == 0) {
    check_writable_dir(dir + "/sync", "--dir");
    check_writable_dir(dir + "/async", "--dir");
  }
  everyone->barrier();
  TrainState state;
  state.seed = cfg.training.seed;
  std::vector<double> save_s, disk_write_s, load_s, disk_read_s, blocked_s, async_s;
  int64_t total_bytes = 0, rank_bytes = 0;
  const std::string plain = dir + "/plain-rank-" + std::to_string(rank) + ".bin";
  for (int it = 0; it <= a.repeat; ++it) {  // iteration 0 warms up
    state.step = it + 1;
    state.lr = learning_rate(cfg.optimizer, cfg.lr_schedule, cfg.training.steps, state.step);  // what a run saves
    CheckpointWriter sync(dir + "/sync", 1, false, io_meeting_wait(cfg));
    CheckpointSaveStats s;
    const double save = timed(*everyone, [&] { s = sync.save(cfg, model, state, groups, *everyone); });
    total_bytes = s.total_bytes;
    rank_bytes = s.rank_bytes;
    std::vector<char> buf(static_cast<size_t>(rank_bytes), static_cast<char>(it + 1));
    const double write = timed(*everyone, [&] { write_plain(plain, buf); });
    const CheckpointInfo info = read_checkpoint_info(s.dir);
    for (const SavedFile& f : info.files)
      if (f.rank == rank) evict(s.dir + "/" + f.name);
    evict(plain);
    const double load = timed(*everyone, [&] { load_checkpoint(s.dir, cfg, model, groups, *everyone); });
    const double read = timed(*everyone, [&] { read_plain(plain, buf); });
    CheckpointWriter background(dir + "/async", 1, true, io_meeting_wait(cfg));
    double blocked = 0;
    const double complete = timed(*everyone, [&] {
      const auto t0 = Clock::now();
      background.save(cfg, model, state, groups, *everyone);
      blocked = std::chrono::duration<double>(Clock::now() - t0).count();
      background.wait(*everyone);
    });
    everyone->all_reduce(std::span<double>(&blocked, 1), comm::ReduceOp::max);
    if (it == 0) continue;
    save_s.push_back(save), disk_write_s.push_back(write), load_s.push_back(load), disk_read_s.push_back(read);
    blocked_s.push_back(blocked), async_s.push_back(complete);
  }
  std::filesystem::remove(plain);
  if (rank != 0) return;
  const double gb = static_cast<double>(total_bytes) / 1e9;
  const double save = median(save_s), write = median(disk_write_s), load = median(load_s), read = median(disk_read_s);
  const double blocked = median(blocked_s), async = median(async_s);
  if (a.json) {
    nlohmann::ordered_json j = {{"ranks", world_size},        {"bytes_total", total_bytes},
                                {"bytes_per_rank", rank_bytes}, {"repeat", a.repeat},
                                {"save_s", save},             {"save_gb_s", gb / save},
                                {"disk_write_gb_s", gb / write}, {"save_over_disk", write / save},
                                {"load_s", load},             {"load_gb_s", gb / load},
                                {"disk_read_gb_s", gb / read}, {"load_over_disk", read / load},
                                {"async_blocked_s", blocked}, {"async_complete_s", async},
                                {"async_blocked_over_sync", blocked / save}};
    std::printf("%s\n", j.dump().c_str());
    return;
  }
  std::printf("# origami bench checkpoint: %s on %d rank(s), %s in all (%s on rank 0), median of %d after 1 warm-up\n",
              a.config.c_str(), world_size, format_bytes(total_bytes).c_str(), format_bytes(rank_bytes).c_str(),
              a.repeat);
  std::printf("save   %8.3f s  %6.2f GB/s | disk write+fsync %6.2f GB/s | ratio %.2f\n", save, gb / save, gb / write,
              write / save);
  std::printf("load   %8.3f s  %6.2f GB/s | disk read        %6.2f GB/s | ratio %.2f\n", load, gb / load, gb / read,
              read / load);
  std::printf("async  blocked %.3f s (%.1f%% of the synchronous save), complete in %.3f s\n", blocked,
              100 * blocked / save, async);
}

}  // namespace

void add_bench_checkpoint_command(CLI::App& bench) {
  auto args = std::make_shared<Args>();
  CLI::App* cmd = bench.add_subcommand("checkpoint", "Checkpoint save/load throughput vs the disk's own rate");
  cmd->add_option("--config", args->config, "TOML config (model, parallel layout)")->required();
  cmd->add_option("--dir", args->dir, "Where to write (default ./bench-checkpoint)");
  cmd->add_option("--repeat", args->repeat, "Timed repeats after one warm-up")->check(CLI::Range(1, 1000))
      ->capture_default_str();
  add_set_option(cmd, args->overrides);
  cmd->add_flag("--json", args->json, "Print one JSON object");
  cmd->callback([args] { run(*args); });
}

}  // namespace origami::tools

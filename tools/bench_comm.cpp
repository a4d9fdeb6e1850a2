// `origami bench comm --op all_to_all_v|all_gather|reduce_scatter|all_reduce`:
// nccl-tests style. Over the world communicator (MPI backend) it sweeps the
// message size, warms up, times each iteration (slowest rank's time, median
// over iterations), and reports algorithm bandwidth (S / t) and bus bandwidth
// (S / t · ring factor), beside a bare MPI baseline (MPI_Alltoallv, ... on the
// same buffers, same run) and the ratio. Data is checked by default: a wrong
// element on any rank makes the command exit non-zero.
//
// S follows nccl-tests: all_reduce the buffer, all_gather the gathered output,
// reduce_scatter and all_to_all_v the input (n equal blocks; per peer S / n).
// Bus factor: 2(n−1)/n for all_reduce, (n−1)/n for the others.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "comm/mpi_communicator.h"
#include "comm/setup_deadline.h"
#include "kernels/check.h"
#include "tools/commands.h"

namespace origami::tools {

namespace {

using comm::Communicator;

// A float that names its sender and index exactly (< 2^24): low 6 bits the
// rank (n <= 64), above them the index mod 2^16.
float tag(int rank, int64_t i) { return static_cast<float>((i & 0xFFFF) * 64 + rank); }
// all_to_all_v also names the destination: ((i mod 2^10)·64 + dst)·64 + src.
float tag2(int src, int dst, int64_t i) { return static_cast<float>(((i & 0x3FF) * 64 + dst) * 64 + src); }
// Reduction inputs: small integers, so sums are exact.
float small(int rank, int64_t i) { return static_cast<float>(rank + 1 + i % 7); }

// One op: buffer sizing, data, the two implementations and the check.
struct OpBench {
  virtual ~OpBench() = default;
  int rank = 0, n = 1;
  int64_t block = 0;  // elements per rank block (all_reduce: the whole buffer)
  std::vector<float> send, recv;
  virtual double bus_factor() const { return (n - 1) / static_cast<double>(n); }
  virtual int64_t bytes() const { return n * block * 4; }  // S
  virtual void init() = 0;                                 // fill inputs, poison outputs
  virtual bool refill_each_iteration() const { return false; }
  virtual void run_ours(Communicator& c) = 0;
  virtual void run_mpi(MPI_Comm c) = 0;
  virtual int64_t wrong() const = 0;  // wrong elements on this rank
};

struct AllReduce final : OpBench {
  double bus_factor() const override { return 2.0 * (n - 1) / n; }
  int64_t bytes() const override { return block * 4; }
  bool refill_each_iteration() const override { return true; }  // in place
  void init() override {
    recv.resize(static_cast<size_t>(block));
    for (int64_t i = 0; i < block; ++i) recv[i] = small(rank, i);
  }
  void run_ours(Communicator& c) override { c.all_reduce(std::span(recv)); }
  void run_mpi(MPI_Comm c) override {
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, recv.data(), static_cast<int>(block), MPI_FLOAT, MPI_SUM, c));
  }
  int64_t wrong() const override {
    int64_t bad = 0;
    for (int64_t i = 0; i < block; ++i) {
      float e = 0;
      for (int r = 0; r < n; ++r) e += small(r, i);
      bad += recv[i] != e;
    }
    return bad;
  }
};

struct AllGather final : OpBench {
  void init() override {
    send.resize(static_cast<size_t>(block));
    for (int64_t i = 0; i < block; ++i) send[i] = tag(rank, i);
    recv.assign(static_cast<size_t>(n * block), -1.0f);
  }
  void run_ours(Communicator& c) override { c.all_gather(std::span<const float>(send), std::span(recv)); }
  void run_mpi(MPI_Comm c) override {
    const int k = static_cast<int>(block);
    MPI_CHECK(MPI_Allgather(send.data(), k, MPI_FLOAT, recv.data(), k, MPI_FLOAT, c));
  }
  int64_t wrong() const override {
    int64_t bad = 0;
    for (int p = 0; p < n; ++p)
      for (int64_t i = 0; i < block; ++i) bad += recv[p * block + i] != tag(p, i);
    return bad;
  }
};

struct ReduceScatter final : OpBench {
  void init() override {
    send.resize(static_cast<size_t>(n * block));
    for (int64_t i = 0; i < n * block; ++i) send[i] = small(rank, i);
    recv.assign(static_cast<size_t>(block), -1.0f);
  }
  void run_ours(Communicator& c) override { c.reduce_scatter(std::span<const float>(send), std::span(recv)); }
  void run_mpi(MPI_Comm c) override {
    MPI_CHECK(MPI_Reduce_scatter_block(send.data(), recv.data(), static_cast<int>(block), MPI_FLOAT, MPI_SUM, c));
  }
  int64_t wrong() const override {
    int64_t bad = 0;
    for (int64_t i = 0; i < block; ++i) {
      float e = 0;
      for (int r = 0; r < n; ++r) e += small(r, rank * block + i);
      bad += recv[i] != e;
    }
    return bad;
  }
};

struct AllToAllV final : OpBench {
  std::vector<int64_t> counts;
  std::vector<int> mpi_counts, mpi_displs;
  void init() override {
    counts.assign(static_cast<size_t>(n), block);
    mpi_counts.assign(static_cast<size_t>(n), static_cast<int>(block));
    mpi_displs.resize(static_cast<size_t>(n));
    for (int p = 0; p < n; ++p) mpi_displs[p] = static_cast<int>(p * block);
    send.resize(static_cast<size_t>(n * block));
    for (int p = 0; p < n; ++p)
      for (int64_t i = 0; i < block; ++i) send[p * block + i] = tag2(rank, p, i);
    recv.assign(static_cast<size_t>(n * block), -1.0f);
  }
  void run_ours(Communicator& c) override {
    c.all_to_all_v(std::span<const float>(send), counts, std::span(recv), counts);
  }
  void run_mpi(MPI_Comm c) override {
    MPI_CHECK(MPI_Alltoallv(send.data(), mpi_counts.data(), mpi_displs.data(), MPI_FLOAT, recv.data(),
                            mpi_counts.data(), mpi_displs.data(), MPI_FLOAT, c));
  }
  int64_t wrong() const override {
    int64_t bad = 0;
    for (int p = 0; p < n; ++p)
      for (int64_t i = 0; i < block; ++i) bad += recv[p * block + i] != tag2(p, rank, i);
    return bad;
  }
};

std::unique_ptr<OpBench> make_op(const std::string& op) {
  if (op == "all_reduce") return std::make_unique<AllReduce>();
  if (op == "all_gather") return std::make_unique<AllGather>();
  if (op == "reduce_scatter") return std::make_unique<ReduceScatter>();
  if (op == "all_to_all_v") return std::make_unique<AllToAllV>();
  ORIGAMI_USER_ERROR("bench comm: unknown --op '", op, "' (all_to_all_v, all_gather, reduce_scatter, all_reduce)");
}

struct BenchCommArgs {
  std::string op = "all_to_all_v";
  int64_t min_bytes = 1 << 10, max_bytes = 16 << 20;
  int64_t factor = 4;
  int iters = 20, warmup = 5;
  bool check = true, json = false;
  double timeout_s = 300;
};

struct Timing {
  double median_s = 0;
  int64_t wrong = 0;  // over all ranks
};

// Slowest rank's time per iteration, median over iterations; then the data
// check. Each iteration's barrier and op, and the reductions after, are
// bounded by --timeout (comm/setup_deadline.h): bare MPI calls have no
// timeout of their own, and a stuck rank must end the bench, not hang it.
template <class Run>
Timing time_op(OpBench& b, const BenchCommArgs& a, MPI_Comm world, const std::string& what, Run&& run) {
  b.init();
  std::vector<double> times;
  for (int it = 0; it < a.warmup + a.iters; ++it) {
    if (b.refill_each_iteration() && it > 0) b.init();
    const comm::SetupDeadline bound(a.timeout_s, what, "bench comm", "--timeout");
    MPI_CHECK(MPI_Barrier(world));
    const auto t0 = std::chrono::steady_clock::now();
    run();
    if (it >= a.warmup) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const comm::SetupDeadline bound(a.timeout_s, what + " (the timings' reduction)", "bench comm", "--timeout");
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, times.data(), static_cast<int>(times.size()), MPI_DOUBLE, MPI_MAX, world));
  std::sort(times.begin(), times.end());
  Timing t;
  t.median_s = times[times.size() / 2];
  if (a.check) {
    t.wrong = b.wrong();
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &t.wrong, 1, MPI_INT64_T, MPI_SUM, world));
  }
  return t;
}

void run_bench_comm(const BenchCommArgs& a) {
  // Each rank holds a few buffers of up to world · max-bytes (all-to-all,
  // all-gather): 1 GiB per message keeps that within a node's memory.
  constexpr int64_t kMaxMessage = int64_t{1} << 30;
  if (a.min_bytes < 1 || a.max_bytes < a.min_bytes || a.max_bytes > kMaxMessage)
    ORIGAMI_USER_ERROR("bench comm: need 1 <= --min-bytes <= --max-bytes <= 1G (", kMaxMessage, "), got ", a.min_bytes,
                       " and ", a.max_bytes);
  std::unique_ptr<OpBench> b = make_op(a.op);
  int rank = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  b->rank = rank;
  b->n = n;
  // Messages are whole floats (all_reduce) or n equal float blocks (the others).
  const bool whole = a.op == "all_reduce";
  const int64_t unit = whole ? 4 : 4 * int64_t{n};
  if (a.max_bytes < unit)
    ORIGAMI_USER_ERROR("bench comm: --max-bytes ", a.max_bytes, " is under the smallest ", a.op, " message over ", n,
                       " rank(s): ", unit, " bytes (one float", whole ? "" : " per rank", ")");
  // Separate communicators, so the baseline shares no state with ours.
  MPI_Comm ours_comm, mpi_comm;
  MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &ours_comm));
  MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &mpi_comm));
  std::vector<int> members(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) members[r] = r;
  comm::MpiCommunicator ours(ours_comm, "world", members, comm::CommOptions{a.timeout_s});

  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  if (rank == 0 && !a.json) {
    std::printf(
        "# origami bench comm: %s over %d rank(s), MPI backend, float32, median of %d iterations after %d "
        "warm-up, slowest rank per iteration\n",
        a.op.c_str(), n, a.iters, a.warmup);
    std::printf("# %10s %10s %10s | %10s %8s %8s | %10s %8s | %6s %7s\n", "size(B)", "peer(B)", "count", "time(us)",
                "algbw", "busbw", "mpi(us)", "mpi bus", "ratio", "#wrong");
  }
  int64_t total_wrong = 0;
  // S rounded down to whole units, and up to one unit below it; a size that rounds to the
  // previous row's is skipped, so rows are distinct and none passes --max-bytes.
  int64_t last_bytes = 0;
  for (int64_t s = a.min_bytes;; s *= a.factor) {
    const bool final_size = s > a.max_bytes / a.factor;  // the next size would pass max (or overflow)
    b->block = std::max<int64_t>(1, s / unit);
    const int64_t bytes = b->bytes();
    if (bytes == last_bytes) {
      if (final_size) break;
      continue;
    }
    last_bytes = bytes;
    ours.reset_stats();
    const std::string what = a.op + " of " + std::to_string(bytes) + " bytes";
    const Timing t_ours = time_op(*b, a, MPI_COMM_WORLD, what, [&] { b->run_ours(ours); });
    const int64_t sent_per_call = ours.total_bytes() / std::max<int64_t>(1, a.warmup + a.iters);
    const Timing t_mpi = time_op(*b, a, MPI_COMM_WORLD, what + " (the MPI baseline)", [&] { b->run_mpi(mpi_comm); });
    const double algbw = bytes / t_ours.median_s / 1e9, busbw = algbw * b->bus_factor();
    const double mpi_busbw = bytes / t_mpi.median_s / 1e9 * b->bus_factor();
    const double ratio = t_mpi.median_s / t_ours.median_s;  // = busbw / mpi busbw, and defined on one rank
    const int64_t wrong = t_ours.wrong + t_mpi.wrong;
    total_wrong += wrong;
    if (rank == 0 && a.json) {
      rows.push_back({{"bytes", bytes},
                      {"bytes_per_peer", whole ? bytes : bytes / n},
                      {"count", whole ? b->block : b->block * n},
                      {"time_us", t_ours.median_s * 1e6},
                      {"algbw_gbs", algbw},
                      {"busbw_gbs", busbw},
                      {"sent_bytes_per_rank", sent_per_call},
                      {"mpi_time_us", t_mpi.median_s * 1e6},
                      {"mpi_busbw_gbs", mpi_busbw},
                      {"ratio_to_mpi", ratio},
                      {"wrong", t_ours.wrong},
                      {"mpi_wrong", t_mpi.wrong}});
    } else if (rank == 0) {
      std::printf("  %10lld %10lld %10lld | %10.1f %8.3f %8.3f | %10.1f %8.3f | %6.2f %7lld\n",
                  static_cast<long long>(bytes), static_cast<long long>(whole ? bytes : bytes / n),
                  static_cast<long long>(whole ? b->block : b->block * n), t_ours.median_s * 1e6, algbw, busbw,
                  t_mpi.median_s * 1e6, mpi_busbw, ratio, static_cast<long long>(wrong));
    }
    if (final_size) break;
  }
  MPI_Comm_free(&mpi_comm);
  if (rank == 0 && a.json) {
    nlohmann::ordered_json j = {{"op", a.op},         {"ranks", n},           {"backend", "mpi"},
                                {"dtype", "float32"}, {"iters", a.iters},     {"warmup", a.warmup},
                                {"checked", a.check}, {"wrong", total_wrong}, {"rows", rows}};
    std::printf("%s\n", j.dump().c_str());
  } else if (rank == 0 && a.check) {
    std::printf("# data check: %s\n", total_wrong == 0 ? "all correct" : "WRONG DATA");
  }
  if (total_wrong != 0) throw CLI::RuntimeError("bench comm: " + std::to_string(total_wrong) + " wrong element(s)", 1);
}

}  // namespace

void add_bench_comm_command(CLI::App& bench) {
  auto args = std::make_shared<BenchCommArgs>();
  CLI::App* cmd = bench.add_subcommand("comm", "Collective bandwidth (nccl-tests style) vs a bare MPI baseline");
  cmd->add_option("--op", args->op, "all_to_all_v | all_gather | reduce_scatter | all_reduce")
      ->check(CLI::IsMember({"all_to_all_v", "all_gather", "reduce_scatter", "all_reduce"}))
      ->capture_default_str();
  cmd->add_option("--min-bytes", args->min_bytes, "Smallest message S (e.g. 1K)")->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  cmd->add_option("--max-bytes", args->max_bytes, "Largest message S (e.g. 16M)")->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  cmd->add_option("--factor", args->factor, "Size multiplier between steps")->check(CLI::Range(2, 1024))
      ->capture_default_str();
  cmd->add_option("--iters", args->iters, "Timed iterations per size (median reported)")->check(CLI::Range(1, 100000))
      ->capture_default_str();
  cmd->add_option("--warmup", args->warmup, "Untimed iterations per size")->check(CLI::Range(0, 100000))
      ->capture_default_str();
  cmd->add_flag("--check,!--no-check", args->check, "Verify received data (default on; wrong data exits non-zero)");
  cmd->add_option("--timeout", args->timeout_s, "Collective timeout in seconds")->check(finite_positive())
      ->capture_default_str();
  cmd->add_flag("--json", args->json, "Print one JSON object");
  cmd->callback([args] { run_bench_comm(*args); });
}

}  // namespace origami::tools

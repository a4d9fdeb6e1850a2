// check_same_run: a 62-bit FNV-1a digest of "origami.version = ...\n" +
// canonical_text, compared with one all_reduce(MAX) of {h, -h}; the texts
// themselves travel only when the digests differ.
#include "engine/preflight.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <sstream>

#include "engine/version.h"
#include "kernels/check.h"
#include "kernels/device.h"

namespace origami {

namespace {

int64_t digest(const std::string& text) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char ch : text) h = (h ^ ch) * 1099511628211ull;
  return static_cast<int64_t>(h >> 2);  // 62 bits: -h cannot overflow
}

// "key = value" lines into key -> value.
std::map<std::string, std::string> entries(const std::string& text) {
  std::map<std::string, std::string> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    const size_t eq = line.find(" = ");
    if (eq != std::string::npos) out[line.substr(0, eq)] = line.substr(eq + 3);
  }
  return out;
}

std::string ranks_text(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

}  // namespace

bool same_on_every_rank(comm::Communicator& world, const std::string& text) {
  if (world.size() == 1) return true;
  const int64_t h = digest(text);
  int64_t span[2] = {h, -h};
  world.all_reduce(std::span<int64_t>(span, 2), comm::ReduceOp::max);
  return span[0] == h && -span[1] == h;  // max == min == h everywhere
}

void check_same_run(comm::Communicator& world, const Config& cfg) {
  check_same_lines(world, detail::concat("origami.version = \"", version(), "\"\n", canonical_text(cfg)),
                   "the ranks of this job resolved different configs or run different binaries (rule: every rank "
                   "runs the same origami build on the same config and --set overrides)");
}

void check_same_lines(comm::Communicator& world, const std::string& text, const std::string& rule) {
  if (same_on_every_rank(world, text)) return;

  const int n = world.size();
  int64_t len = static_cast<int64_t>(text.size());
  std::vector<int64_t> lengths(static_cast<size_t>(n));
  world.all_gather(std::span<const int64_t>(&len, 1), std::span<int64_t>(lengths));
  int64_t total = 0;
  for (int64_t l : lengths) total += l;
  std::vector<int32_t> mine(text.begin(), text.end()), all(static_cast<size_t>(total));
  world.all_gather_v(std::span<const int32_t>(mine), std::span<int32_t>(all), lengths);

  std::vector<std::map<std::string, std::string>> per_rank;
  int64_t at = 0;
  for (int p = 0; p < n; ++p) {
    per_rank.push_back(entries(std::string(all.begin() + at, all.begin() + at + lengths[p])));
    at += lengths[p];
  }
  std::map<std::string, bool> keys;
  for (const auto& m : per_rank)
    for (const auto& [k, v] : m) keys[k] = true;
  std::string report;
  for (const auto& [key, unused] : keys) {
    // Each distinct value with the ranks holding it, in order of first rank.
    std::vector<std::pair<std::string, std::vector<int>>> values;
    for (int p = 0; p < n; ++p) {
      auto it = per_rank[p].find(key);
      const std::string v = it == per_rank[p].end() ? "(absent)" : it->second;
      auto same = std::find_if(values.begin(), values.end(), [&](const auto& x) { return x.first == v; });
      if (same == values.end()) values.push_back({v, {p}});
      else same->second.push_back(p);
    }
    if (values.size() == 1) continue;
    report += "\n  " + key + ":";
    // Piece by piece: `" " + std::string&&` trips a false GCC 12 -Wstringop-overflow.
    for (const auto& [v, ranks] : values) {
      report += ' ';
      report += shorten(v, 60);
      report += " on ";
      report += ranks_text(ranks);
      report += ';';
    }
    report.pop_back();
  }
  throw JobError(detail::concat("error: ", rule, "; differing keys:", report), kExitUserError);
}

std::string shared_gpu_rule(const std::vector<std::string>& gpu_by_node_rank,
                            const std::vector<int>& world_rank_by_node_rank) {
  ORIGAMI_CHECK(gpu_by_node_rank.size() == world_rank_by_node_rank.size(), "one world rank per GPU");
  // Each GPU with the world ranks on it, in order of first node rank.
  std::vector<std::pair<std::string, std::vector<int>>> gpus;
  for (size_t i = 0; i < gpu_by_node_rank.size(); ++i) {
    auto same = std::find_if(gpus.begin(), gpus.end(), [&](const auto& g) { return g.first == gpu_by_node_rank[i]; });
    if (same == gpus.end()) gpus.push_back({gpu_by_node_rank[i], {world_rank_by_node_rank[i]}});
    else same->second.push_back(world_rank_by_node_rank[i]);
  }
  std::string out;
  for (const auto& [gpu, ranks] : gpus)
    if (ranks.size() > 1) out += detail::concat(out.empty() ? "" : "; ", ranks_text(ranks), " share GPU ", gpu);
  return out;
}

void check_one_rank_per_gpu(comm::Communicator& node, const Config& cfg, const std::string& gpu_uuid) {
  // Fixed-width records of the UUID's characters, zero-padded: one all_gather.
  constexpr size_t kSlots = 64;
  ORIGAMI_CHECK(!gpu_uuid.empty() && gpu_uuid.size() < kSlots, "a GPU UUID of 1 to ", kSlots - 1,
                " characters, got '", gpu_uuid, "'");
  std::vector<int32_t> mine(kSlots, 0), all(kSlots * static_cast<size_t>(node.size()));
  std::copy(gpu_uuid.begin(), gpu_uuid.end(), mine.begin());
  node.all_gather(std::span<const int32_t>(mine), std::span<int32_t>(all));
  std::vector<std::string> gpus;
  for (int p = 0; p < node.size(); ++p) {
    const int32_t* rec = all.data() + kSlots * static_cast<size_t>(p);
    std::string g;
    for (size_t i = 0; i < kSlots && rec[i] != 0; ++i) g += static_cast<char>(rec[i]);
    gpus.push_back(g);
  }
  const std::string rule = shared_gpu_rule(gpus, node.members());
  if (!rule.empty())
    ORIGAMI_USER_ERROR(cfg.origin("runtime.device"), ": runtime.device = \"cuda\" runs one GPU per rank, but ", rule,
                       " (", node.size(), " ranks on this node, each seeing ", cuda_device_count(),
                       " CUDA device(s)); start at most one rank per GPU on each node (mpirun -npernode N), ",
                       "give each rank its own GPU (CUDA_VISIBLE_DEVICES), or train on runtime.device = \"cpu\"");
}

void check_shared_checkpoint_dir(comm::Communicator& everyone, const Config& cfg, const comm::MeetingWait& wait) {
  const std::string& dir = cfg.checkpoint.dir;
  if (dir.empty() || everyone.size() == 1) return;
  const bool root = everyone.rank() == 0;
  int64_t nonce = 0;
  auto probe = [&] {
    char name[48];
    std::snprintf(name, sizeof name, "/.origami-shared-%016llx", static_cast<unsigned long long>(nonce));
    return dir + name;
  };
  // A new name: no client has cached its absence (NFS caches lookups).
  comm::run_agreed(everyone, [&] {
    if (!root) return;
    std::random_device rd;
    nonce = static_cast<int64_t>(((static_cast<uint64_t>(rd()) << 32) | rd()) >> 1) | 1;
    const int fd = ::open(probe().c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) ORIGAMI_USER_ERROR(shorten(probe(), 240), ": cannot create (checkpoint.dir): ", std::strerror(errno));
    ::close(fd);
  }, wait);
  everyone.broadcast(std::span<int64_t>(&nonce, 1), 0);
  try {
    comm::run_agreed(everyone, [&] {
      if (root) return;
      std::error_code ec;
      if (std::filesystem::exists(probe(), ec)) return;
      ORIGAMI_USER_ERROR(cfg.origin("checkpoint.dir"), ": checkpoint.dir = \"", shorten(dir), "\" (",
                         std::filesystem::absolute(dir, ec).string(), " on this rank) is not the directory rank 0 "
                         "uses: the file rank 0 just created there is missing; every rank writes its shards into "
                         "checkpoint.dir and rank 0 commits them, so it must be one directory all ranks share (rule: a "
                         "path on a file system every node mounts, the same on every rank; a relative path resolves "
                         "against each rank's working directory)");
    }, wait);
  } catch (...) {
    if (root) ::unlink(probe().c_str());
    throw;
  }
  if (root) ::unlink(probe().c_str());
}

void check_same_corpus(comm::Communicator& everyone, int64_t documents, int64_t tokens) {
  check_same_lines(everyone, detail::concat("data.documents = ", documents, "\ndata.tokens = ", tokens, "\n"),
                   "the ranks of this job opened different corpora through data.path (rule: data.path names one "
                   "corpus for every rank; a relative path resolves against each rank's working directory)");
}

std::string nccl_setup_lines(const std::function<const char*(const char*)>& env, const std::string& nccl_version) {
  // From NCCL's environment variable reference: the tuning knobs whose value
  // decides, on each rank alone, how one collective or send/recv runs.
  static constexpr const char* kMustMatch[] = {
      "NCCL_ALGO",           "NCCL_PROTO",            "NCCL_BUFFSIZE",          "NCCL_LL_BUFFSIZE",
      "NCCL_LL128_BUFFSIZE", "NCCL_NTHREADS",         "NCCL_LL128_NTHREADS",    "NCCL_MIN_NCHANNELS",
      "NCCL_MAX_NCHANNELS",  "NCCL_MIN_CTAS",         "NCCL_MAX_CTAS",          "NCCL_NCHANNELS_PER_NET_PEER",
      "NCCL_MIN_P2P_NCHANNELS", "NCCL_MAX_P2P_NCHANNELS", "NCCL_P2P_NET_CHUNKSIZE", "NCCL_P2P_NVL_CHUNKSIZE",
      "NCCL_P2P_PCI_CHUNKSIZE", "NCCL_P2P_LL_THRESHOLD", "NCCL_NET_OVERHEAD",     "NCCL_NVLS_ENABLE",
      "NCCL_COLLNET_ENABLE", "NCCL_TUNER_PLUGIN",     "NCCL_LAUNCH_ORDER_IMPLICIT"};
  std::string lines = "nccl.library = " + (nccl_version.empty() ? std::string("(none)") : nccl_version) + "\n";
  for (const char* var : kMustMatch)
    if (const char* v = env(var)) {
      std::string value = v;
      std::replace(value.begin(), value.end(), '\n', ' ');  // one line per variable
      lines += detail::concat(var, " = ", value.empty() ? "(empty)" : value, "\n");
    }
  return lines;
}

void check_same_nccl_setup(comm::Communicator& world, const std::string& lines) {
  check_same_lines(world, lines,
                   "the ranks of this CUDA job load different NCCL libraries or set NCCL's tuning variables "
                   "differently, and ranks that choose a different algorithm, protocol or buffer size for one "
                   "collective wait on each other forever (rule: one NCCL version on every node, and each NCCL_* "
                   "tuning variable set alike on every rank or on none; `mpirun -x NAME` passes this shell's value "
                   "to every rank)");
}

void check_cuda_streams_run_apart(const Config& cfg) {
  const ParallelConfig& par = cfg.parallel;
  const bool pipeline = par.pp > 1, ring = par.cp > 1 && par.cp_comm == dense::CpComm::ring;
  const std::string rule = cuda_stream_serialization_rule(
      std::getenv("CUDA_DEVICE_MAX_CONNECTIONS"), std::getenv("NCCL_LAUNCH_ORDER_IMPLICIT"), pipeline || ring);
  if (rule.empty()) return;
  ORIGAMI_USER_ERROR(cfg.origin(pipeline ? "parallel.pp" : "parallel.cp_comm"), ": ",
                     pipeline ? "a pipeline (parallel.pp > 1)" : "ring attention (parallel.cp > 1, cp_comm = \"ring\")",
                     " on CUDA posts NCCL receives ahead of the compute its peers wait for, which needs the GPU's "
                     "streams to run apart, but ", rule, ": the ranks would wait on each other at the first step; "
                     "unset the variable (origami raises CUDA_DEVICE_MAX_CONNECTIONS to 32 when it is unset)");
}

}  // namespace origami

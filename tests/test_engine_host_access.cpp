// No number-crunching outside kernels/ (ARCHITECTURE.md §2): every host read
// or write of tensor elements — .f32(), .i32(), .raw(), .data<T>() — in
// dense/, moe/, engine/, comm/ and tools/ is listed here with its reason, so a
// new one cannot creep in unnoticed. A file with more uses than its entry
// fails (move the loop into a kernels op, or argue for the entry); a file
// with fewer fails too, so the list shrinks as loops move out. Comment lines
// are skipped; the count is of occurrences.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>

namespace {

namespace fs = std::filesystem;

struct Allowed {
  int uses;
  const char* reason;
};

// At most a dozen entries, each with its reason.
const std::map<std::string, Allowed>& allowlist() {
  static const std::map<std::string, Allowed> list = {
      // Named host points: data that lives on the host by nature.
      {"moe/permutation.cpp", {1, "counts_to_host: the per-expert counts the all-to-all and the metrics read"}},
      {"engine/trainer.cpp", {1, "the data loader writes a micro-batch's token ids into its host batch"}},
      {"engine/optimizer.cpp", {1, "grad_norm: the step's two fp64 sums of squares, read once"}},
      {"engine/safetensors.cpp", {2, "file I/O of exported and loaded tensors"}},
      {"engine/export.cpp", {12, "HF export: gathered slices placed into whole tensors, weights read back"}},
      {"engine/checkpoint.cpp", {1, "checkpoint and HF-init load: each rank's pieces copied from mapped files into a host copy of its state"}},
      {"engine/checkpoint_hf.cpp", {2, "checkpoint export: one consolidated tensor at a time, file to file"}},
      // Tools, not the training path.
      {"tools/bench_moe.cpp", {4, "benchmark: exchange buffers and the bitwise comparison of two passes"}},
      {"tools/cmd_bench.cpp", {2, "benchmark: GEMM inputs and random token ids"}},
      {"tools/bench_kernels.cpp", {1, "benchmark: random ids and targets written on the host, then uploaded"}},
      {"tools/bench_kernels_ops.cpp", {1, "benchmark: the per-expert counts read back (the dispatcher's own sync point)"}},
  };
  return list;
}

int count_uses(const fs::path& file) {
  static const std::regex use(R"(\.(f32|i32|raw)\(\)|data<[A-Za-z0-9_:]+>\(\))");
  std::ifstream in(file);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    const size_t first = line.find_first_not_of(" \t");
    if (first != std::string::npos && line.compare(first, 2, "//") == 0) continue;
    n += static_cast<int>(std::distance(std::sregex_iterator(line.begin(), line.end(), use), std::sregex_iterator()));
  }
  return n;
}

TEST(HostAccess, OnlyAllowlistedFilesTouchTensorDataOutsideKernels) {
  const fs::path root = ORIGAMI_SOURCE_DIR;
  std::map<std::string, int> found;
  for (const char* dir : {"dense", "moe", "engine", "comm", "tools"}) {
    for (const fs::directory_entry& e : fs::recursive_directory_iterator(root / dir)) {
      const std::string ext = e.path().extension().string();
      if (!e.is_regular_file() || (ext != ".cpp" && ext != ".h" && ext != ".cu")) continue;
      const int n = count_uses(e.path());
      if (n > 0) found[fs::relative(e.path(), root).generic_string()] = n;
    }
  }
  EXPECT_LE(allowlist().size(), 12u) << "the allowlist is meant to stay short";
  for (const auto& [file, n] : found) {
    const auto it = allowlist().find(file);
    if (it == allowlist().end()) {
      ADD_FAILURE() << file << ": " << n << " host access(es) to tensor data outside kernels/ and no allowlist entry";
      continue;
    }
    EXPECT_EQ(n, it->second.uses) << file << " (" << it->second.reason << "): "
                                  << (n > it->second.uses ? "new host access; move it into a kernels op"
                                                          : "fewer than listed; lower the entry");
  }
  for (const auto& [file, allowed] : allowlist())
    EXPECT_TRUE(found.count(file)) << file << " no longer touches tensor data: remove its entry";
  int total = 0;
  for (const auto& [file, n] : found) total += n;
  std::printf("[host access] %zu files, %d uses outside kernels/\n", found.size(), total);
}

}  // namespace

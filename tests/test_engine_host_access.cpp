// No number-crunching outside kernels/ (ARCHITECTURE.md §2): every host read
// or write of tensor elements — .f32(), .i32(), .raw(), .data<T>() — in
// dense/, moe/, engine/, comm/ and tools/ is listed here with its reason, so a
// new one cannot creep in unnoticed. A file with more uses than its entry
// fails (move the loop into a kernels op, or argue for the entry); a file
// with fewer fails too, so the list shrinks as loops move out. Comment lines
// are skipped; the count is of occurrences.
//
// And no CUDA name outside a CUDA build's code: CI's machine has the CUDA
// toolkit, so a CUDA runtime call, cuBLAS or NCCL name or a CUDA header
// left outside `#if ORIGAMI_WITH_CUDA` / `ORIGAMI_WITH_NCCL` compiles there
// and breaks only a machine without the toolkit (the README's quickstart on
// a fresh machine: one test did, and only tools/fresh_check.sh saw it).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

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
      {"engine/run_context.h", {1, "the data loader writes a micro-batch's token ids into its host batch"}},
      {"engine/optimizer.cpp", {1, "grad_norm: the step's two fp64 sums of squares, read once"}},
      {"engine/safetensors.cpp", {2, "file I/O of exported and loaded tensors"}},
      {"engine/export.cpp", {12, "HF export: gathered slices placed into whole tensors, weights read back"}},
      {"engine/checkpoint_read.cpp", {1, "checkpoint and HF-init load: each rank's pieces copied from mapped files into a host copy of its state"}},
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

// Lines of `file` that name CUDA, cuBLAS or NCCL outside a preprocessor
// branch that only a CUDA (or NCCL) build compiles; comments and string
// literals skipped.
std::vector<std::string> unguarded_cuda_names(const fs::path& file) {
  static const std::regex name(
      R"(\b(cuda[A-Z]\w*|cublas\w*|CUBLAS_\w+|nccl[A-Z]\w*|ORIGAMI_(CUDA|NCCL)_CHECK|CUDA_CHECK\w*|__global__|__device__)\b)");
  static const std::regex header(R"(^\s*#\s*include\s*[<"](cuda|cublas|nccl|cub/|thrust/|kernels/cuda/))");
  static const std::regex cond(R"(^\s*#\s*(if|ifdef|ifndef|elif|else|endif)\b(.*))");
  static const std::regex guard(R"(ORIGAMI_WITH_(CUDA|NCCL)|__CUDACC__)");
  static const std::regex raw_strings(R"re(R"\((.*?)\)")re");  // one-line raw strings, no delimiter
  static const std::regex strings(R"("(?:[^"\\]|\\.)*")");
  // Per open #if: whether its current branch is CUDA-only, and the branch
  // its #else takes.
  struct Branch {
    bool cuda_only, else_cuda_only;
  };
  std::vector<Branch> open;
  auto guarded = [&] {
    for (const Branch& b : open)
      if (b.cuda_only) return true;
    return false;
  };
  std::ifstream in(file);
  std::string line;
  std::vector<std::string> found;
  for (int n = 1; std::getline(in, line); ++n) {
    std::smatch m;
    if (std::regex_search(line, m, cond)) {
      const std::string kw = m[1], rest = m[2];
      const bool names_guard = std::regex_search(rest, guard);
      const bool negated = kw == "ifndef" || rest.find('!') != std::string::npos;
      if (kw == "if" || kw == "ifdef" || kw == "ifndef") {
        open.push_back({names_guard && !negated, names_guard && negated});
      } else if (kw == "elif" && !open.empty()) {
        open.back() = {names_guard && !negated, false};
      } else if (kw == "else" && !open.empty()) {
        open.back().cuda_only = open.back().else_cuda_only;
      } else if (kw == "endif" && !open.empty()) {
        open.pop_back();
      }
      continue;
    }
    const size_t first = line.find_first_not_of(" \t");
    if (first == std::string::npos || line.compare(first, 2, "//") == 0) continue;
    std::string code = std::regex_replace(std::regex_replace(line, raw_strings, "\"\""), strings, "\"\"");
    if (const size_t c = code.find("//"); c != std::string::npos) code.resize(c);
    if (!guarded() && (std::regex_search(code, name) || std::regex_search(code, header)))
      found.push_back(fs::relative(file, ORIGAMI_SOURCE_DIR).generic_string() + ":" + std::to_string(n) + ": " + line);
  }
  return found;
}

TEST(CudaGuards, CudaNamesAppearOnlyWhereACudaBuildCompilesThem) {
  const fs::path root = ORIGAMI_SOURCE_DIR;
  int files = 0;
  std::vector<std::string> found;
  for (const char* dir : {"kernels", "dense", "moe", "engine", "comm", "tools", "tests"}) {
    for (const fs::directory_entry& e : fs::recursive_directory_iterator(root / dir)) {
      const std::string ext = e.path().extension().string();
      // kernels/cuda/ and .cu/.cuh files are compiled by CUDA builds alone.
      if (!e.is_regular_file() || (ext != ".cpp" && ext != ".h" && ext != ".inc")) continue;
      if (fs::relative(e.path(), root).generic_string().starts_with("kernels/cuda/")) continue;
      ++files;
      for (std::string& f : unguarded_cuda_names(e.path())) found.push_back(std::move(f));
    }
  }
  EXPECT_GT(files, 100) << "the scan found too few sources: wrong root?";
  for (const std::string& f : found) ADD_FAILURE() << f << "\n  (a CUDA name outside #if ORIGAMI_WITH_CUDA/NCCL)";
}

}  // namespace

// Shared harness of the reference tests (test_cli_reference*.cpp): run a
// command with stdout and stderr apart (the JSON results are on stdout),
// deterministic English-like text with some multi-byte UTF-8 words for the
// byte-level corpus, and relative differences.
#pragma once
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <random>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "cli_util.h"

namespace origami::testing {

struct CmdResult {
  int status = -1;
  std::string out;  // stdout only
  std::string all;  // stdout + stderr (stderr goes to a file, appended)
};

// Runs `cmd` through the shell; stdout and stderr captured separately.
inline CmdResult run(const std::string& cmd, const std::string& scratch) {
  isolate_mpi_session_dirs();  // cli_util.h
  CmdResult r;
  const std::string err_path = scratch + "/stderr.txt";
  FILE* pipe = popen((cmd + " 2>" + err_path).c_str(), "r");
  if (!pipe) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) r.out.append(buf.data(), n);
  const int raw = pclose(pipe);
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
  std::ifstream in(err_path);
  std::stringstream ss;
  ss << in.rdbuf();
  r.all = r.out + ss.str();
  return r;
}

inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// Deterministic English-ish prose (with a few multi-byte UTF-8 words so byte
// values above 127 occur), about `bytes` long.
inline std::string prose(uint32_t seed, size_t bytes) {
  static const std::vector<std::string> words = {
      "the", "a", "of", "and", "to", "in", "is", "that", "it", "was", "for", "on", "are", "with", "as", "his",
      "they", "be", "at", "one", "have", "this", "from", "or", "had", "by", "word", "but", "what", "some", "we",
      "can", "out", "other", "were", "all", "there", "when", "up", "use", "your", "how", "said", "an", "each",
      "she", "which", "do", "their", "time", "if", "will", "way", "about", "many", "then", "them", "write",
      "would", "like", "so", "these", "her", "long", "make", "thing", "see", "him", "two", "has", "look",
      "more", "day", "could", "go", "come", "did", "number", "sound", "no", "most", "people", "my", "over",
      "know", "water", "than", "call", "first", "who", "may", "down", "side", "been", "now", "find", "café",
      "naïve", "façade", "Zürich", "fortune", "cookie", "computer", "program", "memory", "quickly", "brown",
      "expert", "router", "token", "gate"};
  uint64_t s = seed * 6364136223846793005ULL + 1442695040888963407ULL;
  auto next = [&s] {
    s = s * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<uint32_t>(s >> 33);
  };
  std::string out;
  bool cap = true;
  while (out.size() < bytes) {
    std::string w = words[next() % words.size()];
    if (cap) w[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(w[0])));
    out += w;
    const uint32_t r = next() % 16;
    cap = r < 2;
    out += r == 0 ? ".\n" : r == 1 ? ". " : r == 2 ? ", " : " ";
  }
  return out;
}

inline double rel_diff(double a, double b) { return std::fabs(a - b) / std::max(std::fabs(b), 1e-300); }

// A scratch directory with a byte-level corpus of three prose files,
// preprocessed by `binary` into <dir>/data, and whether `python` can import
// the reference's dependencies. Each fixture makes one per suite.
struct ReferenceCorpus {
  std::string dir;
  CmdResult preprocess, python;
};

inline ReferenceCorpus make_reference_corpus(const std::string& binary, const std::string& python,
                                             const std::string& tag, uint32_t seed,
                                             const std::array<size_t, 3>& sizes) {
  ReferenceCorpus c;
  std::random_device rd;
  c.dir = (std::filesystem::temp_directory_path() / ("origami-" + tag + "-" + std::to_string(rd()))).string();
  std::filesystem::create_directories(c.dir);
  std::string inputs;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const std::string p = c.dir + "/doc" + std::to_string(i) + ".txt";
    write_text(p, prose(seed + static_cast<uint32_t>(i), sizes[i]));
    inputs += " " + p;
  }
  c.preprocess = run(binary + " preprocess --format text --input" + inputs + " --output-prefix " + c.dir + "/data",
                     c.dir);
  // Found, not imported: importing torch costs ~1.4 CPU-s in every test
  // process, and the reference's own import reports a broken install.
  c.python = run(python +
                     " -c 'import importlib.util as u, sys; missing = [m for m in (\"numpy\", \"torch\") "
                     "if u.find_spec(m) is None]; print(\"missing:\", *missing) if missing else None; "
                     "sys.exit(1 if missing else 0)'",
                 c.dir);
  return c;
}

inline void remove_reference_corpus(const ReferenceCorpus& c) {
  std::error_code ec;
  std::filesystem::remove_all(c.dir, ec);
}

}  // namespace origami::testing

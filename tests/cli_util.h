// Helpers for end-to-end tests of the `origami` binary: run a command line,
// capture its output and exit status, and make scratch directories.
#pragma once
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>

namespace origami::testing {

struct CommandResult {
  int status = -1;     // exit status, or 128 + signal
  std::string output;  // stdout and stderr together
};

inline CommandResult run_command(const std::string& cmd) {
  CommandResult r;
  FILE* pipe = popen((cmd + " 2>&1").c_str(), "r");
  if (!pipe) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) r.output.append(buf.data(), n);
  const int raw = pclose(pipe);
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
  return r;
}

// A fresh directory under the system temp dir, removed with the object.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& tag) {
    std::random_device rd;
    path_ = std::filesystem::temp_directory_path() / ("origami-" + tag + "-" + std::to_string(rd()));
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string str() const { return path_.string(); }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

inline void write_file(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

#ifdef ORIGAMI_BINARY
// `origami preprocess` of Debian's fortunes corpus into <prefix>.bin/.idx;
// status 1 with a message when the package is missing.
inline CommandResult preprocess_fortunes(const std::string& prefix) {
  std::string inputs;
  for (const auto& e : std::filesystem::directory_iterator("/usr/share/games/fortunes"))
    if (e.is_regular_file() && e.path().extension() != ".dat" && e.path().extension() != ".u8")
      inputs += " " + e.path().string();
  if (inputs.empty()) return {1, "the fortunes package is not installed (tools/setup.sh installs it)"};
  return run_command(std::string(ORIGAMI_BINARY) + " preprocess --format fortune --output-prefix " + prefix +
                     " --input" + inputs);
}
#endif

}  // namespace origami::testing

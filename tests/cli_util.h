// Helpers for end-to-end tests of the `origami` binary: run a command line,
// capture its output and exit status, and make scratch directories.
#pragma once
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace origami::testing {

struct CommandResult {
  int status = -1;     // exit status, or 128 + signal
  std::string output;  // stdout and stderr together
};

// Open MPI keeps each job's session directory under one shared top
// directory per host and user, and a job that ends removes that top
// directory when it looks empty: a job starting at that moment in another
// test fails in orte_init ("unable to create the desired directory"). Jobs
// that tests launch therefore get a session root of this test process's
// own (its commands run one after another, so they cannot race), removed
// when the process exits.
inline void isolate_mpi_session_dirs() {
  static const bool done = [] {
    std::string name = "origami-ompi-";
    name += std::to_string(::getpid());
    const std::filesystem::path root = std::filesystem::temp_directory_path() / name;
    std::filesystem::create_directories(root);
    ::setenv("OMPI_MCA_orte_tmpdir_base", root.c_str(), 1);
    static const std::string keep = root.string();
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(keep, ec);
    });
    return true;
  }();
  (void)done;
}

inline CommandResult run_command(const std::string& cmd) {
  isolate_mpi_session_dirs();
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

// One JSON object per line (metrics.jsonl).
inline std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

#ifdef ORIGAMI_BINARY
// `origami preprocess` of Debian's fortunes corpus into <prefix>.bin/.idx;
// status 1 with a message when the package is missing. The corpus is
// $ORIGAMI_FORTUNES_DIR when set (tools/gpu_check.sh: the bundle's copy, on
// a machine without the package), else /usr/share/games/fortunes.
inline CommandResult preprocess_fortunes(const std::string& prefix) {
  const char* env = std::getenv("ORIGAMI_FORTUNES_DIR");
  const std::string from = env && *env ? env : "/usr/share/games/fortunes";
  std::string inputs;
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator(from, ec); !ec && it != std::filesystem::directory_iterator();
       it.increment(ec))
    if (it->is_regular_file() && it->path().extension() != ".dat" && it->path().extension() != ".u8") {
      inputs += ' ';  // appended piecewise: GCC 12 warns (-Wrestrict) on " " + string here
      inputs += it->path().string();
    }
  if (inputs.empty())
    return {1, "no fortune files in " + from + " (tools/setup.sh installs the fortunes package)" +
                   (ec ? ": " + ec.message() : std::string())};
  return run_command(std::string(ORIGAMI_BINARY) + " preprocess --format fortune --output-prefix " + prefix +
                     " --input" + inputs);
}
#endif

#ifdef ORIGAMI_MPIEXEC
// Scenarios that must end their job (a failed check aborts under MPI) run in
// a child: this same test binary, launched by run_child_scenario under
// `mpirun -n np` as `<self> --check-child SCENARIO`. Its main() asks
// child_scenario first: the scenario's name in a child, else null.
inline const char* child_scenario(int argc, char** argv) {
  return argc == 3 && std::string(argv[1]) == "--check-child" ? argv[2] : nullptr;
}
inline CommandResult run_child_scenario(int np, const std::string& scenario) {
  char self[4096] = {};
  if (readlink("/proc/self/exe", self, sizeof(self) - 1) <= 0) return {1, "cannot read /proc/self/exe"};
  return run_command(std::string(ORIGAMI_MPIEXEC) + " --allow-run-as-root --oversubscribe --bind-to none -n " +
                     std::to_string(np) + " " + self + " --check-child " + scenario);
}
#endif

}  // namespace origami::testing

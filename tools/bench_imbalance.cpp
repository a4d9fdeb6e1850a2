// `origami bench imbalance [--size-mb N] [--layers L] [--experts E] [--ep P]
// [--repeat R] [--dir D] [--json]`: how fast `origami imbalance` summarizes a
// large metrics.jsonl, beside a plain line count of the same file.
//
// Writes a synthetic file of about N MB (records shaped like the trainer's:
// step fields, ledger, comm bytes, and per MoE layer tokens_per_expert,
// kept_per_expert, tokens_per_ep_rank with random counts), then, after one
// warm-up pass of each (the page cache holds the file for both), runs R
// times each as child processes: `wc -l FILE` (the baseline: reading the
// bytes and finding newlines) and `origami imbalance FILE --json`. Reported:
// the medians, MB/s of each, their ratio, and the imbalance child's peak
// resident memory (wait4's ru_maxrss) beside that of the same command on a
// one-record file (what the process maps before reading anything).
#include <fcntl.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <charconv>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>

#include "engine/files.h"
#include "kernels/check.h"
#include "tools/commands.h"

extern char** environ;

namespace origami::tools {

namespace {

struct Args {
  int64_t size_mb = 1024, layers = 64, experts = 256, ep = 8, repeat = 3;
  std::string dir;
  bool json = false;
};

struct ChildRun {
  double seconds = 0;
  int64_t max_rss_kb = 0;
};

// Runs argv with stdout to /dev/null; wall time and peak RSS of the child.
ChildRun run_child(const std::vector<std::string>& argv) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
  // Not the launcher's variables: a child that inherits them takes itself
  // for a rank of this job and fails to start MPI.
  std::vector<char*> env;
  for (char** e = environ; *e; ++e) {
    const std::string_view v(*e);
    if (!v.starts_with("OMPI_") && !v.starts_with("PMIX_") && !v.starts_with("PMI_")) env.push_back(*e);
  }
  env.push_back(nullptr);
  const auto t0 = std::chrono::steady_clock::now();
  pid_t pid = 0;
  const int err = posix_spawn(&pid, args[0], &actions, nullptr, args.data(), env.data());
  posix_spawn_file_actions_destroy(&actions);
  if (err != 0) ORIGAMI_USER_ERROR("bench imbalance: cannot start ", argv[0], ": ", std::strerror(err));
  int status = 0;
  rusage usage{};
  if (wait4(pid, &status, 0, &usage) != pid) ORIGAMI_USER_ERROR("bench imbalance: wait4 failed: ", std::strerror(errno));
  ChildRun r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.max_rss_kb = usage.ru_maxrss;
  // imbalance exits 1 when an alert fires: a verdict, not a failure.
  const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  if (code != 0 && !(code == 1 && argv.size() > 1 && argv[1] == "imbalance"))
    ORIGAMI_USER_ERROR("bench imbalance: ", argv[0], " exited with status ", code);
  return r;
}

// Appends v in decimal.
void put(std::string& s, int64_t v) {
  char buf[24];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  s.append(buf, end);
}

// The synthetic run: each step's tokens spread over the experts by fixed
// per-expert weights with random noise; 10% of steps drop a little.
int64_t write_synthetic(const std::string& path, const Args& a, int64_t bytes) {
  OutputFile out(path, OutputFile::Mode::truncate);
  std::mt19937_64 rng(12345);
  std::lognormal_distribution<double> weight(0.0, 0.7);
  std::vector<std::vector<double>> w(a.layers, std::vector<double>(a.experts));
  for (auto& layer : w)
    for (double& x : layer) x = weight(rng);
  const int64_t tokens = 4096 * 8, per_expert = tokens * 8 / a.experts;
  std::string line, block;
  int64_t written = 0, steps = 0;
  std::vector<int64_t> routed(a.experts), kept(a.experts), ranks(a.ep);
  while (written < bytes) {
    ++steps;
    line.clear();
    line += "{\"step\":";
    put(line, steps);
    line += ",\"lm_loss\":2.7182818284590451,\"grad_norm\":0.5772156649015329,\"lr\":0.0003,\"tokens\":";
    put(line, tokens);
    line += ",\"step_time_s\":1.4142135623730951,\"tokens_per_s\":23170.475,\"gflops\":391.2,"
            "\"mem\":{\"param\":1048576,\"grad\":1048576,\"optim\":2097152,\"activation\":8388608,\"comm\":0,"
            "\"workspace\":65536,\"total\":12648448},\"comm_bytes\":{\"ep\":73400320,\"edp\":1048576},"
            "\"comm_a2a_s\":{\"ep\":0.083},\"samples\":{\"first\":0,\"count\":256,\"epoch\":0},"
            "\"aux_loss\":0.0123,\"z_loss\":0.0,\"moe\":[";
    for (int64_t l = 0; l < a.layers; ++l) {
      double sum = 0;
      for (double x : w[l]) sum += x;
      const bool drops = steps % 10 == 0;
      std::fill(ranks.begin(), ranks.end(), 0);
      for (int64_t e = 0; e < a.experts; ++e) {
        const double mean = w[l][e] / sum * static_cast<double>(per_expert * a.experts);
        routed[e] = std::max<int64_t>(0, static_cast<int64_t>(mean + std::sqrt(mean + 1) * (std::generate_canonical<double, 32>(rng) - 0.5)));
        kept[e] = drops ? std::min<int64_t>(routed[e], 2 * per_expert) : routed[e];
        ranks[e / (a.experts / a.ep)] += kept[e];
      }
      line += l ? ",{\"layer\":" : "{\"layer\":";
      put(line, l + 1);
      for (auto [key, v] : {std::pair{"tokens_per_expert", &routed}, {"kept_per_expert", &kept}, {"tokens_per_ep_rank", &ranks}}) {
        line += ",\"";
        line += key;
        line += "\":[";
        for (size_t i = 0; i < v->size(); ++i) {
          if (i) line += ',';
          put(line, (*v)[i]);
        }
        line += ']';
      }
      line += ",\"dropped_fraction\":0.0,\"max_over_mean\":1.5}";
    }
    line += "]}\n";
    block += line;
    written += static_cast<int64_t>(line.size());
    if (block.size() > (8u << 20)) out.write(block), block.clear();
  }
  out.write(block);
  out.close();
  return steps;
}

void run_bench(const Args& a) {
  if (a.ep <= 0 || a.experts % a.ep != 0) ORIGAMI_USER_ERROR("bench imbalance: --ep ", a.ep, " must divide --experts ", a.experts);
  const std::string dir = a.dir.empty() ? (std::filesystem::temp_directory_path() / ("origami-bench-imbalance-" + std::to_string(::getpid()))).string() : a.dir;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec || !std::filesystem::is_directory(dir))
    ORIGAMI_USER_ERROR("bench imbalance --dir ", dir, ": cannot create it as a directory: ",
                       ec ? ec.message() : "a file of that name exists", " (rule: --dir names a directory to write in)");
  const std::string file = dir + "/metrics.jsonl";
  const auto g0 = std::chrono::steady_clock::now();
  const int64_t steps = write_synthetic(file, a, a.size_mb << 20);
  const std::string one_step = dir + "/one-step.jsonl";
  write_synthetic(one_step, a, 1);
  const double gen_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - g0).count();
  const double mb = static_cast<double>(std::filesystem::file_size(file)) / (1 << 20);
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const std::vector<std::string> wc = {"/usr/bin/wc", "-l", file}, tool = {self, "imbalance", file, "--json"};
  run_child(wc), run_child(tool);  // warm-up: the file in the page cache for both
  // The process's own start-up memory (the libraries it maps: with CUDA,
  // cuBLAS's relocated pages alone are ~218 MB), from a one-record file.
  const int64_t startup_kb = run_child({self, "imbalance", one_step, "--json"}).max_rss_kb;
  std::vector<double> wc_s, tool_s;
  int64_t rss_kb = 0;
  for (int64_t i = 0; i < a.repeat; ++i) {
    wc_s.push_back(run_child(wc).seconds);
    const ChildRun t = run_child(tool);
    tool_s.push_back(t.seconds);
    rss_kb = std::max(rss_kb, t.max_rss_kb);
  }
  const double wc_med = median(wc_s), tool_med = median(tool_s);
  if (a.json) {
    nlohmann::ordered_json j = {{"file_mb", mb}, {"steps", steps}, {"layers", a.layers}, {"experts", a.experts},
                                {"generate_s", gen_s}, {"wc_s", wc_med}, {"imbalance_s", tool_med},
                                {"wc_mb_per_s", mb / wc_med}, {"imbalance_mb_per_s", mb / tool_med},
                                {"ratio", tool_med / wc_med}, {"max_rss_mb", static_cast<double>(rss_kb) / 1024},
                                {"startup_rss_mb", static_cast<double>(startup_kb) / 1024},
                                {"analysis_rss_mb", static_cast<double>(rss_kb - startup_kb) / 1024}};
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("bench imbalance: %.0f MB, %lld steps x %lld MoE layers x %lld experts (written in %.1f s)\n", mb,
                static_cast<long long>(steps), static_cast<long long>(a.layers), static_cast<long long>(a.experts), gen_s);
    std::printf("  wc -l               %7.2f s  %7.0f MB/s   (median of %lld)\n", wc_med, mb / wc_med,
                static_cast<long long>(a.repeat));
    std::printf("  origami imbalance   %7.2f s  %7.0f MB/s   %.1fx the line count\n", tool_med, mb / tool_med,
                tool_med / wc_med);
    std::printf("  peak RSS %.0f MB: %.0f MB the process at start-up (one-record file), %.0f MB the analysis\n",
                static_cast<double>(rss_kb) / 1024, static_cast<double>(startup_kb) / 1024,
                static_cast<double>(rss_kb - startup_kb) / 1024);
  }
  if (a.dir.empty()) std::filesystem::remove_all(dir);
}

}  // namespace

void add_bench_imbalance_command(CLI::App& bench) {
  auto args = std::make_shared<Args>();
  CLI::App* cmd = bench.add_subcommand("imbalance", "origami imbalance on a large synthetic metrics.jsonl beside wc -l");
  // Bounds: a record (layers · experts counts) stays tens of MB at most, and
  // the file a terabyte.
  cmd->add_option("--size-mb", args->size_mb, "File size to write (MB)")->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--layers", args->layers, "MoE layers per record")->check(CLI::Range(int64_t{1}, int64_t{1024}));
  cmd->add_option("--experts", args->experts, "Experts per layer")->check(CLI::Range(int64_t{1}, int64_t{4096}));
  cmd->add_option("--ep", args->ep, "EP ranks per record")->check(CLI::Range(int64_t{1}, int64_t{4096}));
  cmd->add_option("--repeat", args->repeat, "Timed runs of each (median)")->check(CLI::Range(int64_t{1}, int64_t{1000}))
      ->capture_default_str();
  cmd->add_option("--dir", args->dir, "Keep the file in this directory (default: a temporary one, removed)");
  cmd->add_flag("--json", args->json, "Print the figures as JSON");
  cmd->callback([args] {
    require_one_process("bench imbalance");
    run_bench(*args);
  });
}

}  // namespace origami::tools

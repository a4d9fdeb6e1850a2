// `origami preprocess`: text / JSONL / fortune files -> byte-level Megatron
// indexed dataset (engine/preprocess.h does the work). Only rank 0 reads and
// writes; other ranks of an mpirun job return at once. Progress goes to stderr
// (one line redrawn with \r), the summary to stdout (a JSON object with
// --json), so stdout stays machine-readable.
#include <chrono>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/preprocess.h"
#include "kernels/check.h"
#include "tools/commands.h"

namespace origami::tools {

namespace {

struct PreprocessArgs {
  std::vector<std::string> inputs;
  std::string output_prefix;
  std::string format = "text";
  bool json = false;
};

// Redraws "preprocess [#####     ]  42.0%  12.3 MB/s" at most 10 times a
// second, and always for the final call.
class ProgressBar {
 public:
  void operator()(int64_t done, int64_t total) {
    const auto now = std::chrono::steady_clock::now();
    const bool last = done >= total;
    if (!last && drawn_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
    last_draw_ = now;
    drawn_ = true;
    const double frac = total > 0 ? static_cast<double>(done) / static_cast<double>(total) : 1.0;
    const double secs = std::chrono::duration<double>(now - start_).count();
    const double mb_per_s = secs > 0 ? static_cast<double>(done) / 1e6 / secs : 0.0;
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(frac * kWidth);
    std::string bar(static_cast<size_t>(filled), '#');
    bar.append(static_cast<size_t>(kWidth - filled), ' ');
    std::fprintf(stderr, "\rpreprocess [%s] %5.1f%%  %8.1f MB/s", bar.c_str(), 100.0 * frac, mb_per_s);
    if (last) std::fputc('\n', stderr);
    std::fflush(stderr);
  }

 private:
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point last_draw_;
  bool drawn_ = false;
};

void run(const PreprocessArgs& args) {
  if (job_rank() != 0) return;  // one writer; the other ranks have nothing to do

  PreprocessOptions options;
  options.inputs = args.inputs;
  options.output_prefix = args.output_prefix;
  options.format = parse_preprocess_format(args.format);
  ProgressBar bar;
  const PreprocessStats stats = run_preprocess(options, [&bar](int64_t done, int64_t total) { bar(done, total); });

  if (args.json) {
    nlohmann::json out = {{"documents", stats.documents}, {"tokens", stats.tokens}, {"bytes", stats.bytes},
                          {"bin", stats.bin_path},        {"idx", stats.idx_path}};
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::printf("preprocess: %lld documents, %lld tokens from %lld bytes -> %s, %s\n",
                static_cast<long long>(stats.documents), static_cast<long long>(stats.tokens),
                static_cast<long long>(stats.bytes), stats.bin_path.c_str(), stats.idx_path.c_str());
  }
  std::fflush(stdout);
}

}  // namespace

void add_preprocess_command(CLI::App& app) {
  auto args = std::make_shared<PreprocessArgs>();
  CLI::App* cmd = app.add_subcommand(
      "preprocess", "Turn text, JSONL or fortune files into a byte-level indexed dataset (.bin/.idx)");
  cmd->add_option("--input", args->inputs, "Input files (one or more)")
      ->required()
      ->expected(1, -1)
      ->check(CLI::ExistingFile);
  cmd->add_option("--output-prefix", args->output_prefix, "Writes PREFIX.bin and PREFIX.idx")->required();
  cmd->add_option("--format", args->format,
                  "text: each file is a document; jsonl: one {\"text\": ...} object per line; "
                  "fortune: entries separated by lines of '%'")
      ->check(CLI::IsMember({"text", "jsonl", "fortune"}))
      ->capture_default_str();
  cmd->add_flag("--json", args->json, "Print the summary as one JSON object");
  cmd->callback([args] { run(*args); });
}

}  // namespace origami::tools

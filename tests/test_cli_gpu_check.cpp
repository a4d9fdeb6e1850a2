// The reports of tools/gpu_check.sh (tools/gpu_check_report.py), on a CPU
// machine, from inputs made the way the GPU check makes them: CTest's own
// JUnit file, `origami train` metrics and tools/train_torch.py results
// (both run here on the CPU), and `origami bench kernels --json`. The GPU
// check runs once per lent machine with no chance to fix it there; a
// report that broke on real records would lose that run's figures.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>

#include "cli_util.h"

namespace origami {
namespace {

namespace fs = std::filesystem;
using testing::run_command;
using testing::ScratchDir;

const std::string kPython = "/usr/bin/python3";
const std::string kReport = std::string(ORIGAMI_SOURCE_DIR) + "/tools/gpu_check_report.py";
const std::string kOrigami = ORIGAMI_BINARY;

// The report's output, status 0 asserted by the caller through `status`.
testing::CommandResult report(const std::string& args, const std::string& env = "") {
  return run_command(env + (env.empty() ? "" : " ") + kPython + " " + kReport + " " + args);
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

nlohmann::json read_json(const std::string& path) { return nlohmann::json::parse(testing::read_file(path)); }

// A CTest project whose tests pass (printing a figure), fail, skip by a
// regular expression (as gtest_discover_tests marks GTEST_SKIP), skip by
// exit code, and are disabled; its JUnit file is what the GPU check's
// `ctest --output-junit` writes.
TEST(GpuCheckReport, CountsFiguresAndUnexpectedSkipsFromCTestsJUnitFile) {
  ScratchDir dir("junit");
  testing::write_file(dir / "CMakeLists.txt", R"(cmake_minimum_required(VERSION 3.21)
project(junit NONE)
enable_testing()
add_test(NAME Passes COMMAND sh -c "echo '[ measured ] 0.5 of a bound'; echo other output")
add_test(NAME Fails COMMAND false)
add_test(NAME Skips COMMAND sh -c "echo '[  SKIPPED ] no device'")
set_tests_properties(Skips PROPERTIES SKIP_REGULAR_EXPRESSION "\\[  SKIPPED \\]")
add_test(NAME SkipsByDesign COMMAND sh -c "exit 77")
set_tests_properties(SkipsByDesign PROPERTIES SKIP_RETURN_CODE 77)
add_test(NAME Off COMMAND true)
set_tests_properties(Off PROPERTIES DISABLED TRUE)
)");
  auto r = run_command("cmake -S " + dir.str() + " -B " + (dir / "build"));
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string xml = dir / "ctest.xml";
  r = run_command("ctest --test-dir " + (dir / "build") + " --test-output-size-passed 65536 --output-junit " + xml);
  ASSERT_NE(r.status, 0) << "a test fails: " << r.output;
  ASSERT_TRUE(fs::exists(xml)) << r.output;

  r = report("ctest-counts " + xml);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output, "1 1 3 5\n") << "passed failed skipped total (disabled counts as skipped)";
  r = report("ctest-figures " + xml);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output, "  Passes: 0.5 of a bound\n");
  r = report("unexpected-skips " + xml + " SkipsByDesign");
  ASSERT_EQ(r.status, 0) << r.output;
  const std::vector<std::string> unexpected = lines_of(r.output);
  EXPECT_EQ(std::set<std::string>(unexpected.begin(), unexpected.end()), (std::set<std::string>{"Skips", "Off"}))
      << r.output;
  r = report("unexpected-skips " + xml + " SkipsByDesign Skips Off");
  EXPECT_EQ(r.output, "") << "every skip allowed";
}

// train-gpu and train-torch on real records: origami trains tiny-moe on the
// CPU under the GPU configs' names, tools/train_torch.py trains its twin on
// the CPU; the runs the GPU check can meet are all here (a whole run, one cut
// short, none; PyTorch's result, its skip, its fit at fewer layers, none).
TEST(GpuCheckReport, TrainingNotesFromOrigamisAndPyTorchsRecords) {
  ScratchDir dir("train-report");
  auto r = testing::preprocess_fortunes(dir / "corpus");
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string build = dir / "build";
  fs::create_directories(build);
  std::vector<std::string> configs;
  for (const char* name : {"gpu-whole", "gpu-cut", "gpu-fit", "gpu-absent"}) {
    configs.push_back(dir / (std::string(name) + ".toml"));
    fs::copy_file(std::string(ORIGAMI_SOURCE_DIR) + "/configs/tiny-moe.toml", configs.back());
  }
  std::string config_args;
  for (const std::string& c : configs) config_args += " " + c;
  const auto train = [&](const std::string& config, const std::string& run, int steps, const std::string& more) {
    auto t = run_command(kOrigami + " train " + config + " --set data.path=" + (dir / "corpus") +
                         " --set training.steps=" + std::to_string(steps) +
                         " --set export.dir= --set logging.dir=" + build + "/train-" + run + more);
    ASSERT_EQ(t.status, 0) << t.output;
  };
  // gpu_check's 4 steps: 2 of warm-up, then the median of steps 3 and 4.
  train(configs[0], "gpu-whole", 4, "");
  train(configs[1], "gpu-cut", 2, "");  // stopped before the last step
  // As on a GPU smaller than the config's: the layers that fit (3 of 4),
  // then origami again at the fewer layers PyTorch fitted.
  train(configs[2], "gpu-fit", 4, " --set model.num_layers=3");
  train(configs[2], "gpu-fit-L2", 4, " --set model.num_layers=2");
  if (HasFatalFailure()) return;

  // origami's side, as on an H200 SXM (datasheet MFU beside the measured
  // one), with the check's build holding its binary: the plan of each run's
  // own config beside its measured peak.
  fs::create_directories(build + "/tools");
  fs::create_symlink(kOrigami, build + "/tools/origami");
  const std::string ours = dir / "train_gpu.json";
  r = report("train-gpu " + ours + " " + build + " 4" + config_args, "GPU_NAME='NVIDIA H200'");
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json runs = read_json(ours);
  ASSERT_EQ(runs.size(), 2u) << runs.dump();
  const nlohmann::json& whole = runs.at("gpu-whole");
  EXPECT_EQ(whole.at("layers"), 4);
  EXPECT_EQ(whole.at("config_layers"), 4);
  EXPECT_EQ(runs.at("gpu-fit").at("layers"), 3);
  EXPECT_EQ(runs.at("gpu-fit").at("config_layers"), 4);
  const std::vector<nlohmann::json> records = testing::read_jsonl(build + "/train-gpu-whole/metrics.jsonl");
  ASSERT_EQ(records.size(), 4u);
  // The median of the two timed steps is their mean.
  const auto timed = [&](const char* key) {
    return (records[2].at(key).get<double>() + records[3].at(key).get<double>()) / 2;
  };
  EXPECT_EQ(whole.at("step"), 4);
  EXPECT_EQ(whole.at("timed_steps"), nlohmann::json::array({3, 4}));
  EXPECT_DOUBLE_EQ(whole.at("tokens_per_s").get<double>(), timed("tokens_per_s"));
  EXPECT_DOUBLE_EQ(whole.at("gflops").get<double>(), timed("gflops"));
  EXPECT_DOUBLE_EQ(whole.at("mfu_datasheet").get<double>(), timed("gflops") / 989.4e3);
  EXPECT_EQ(whole.at("lm_loss"), records[3].at("lm_loss")) << "the rest is the last step's record";
  // The plan of the run's own config.toml: tiny-moe in bf16 on one rank, the
  // measured peak above it by the kernel workspaces it leaves out.
  const nlohmann::json plan = nlohmann::json::parse(
      run_command(kOrigami + " plan " + build + "/train-gpu-whole/config.toml --world 1 --recipe bf16 --json").output);
  const auto& ledger = plan.at("ledger");
  EXPECT_EQ(whole.at("planned_total_bytes"), ledger.at("stages").at(ledger.at("worst_stage").get<int>()).at("total"));
  char tok_s[64];
  std::snprintf(tok_s, sizeof tok_s, "gpu-whole: %.0f tok/s, ", timed("tokens_per_s"));
  EXPECT_NE(r.output.find(tok_s), std::string::npos) << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex("MFU [0-9.]+% of the measured [0-9]+ TFLOP/s \\([0-9.]+% of the "
                                                     "989 TFLOP/s datasheet\\), peak [0-9.]+ GB \\(planned [0-9.]+ GB, workspaces not "
                                                     "counted\\), comm exposed "
                                                     "0\\.000 s; gpu-cut: stopped after step 2 of 4; gpu-fit at 3 of 4 "
                                                     "layers \\(what fits this GPU\\): [0-9]+ tok/s, .*; "
                                                     "gpu-absent: no metrics\n$")))
      << r.output;
  r = report("train-gpu " + (dir / "nvl.json") + " " + build + " 4 " + configs[0], "GPU_NAME='NVIDIA H200 NVL'");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output.find("datasheet"), std::string::npos) << "no datasheet peak for an NVL board: " << r.output;
  EXPECT_FALSE(read_json(dir / "nvl.json").at("gpu-whole").contains("mfu_datasheet"));

  // PyTorch's side: the twin itself for gpu-whole; a skip; a fit at 2 of 4 layers
  // whose allocator retried.
  r = run_command(kPython + " " + ORIGAMI_SOURCE_DIR + "/tools/train_torch.py " + configs[0] +
                  " --steps 1 --warmup 0 --device cpu --json " + build + "/torch-gpu-whole.json");
  ASSERT_EQ(r.status, 0) << r.output;
  testing::write_file(build + "/torch-gpu-cut.json", R"({"config": "gpu-cut", "skipped": "no CUDA device"})");
  testing::write_file(build + "/torch-gpu-fit.json",
                      R"({"config": "gpu-fit", "tokens_per_s": 1000.0, "peak_memory_bytes": 2.5e9, "layers": 2,
                          "oom_layers": [3], "alloc_retries": 3})");
  const std::string theirs = dir / "train_torch.json";
  r = report("train-torch " + theirs + " " + ours + " " + build + " 4" + config_args);
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json torch = read_json(theirs);
  const nlohmann::json twin = read_json(build + "/torch-gpu-whole.json");
  EXPECT_DOUBLE_EQ(torch.at("gpu-whole").at("origami_over_torch").get<double>(),
                   timed("tokens_per_s") / twin.at("tokens_per_s").get<double>());
  const std::vector<nlohmann::json> fit = testing::read_jsonl(build + "/train-gpu-fit-L2/metrics.jsonl");
  ASSERT_EQ(fit.size(), 4u);
  EXPECT_DOUBLE_EQ(torch.at("gpu-fit").at("origami_over_torch").get<double>(),
                   (fit[2].at("tokens_per_s").get<double>() + fit[3].at("tokens_per_s").get<double>()) / 2 / 1000.0);
  EXPECT_EQ(torch.at("gpu-fit").at("origami_same_layers").at("step"), 4);
  EXPECT_EQ(torch.at("gpu-cut").at("skipped"), "no CUDA device");
  EXPECT_FALSE(torch.contains("gpu-absent"));
  EXPECT_TRUE(std::regex_search(r.output, std::regex("^gpu-whole: torch [0-9]+ tok/s, peak 0\\.0 GB, origami/torch "
                                                     "[0-9.]+x; gpu-cut: no CUDA device; gpu-fit: torch 1000 tok/s at "
                                                     "2 layers \\(out of memory at 3\\), peak 2\\.5 GB, 3 "
                                                     "allocator retries, origami/torch [0-9.]+x; gpu-absent: no "
                                                     "result\n$")))
      << r.output;
}

// fit-layers: the GPU configs are sized for an H200; on a smaller GPU the
// check runs each at the most layers whose planned peak fits the memory
// less the reserve. The answer is the boundary the plan draws (L fits, L + 1
// does not), for an H100's 81559 MiB, an H200's 143771 MiB, and a memory
// that not one layer fits.
TEST(GpuCheckReport, FitLayersIsTheMostLayersThePlanFitsInTheGpu) {
  const std::string mixtral = std::string(ORIGAMI_SOURCE_DIR) + "/configs/gpu-mixtral-h200.toml";
  const int64_t reserve = 6'000'000'000;
  const auto planned_peak = [&](int layers) {
    auto r = run_command(kOrigami + " plan " + mixtral + " --world 1 --recipe bf16 --json --set model.num_layers=" +
                         std::to_string(layers));
    EXPECT_EQ(r.status, 0) << r.output;
    const nlohmann::json ledger = nlohmann::json::parse(r.output).at("ledger");
    return ledger.at("stages").at(ledger.at("worst_stage").get<size_t>()).at("total").get<int64_t>();
  };
  const auto fit = [&](int64_t memory) {
    auto r = report("fit-layers " + kOrigami + " " + mixtral + " " + std::to_string(memory) + " " +
                    std::to_string(reserve));
    EXPECT_EQ(r.status, 0) << r.output;
    return std::stoi(r.output);
  };
  const int64_t h100 = 81559LL << 20, h200 = 143771LL << 20;
  const int on_h100 = fit(h100);
  EXPECT_EQ(on_h100, 3);
  EXPECT_LE(planned_peak(on_h100), h100 - reserve);
  EXPECT_GT(planned_peak(on_h100 + 1), h100 - reserve);
  EXPECT_EQ(fit(h200), 5) << "the config's own layers on the GPU it is sized for";
  EXPECT_EQ(fit(reserve + planned_peak(1) - 1), 0);
  EXPECT_EQ(fit(reserve + planned_peak(1)), 1);
}

// The kernel table: origami's ops (a real CPU run at the tiny shapes) beside
// PyTorch's by key, PyTorch's extra keys listed after, nothing measured said
// as such.
TEST(GpuCheckReport, KernelTableMatchesOrigamisOpsToPyTorchsByKey) {
  ScratchDir dir("kernel-table");
  auto r = run_command(kOrigami + " bench kernels --device cpu --shapes tiny --samples 3 --json");
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string ours_path = dir / "bench_kernels.json";
  testing::write_file(ours_path, r.output.substr(r.output.find('{')));
  const nlohmann::json ours = read_json(ours_path);
  const nlohmann::json& ops = ours.at("ops");
  ASSERT_GT(ops.size(), 2u);
  const double ms0 = ops[0].at("ms").get<double>();
  nlohmann::json torch = {{"bench", "kernels_torch"}, {"device_name", "NVIDIA H200"}, {"dtype", "bf16"},
                          {"ops",
                           {{{"key", ops[0].at("key")}, {"impl", "torch.mm"}, {"shape", "s"}, {"ms", 2 * ms0}},
                            {{"key", "only/torch"}, {"impl", "sdpa"}, {"shape", "s"}, {"ms", 1.25}}}}};
  testing::write_file(dir / "bench_torch.json", torch.dump());
  r = report("kernel-table " + ours_path + " " + (dir / "bench_torch.json"));
  ASSERT_EQ(r.status, 0) << r.output;
  const std::vector<std::string> lines = lines_of(r.output);
  // origami's facts, torch's, the header, one row per op of ours, the extra key, the legend.
  ASSERT_EQ(lines.size(), 3 + ops.size() + 2) << r.output;
  EXPECT_EQ(lines[0].rfind("origami: " + ours.at("device_name").get<std::string>() + "; f32; ceiling ", 0), 0u)
      << lines[0];
  EXPECT_EQ(lines[1], "torch: NVIDIA H200; bf16");
  EXPECT_EQ(lines[2].rfind("key ", 0), 0u) << lines[2];
  for (size_t i = 0; i < ops.size(); ++i) {
    const std::string& row = lines[3 + i];
    EXPECT_EQ(row.rfind(ops[i].at("key").get<std::string>().substr(0, 26), 0), 0u) << row;
    const std::string ratio = row.substr(row.find_last_of(' ') + 1);
    EXPECT_EQ(ratio, i == 0 ? "0.50" : "-") << row;
  }
  EXPECT_TRUE(std::regex_search(lines[3 + ops.size()], std::regex("^only/torch .* 1\\.250 sdpa +-$")))
      << lines[3 + ops.size()];
  r = report("kernel-table " + (dir / "absent.json") + " " + (dir / "absent.json"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output, "kernels: nothing measured\n");
}

}  // namespace
}  // namespace origami

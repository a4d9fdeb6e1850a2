// Bad input through the real binary: every user error exits with status 2 and
// a message naming the file, the key or byte offset, and the rule; nothing
// crashes. Config rules are tested in depth in test_engine_config and data
// rules in test_engine_data; this file checks the CLI contract for each case.
#include <gtest/gtest.h>

#include <cstring>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli_util.h"
#include "kernels/device.h"

namespace origami {
namespace {

using testing::read_file;
using testing::run_command;
using testing::ScratchDir;
using testing::write_file;

const std::string kBinary = ORIGAMI_BINARY;

// A tiny valid config; `extra` lines are appended to the sections given.
std::string tiny_config(const std::string& data_path, const std::string& model_extra = "",
                        const std::string& training_extra = "") {
  return "[model]\nvocab_size = 257\nhidden_size = 32\nnum_layers = 1\nnum_heads = 2\nnum_kv_heads = 1\n"
         "ffn_hidden_size = 48\n" +
         model_extra + "\n[training]\nsteps = 1\nseq_len = 16\nglobal_batch = 2\nmicro_batch = 2\n" +
         training_extra + "\n[data]\npath = \"" + data_path + "\"\n";
}

class CliErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string text;
    for (int i = 0; i < 40; ++i) text += "The quick brown fox " + std::to_string(i) + " jumps over the lazy dog.\n";
    write_file(dir / "a.txt", text);
    write_file(dir / "b.txt", text + text);
    auto r = run_command(kBinary + " preprocess --format text --input " + (dir / "a.txt") + " " + (dir / "b.txt") +
                         " --output-prefix " + (dir / "good"));
    ASSERT_EQ(r.status, 0) << r.output;
  }

  // Copies the good dataset to `name`, lets `patch` edit the idx and bin bytes.
  std::string corrupt(const std::string& name, const std::function<void(std::string& idx, std::string& bin)>& patch) {
    std::string idx = read_file(dir / "good.idx"), bin = read_file(dir / "good.bin");
    patch(idx, bin);
    write_file(dir / (name + ".idx"), idx);
    write_file(dir / (name + ".bin"), bin);
    return dir / name;
  }

  testing::CommandResult train_with(const std::string& config_text, const std::string& args = "") {
    write_file(dir / "c.toml", config_text);
    return run_command(kBinary + " train " + (dir / "c.toml") + " " + args);
  }

  void expect_user_error(const testing::CommandResult& r, const std::vector<std::string>& needles) {
    EXPECT_EQ(r.status, 2) << r.output;
    for (const std::string& n : needles) EXPECT_NE(r.output.find(n), std::string::npos) << "missing '" << n << "' in:\n"
                                                                                          << r.output;
  }

  ScratchDir dir{"cli-errors"};
};

TEST_F(CliErrors, GoodConfigTrains) {
  auto r = train_with(tiny_config(dir / "good"));
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("lm loss"), std::string::npos) << r.output;
}

TEST_F(CliErrors, TrainJsonPrintsTheMetricsRecords) {
  auto r = train_with(tiny_config(dir / "good"), "--json --set training.steps=2");
  ASSERT_EQ(r.status, 0) << r.output;
  std::istringstream lines(r.output);
  std::string line;
  int records = 0;
  while (std::getline(lines, line)) {
    if (line.empty() || line[0] != '{') continue;
    auto j = nlohmann::json::parse(line);
    EXPECT_EQ(j.at("step").get<int>(), ++records);
    EXPECT_GT(j.at("lm_loss").get<double>(), 0.0);
  }
  EXPECT_EQ(records, 2) << r.output;
}

TEST_F(CliErrors, UnknownKeyWithDidYouMean) {
  expect_user_error(train_with(tiny_config(dir / "good", "", "seqlen = 8")),
                    {"c.toml", "training.seqlen", "did you mean", "training.seq_len"});
}

TEST_F(CliErrors, WrongType) {
  expect_user_error(train_with(tiny_config(dir / "good"), "--set training.steps=abc"), {"training.steps", "integer"});
}

TEST_F(CliErrors, OutOfRange) {
  expect_user_error(train_with(tiny_config(dir / "good"), "--set model.num_layers=0"), {"model.num_layers", ">= 1"});
}

TEST_F(CliErrors, HeadsNotDividingHidden) {
  expect_user_error(train_with(tiny_config(dir / "good"), "--set model.num_heads=3"),
                    {"model.hidden_size", "model.num_heads"});
}

// runtime.device = "cuda" where there is no device (or no CUDA build): exit 2
// before any step, naming the key and the reason.
TEST_F(CliErrors, CudaWithoutADevice) {
  if (built_with_cuda() && cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present";
  expect_user_error(train_with(tiny_config(dir / "good"), "--set runtime.device=cuda"),
                    {"--set runtime.device=cuda: runtime.device = \"cuda\", but this ",
                     built_with_cuda() ? "sees no CUDA device" : "built without the CUDA backend"});
}

TEST_F(CliErrors, MissingConfigFile) {
  auto r = run_command(kBinary + " train " + (dir / "nope.toml"));
  expect_user_error(r, {"nope.toml"});
}

TEST_F(CliErrors, IdxWrongMagic) {
  auto p = corrupt("magic", [](std::string& idx, std::string&) { idx[0] = 'X'; });
  expect_user_error(train_with(tiny_config(p)), {"magic.idx", "offset 0", "magic"});
}

TEST_F(CliErrors, IdxWrongVersion) {
  auto p = corrupt("version", [](std::string& idx, std::string&) { idx[9] = 7; });
  expect_user_error(train_with(tiny_config(p)), {"version.idx", "offset 9", "version"});
}

TEST_F(CliErrors, IdxTruncatedArrays) {
  auto p = corrupt("trunc", [](std::string& idx, std::string&) { idx.resize(idx.size() - 12); });
  expect_user_error(train_with(tiny_config(p)), {"trunc.idx", "offset"});
}

TEST_F(CliErrors, BinSizeMismatch) {
  auto p = corrupt("binsize", [](std::string&, std::string& bin) { bin.resize(bin.size() - 6); });
  expect_user_error(train_with(tiny_config(p)), {"binsize.bin", "bytes"});
}

TEST_F(CliErrors, TokenIdNotBelowVocab) {
  // u16 tokens: overwrite the 5th token with 300 (vocab is 257).
  auto p = corrupt("vocab", [](std::string&, std::string& bin) {
    bin[8] = static_cast<char>(300 & 0xff);
    bin[9] = static_cast<char>(300 >> 8);
  });
  expect_user_error(train_with(tiny_config(p)), {"vocab.bin", "offset 8", "300", "257"});
}

TEST_F(CliErrors, BadCommandLine) {
  auto r = run_command(kBinary + " train");
  EXPECT_EQ(r.status, 2) << r.output;
  r = run_command(kBinary + " frobnicate");
  EXPECT_EQ(r.status, 2) << r.output;
}

TEST_F(CliErrors, EvalSamplesOutOfRange) {
  write_file(dir / "c.toml", tiny_config(dir / "good", "", "") + "\n[export]\ndir = \"" + (dir / "w") + "\"\n");
  auto r = run_command(kBinary + " train " + (dir / "c.toml") + " --set training.steps=0");
  ASSERT_EQ(r.status, 0) << r.output;
  r = run_command(kBinary + " eval " + (dir / "c.toml") + " --weights " + (dir / "w") + " --data " + (dir / "good") +
                  " --samples 100000");
  expect_user_error(r, {"--samples", "windows"});
}

// Option values the parser would otherwise read as something else: an
// empty value as "not given" (an --html written nowhere, --only selecting
// every op), an integer past 64 bits as the largest one (and the message
// quoting a number nobody typed), an empty item of a comma list as no item.
TEST_F(CliErrors, EmptyValuesHugeIntegersAndEmptyListItemsAreRefusedAsTyped) {
  write_file(dir / "c.toml", tiny_config(dir / "good"));
  const std::string config = dir / "c.toml";
  const std::pair<std::string, std::vector<std::string>> cases[] = {
      {" imbalance " + (dir / "none") + " --html ''", {"--html: an empty value (rule: give one"}},
      {" bench kernels --only ''", {"--only: an empty value"}},
      {" bench checkpoint --config " + config + " --dir ''", {"--dir: an empty value"}},
      {" plan ''", {"config: an empty value"}},
      {" train " + config + " --set ''", {"--set: an empty value"}},
      {" bench comm --max-bytes 99999999999999999999", {"--max-bytes: '99999999999999999999' does not fit in 64 bits"}},
      {" eval " + config + " --weights w --data d --samples 99999999999999999999",
       {"--samples: '99999999999999999999' does not fit in 64 bits"}},
      {" plan " + config + " --world 2 --set parallel.pp=2 --pp-layers 1,,1",
       {"--pp-layers '1,,1': item 2 is empty (rule: comma-separated items, none empty)"}},
      {" plan " + config + " --world 2 --set parallel.pp=2 --pp-layers 1,", {"--pp-layers '1,': item 2 is empty"}},
      {" plan " + config + " --world 2 --set parallel.pp=2 --pp-layers 99999999999999999999,1",
       {"--pp-layers '99999999999999999999': does not fit in 64 bits"}},
      {" bench kernels --skip attention,", {"--skip 'attention,': item 2 is empty"}},
      {" plan " + config + " --world 1 --pp-layers 1 --pp-layers 2,,3", {"--pp-layers '2,,3': item 2 is empty"}},
      {" plan " + config + " --world 1 --pp-layers ' 1, '", {"--pp-layers ' 1, ': item 2 is empty"}},
      // Hex and leading blanks: CLI11 reads those too (strtoll, base 0).
      {" groups --world 4 --tp 0x1FFFFFFFFFFFFFFFFFFFFFFFF", {"--tp: '0x1FFFFFFFFFFFFFFFFFFFFFFFF' does not fit in 64 bits"}},
      {" groups --world 4 --tp ' 99999999999999999999'", {"does not fit in 64 bits"}},
  };
  for (const auto& [args, needles] : cases) {
    SCOPED_TRACE(args);
    const auto r = run_command(kBinary + args);
    expect_user_error(r, needles);
    EXPECT_EQ(r.output.find("9223372036854775807"), std::string::npos) << r.output;
  }
  // A list as meant still parses, spaced or signed as a number may be.
  for (const char* list : {"1", "' 1'", "+1"}) {
    auto r = run_command(kBinary + " plan " + config + " --world 1 --pp-layers " + list);
    EXPECT_EQ(r.status, 0) << list << "\n" << r.output;
  }
}

}  // namespace
}  // namespace origami

// The bf16 recipe on the CPU, end to end through the binary.
// runtime.precision = "bf16" trains with bf16 parameters, gradients and
// activations, and keeps fp32 master weights beside the AdamW moments. The
// CPU's f32 kernels widen bf16 inputs and round what they write, which is
// the CUDA kernels' per-element rule (HostBf16, kernels/dispatch_detail.h). The
// cases:
//   - 20 steps of configs/tiny-moe.toml on one rank give per-step LM losses
//     within 2e-2 relative of the fp32 run and a falling curve. At least one
//     step differs from fp32 by more than 1e-4, so bf16 really ran. The
//     persistent param, grad and optim bytes are those of
//     `origami plan --recipe bf16`.
//   - Folded layouts train within kLayoutRtol of the one-rank bf16 run over
//     6 steps, each with the plan's persistent bytes for its rank 0:
//       * TP 2 × EP 2 at ZeRO 3 with overlap_grad_reduce (np 4);
//       * PP 2 × CP 2 (np 4);
//       * ETP 2 × EP 2 (np 4).
//     Bf16 collectives round each combine (comm/mpi_communicator.cpp).
//     Multi-rank runs train on the host stand-in device (ORIGAMI_HOST_STAND_IN=1:
//     the device path of saves and loads, communication by NCCL's rules
//     as in the parity tests, bf16 receive bytes reading NaN until the wait).
//     The pipelined layout holds the plan's activations per stage within 5%.
//   - Bytes on the wire per group (TP 2 × EP 2; PP 2 × CP 2 × ETP 2, padded
//     to capacity) are within 1% of `origami plan`'s bf16 figures.
//   - Resume on EP 2 (np 2) is bit-exact: 3 steps, a checkpoint and 3 more
//     give bitwise the losses and grad norms of 6 uninterrupted steps.
//   - Resharding: a bf16 checkpoint saved under TP 2 × EP 2 at ZeRO 3
//     loads on one rank and under EP 2 at ZeRO 1 with bitwise the saved
//     master weights and moments.
//   - Checkpoints move between precisions: fp32 → bf16 and bf16 → fp32,
//     loaded and saved again at once, give bitwise the consolidated
//     parameters and moments that were saved. A bf16 checkpoint holds the
//     fp32 master, so the bf16 rounding is never the saved state.
// Why 2e-2 against fp32: bf16 keeps 8 significant bits (unit roundoff 2^-8,
// about 3.9e-3). Each activation and weight read is off by up to that, and the
// error compounds through 4 layers and 20 updates. 2e-2 is issue 18's bar
// for a GPU bf16 run against the CPU's fp32; the measured worst here is
// 1.25e-2 relative (2026-12-03, one rank).
// Why kLayoutRtol = 2e-4 against the one-rank bf16 run: the layouts' f32
// sums run in another order, and a sum that lands near a bf16 rounding
// boundary rounds to the neighbouring value (2^-8 relative on that element),
// so the layouts are not bitwise the one-rank run. Measured worst over the
// 6 steps (2026-12-03): 1.6e-5 (TP 2 × EP 2), 1.2e-5 (PP 2 × CP 2), 7.9e-6
// (ETP 2 × EP 2). 2e-4 leaves 12× room and is still 60× below bf16's
// distance from fp32, so a layout that lost the recipe would fail. The aux
// loss is a sum of per-expert products of routed fractions and mean scores,
// more sensitive to each score's rounding: measured worst 3.0e-4 (PP 2 ×
// CP 2), bound kAuxRtol = 2e-3.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "cli_checks.h"

namespace origami {
namespace {

using testing::consolidated;
using testing::read_jsonl;
using testing::run_command;

constexpr double kFp32Rtol = 2e-2;
constexpr double kLayoutRtol = 2e-4, kAuxRtol = 2e-3;

class Bf16Train : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::ScratchDir("bf16");
    corpus_ = testing::preprocess_fortunes(*dir_ / "fortunes");
  }
  // GoogleTest reports a failure in SetUpTestSuite as skipped tests (and
  // CTest counts them so): each test fails on it instead.
  void SetUp() override { ASSERT_EQ(corpus_.status, 0) << corpus_.output; }
  static inline testing::CommandResult corpus_;
  static void TearDownTestSuite() { delete dir_; }

  static std::string launcher(int np) {
    return np == 1 ? std::string()
                   : std::string("ORIGAMI_HOST_STAND_IN=1 ") + ORIGAMI_MPIEXEC +
                         " --allow-run-as-root --oversubscribe --bind-to none -np " + std::to_string(np) + " ";
  }
  // `np` ranks of tiny-moe for `steps` steps, logging into tag/.
  static testing::CommandResult train(const std::string& tag, int np, int steps, const std::string& extra) {
    return run_command(launcher(np) + ORIGAMI_BINARY + " train " + ORIGAMI_SOURCE_DIR + "/configs/tiny-moe.toml" +
                       " --set data.path=" + (*dir_ / "fortunes") + " --set logging.dir=" + (*dir_ / tag) +
                       " --set export.dir= --set training.steps=" + std::to_string(steps) + " " + extra);
  }
  static std::vector<nlohmann::json> records(const std::string& tag) { return read_jsonl(*dir_ / (tag + "/metrics.jsonl")); }

  // `origami plan --json` of tiny-moe with runtime.precision = "bf16" and
  // `sets` on `world` ranks (the recipe follows the config's precision).
  static nlohmann::json plan(int world, const std::string& sets) {
    auto r = run_command(std::string(ORIGAMI_BINARY) + " plan " + ORIGAMI_SOURCE_DIR + "/configs/tiny-moe.toml" +
                         " --world " + std::to_string(world) + " --json --set runtime.precision=bf16 " + sets);
    EXPECT_EQ(r.status, 0) << r.output;
    nlohmann::json j = nlohmann::json::parse(r.output);
    EXPECT_EQ(j.at("recipe"), "bf16");
    return j;
  }
  // The run's persistent bytes (rank 0's, every step) equal the plan's
  // ledger for pipeline stage 0 (whose first rank is rank 0).
  static void expect_planned_bytes(const std::vector<nlohmann::json>& run, const nlohmann::json& planned) {
    const nlohmann::json& stage0 = planned.at("ledger").at("stages").at(0);
    ASSERT_EQ(stage0.at("stage"), 0);
    for (const auto& rec : run)
      for (const char* key : {"param", "grad", "optim"})
        EXPECT_EQ(rec.at("mem").at("persistent").at(key).get<int64_t>(), stage0.at(key).get<int64_t>())
            << key << " bytes at step " << rec.at("step");
  }

  static std::string step_dir(const std::string& tag, int step) {
    return testing::step_dir(*dir_ / (tag + "-ckpt"), step);
  }

  static testing::ScratchDir* dir_;
};

testing::ScratchDir* Bf16Train::dir_ = nullptr;

TEST_F(Bf16Train, TracksFp32OverTwentyStepsWithThePlannedBytes) {
  auto r = train("fp32", 1, 20, "--set runtime.precision=fp32");
  ASSERT_EQ(r.status, 0) << r.output;
  r = train("bf16", 1, 20, "--set runtime.precision=bf16");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("training on cpu in bf16 (emulated: f32 kernels, rounded)"), std::string::npos) << r.output;
  const auto fp32 = records("fp32"), bf16 = records("bf16");
  ASSERT_EQ(fp32.size(), 20u);
  ASSERT_EQ(bf16.size(), 20u);
  double worst = 0;
  for (size_t s = 0; s < fp32.size(); ++s) {
    const double b = fp32[s].at("lm_loss").get<double>(), x = bf16[s].at("lm_loss").get<double>();
    ASSERT_TRUE(std::isfinite(x)) << "step " << s + 1;
    worst = std::max(worst, std::abs(x - b) / std::abs(b));
    EXPECT_LE(std::abs(x - b), kFp32Rtol * std::abs(b)) << "step " << s + 1 << ": bf16 " << x << ", fp32 " << b;
  }
  std::printf("bf16 against fp32, one rank: worst lm loss difference %.3g relative over 20 steps\n", worst);
  EXPECT_GT(worst, 1e-4) << "the bf16 run is the fp32 run: was bf16 applied?";
  EXPECT_LT(bf16.back().at("lm_loss").get<double>(), 0.9 * bf16.front().at("lm_loss").get<double>());
  expect_planned_bytes(bf16, plan(1, ""));
}

TEST_F(Bf16Train, FoldedLayoutsTrackOneRank) {
  constexpr int kSteps = 6;
  auto r = train("one", 1, kSteps, "--set runtime.precision=bf16");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto base = records("one");
  ASSERT_EQ(base.size(), static_cast<size_t>(kSteps));
  const struct {
    const char* tag;
    const char* sets;
    bool pipelined;
  } layouts[] = {
      {"tp2-ep2-zero3-overlap",
       "--set parallel.tp=2 --set parallel.ep=2 --set parallel.zero_stage=3 --set parallel.overlap_grad_reduce=true",
       false},
      {"pp2-cp2", "--set parallel.pp=2 --set parallel.cp=2", true},
      {"etp2-ep2", "--set parallel.etp=2 --set parallel.ep=2", false},
  };
  for (const auto& l : layouts) {
    SCOPED_TRACE(l.tag);
    r = train(l.tag, 4, kSteps, std::string("--set runtime.precision=bf16 ") + l.sets);
    ASSERT_EQ(r.status, 0) << r.output;
    const auto run = records(l.tag);
    ASSERT_EQ(run.size(), base.size());
    double worst = 0, worst_aux = 0;
    for (size_t s = 0; s < base.size(); ++s) {
      const double b = base[s].at("lm_loss").get<double>(), x = run[s].at("lm_loss").get<double>();
      worst = std::max(worst, std::abs(x - b) / std::abs(b));
      EXPECT_LE(std::abs(x - b), kLayoutRtol * std::abs(b)) << "step " << s + 1 << ": " << x << " vs " << b;
      const double ba = base[s].at("aux_loss").get<double>(), xa = run[s].at("aux_loss").get<double>();
      worst_aux = std::max(worst_aux, std::abs(xa - ba) / std::abs(ba));
      EXPECT_LE(std::abs(xa - ba), kAuxRtol * std::abs(ba)) << "aux loss, step " << s + 1;
    }
    std::printf("bf16 %s (np 4) against one rank over %d steps: worst relative difference %.3g (lm loss), %.3g (aux)\n",
                l.tag, kSteps, worst, worst_aux);
    const nlohmann::json planned = plan(4, l.sets);
    expect_planned_bytes(run, planned);
    // Pipelined: each stage's held activations (bf16 data, f32 statistics)
    // equal to the plan's, as tests/test_cli_parity.cpp checks in fp32.
    if (l.pipelined) testing::expect_held_as_planned(run.back(), planned);
  }
}

// Bytes on the wire per group at step 2 within 1% of the plan's bf16
// figures: rows, K/V, params and grads travel as bf16. Routing is padded to
// capacity so the all-to-all volumes are fixed, as in Parity's fp32 check.
TEST_F(Bf16Train, MeasuredCommBytesMatchThePlan) {
  const std::string capacity = " --set moe.capacity_factor=1.0 --set moe.pad_to_capacity=true";
  for (const auto& [tag, layout] :
       {std::pair{"comm-tp2-ep2", "--set parallel.tp=2 --set parallel.ep=2" + capacity},
        std::pair{"comm-pp2-cp2-etp2", "--set parallel.pp=2 --set parallel.cp=2 --set parallel.etp=2" + capacity}}) {
    SCOPED_TRACE(tag);
    auto r = train(tag, 4, 2, "--set runtime.precision=bf16 " + layout);
    ASSERT_EQ(r.status, 0) << r.output;
    const auto run = records(tag);
    ASSERT_EQ(run.size(), 2u);
    testing::expect_comm_bytes_as_planned(run[1], plan(4, layout));
  }
}

TEST_F(Bf16Train, ResumeOnEp2IsBitExact) {
  const std::string sets = "--set runtime.precision=bf16 --set parallel.ep=2 --set checkpoint.interval=3";
  auto r = train("whole", 2, 6, sets + " --set checkpoint.dir=" + (*dir_ / "whole-ckpt"));
  ASSERT_EQ(r.status, 0) << r.output;
  r = train("resumed", 2, 6,
            sets + " --set checkpoint.dir=" + (*dir_ / "resumed-ckpt") + " --set checkpoint.load=" + step_dir("whole", 3));
  ASSERT_EQ(r.status, 0) << r.output;
  const auto whole = records("whole"), resumed = records("resumed");
  ASSERT_EQ(whole.size(), 6u);
  ASSERT_EQ(resumed.size(), 3u);  // steps 4-6
  for (size_t i = 0; i < resumed.size(); ++i) {
    const nlohmann::json& a = whole.at(i + 3);
    const nlohmann::json& b = resumed[i];
    ASSERT_EQ(a.at("step"), b.at("step"));
    for (const char* key : {"lm_loss", "aux_loss", "grad_norm", "lr"})
      EXPECT_EQ(a.at(key).get<double>(), b.at(key).get<double>()) << key << " at step " << b.at("step");
  }
  const auto want = consolidated(step_dir("whole", 6), *dir_ / "whole-export");
  const auto got = consolidated(step_dir("resumed", 6), *dir_ / "resumed-export");
  ASSERT_FALSE(want.first.empty());
  EXPECT_TRUE(got.first == want.first) << "the resumed run ends in other parameters";
  EXPECT_TRUE(got.second == want.second) << "the resumed run ends in other AdamW moments";
}

// Resharding the bf16 state: saved under TP 2 × EP 2 at ZeRO 3 (np 4; the
// master weights sharded like the moments), loaded on one rank at ZeRO 0 and
// on two at EP 2, ZeRO 1, and saved again at once: the consolidated master
// weights and moments are bitwise those saved.
TEST_F(Bf16Train, ReshardingKeepsTheMasterWeightsBitwise) {
  const std::string bf16 = "--set runtime.precision=bf16 --set checkpoint.interval=3 ";
  auto r = train("reshard-saved", 4, 3,
                 bf16 + "--set parallel.tp=2 --set parallel.ep=2 --set parallel.zero_stage=3 --set checkpoint.dir=" +
                     (*dir_ / "reshard-saved-ckpt"));
  ASSERT_EQ(r.status, 0) << r.output;
  const auto want = consolidated(step_dir("reshard-saved", 3), *dir_ / "reshard-saved-export");
  ASSERT_FALSE(want.first.empty());
  const struct {
    const char* tag;
    int np;
    const char* sets;
  } loads[] = {{"reshard-one", 1, "--set parallel.zero_stage=0"},
               {"reshard-ep2", 2, "--set parallel.ep=2 --set parallel.zero_stage=1"}};
  for (const auto& l : loads) {
    SCOPED_TRACE(l.tag);
    r = train(l.tag, l.np, 3,
              bf16 + l.sets + " --set checkpoint.load=" + step_dir("reshard-saved", 3) + " --set checkpoint.dir=" +
                  (*dir_ / (std::string(l.tag) + "-ckpt")));
    ASSERT_EQ(r.status, 0) << r.output;
    const auto got = consolidated(step_dir(l.tag, 3), *dir_ / (std::string(l.tag) + "-export"));
    EXPECT_TRUE(got.first == want.first) << "consolidated master weights differ after resharding";
    EXPECT_TRUE(got.second == want.second) << "consolidated AdamW moments differ after resharding";
  }
}

// One bf16 rank and two fp32 ranks at ZeRO-3 (sharded, resharded on each
// load), with the expert bias on: each loads the other's checkpoint to the
// bit, and every run's export holds its weights (tests/cli_checks.h). The
// same check runs with the bf16 side on a GPU (tests/test_cli_cuda.cpp).
TEST_F(Bf16Train, CheckpointsMoveBetweenPrecisionsAndLayoutsBitExact) {
  const auto on = [](int np) {
    return [np](const std::string& tag, const std::string& sets) { return train(tag, np, 3, sets); };
  };
  testing::expect_moves_keep_the_state(on(1), "--set runtime.precision=bf16 --set moe.expert_bias=true", true, on(2),
                                       "--set runtime.precision=fp32 --set moe.expert_bias=true "
                                       "--set parallel.zero_stage=3",
                                       false, dir_->str());
}

}  // namespace
}  // namespace origami

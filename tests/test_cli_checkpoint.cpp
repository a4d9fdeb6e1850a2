// Sharded checkpoints end to end (engine/checkpoint.h), through the
// `origami` binary:
//   - bit-exact resume (llm.c's test): 20 uninterrupted steps against 10,
//     a checkpoint, a fresh process and 10 more — per-step losses, grad norms
//     and the samples each step read are bitwise equal, on one rank and on
//     configs/tiny-moe-folded8.toml at np 8 (whose export then equals the
//     consolidated export of its checkpoint byte for byte);
//   - resharding: saved under seven layouts, loaded under two others each, the
//     consolidated parameters and AdamW moments after loading are bitwise
//     the saved ones, and the next 5 steps' losses match the uninterrupted
//     one-rank run within 1e-6 relative; among them EP 4 under an expert
//     placement P (moe.expert_placement) loaded under the contiguous
//     placement and under another placement Q;
//   - faults: a rank killed during a save, SIGTERM mid-run, a divergence
//     stop, and damaged checkpoints (truncated, flipped byte, no
//     metadata.json, another model size) refused with exit 2 naming the file
//     or key.
// Why 1e-6 holds after resharding: the loaded state is bitwise the saved
// one; what differs is the order of the sums in the layout's reductions,
// ~1e-7 relative per step in fp32 (the parity tests measure 1e-9..1e-8 over
// these steps). Runs use tiny-moe (ZeRO 3, dropless, clipping active).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>

#include "cli_checks.h"
#include "cli_util.h"
#include "engine/safetensors.h"

namespace origami {
namespace {

using testing::expect_same_steps;

using testing::read_jsonl;
using testing::run_command;
namespace fs = std::filesystem;

// Multi-rank runs train on the host stand-in device (ORIGAMI_HOST_STAND_IN=1),
// as the parity tests do: their saves and loads take the device path (host
// copies of the state, read back into the device's), so a checkpoint saved
// there and loaded on one plain-cpu rank, and back, is the move between a
// GPU and CPU ranks.
std::string launcher(int np) {
  return np == 1 ? std::string()
                 : std::string("ORIGAMI_HOST_STAND_IN=1 ") + ORIGAMI_MPIEXEC +
                       " --allow-run-as-root --oversubscribe --bind-to none -np " + std::to_string(np) + " ";
}

class Checkpoint : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::ScratchDir("ckpt");
    corpus_ = testing::preprocess_fortunes(*dir_ / "fortunes");
  }
  // GoogleTest reports a failure in SetUpTestSuite as skipped tests (and
  // CTest counts them so): each test fails on it instead.
  void SetUp() override { ASSERT_EQ(corpus_.status, 0) << corpus_.output; }
  static inline testing::CommandResult corpus_;
  // The uninterrupted one-rank run, run by the first test that needs it (each
  // test is a process of its own): 20 steps, a checkpoint every 5, the
  // newest 3 kept.
  static const std::vector<nlohmann::json>& base() {
    if (!base_) {
      auto r = train("base", 1, "--set training.steps=20 --set checkpoint.interval=5 --set checkpoint.keep=3");
      EXPECT_EQ(r.status, 0) << r.output;
      base_ = new std::vector<nlohmann::json>(read_jsonl(*dir_ / "base/metrics.jsonl"));
      EXPECT_EQ(base_->size(), 20u);
    }
    return *base_;
  }
  static void TearDownTestSuite() {
    delete base_;
    delete dir_;
  }

  // `origami train` of tiny-moe (or `config`) on np ranks, logging to
  // <tag>/metrics.jsonl and checkpointing into ck-<tag> (when asked to).
  static testing::CommandResult train(const std::string& tag, int np, const std::string& extra,
                                      const std::string& config = "tiny-moe.toml") {
    return run_command(train_command(tag, np, extra, config));
  }
  static std::string train_command(const std::string& tag, int np, const std::string& extra,
                                   const std::string& config = "tiny-moe.toml") {
    return launcher(np) + ORIGAMI_BINARY + " train " + ORIGAMI_SOURCE_DIR + "/configs/" + config +
                       " --set data.path=" + (*dir_ / "fortunes") + " --set logging.dir=" + (*dir_ / tag) +
                       " --set checkpoint.dir=" + ck(tag) + " --set export.dir= --set logging.interval=10 " + extra;
  }
  static std::string ck(const std::string& tag) { return *dir_ / ("ck-" + tag); }
  static std::string step_dir(const std::string& tag, int step) {
    char name[32];
    std::snprintf(name, sizeof name, "/step-%08d", step);
    return ck(tag) + name;
  }
  static std::string latest(const std::string& tag) { return testing::read_file(ck(tag) + "/latest"); }

  static testing::ScratchDir* dir_;
  static std::vector<nlohmann::json>* base_;
};

testing::ScratchDir* Checkpoint::dir_ = nullptr;
std::vector<nlohmann::json>* Checkpoint::base_ = nullptr;

TEST_F(Checkpoint, ResumeOnOneRankIsBitExact) {
  // The base run kept its newest 3 checkpoints and names the last.
  ASSERT_EQ(base().size(), 20u);
  EXPECT_EQ(latest("base"), "step-00000020\n");
  EXPECT_FALSE(fs::exists(step_dir("base", 5))) << "checkpoint.keep = 3 keeps steps 10, 15, 20";
  for (int s : {10, 15, 20}) EXPECT_TRUE(fs::exists(step_dir("base", s) + "/metadata.json")) << s;
  EXPECT_TRUE(base().at(9).contains("checkpoint")) << "the JSONL says when a checkpoint was written";
  EXPECT_GT(base().at(9).at("checkpoint").at("total_bytes").get<int64_t>(), 0);
  EXPECT_EQ(base().at(9).at("checkpoint").at("host_staged_bytes").get<int64_t>(), 0)
      << "a synchronous save of host state writes it in place";

  // A fresh process from step 10, logging into a copy of the base's
  // metrics: the resumed run keeps steps 1-10 and appends 11-20. It saves
  // in the background (checkpoint.async): its step 20 is the base's.
  fs::create_directories(*dir_ / "resumed");
  fs::copy_file(*dir_ / "base/metrics.jsonl", *dir_ / "resumed/metrics.jsonl");
  auto r = train("resumed", 1,
                 "--set training.steps=20 --set checkpoint.interval=5 --set checkpoint.async=true "
                 "--set checkpoint.load=" + step_dir("base", 10));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from " + step_dir("base", 10) + " at step 10 (160 samples consumed)"),
            std::string::npos) << r.output;
  const auto run = read_jsonl(*dir_ / "resumed/metrics.jsonl");
  ASSERT_EQ(run.size(), 20u) << "one record per step: the steps after 10 were not kept twice";
  for (size_t s = 0; s < run.size(); ++s) EXPECT_EQ(run[s].at("step"), s + 1);
  expect_same_steps(base(), run, 1, 20);
  EXPECT_TRUE(run[14].at("checkpoint").at("async").get<bool>());
  EXPECT_EQ(run[14].at("checkpoint").at("host_staged_bytes"), run[14].at("checkpoint").at("rank_bytes"))
      << "a background save copies the rank's whole state";
  // Its sizes over the ranks are the completion's (not yet known here).
  EXPECT_FALSE(run[14].at("checkpoint").contains("total_bytes")) << run[14].dump();
  EXPECT_FALSE(run[14].at("checkpoint").contains("max_rank_bytes")) << run[14].dump();
  // The background save of step 15 completes at the first step boundary
  // where its thread is done: step 16 on an idle machine, later when the
  // suite's other jobs hold the cores, at the latest at step 20, before it saves again.
  size_t done_at = 0;
  for (size_t s = 15; s < 20 && !done_at; ++s)
    if (run[s].contains("checkpoint_done")) done_at = s;
  ASSERT_NE(done_at, 0u) << "the background save of step 15 was not reported by step 20";
  EXPECT_NE(run[done_at].at("checkpoint_done").at("dir").get<std::string>().find("step-00000015"), std::string::npos)
      << run[done_at].dump();
  for (const char* tag : {"base", "resumed"}) {
    r = run_command(std::string(ORIGAMI_BINARY) + " export --optimizer --checkpoint " + step_dir(tag, 20) + " --out " +
                    (*dir_ / (std::string(tag) + "-export")));
    ASSERT_EQ(r.status, 0) << r.output;
  }
  for (const char* f : {"/model.safetensors", "/optimizer.safetensors"})
    EXPECT_TRUE(testing::read_file(*dir_ / "base-export" + f) == testing::read_file(*dir_ / "resumed-export" + f)) << f;
  // Exported again without --optimizer, from another step: step 10's moments
  // are not left beside step 15's weights.
  r = run_command(std::string(ORIGAMI_BINARY) + " export --checkpoint " + step_dir("base", 15) + " --out " +
                  (*dir_ / "base-export"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(fs::exists(*dir_ / "base-export/model.safetensors"));
  EXPECT_FALSE(fs::exists(*dir_ / "base-export/optimizer.safetensors")) << "an earlier export's moments were kept";
}

// checkpoint.load = "latest" without a `latest` file (the job died between
// the first save's rename and its `latest`, or the file was removed): the
// newest step directory, never a fresh start that would prune it away. A
// checkpoint at training.steps is a finished run (no step, exit 0); one
// past it does not fit the config (exit 2).
TEST_F(Checkpoint, ResumingWithoutLatestAtTheEndAndPastIt) {
  ASSERT_EQ(base().size(), 20u);
  fs::copy(ck("base"), ck("no-latest"), fs::copy_options::recursive);
  fs::remove(ck("no-latest") + "/latest");
  fs::remove_all(step_dir("no-latest", 20));
  fs::create_directories(step_dir("no-latest", 12) + ".tmp");  // an unfinished save is never a candidate
  auto r = train("no-latest", 1, "--set training.steps=20 --set checkpoint.load=latest");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from " + step_dir("no-latest", 15) + " at step 15"), std::string::npos) << r.output;
  const auto run = read_jsonl(*dir_ / "no-latest/metrics.jsonl");
  ASSERT_EQ(run.size(), 5u);
  expect_same_steps(base(), run, 16, 20);

  r = train("finished", 1, "--set training.steps=20 --set checkpoint.load=" + step_dir("base", 20));
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("trained 0 steps: the checkpoint is at step 20 = training.steps"), std::string::npos)
      << r.output;
  r = train("past", 1, "--set training.steps=12 --set checkpoint.load=" + step_dir("base", 20));
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find(step_dir("base", 20) + ": the checkpoint is at step 20, past training.steps = 12 "
                                                  "(--set training.steps=12; rule:"),
            std::string::npos)
      << r.output;
}

// Rolled back: resumed from step 10 of a directory holding 10, 15 and 20,
// saving every step with keep = 1. Pruning counts only the steps up to the
// one just saved (it removed that one before, and `latest` then named
// nothing); the abandoned run's 15 and 20 stay.
TEST_F(Checkpoint, ARollbackKeepsWhatItSavesAndLeavesTheAbandonedSteps) {
  ASSERT_EQ(base().size(), 20u);
  fs::copy(ck("base"), ck("rollback"), fs::copy_options::recursive);
  auto r = train("rollback", 1,
                 "--set training.steps=12 --set checkpoint.interval=1 --set checkpoint.keep=1 --set checkpoint.load=" +
                     step_dir("rollback", 10));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(testing::read_file(ck("rollback") + "/latest"), "step-00000012\n");
  for (int step : {10, 11}) EXPECT_FALSE(fs::exists(step_dir("rollback", step))) << step;
  for (int step : {12, 15, 20}) EXPECT_TRUE(fs::exists(step_dir("rollback", step) + "/metadata.json")) << step;
  r = train("rollback", 1, "--set training.steps=12 --set checkpoint.load=latest");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("the checkpoint is at step 12 = training.steps"), std::string::npos) << r.output;
}

// A file that will not go from an old checkpoint (one a reader holds open on
// NFS; here an immutable one) costs disk, not the run: re-saving a step that
// exists (a rollback's resume saves it again) swaps the new directory in
// before the old is removed, so `latest` never names a missing or
// half-deleted one, and neither that removal nor checkpoint.keep's pruning
// ends the run; each is a warning.
TEST_F(Checkpoint, AnOldCheckpointThatWillNotGoIsAWarningAndLatestStaysWhole) {
  ASSERT_EQ(base().size(), 20u);
  fs::copy(ck("base"), ck("stuck"), fs::copy_options::recursive);
  const std::string held20 = step_dir("stuck", 20) + "/.nfs0001", held10 = step_dir("stuck", 10) + "/.nfs0002";
  testing::write_file(held20, "held");
  testing::write_file(held10, "held");
  struct Unpin {
    std::string dir;
    ~Unpin() { (void)run_command("chattr -R -i " + dir); }
  } unpin{ck("stuck")};
  if (run_command("chattr +i " + held20 + " " + held10).status != 0)
    GTEST_SKIP() << "this file system has no immutable files (chattr +i)";
  auto r = train("stuck", 1, "--set training.steps=20 --set checkpoint.interval=5 --set checkpoint.keep=2 "
                             "--set checkpoint.load=" + step_dir("stuck", 15));
  ASSERT_EQ(r.status, 0) << r.output;
  for (const std::string& warning :
       {"origami: warning: " + step_dir("stuck", 20) + ".tmp: cannot remove the checkpoint this save replaced",
        "origami: warning: " + step_dir("stuck", 10) + ": cannot remove an old checkpoint (checkpoint.keep = 2)"})
    EXPECT_NE(r.output.find(warning), std::string::npos) << warning << " in:\n" << r.output;
  EXPECT_EQ(testing::read_file(ck("stuck") + "/latest"), "step-00000020\n");
  EXPECT_FALSE(fs::exists(step_dir("stuck", 20) + "/.nfs0001")) << "the new step-20 is in place";
  r = run_command(std::string(ORIGAMI_BINARY) + " checkpoint inspect " + step_dir("stuck", 20) + " --verify");
  EXPECT_EQ(r.status, 0) << r.output;
  r = train("stuck", 1, "--set training.steps=20 --set checkpoint.load=latest");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("the checkpoint is at step 20 = training.steps"), std::string::npos) << r.output;
  // A partial save that will not go is moved aside at the start (and said),
  // so the next save of its step writes into an empty directory rather than
  // failing on the stuck file or publishing it.
  const std::string stale = step_dir("stuck", 16) + ".tmp";
  fs::create_directories(stale);
  testing::write_file(stale + "/rank-00000-model.safetensors", "stuck");
  ASSERT_EQ(run_command("chattr +i " + stale + "/rank-00000-model.safetensors").status, 0);
  r = train("stuck", 1, "--set training.steps=16 --set checkpoint.interval=1 --set checkpoint.load=" +
                            step_dir("stuck", 15));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("origami: warning: " + stale + ": cannot remove a partial save"), std::string::npos) << r.output;
  r = run_command(std::string(ORIGAMI_BINARY) + " checkpoint inspect " + step_dir("stuck", 16) + " --verify");
  EXPECT_EQ(r.status, 0) << r.output;
}

// A setting of the forward pass changed on resume (beyond the shape, which
// a load enforces) may be deliberate, so it is not refused; but the weights
// then continue under another model than they were trained as (eval of
// them refuses the mix), so the run names each change. Unchanged, nothing.
TEST_F(Checkpoint, ResumingUnderAnotherForwardPassWarnsNamingEachChange) {
  ASSERT_EQ(base().size(), 20u);
  fs::copy(ck("base"), ck("forward"), fs::copy_options::recursive);
  auto r = train("forward", 1, "--set training.steps=16 --set moe.top_k=3 --set model.rope_theta=5000 "
                               "--set checkpoint.load=" + step_dir("forward", 15));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("origami: warning: the model's forward pass differs from the saving run's "
                          "(model.rope_theta 10000 -> 5000, moe.top_k 2 -> 3)"),
            std::string::npos)
      << r.output;
  r = train("forward", 1, "--set training.steps=16 --set checkpoint.load=" + step_dir("forward", 15));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output.find("forward pass differs"), std::string::npos) << r.output;
}

// A resume whose schedule gives its next step another learning rate than
// the saving run's says so, naming what changed, and, where the change is
// the cosine's length alone, the setting that keeps the old curve; with it,
// nothing is said.
TEST_F(Checkpoint, AResumeSaysWhenTheLearningRateScheduleChanges) {
  ASSERT_EQ(base().size(), 20u);
  // The base warms up for all its 20 steps; this run adds a cosine after a
  // shorter warmup (and saves its step 22).
  auto r = train("schedule", 1,
                 "--set training.steps=22 --set lr_schedule.warmup_steps=5 --set checkpoint.interval=2 "
                 "--set checkpoint.load=" + step_dir("base", 20));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("origami: warning: the learning-rate schedule differs from the saving run's "
                          "(lr_schedule.warmup_steps 20 -> 5, training.steps 20 -> 22: step 21 runs at lr "),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("keeps its curve"), std::string::npos) << r.output;
  // Longer again: the cosine stretches.
  const std::string longer = "--set training.steps=24 --set lr_schedule.warmup_steps=5 --set checkpoint.load=" +
                             step_dir("schedule", 22);
  r = train("schedule-longer", 1, longer);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("(training.steps 22 -> 24: step 23 runs at lr "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("; --set lr_schedule.decay_steps=22 keeps its curve)"), std::string::npos) << r.output;
  r = train("schedule-kept", 1, longer + " --set lr_schedule.decay_steps=22");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output.find("learning-rate schedule differs"), std::string::npos) << r.output;
}

// Rules added for a run's own settings (decay_steps after the warmup, EP
// with experts) do not make an older checkpoint unreadable: its saved
// config, read back, is not held to them.
TEST_F(Checkpoint, ACheckpointSavedUnderOlderRulesStillLoads) {
  ASSERT_EQ(base().size(), 20u);
  fs::copy(ck("base"), ck("older"), fs::copy_options::recursive);
  const std::string meta_path = step_dir("older", 20) + "/metadata.json";
  nlohmann::ordered_json meta = nlohmann::ordered_json::parse(testing::read_file(meta_path));
  std::string config = meta.at("config").get<std::string>();
  const std::string from = "lr_schedule.decay_steps = 0\n", to = "lr_schedule.decay_steps = 20\n";  // = warmup_steps
  ASSERT_NE(config.find(from), std::string::npos) << config;
  config.replace(config.find(from), from.size(), to);
  meta["config"] = config;
  testing::write_file(meta_path, meta.dump(1) + "\n");
  auto r = run_command(std::string(ORIGAMI_BINARY) + " checkpoint inspect " + step_dir("older", 20) + " --verify");
  EXPECT_EQ(r.status, 0) << r.output;
  r = train("older", 1, "--set training.steps=20 --set checkpoint.load=latest");
  EXPECT_EQ(r.status, 0) << r.output;
}

// Resuming keeps metrics.jsonl's records up to the checkpoint; what the file
// lacks there (a line torn by a full disk, steps whose record was lost) is
// said, not passed over.
TEST_F(Checkpoint, AResumeSaysWhatTheMetricsFileLacks) {
  ASSERT_EQ(base().size(), 20u);
  fs::copy(ck("base"), ck("gaps"), fs::copy_options::recursive);
  fs::create_directories(*dir_ / "gaps");
  std::istringstream records(testing::read_file(*dir_ / "base/metrics.jsonl"));
  std::string kept, line;
  for (int i = 0; i < 12 && std::getline(records, line); ++i) kept += line + "\n";
  testing::write_file(*dir_ / "gaps/metrics.jsonl", kept + "{\"step\":13,\"lm_lo");
  auto r = train("gaps", 1, "--set training.steps=16 --set checkpoint.load=" + step_dir("gaps", 15));
  ASSERT_EQ(r.status, 0) << r.output;
  for (const char* warning : {"1 line(s) that are not step records dropped",
                              "the records end at step 12 and the run resumes at step 15: steps 13 to 15 have none"})
    EXPECT_NE(r.output.find(warning), std::string::npos) << warning << " in:\n" << r.output;
  const auto after = read_jsonl(*dir_ / "gaps/metrics.jsonl");
  ASSERT_EQ(after.size(), 13u);
  EXPECT_EQ(after.back().at("step"), 16);
  // A logging.dir with no metrics.jsonl at all.
  r = train("no-records", 1, "--set training.steps=16 --set checkpoint.load=" + step_dir("gaps", 15));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("metrics.jsonl did not exist: the run resumes at step 15, so steps 1 to 15 have no record"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(read_jsonl(*dir_ / "no-records/metrics.jsonl").size(), 1u);
}

// A step directory that is a symbolic link (kept on another disk): pruning
// removes the link alone. It used to remove the target's metadata.json
// through the link and leave its shards: an unloadable save outside
// checkpoint.dir.
TEST_F(Checkpoint, PruningAStepThatIsALinkRemovesTheLinkAndLeavesItsTargetWhole) {
  auto r = train("linked", 1, "--set training.steps=2 --set checkpoint.interval=2");
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string target = *dir_ / "linked-step-2-elsewhere";
  fs::rename(step_dir("linked", 2), target);
  fs::create_directory_symlink(target, step_dir("linked", 2));
  r = train("linked", 1,
            "--set training.steps=6 --set checkpoint.interval=2 --set checkpoint.keep=1 --set checkpoint.load=latest");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(fs::symlink_status(step_dir("linked", 2)))) << "the link was kept";
  EXPECT_TRUE(fs::exists(step_dir("linked", 6)));
  r = run_command(std::string(ORIGAMI_BINARY) + " checkpoint inspect --verify " + target);
  EXPECT_EQ(r.status, 0) << "the link's target was damaged:\n" << r.output;
}

// Where the file system cannot swap two directories (NFS: renameat2 with
// RENAME_EXCHANGE fails, here by an LD_PRELOAD shim), a re-save moves the
// old step directory aside under a name no leftover holds, renames the new
// one in, and removes the old: the same result, `latest` whole, nothing left.
TEST_F(Checkpoint, ReSavingWithoutAnAtomicSwapMovesTheOldStepAside) {
  ASSERT_EQ(base().size(), 20u);
  fs::copy(ck("base"), ck("nfs"), fs::copy_options::recursive);
  // A leftover of an earlier run's fallback that would not go.
  const std::string leftover = step_dir("nfs", 20) + ".replaced-1-0.tmp";
  fs::create_directories(leftover);
  auto r = run_command("LD_PRELOAD=" + std::string(ORIGAMI_NO_RENAME_EXCHANGE) + " " +
                       train_command("nfs", 1, "--set training.steps=20 --set checkpoint.interval=5 "
                                               "--set checkpoint.load=" + step_dir("nfs", 15)));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(testing::read_file(ck("nfs") + "/latest"), "step-00000020\n");
  r = run_command(std::string(ORIGAMI_BINARY) + " checkpoint inspect " + step_dir("nfs", 20) + " --verify");
  EXPECT_EQ(r.status, 0) << r.output;
  for (const auto& e : fs::directory_iterator(ck("nfs")))
    EXPECT_EQ(e.path().filename().string().find(".replaced-"), std::string::npos)
        << e.path() << ": the moved-aside copy is removed (and the start removed the leftover)";
}

// A job killed between a save's completion (metadata.json written after
// every rank's files are synced) and its rename leaves a complete .tmp,
// possibly with `latest` naming the step already: the next start puts it in
// place rather than removing it.
TEST_F(Checkpoint, ACompleteSaveKilledBeforeItsRenameIsPutInPlaceAtStart) {
  ASSERT_EQ(base().size(), 20u);
  fs::copy(ck("base"), ck("torn"), fs::copy_options::recursive);
  fs::rename(step_dir("torn", 20), step_dir("torn", 20) + ".tmp");
  ASSERT_EQ(testing::read_file(ck("torn") + "/latest"), "step-00000020\n");
  auto r = train("torn", 1, "--set training.steps=20 --set checkpoint.load=latest");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("origami: " + step_dir("torn", 20) + ": a complete save interrupted before its rename, put in place"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("the checkpoint is at step 20 = training.steps"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(step_dir("torn", 20) + ".tmp"));
  // The first save of a run (no `latest` yet), on 2 ranks: every rank looks
  // for the newest step only after rank 0 has put it in place.
  fs::copy(ck("base"), ck("torn2"), fs::copy_options::recursive);
  fs::remove(ck("torn2") + "/latest");
  for (int step : {10, 15}) fs::remove_all(step_dir("torn2", step));
  fs::rename(step_dir("torn2", 20), step_dir("torn2", 20) + ".tmp");
  r = train("torn2", 2, "--set training.steps=20 --set checkpoint.load=latest");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("the checkpoint is at step 20 = training.steps"), std::string::npos) << r.output;

  // Killed while committing (the journal `committing` names step 20 and its
  // save_id; `latest` still names 15): the start completes the commit,
  // `latest` included. Without the journal a complete step 20 is put in
  // place but `latest` is not moved on a guess (a rollback's abandoned steps
  // are higher): the run resumes at 15.
  const auto case_of = [&](const std::string& tag) {
    fs::copy(ck("base"), ck(tag), fs::copy_options::recursive);
    testing::write_file(ck(tag) + "/latest", "step-00000015\n");
    fs::rename(step_dir(tag, 20), step_dir(tag, 20) + ".tmp");
  };
  const auto save_id = [&](const std::string& dir) {
    return nlohmann::json::parse(testing::read_file(dir + "/metadata.json")).at("save_id").get<std::string>();
  };
  case_of("torn3");
  testing::write_file(ck("torn3") + "/committing", "step-00000020 " + save_id(step_dir("torn3", 20) + ".tmp") + "\n");
  r = train("torn3", 1, "--set training.steps=20 --set checkpoint.load=latest");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(testing::read_file(ck("torn3") + "/latest"), "step-00000020\n");
  EXPECT_NE(r.output.find("a save interrupted while being committed, completed"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("the checkpoint is at step 20 = training.steps"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(ck("torn3") + "/committing"));
  case_of("torn3b");
  r = train("torn3b", 1, "--set training.steps=16 --set checkpoint.load=latest");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from " + step_dir("torn3b", 15) + " at step 15"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(step_dir("torn3b", 20) + "/metadata.json")) << "put in place, not thrown away";
  // Two copies of step 20, an abandoned run's in place and the journal's in
  // .tmp (a kill before the swap), and the other way round (a kill after
  // it): either way the journal's copy ends in place.
  for (const bool swapped : {false, true}) {
    const std::string tag = swapped ? "both-swapped" : "both";
    fs::copy(ck("base"), ck(tag), fs::copy_options::recursive);
    testing::write_file(ck(tag) + "/latest", "step-00000015\n");
    fs::copy(step_dir(tag, 20), step_dir(tag, 20) + ".tmp", fs::copy_options::recursive);
    const std::string ours = step_dir(tag, 20) + (swapped ? "" : ".tmp");
    nlohmann::ordered_json meta = nlohmann::ordered_json::parse(testing::read_file(ours + "/metadata.json"));
    meta["save_id"] = "00000000000000b2";
    testing::write_file(ours + "/metadata.json", meta.dump(1) + "\n");
    testing::write_file(ck(tag) + "/committing", "step-00000020 00000000000000b2\n");
    r = train(tag, 1, "--set training.steps=20 --set checkpoint.load=latest");
    ASSERT_EQ(r.status, 0) << tag << ": " << r.output;
    EXPECT_EQ(save_id(step_dir(tag, 20)), "00000000000000b2") << tag;
    EXPECT_EQ(testing::read_file(ck(tag) + "/latest"), "step-00000020\n") << tag;
    EXPECT_FALSE(fs::exists(step_dir(tag, 20) + ".tmp")) << tag;
  }
  case_of("torn4");
  const std::string meta = step_dir("torn4", 20) + ".tmp/metadata.json";
  testing::write_file(meta, testing::read_file(meta).substr(0, 300));
  r = train("torn4", 1, "--set training.steps=16 --set checkpoint.load=latest");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from " + step_dir("torn4", 15) + " at step 15"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(step_dir("torn4", 20) + ".tmp"));
  fs::copy(ck("base"), ck("torn5"), fs::copy_options::recursive);
  fs::rename(step_dir("torn5", 20), step_dir("torn5", 20) + ".replaced-999-0.tmp");
  r = train("torn5", 1, "--set training.steps=20 --set checkpoint.load=latest");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("the checkpoint is at step 20 = training.steps"), std::string::npos) << r.output;
}

// A save that failed (a full disk) leaves its .tmp; the next start removes
// it before probing the directory (the probe would find that disk full),
// also when only preemption saves there (interval 0).
TEST_F(Checkpoint, APartialSaveIsRemovedAtStartAndJsonKeepsNotesOnStderr) {
  ASSERT_EQ(base().size(), 20u);
  fs::copy(ck("base"), ck("partial"), fs::copy_options::recursive);
  const std::string partial = step_dir("partial", 17) + ".tmp";
  fs::create_directories(partial);
  testing::write_file(partial + "/rank-00000-optim.safetensors", std::string(4096, 'x'));
  // Under --json, with another seed: standard output holds the step's JSON
  // alone, the resume note and the data-order warning go to standard error.
  const std::string err = *dir_ / "partial-stderr.txt";
  auto r = run_command("{ " +
                       train_command("partial", 1,
                                     "--set training.steps=16 --set checkpoint.interval=0 --set training.seed=99 --json "
                                     "--set checkpoint.load=" + step_dir("partial", 15)) +
                       " 2>" + err + "; }");
  ASSERT_EQ(r.status, 0) << r.output << testing::read_file(err);
  EXPECT_FALSE(fs::exists(partial)) << r.output;
  EXPECT_TRUE(fs::exists(step_dir("partial", 15) + "/metadata.json"));
  std::istringstream lines(r.output);
  int records = 0;
  for (std::string line; std::getline(lines, line); ++records)
    EXPECT_TRUE(nlohmann::json::accept(line)) << "not JSON on standard output: " << line;
  EXPECT_EQ(records, 1);
  const std::string notes = testing::read_file(err);
  EXPECT_NE(notes.find("origami: resumed from " + step_dir("partial", 15) + " at step 15"), std::string::npos) << notes;
  EXPECT_NE(notes.find("origami: warning: the data order differs from the saving run's"), std::string::npos) << notes;
}

TEST_F(Checkpoint, ResumeOfTheFoldedConfigAtNp8IsBitExactAndItsExportEqualsTheCheckpoints) {
  // The shipped folded config (TP 2 × CP 2 × PP 2, EP 2 × EDP 2): a falling
  // loss, both stages' timings in every record, a checkpoint at 10 and 20.
  auto r = train("folded", 8, "--set training.steps=20 --set checkpoint.interval=10", "tiny-moe-folded8.toml");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("| pp idle "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("| saved step-00000010 ("), std::string::npos) << r.output;
  const auto run = read_jsonl(*dir_ / "folded/metrics.jsonl");
  ASSERT_EQ(run.size(), 20u);
  double last5 = 0;
  for (size_t s = 15; s < 20; ++s) last5 += run[s].at("lm_loss").get<double>() / 5;
  EXPECT_LT(last5, run[0].at("lm_loss").get<double>() - 1.0) << "loss should fall by more than 1 nat in 20 steps";
  for (const auto& step : run) {
    ASSERT_EQ(step.at("pipeline").size(), 2u);
    for (const auto& stage : step.at("pipeline")) EXPECT_GT(stage.at("busy_s").get<double>(), 0.0);
  }
  r = train("folded-resumed", 8,
            "--set training.steps=20 --set checkpoint.load=" + step_dir("folded", 10) +
                " --set export.dir=" + (*dir_ / "folded-export"),
            "tiny-moe-folded8.toml");
  ASSERT_EQ(r.status, 0) << r.output;
  expect_same_steps(run, read_jsonl(*dir_ / "folded-resumed/metrics.jsonl"), 11, 20);
  // The stand-in's state (the device path) was saved through host memory
  // one tensor at a time: rank 0's peak is its largest tensor, not its state.
  {
    int64_t largest = 0, files = 0;
    for (const char* f : {"/rank-00000-model.safetensors", "/rank-00000-optim.safetensors"}) {
      const SafetensorsFile file(step_dir("folded", 10) + f);
      files += file.size();
      for (const auto& [name, e] : file.entries()) largest = std::max(largest, e.end - e.begin);
    }
    EXPECT_EQ(run[9].at("checkpoint").at("host_staged_bytes").get<int64_t>(), largest) << "of " << files;
  }
  // origami plan's checkpoint bytes: the files' sizes but headers and biases (< 2%).
  {
    const auto meta = nlohmann::json::parse(testing::read_file(step_dir("folded", 10) + "/metadata.json"));
    std::map<int64_t, int64_t> per_rank;
    int64_t total = 0;
    for (const auto& f : meta.at("files")) {
      per_rank[f.at("rank").get<int64_t>()] += f.at("bytes").get<int64_t>();
      total += f.at("bytes").get<int64_t>();
    }
    int64_t largest = 0;
    for (const auto& [rank, bytes] : per_rank) largest = std::max(largest, bytes);
    auto p = run_command(std::string(ORIGAMI_BINARY) + " plan " + ORIGAMI_SOURCE_DIR +
                         "/configs/tiny-moe-folded8.toml --world 8 --json");
    ASSERT_EQ(p.status, 0) << p.output;
    const auto plan = nlohmann::json::parse(p.output.substr(p.output.find('{'))).at("checkpoint");
    EXPECT_NEAR(plan.at("max_rank_bytes").get<double>(), static_cast<double>(largest), 0.02 * static_cast<double>(largest));
    EXPECT_NEAR(plan.at("total_bytes").get<double>(), static_cast<double>(total), 0.02 * static_cast<double>(total));
  }
  // The resumed run ends in the state the first saved at step 20.
  r = run_command(std::string(ORIGAMI_BINARY) + " export --checkpoint " + step_dir("folded", 20) + " --out " +
                  (*dir_ / "folded-ck-export"));
  ASSERT_EQ(r.status, 0) << r.output;
  for (const char* f : {"/model.safetensors", "/config.json"})
    EXPECT_EQ(testing::read_file(*dir_ / "folded-export" + f), testing::read_file(*dir_ / "folded-ck-export" + f))
        << f << " of the np-8 run's export and of its checkpoint's";
}

struct Layout {
  std::string tag;
  int np;
  std::string sets;
};

// Seven saving layouts, each loaded under two others, among them EP 4 -> EP 1,
// EP 1 -> EP 8, ZeRO 3 -> 0, PP 2 -> PP 1, np 8 -> np 2 and EP 4 under
// placement P -> EP 4 contiguous and EP 4 under placement Q (every layer
// placed in P, only layer 2 in Q): a checkpoint's pieces are named by
// tensor, so another placement reads them like another layout.
TEST_F(Checkpoint, ReshardingKeepsTheStateBitwiseAndTheLossesOfOneRank) {
  const std::string P = *dir_ / "placement-P.toml", Q = *dir_ / "placement-Q.toml";
  testing::write_file(P, "[moe.expert_placement]\nep = 4\n[moe.expert_placement.layers]\n"
                         "1 = [[0, 5], [1, 2], [3, 4], [6, 7]]\n2 = [[7, 1], [0, 6], [2, 3], [4, 5]]\n"
                         "3 = [[6, 3], [5, 0], [7, 2], [1, 4]]\n");
  testing::write_file(Q, "[moe.expert_placement]\nep = 4\n[moe.expert_placement.layers]\n"
                         "2 = [[3, 6], [0, 4], [1, 7], [2, 5]]\n");
  const Layout one{"one", 1, ""}, ep4{"ep4", 4, "--set parallel.ep=4"},
      tp2ep2{"tp2-ep2-z3", 4, "--set parallel.tp=2 --set parallel.ep=2 --set parallel.etp=1 --set parallel.zero_stage=3"},
      pp2dp2{"pp2-dp2-z1", 4, "--set parallel.pp=2 --set parallel.zero_stage=1"},
      folded{"folded8", 8, "--set parallel.tp=2 --set parallel.cp=2 --set parallel.pp=2 --set parallel.ep=2 --set parallel.etp=1"},
      etp2ep2{"etp2-ep2", 4, "--set parallel.etp=2 --set parallel.ep=2"},
      ep4P{"ep4-P", 4, "--set parallel.ep=4 --set moe.expert_placement=" + P};
  const std::vector<std::pair<Layout, std::vector<Layout>>> plan = {
      {one, {{"ep8", 8, "--set parallel.ep=8"}, {"tp2-pp2-z2", 4, "--set parallel.tp=2 --set parallel.pp=2 --set parallel.zero_stage=2"}}},
      {ep4, {one, {"etp2-ep2-z0", 4, "--set parallel.etp=2 --set parallel.ep=2 --set parallel.zero_stage=0"}}},
      {tp2ep2, {{"dp2-z0", 2, "--set parallel.zero_stage=0"}, {"cp2", 2, "--set parallel.cp=2"}}},
      {pp2dp2, {one, {"pp2-1-3", 2, "--set parallel.pp=2 --set parallel.pp_layers=[1,3]"}}},
      {folded, {{"ep2", 2, "--set parallel.ep=2"}, one}},
      {etp2ep2, {one, {"ep2-z3", 2, "--set parallel.ep=2"}}},
      {ep4P, {ep4, {"ep4-Q", 4, "--set parallel.ep=4 --set moe.expert_placement=" + Q}}},
  };
  // Lighter steps than the other tests (8 samples of 64 tokens), and one LR
  // schedule (tiny-moe's 20 warmup steps, then decaying to step 21, so not
  // training.steps) for runs of 3 and 8 steps. The one-rank
  // reference runs 8 steps uninterrupted.
  const std::string schedule =
      " --set lr_schedule.decay_steps=21 --set training.global_batch=8 --set training.micro_batch=1"
      " --set training.seq_len=64";
  auto r0 = train("reshard-base", 1, schedule + " --set training.steps=8");
  ASSERT_EQ(r0.status, 0) << r0.output;
  const auto reference = read_jsonl(*dir_ / "reshard-base/metrics.jsonl");
  ASSERT_EQ(reference.size(), 8u);
  auto export_of = [&](const std::string& step_dir, const std::string& out) {
    auto r = run_command(std::string(ORIGAMI_BINARY) + " export --optimizer --checkpoint " + step_dir + " --out " + out);
    EXPECT_EQ(r.status, 0) << r.output;
    return std::make_pair(testing::read_file(out + "/model.safetensors"), testing::read_file(out + "/optimizer.safetensors"));
  };
  auto expect_losses = [&](const std::string& tag, int first, int last) {
    const auto run = read_jsonl(*dir_ / (tag + "/metrics.jsonl"));
    ASSERT_EQ(run.size(), static_cast<size_t>(last - first + 1)) << tag;
    for (const auto& rec : run) {
      const int64_t s = rec.at("step").get<int64_t>();
      const double b = reference.at(static_cast<size_t>(s - 1)).at("lm_loss").get<double>();
      EXPECT_LE(std::abs(rec.at("lm_loss").get<double>() - b), 1e-6 * b) << tag << " step " << s;
    }
  };
  for (const auto& [from, loads] : plan) {
    const std::string saved = "save-" + from.tag;
    auto r = train(saved, from.np, from.sets + schedule + " --set training.steps=3 --set checkpoint.interval=3");
    ASSERT_EQ(r.status, 0) << r.output;
    expect_losses(saved, 1, 3);
    const auto want = export_of(step_dir(saved, 3), *dir_ / (saved + "-export"));
    ASSERT_FALSE(want.first.empty());
    for (const Layout& to : loads) {
      SCOPED_TRACE(from.tag + " -> " + to.tag);
      const std::string load = " --set checkpoint.load=" + step_dir(saved, 3);
      // Loaded and saved again at once (no step): the state bitwise the same.
      const std::string resaved = from.tag + "-to-" + to.tag;
      r = train(resaved, to.np, to.sets + schedule + load + " --set training.steps=3 --set checkpoint.interval=3");
      ASSERT_EQ(r.status, 0) << r.output;
      const auto got = export_of(step_dir(resaved, 3), *dir_ / (resaved + "-export"));
      EXPECT_TRUE(got.first == want.first) << "consolidated parameters differ after loading";
      EXPECT_TRUE(got.second == want.second) << "consolidated AdamW moments differ after loading";
      // Loaded and trained on: the uninterrupted one-rank run's losses.
      r = train(resaved + "-steps", to.np, to.sets + schedule + load + " --set training.steps=8");
      ASSERT_EQ(r.status, 0) << r.output;
      expect_losses(resaved + "-steps", 4, 8);
    }
  }
}

// Exit 2 and a message naming the file or key and the rule, before any step.
TEST_F(Checkpoint, DamagedCheckpointsAreRefusedNamingTheFileOrKey) {
  ASSERT_EQ(base().size(), 20u);
  const std::string src = step_dir("base", 10);
  auto copy = [&](const std::string& name) {
    const std::string d = *dir_ / ("damaged-" + name) + "/step-00000010";
    fs::create_directories(d);
    fs::copy(src, d, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
    return d;
  };
  auto edit_json = [](const std::string& d, const std::function<void(nlohmann::ordered_json&)>& edit) {
    nlohmann::ordered_json j = nlohmann::ordered_json::parse(testing::read_file(d + "/metadata.json"));
    edit(j);
    testing::write_file(d + "/metadata.json", j.dump(1));
  };
  auto edit_metadata = [&](const std::string& d, const char* section, const char* key, int64_t value) {
    edit_json(d, [&](nlohmann::ordered_json& j) {
      ASSERT_TRUE(j[section].contains(key)) << section << "." << key;
      j[section][key] = value;
    });
  };
  struct Case {
    std::string name, extra;
    std::function<void(const std::string&)> damage;
    std::vector<std::string> expected;
  };
  const std::vector<Case> cases = {
      {"truncated", "", [](const std::string& d) {
         const std::string f = d + "/rank-00000-model.safetensors";
         fs::resize_file(f, fs::file_size(f) - 100);
       }, {"rank-00000-model.safetensors: ", "bytes, but", "metadata.json records", "truncated"}},
      {"flipped", "", [](const std::string& d) {
         const std::string f = d + "/rank-00000-optim.safetensors";
         std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
         io.seekg(static_cast<std::streamoff>(fs::file_size(f) / 2));
         char c = 0;
         io.read(&c, 1);
         c = static_cast<char>(c ^ 0x10);
         io.seekp(static_cast<std::streamoff>(fs::file_size(f) / 2));
         io.write(&c, 1);
       }, {"rank-00000-optim.safetensors: XXH3 digest", "metadata.json records", "changed after the save"}},
      {"no-metadata", "", [](const std::string& d) { fs::remove(d + "/metadata.json"); },
       {"metadata.json: missing", "unfinished save or not a checkpoint"}},
      {"no-shard", "", [](const std::string& d) { fs::remove(d + "/rank-00000-model.safetensors"); },
       {"rank-00000-model.safetensors: missing"}},
      // metadata.json's own values, out of their range (no digest covers them).
      {"negative-samples", "", [&](const std::string& d) { edit_metadata(d, "train", "consumed_samples", -5); },
       {"metadata.json: train.consumed_samples: must be in 0..2^53, got -5", "damaged"}},
      {"huge-samples", "", [&](const std::string& d) {
         edit_metadata(d, "train", "consumed_samples", std::numeric_limits<int64_t>::max());
       }, {"train.consumed_samples: must be in 0..2^53, got 9223372036854775807"}},
      {"zero-tp", "", [&](const std::string& d) { edit_metadata(d, "layout", "tp", 0); },
       {"metadata.json: layout.tp: must be in 1..layout.world (1), got 0"}},
      {"other-world", "", [&](const std::string& d) { edit_metadata(d, "layout", "world", 2); },
       {"metadata.json: layout: tp·cp·dp·pp and etp·ep·edp·pp must both equal world (2)"}},
      // Values that contradict the config recorded beside them.
      {"stage-layers", "", [&](const std::string& d) {
         edit_json(d, [](nlohmann::ordered_json& j) { j["layout"]["stage_layers"] = {1}; });
       }, {"metadata.json: layout.stage_layers: [1] differs from the config's stages ["}},
      {"layout-order", "", [&](const std::string& d) {
         edit_json(d, [](nlohmann::ordered_json& j) { j["layout"]["order"] = "tp-cp-dp-ep-pp"; });
       }, {"metadata.json: layout.order: \"tp-cp-dp-ep-pp\" differs from the config's parallel.order"}},
      {"layout-zero", "", [&](const std::string& d) { edit_metadata(d, "layout", "zero_stage", 1); },
       {"metadata.json: layout.zero_stage: 1 differs from the config's parallel.zero_stage"}},
      {"lr", "", [&](const std::string& d) {
         edit_json(d, [](nlohmann::ordered_json& j) { j["train"]["lr"] = 5.0; });
       }, {"metadata.json: train.lr: 5 differs from the config's schedule at step 10"}},
      {"epoch", "", [&](const std::string& d) { edit_metadata(d, "train", "epoch", 7); },
       {"metadata.json: train.epoch: 7 differs from 0, what consumed_samples and windows_per_epoch give"}},
      {"epoch-offset", "", [&](const std::string& d) { edit_metadata(d, "train", "epoch_offset", 99999999); },
       {"metadata.json: train.epoch_offset: 99999999 differs from"}},
      {"config-text", "", [&](const std::string& d) {
         edit_json(d, [](nlohmann::ordered_json& j) {
           std::string text = j["config"];
           const size_t at = text.find("model.hidden_size = 128");
           ASSERT_NE(at, std::string::npos) << text;
           j["config"] = text.replace(at, 23, "model.hidden_size = 64");
         });
       }, {"metadata.json: config: its model.hidden_size = 64 differs from the 128 recorded under \"model\""}},
      {"config-garbage", "", [&](const std::string& d) {
         edit_json(d, [](nlohmann::ordered_json& j) { j["config"] = "[model\nhidden_size = "; });
       }, {"metadata.json (config)"}},
      {"negative-seed", "", [&](const std::string& d) { edit_metadata(d, "train", "seed", -1); },
       {"metadata.json: train.seed: must be in 0..2^63 - 1 (training.seed's range), got -1", "damaged"}},
      {"negative-bytes", "", [&](const std::string& d) {
         edit_json(d, [](nlohmann::ordered_json& j) { j["files"][0]["bytes"] = -1; });
       }, {"metadata.json: files[0].bytes: must be >= 0, got -1"}},
      {"no-files", "", [&](const std::string& d) {
         edit_json(d, [](nlohmann::ordered_json& j) { j["files"] = nlohmann::ordered_json::array(); });
       }, {"metadata.json: files: lists 0 files; a save of 1 rank(s) writes 2"}},
      {"file-renamed", "", [&](const std::string& d) {
         edit_json(d, [](nlohmann::ordered_json& j) { j["files"][0]["name"] = "rank-00003-model.safetensors"; });
       }, {"files[0].name: \"rank-00003-model.safetensors\" is not one of rank 0's files"}},
      {"extra-tensor", "", [&](const std::string& d) {
         edit_json(d, [](nlohmann::ordered_json& j) { j["tensors"]["model.bogus.weight"] = j["tensors"].begin().value(); });
       }, {"metadata.json: tensors.model.bogus.weight: is not a tensor of the model its config describes"}},
      {"file-twice", "", [&](const std::string& d) {
         edit_json(d, [](nlohmann::ordered_json& j) { j["files"][1] = j["files"][0]; });
       }, {"metadata.json: files[1].name: \"rank-00000-", "is listed twice"}},
      // Shards: a rank past 2^32 (not rank 0 after narrowing), an offset
      // whose sum with the slice overflows, and two shards of the first
      // tensor that overlap by 5 elements beside a hole of 5 (the element
      // count each rank reads would still add up).
      {"rank-2^32", "", [&](const std::string& d) {
         edit_json(d, [](nlohmann::ordered_json& j) { j["tensors"].begin().value()["shards"][0]["rank"] = int64_t{1} << 32; });
       }, {".shards[0].rank: outside the saving world of 1"}},
      {"offset-overflow", "", [&](const std::string& d) {
         edit_json(d, [](nlohmann::ordered_json& j) {
           j["tensors"].begin().value()["shards"][0]["saved_offsets"][0] = std::numeric_limits<int64_t>::max();
         });
       }, {".shards[0]: the slice exceeds the global shape"}},
      {"overlap-and-hole", "", [&](const std::string& d) {
         edit_json(d, [](nlohmann::ordered_json& j) {
           nlohmann::ordered_json& shards = j["tensors"].begin().value()["shards"];
           const int64_t n = shards[0]["flat_range"][1];
           nlohmann::ordered_json second = shards[0];
           shards[0]["flat_range"] = {0, n / 2};
           second["flat_range"] = {n / 2 - 5, n - 5};
           shards.push_back(second);
         });
       }, {"metadata.json: tensors.model.embed_tokens.weight.shards: hold element ", " twice (rule: the shards hold "
           "every element exactly once)"}},
      {"other-model", " --set model.hidden_size=64", [](const std::string&) {},
       {"metadata.json: the checkpoint was saved with model.hidden_size = 128", "--set model.hidden_size=64",
        "configures model.hidden_size = 64", "the model may not"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string d = copy(c.name);
    c.damage(d);
    auto r = train("damaged-run-" + c.name, 1, "--set training.steps=12 --set checkpoint.load=" + d + c.extra);
    EXPECT_EQ(r.status, 2) << r.output;
    for (const std::string& e : c.expected) EXPECT_NE(r.output.find(e), std::string::npos) << e << "\n" << r.output;
    EXPECT_EQ(r.output.find("step    "), std::string::npos) << "no step ran:\n" << r.output;
  }
  // A step directory renamed by hand: its name and its metadata disagree.
  {
    const std::string renamed = *dir_ / "damaged-renamed/step-00000012";
    fs::create_directories(renamed);
    fs::copy(src, renamed, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
    auto r = train("damaged-run-renamed", 1, "--set training.steps=14 --set checkpoint.load=" + renamed);
    EXPECT_EQ(r.status, 2) << r.output;
    EXPECT_NE(r.output.find(renamed + ": named for step 12, but its metadata.json holds step 10"), std::string::npos)
        << r.output;
  }
  // inspect names a missing or truncated shard without --verify too (a stat each).
  for (const char* damaged : {"damaged-no-shard", "damaged-truncated"}) {
    auto r = run_command(std::string(ORIGAMI_BINARY) + " checkpoint inspect " + *dir_ / damaged + "/step-00000010");
    EXPECT_EQ(r.status, 2) << r.output;
    EXPECT_NE(r.output.find("rank-00000-model.safetensors: "), std::string::npos) << r.output;
  }
  // inspect --verify finds the flipped byte too; the intact checkpoint passes.
  auto r = run_command(std::string(ORIGAMI_BINARY) + " checkpoint inspect --verify " + *dir_ / "damaged-flipped/step-00000010");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("XXH3 digest"), std::string::npos) << r.output;
  // A path that is no directory is named so, not taken for an unfinished save.
  r = run_command(std::string(ORIGAMI_BINARY) + " checkpoint inspect " + src + "-absent");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find(src + "-absent: no such checkpoint directory"), std::string::npos) << r.output;
  // A checkpoint.dir, or its latest file, where a step belongs: the step it names.
  ASSERT_EQ(base().size(), 20u);
  r = run_command(std::string(ORIGAMI_BINARY) + " checkpoint inspect " + ck("base"));
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("(this is a checkpoint.dir: name one of its steps, as `latest` does: " + step_dir("base", 20) +
                          ")"),
            std::string::npos)
      << r.output;
  r = run_command(std::string(ORIGAMI_BINARY) + " checkpoint inspect " + ck("base") + "/latest");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("(a checkpoint.dir's latest file: name one of its steps, as `latest` does: " +
                          step_dir("base", 20) + ")"),
            std::string::npos)
      << r.output;
  // An export --out that cannot be a directory is named as the option, not
  // as a library's filesystem error.
  testing::write_file(*dir_ / "export-out-is-a-file", "x");
  r = run_command(std::string(ORIGAMI_BINARY) + " export --checkpoint " + src + " --out " + *dir_ / "export-out-is-a-file");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--out = \"" + *dir_ / "export-out-is-a-file" + "\": cannot create the directory"),
            std::string::npos)
      << r.output;
  r = run_command(std::string(ORIGAMI_BINARY) + " checkpoint inspect --verify " + src);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("every digest matches"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("model.layers.1.block_sparse_moe.experts.7.w2.weight"), std::string::npos) << r.output;
}

// SIGKILL of one rank midway through the save of step 4 (it wrote one of its
// files): step 2 stays complete and `latest`; the restart cleans the .tmp,
// resumes from step 2 and recomputes step 3 bitwise.
TEST_F(Checkpoint, ARankKilledDuringASaveLeavesThePreviousCheckpoint) {
  const std::string sets = "--set parallel.ep=2 --set training.steps=6 --set checkpoint.interval=2";
  auto r = run_command("ORIGAMI_FAULT_KILL_IN_SAVE=4 " + train_command("killed", 2, sets));
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_EQ(latest("killed"), "step-00000002\n");
  EXPECT_TRUE(fs::exists(ck("killed") + "/step-00000004.tmp")) << "the killed save's directory";
  EXPECT_FALSE(fs::exists(step_dir("killed", 4)));
  const auto before = read_jsonl(*dir_ / "killed/metrics.jsonl");
  ASSERT_EQ(before.size(), 3u) << "steps 1-3; step 4 died in its save";
  r = run_command(std::string(ORIGAMI_BINARY) + " checkpoint inspect --verify " + step_dir("killed", 2));
  EXPECT_EQ(r.status, 0) << r.output;
  r = train("killed", 2, sets + " --set checkpoint.load=latest");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from " + step_dir("killed", 2) + " at step 2"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(ck("killed") + "/step-00000004.tmp")) << "cleaned at the next start";
  EXPECT_EQ(latest("killed"), "step-00000006\n");
  const auto after = read_jsonl(*dir_ / "killed/metrics.jsonl");
  ASSERT_EQ(after.size(), 6u);
  expect_same_steps(before, after, 1, 3);
}

// SIGTERM (how schedulers preempt): the current step finishes, a checkpoint
// is written, every rank exits 0 without the export; resuming from `latest`
// is bit-exact. On one rank, and at np 2 with SIGUSR1 (SLURM's --signal
// warning) to one rank only. The last record names the save and the signal.
TEST_F(Checkpoint, SigtermCheckpointsExitsZeroAndResumesBitExact) {
  for (int np : {1, 2}) {
    SCOPED_TRACE(::testing::Message() << "np " << np);
    const std::string tag = "sigterm-np" + std::to_string(np);
    const int steps = np == 1 ? 20 : 8;  // one rank: the base run's 20 steps
    const std::string sets =
        std::string(np == 2 ? "--set parallel.ep=2 " : "") + "--set training.steps=" + std::to_string(steps);
    const std::string log = *dir_ / (tag + "/metrics.jsonl");
    // Signal once three steps are logged: the process itself (one rank), or
    // the newest process whose command line names this run (a rank of it).
    const std::string signal = np == 1 ? "kill -TERM \\$p" : "pkill -USR1 -n -f 'logging.dir=" + (*dir_ / tag) + " '";
    const std::string signal_name = np == 1 ? "SIGTERM" : "SIGUSR1";
    auto r = run_command("bash -c \"" + train_command(tag, np, sets + " --set export.dir=" + (*dir_ / (tag + "-export"))) +
                         " & p=\\$!; while [ \\$(cat " + log + " 2>/dev/null | wc -l) -lt 3 ]; do sleep 0.05; done; " +
                         signal + "; wait \\$p\"");
    ASSERT_EQ(r.status, 0) << r.output;
    ASSERT_NE(r.output.find("stopped by " + signal_name + " after "), std::string::npos) << r.output;
    const auto stopped = read_jsonl(log);
    ASSERT_GE(stopped.size(), 3u);
    EXPECT_NE(r.output.find(" steps (at step " + std::to_string(stopped.size()) + " of " + std::to_string(steps) + ")"),
              std::string::npos)
        << r.output;
    ASSERT_LT(stopped.size(), static_cast<size_t>(steps)) << "the signal came too late to test anything";
    char name[32];
    std::snprintf(name, sizeof name, "step-%08zu\n", stopped.size());
    EXPECT_EQ(latest(tag), name) << "the checkpoint is of the last finished step";
    EXPECT_EQ(stopped.back().value("stopped_by", ""), signal_name) << stopped.back().dump();
    ASSERT_TRUE(stopped.back().contains("checkpoint")) << stopped.back().dump();
    EXPECT_EQ(fs::path(stopped.back()["checkpoint"]["dir"].get<std::string>()).filename().string() + "\n", name);
    for (size_t i = 0; i + 1 < stopped.size(); ++i) EXPECT_FALSE(stopped[i].contains("stopped_by")) << i;
    EXPECT_FALSE(fs::exists(*dir_ / (tag + "-export/model.safetensors"))) << "a preempted run does not export";
    r = train(tag, np, sets + " --set checkpoint.load=latest");
    ASSERT_EQ(r.status, 0) << r.output;
    if (np == 1) {
      expect_same_steps(base(), read_jsonl(log), 1, 20);
      // A second signal does not wait for the step: the default action, at once
      // (steps of 64 samples, ~1 s, so the first signal's step is still running).
      const std::string twice = tag + "-twice";
      r = run_command("bash -c \"" + train_command(twice, 1, sets + " --set training.global_batch=64") + " & p=\\$!; while [ \\$(cat " +
                      (*dir_ / (twice + "/metrics.jsonl")) + " 2>/dev/null | wc -l) -lt 1 ]; do sleep 0.05; done; " +
                      "kill -TERM \\$p; sleep 0.1; kill -TERM \\$p; wait \\$p\"");
      EXPECT_EQ(r.status, 128 + 15) << r.output;
      EXPECT_FALSE(fs::exists(ck(twice) + "/latest")) << "killed by the second signal before any save";
      // A signal during the last step (sent once the one before is logged;
      // steps of ~1 s) does not stop a run that is done: it ends as a
      // finished one, export included, and no record says it stopped.
      const std::string last = tag + "-last";
      const std::string last_log = *dir_ / (last + "/metrics.jsonl");
      r = run_command("bash -c \"" +
                      train_command(last, 1,
                                    "--set training.steps=3 --set training.global_batch=64 --set export.dir=" +
                                        (*dir_ / (last + "-export"))) +
                      " & p=\\$!; while [ \\$(cat " + last_log +
                      " 2>/dev/null | wc -l) -lt 2 ]; do sleep 0.05; done; kill -USR2 \\$p; wait \\$p\"");
      EXPECT_EQ(r.status, 0) << r.output;
      EXPECT_NE(r.output.find("trained 3 steps"), std::string::npos) << r.output;
      EXPECT_TRUE(fs::exists(*dir_ / (last + "-export/model.safetensors"))) << r.output;
      for (const auto& rec : read_jsonl(last_log)) EXPECT_FALSE(rec.contains("stopped_by")) << rec.dump();
      continue;
    }
    // The uninterrupted run of this layout.
    r = train(tag + "-uninterrupted", np, sets);
    ASSERT_EQ(r.status, 0) << r.output;
    expect_same_steps(read_jsonl(*dir_ / (tag + "-uninterrupted/metrics.jsonl")), read_jsonl(log), 1, steps);
  }
}

// The divergence stop (exit 3) comes before the bad step's update and its
// checkpoint: the last checkpoint is of the step before, and the restart
// from `latest` continues bitwise as if nothing happened. The non-finite
// loss of step 13 is injected.
// With checkpoint.async the save of step 12 is still being written when
// step 13 stops: it completes before the exit (it was left a .tmp, which the
// restart removed, going back to step 11).
TEST_F(Checkpoint, ARunStoppedForDivergenceResumesFromItsLastCheckpoint) {
  ASSERT_EQ(base().size(), 20u);
  for (const std::string async : {"false", "true"}) {
    SCOPED_TRACE("checkpoint.async=" + async);
    const std::string tag = "diverged-" + async;
    const std::string sets =
        "--set training.steps=20 --set checkpoint.interval=1 --set checkpoint.keep=2 --set checkpoint.async=" + async;
    auto r = run_command("ORIGAMI_FAULT_NAN_AT_STEP=13 " +
                         train_command(tag, 1, sets + " --set checkpoint.load=" + step_dir("base", 10)));
    EXPECT_EQ(r.status, 3) << r.output;
    EXPECT_NE(r.output.find("training diverged at step 13 of 20"), std::string::npos) << r.output;
    EXPECT_EQ(latest(tag), "step-00000012\n");
    EXPECT_FALSE(fs::exists(step_dir(tag, 13)));
    EXPECT_FALSE(fs::exists(step_dir(tag, 12) + ".tmp"));
    EXPECT_EQ(r.output.find(step_dir(tag, 12) + ", completed before the job stopped") != std::string::npos,
              async == "true")
        << r.output;
    r = train(tag, 1, sets + " --set checkpoint.load=latest");
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("resumed from " + step_dir(tag, 12) + " at step 12"), std::string::npos) << r.output;
    expect_same_steps(base(), read_jsonl(*dir_ / (tag + "/metrics.jsonl")), 13, 20);
  }
}

// checkpoint.init_from_hf: a one-rank run's consolidated export, loaded under
// TP 2 × EP 2, gives the loss of the one-rank model (the first step's loss is
// the forward before any update); HF's sharded layout (two files and
// model.safetensors.index.json) loads the same weights.
TEST_F(Checkpoint, InitFromHfLoadsAConsolidatedExportIntoAnyLayout) {
  auto r = train("hf-source", 1, "--set training.steps=2 --set export.dir=" + (*dir_ / "hf"));
  ASSERT_EQ(r.status, 0) << r.output;
  // The same tensors split over two files, with HF's index.
  const auto tensors = read_safetensors(*dir_ / "hf/model.safetensors");
  std::vector<NamedTensor> halves[2];
  nlohmann::json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", nlohmann::json::object()}};
  size_t i = 0;
  for (const auto& [name, t] : tensors) {
    const int half = i++ < tensors.size() / 2 ? 0 : 1;
    halves[half].push_back({name, t});
    index["weight_map"][name] = half == 0 ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  fs::create_directories(*dir_ / "hf-sharded");
  write_safetensors(*dir_ / "hf-sharded/model-00001-of-00002.safetensors", halves[0]);
  write_safetensors(*dir_ / "hf-sharded/model-00002-of-00002.safetensors", halves[1]);
  testing::write_file(*dir_ / "hf-sharded/model.safetensors.index.json", index.dump());
  const std::string one_step = " --set training.steps=1 --set checkpoint.init_from_hf=";
  r = train("hf-one", 1, one_step + (*dir_ / "hf"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("initial weights from"), std::string::npos) << r.output;
  const double one = read_jsonl(*dir_ / "hf-one/metrics.jsonl").at(0).at("lm_loss").get<double>();
  EXPECT_LT(one, base().at(1).at("lm_loss").get<double>()) << "the exported weights are trained, not the random init";
  // A setting that differs from the weights' config.json is said (training
  // may change it on purpose); a config.json that is no JSON is refused.
  r = train("hf-eps", 1, one_step + (*dir_ / "hf") + " --set model.norm_eps=1e-6");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("warning: checkpoint.init_from_hf: --set model.norm_eps=1e-6: model.norm_eps gives "
                          "\"rms_norm_eps\": 1e-06, but " + (*dir_ / "hf/config.json") + " has 1e-05"),
            std::string::npos)
      << r.output;
  fs::copy(*dir_ / "hf", *dir_ / "hf-bad-config", fs::copy_options::recursive);
  testing::write_file(*dir_ / "hf-bad-config/config.json", "{\"vocab_size\": 257,");
  r = train("hf-bad-config", 1, one_step + (*dir_ / "hf-bad-config"));
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find(*dir_ / "hf-bad-config/config.json" + ": not valid JSON"), std::string::npos) << r.output;
  const std::string tp2ep2 = "--set parallel.tp=2 --set parallel.ep=2 --set parallel.etp=1";
  for (const char* src : {"hf", "hf-sharded"}) {
    SCOPED_TRACE(src);
    const std::string tag = std::string("hf-tp2ep2-") + src;
    r = train(tag, 4, tp2ep2 + one_step + (*dir_ / src));
    ASSERT_EQ(r.status, 0) << r.output;
    const double got = read_jsonl(*dir_ / (tag + "/metrics.jsonl")).at(0).at("lm_loss").get<double>();
    EXPECT_LE(std::abs(got - one), 1e-6 * one) << got << " vs " << one;
  }
  // eval reads both layouts too, to the same loss.
  fs::copy_file(*dir_ / "hf/config.json", *dir_ / "hf-sharded/config.json");
  std::string eval_out[2];
  for (int k = 0; k < 2; ++k) {
    r = run_command(std::string(ORIGAMI_BINARY) + " eval " + ORIGAMI_SOURCE_DIR + "/configs/tiny-moe.toml --weights " +
                    (*dir_ / (k == 0 ? "hf" : "hf-sharded")) + " --data " + (*dir_ / "fortunes") +
                    " --samples 8 --json");
    ASSERT_EQ(r.status, 0) << r.output;
    eval_out[k] = nlohmann::json::parse(r.output).at("loss").dump();
  }
  EXPECT_EQ(eval_out[0], eval_out[1]) << "eval of the sharded copy differs from the single file's";
  // Beside model.safetensors an index is not read (Hugging Face's order), and
  // an export over a sharded directory removes it.
  testing::write_file(*dir_ / "hf/model.safetensors.index.json", "{not an index");
  r = run_command(std::string(ORIGAMI_BINARY) + " eval " + ORIGAMI_SOURCE_DIR + "/configs/tiny-moe.toml --weights " +
                  (*dir_ / "hf") + " --data " + (*dir_ / "fortunes") + " --samples 8 --json");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(r.output).at("loss").dump(), eval_out[0]);
  ASSERT_EQ(base().size(), 20u);
  r = run_command(std::string(ORIGAMI_BINARY) + " export --checkpoint " + step_dir("base", 20) + " --out " +
                  (*dir_ / "hf-sharded"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(fs::exists(*dir_ / "hf-sharded/model.safetensors"));
  EXPECT_FALSE(fs::exists(*dir_ / "hf-sharded/model.safetensors.index.json")) << "the replaced shards' index was kept";
  // An index that does not say where each tensor is (Hugging Face's loader
  // reads it): a tensor placed in the wrong file, one left out, one that no
  // file holds. Each refused naming the index key.
  fs::remove(*dir_ / "hf-sharded/model.safetensors");
  for (const auto& [edit, needle] :
       {std::pair<std::function<void(nlohmann::json&)>, std::string>{
            [](nlohmann::json& j) { j["weight_map"]["model.embed_tokens.weight"] = "model-00002-of-00002.safetensors"; },
            "weight_map.model.embed_tokens.weight: names model-00002-of-00002.safetensors, but the tensor is in "
            "model-00001-of-00002.safetensors"},
        {[](nlohmann::json& j) { j["weight_map"].erase("model.embed_tokens.weight"); },
         "weight_map: lacks tensor 'model.embed_tokens.weight', which model-00001-of-00002.safetensors holds"},
        {[](nlohmann::json& j) { j["weight_map"]["bogus.weight"] = "model-00001-of-00002.safetensors"; },
         "weight_map.bogus.weight: names model-00001-of-00002.safetensors, which holds no such tensor"}}) {
    nlohmann::json bad = index;
    edit(bad);
    ASSERT_TRUE(index["weight_map"].contains("model.embed_tokens.weight"));
    testing::write_file(*dir_ / "hf-sharded/model.safetensors.index.json", bad.dump());
    r = train("hf-bad-index", 1, one_step + (*dir_ / "hf-sharded"));
    EXPECT_EQ(r.status, 2) << r.output;
    EXPECT_NE(r.output.find("model.safetensors.index.json: " + needle), std::string::npos) << needle << "\n" << r.output;
    EXPECT_NE(r.output.find("(rule: weight_map names, for every tensor of the shards, the file holding it)"),
              std::string::npos)
        << r.output;
  }
  // A file of another model is refused, naming it.
  r = train("hf-wrong", 1, one_step + (*dir_ / "hf") + " --set model.ffn_hidden_size=256");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("hf/model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' has shape [352, 128], "
                          "the config needs [256, 128]"),
            std::string::npos)
      << r.output;
}

// Each rank resolves checkpoint.load and init_from_hf on its own view of
// the file system (a relative path under per-rank working directories,
// node-local copies). Copies of one save are fine; different saves or
// weights are refused on every rank before any step, naming what differs:
// unchecked, each rank trained on from its own state, or waited at a step
// the others never reached.
TEST_F(Checkpoint, RanksThatResolveDifferentSavesOrWeightsAreRefusedAndCopiesAreNot) {
  ASSERT_EQ(base().size(), 20u);
  for (const char* d : {"rank0", "rank1"}) fs::create_directories(*dir_ / d);
  auto mpmd = [&](const std::string& tag, const std::string& extra) {
    const std::string cmd = std::string(ORIGAMI_BINARY) + " train " + ORIGAMI_SOURCE_DIR +
                            "/configs/tiny-moe.toml --set data.path=" + (*dir_ / "fortunes") + " --set logging.dir=" +
                            (*dir_ / tag) + " --set checkpoint.dir=" + ck(tag) + " --set export.dir= " +
                            "--set parallel.ep=2 " + extra;
    return run_command("ORIGAMI_HOST_STAND_IN=1 " + std::string(ORIGAMI_MPIEXEC) +
                       " --allow-run-as-root --oversubscribe --bind-to none -np 1 --wdir " + (*dir_ / "rank0") + " " +
                       cmd + " : -np 1 --wdir " + (*dir_ / "rank1") + " " + cmd);
  };
  fs::copy(step_dir("base", 10), *dir_ / "rank0/ld", fs::copy_options::recursive);
  fs::copy(step_dir("base", 15), *dir_ / "rank1/ld", fs::copy_options::recursive);
  auto r = mpmd("mpmd-saves", "--set training.steps=17 --set checkpoint.load=ld");
  EXPECT_EQ(r.status, 2) << r.output;
  for (const char* needle : {"error: the ranks of this job resolved checkpoint.load to different checkpoints",
                             "checkpoint.step: 10 on rank 0; 15 on rank 1", "checkpoint.save_id: "})
    EXPECT_NE(r.output.find(needle), std::string::npos) << needle << "\n" << r.output;
  EXPECT_EQ(r.output.find("step    "), std::string::npos) << "no step ran:\n" << r.output;
  // The same save copied to each rank: resumed.
  fs::remove_all(*dir_ / "rank1/ld");
  fs::copy(step_dir("base", 10), *dir_ / "rank1/ld", fs::copy_options::recursive);
  r = mpmd("mpmd-copies", "--set training.steps=11 --set checkpoint.load=ld");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from ld at step 10"), std::string::npos) << r.output;

  // Initial weights: two random inits' exports, one per rank, then copies of one.
  for (const auto& [tag, seed] : {std::pair<std::string, int>{"hf-seed1", 1}, {"hf-seed2", 2}}) {
    r = train(tag, 1, "--set training.steps=0 --set training.seed=" + std::to_string(seed) + " --set export.dir=" +
                          (*dir_ / tag));
    ASSERT_EQ(r.status, 0) << r.output;
  }
  fs::copy(*dir_ / "hf-seed1", *dir_ / "rank0/hf", fs::copy_options::recursive);
  fs::copy(*dir_ / "hf-seed2", *dir_ / "rank1/hf", fs::copy_options::recursive);
  r = mpmd("mpmd-hf", "--set training.steps=1 --set checkpoint.init_from_hf=hf");
  EXPECT_EQ(r.status, 2) << r.output;
  for (const char* needle : {"error: the ranks of this job read different weights through checkpoint.init_from_hf",
                             "model.safetensors: ", "sampled xxh3 "})
    EXPECT_NE(r.output.find(needle), std::string::npos) << needle << "\n" << r.output;
  EXPECT_EQ(r.output.find("step    "), std::string::npos) << "no step ran:\n" << r.output;
  fs::remove_all(*dir_ / "rank1/hf");
  fs::copy(*dir_ / "hf-seed1", *dir_ / "rank1/hf", fs::copy_options::recursive);
  r = mpmd("mpmd-hf-copies", "--set training.steps=1 --set checkpoint.init_from_hf=hf");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("initial weights from hf"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace origami

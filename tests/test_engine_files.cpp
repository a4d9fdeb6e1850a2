// engine/files.h's locks: one writer per output file (WriterLock, through
// ReplacedFiles and the dataset writer) and one run per directory
// (DirectoryLock), including a directory moved away while a run holds it;
// and engine/stop_signals.h's start-up window, the run's other guard
// against losing its output; and the step directories' names, which a run
// finds its checkpoints by.
// flock locks belong to an open file description, so two locks taken in
// this one process conflict exactly as two processes' would.
#include <gtest/gtest.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <string>

#include "cli_util.h"
#include "engine/checkpoint.h"
#include "engine/files.h"
#include "engine/indexed_dataset.h"
#include "engine/stop_signals.h"
#include "kernels/check.h"

namespace origami {
namespace {

namespace fs = std::filesystem;
using testing::ScratchDir;

// The message of the UserError `f` throws, or "" when it throws none.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

TEST(WriterLock, ASecondWriterOfOneOutputIsRefusedBeforeItTruncatesTheFirstsFile) {
  ScratchDir dir("writer-lock");
  const std::string model = dir / "model.safetensors", config = dir / "config.json";
  std::optional<ReplacedFiles> first(std::in_place, std::vector<std::string>{model, config});
  testing::write_file(first->tmp(0), "the first writer's bytes");
  const std::string refused = error_of([&] { ReplacedFiles second({model, config}); });
  EXPECT_NE(refused.find(model + ".tmp: another process is writing it (an export to the same directory; rule: one "
                         "writer per output"),
            std::string::npos)
      << refused;
  EXPECT_EQ(testing::read_file(first->tmp(0)), "the first writer's bytes") << "untouched by the refused writer";
  testing::write_file(first->tmp(1), "{}");
  first->commit();
  first.reset();
  EXPECT_EQ(testing::read_file(model), "the first writer's bytes");
  // Released at commit: the next export writes.
  ReplacedFiles next({model, config});
  testing::write_file(next.tmp(0), "next");
  testing::write_file(next.tmp(1), "{}");
  next.commit();
  EXPECT_EQ(testing::read_file(model), "next");

  // preprocess: two writers of one prefix.
  IndexedDatasetWriter data(dir / "corpus", IndexDType::u16);
  const std::string again = error_of([&] { IndexedDatasetWriter other(dir / "corpus", IndexDType::u16); });
  EXPECT_NE(again.find("corpus.bin.tmp: another process is writing it (a preprocess to the same output prefix"),
            std::string::npos)
      << again;
}

TEST(DirectoryLock, ADirectoryMovedAwayIsLockedAgainOrRefusedWhenAnotherRunTookIt) {
  ScratchDir dir("dir-lock");
  const std::string ck = dir / "ck";
  DirectoryLock held(ck, "checkpoint.dir");
  EXPECT_NE(error_of([&] { DirectoryLock second(ck, "checkpoint.dir"); }).find("another origami run uses this directory"),
            std::string::npos);
  held.check_held();  // still its own: nothing happens

  // Moved away, nobody else there: taken again (a warning).
  fs::rename(ck, dir / "ck.old");
  held.check_held();
  EXPECT_TRUE(fs::exists(ck + "/.origami.lock"));
  EXPECT_NE(error_of([&] { DirectoryLock second(ck, "checkpoint.dir"); }).find("another origami run uses this directory"),
            std::string::npos)
      << "the new directory is this run's";

  // Moved away and another run started there: this run is refused.
  fs::rename(ck, dir / "ck.old2");
  DirectoryLock other(ck, "checkpoint.dir");
  const std::string taken = error_of([&] { held.check_held(); });
  EXPECT_NE(taken.find("checkpoint.dir = \"" + ck + "\": was moved or removed while this run used it, and another "
                       "origami run uses this directory"),
            std::string::npos)
      << taken;
}

// A preemption signal between main's start and the trainer's handlers (MPI_Init
// on a large job) is noted, not fatal, and the trainer's StopSignals acts on
// it; when that ends, the actions from before start-up are back.
TEST(StopSignals, ASignalDuringStartUpIsKeptForTheRunAndTheDefaultsComeBackAfter) {
  struct sigaction before {};
  ASSERT_EQ(sigaction(SIGUSR2, nullptr, &before), 0);
  ASSERT_EQ(before.sa_handler, SIG_DFL);
  catch_stop_signals_from_start();
  ASSERT_EQ(raise(SIGUSR2), 0);  // the default action would end this test binary
  EXPECT_EQ(first_stop_signal(), SIGUSR2);
  {
    StopSignals run;
    EXPECT_EQ(first_stop_signal(), SIGUSR2) << "the start-up signal is the run's to act on";
    struct sigaction second {};
    ASSERT_EQ(sigaction(SIGUSR2, nullptr, &second), 0);
    EXPECT_EQ(second.sa_handler, SIG_DFL) << "a second SIGUSR2 kills at once, as after a signal during the run";
    struct sigaction other {};
    ASSERT_EQ(sigaction(SIGUSR1, nullptr, &other), 0);
    EXPECT_NE(other.sa_handler, SIG_DFL) << "another kind is still only noted";
  }
  struct sigaction after {};
  ASSERT_EQ(sigaction(SIGUSR2, nullptr, &after), 0);
  EXPECT_EQ(after.sa_handler, SIG_DFL);
  {
    StopSignals next;  // a later run in the same process starts clean
    EXPECT_EQ(first_stop_signal(), 0);
  }
}

// Past step 99,999,999 the name grows a digit: the reader must take every
// name the writer makes (a run of 10^8 steps could not resume, and `keep`
// passed over its newest saves), and no other spelling of a step.
TEST(CheckpointNames, EveryStepsDirectoryNameReadsBackAsItsStep) {
  for (int64_t step : {int64_t{0}, int64_t{1}, int64_t{99999999}, int64_t{100000000}, int64_t{123456789012},
                       std::numeric_limits<int64_t>::max()})
    EXPECT_EQ(step_of(step_dir_name(step)), step) << step_dir_name(step);
  EXPECT_EQ(step_dir_name(100000000), "step-100000000");
  for (const char* other : {"step-", "step-1", "step-0000001", "step-000000001", "step-0100000000", "step-+0000001",
                            "step--0000001", "step-0000001a", "step-00000001.tmp", "Step-00000001",
                            "step-99999999999999999999", "step-00000001 "})
    EXPECT_EQ(step_of(other), -1) << other;
}

TEST(CheckpointNames, TheNewestSaveIsFoundAcrossTheEighthDigit) {
  ScratchDir dir("names");
  for (const char* name : {"step-99999999", "step-100000000", "step-20000000"}) {
    fs::create_directories(dir / name);
    std::ofstream(dir / (std::string(name) + "/metadata.json")) << "{}";
  }
  CheckpointConfig ck;
  ck.dir = dir.str();
  ck.load = "latest";
  // No `latest` (the job died before writing it): the newest step directory.
  EXPECT_EQ(resolve_load(ck), dir / "step-100000000");
  std::ofstream(dir / "latest") << "step-100000000\n";
  EXPECT_EQ(resolve_load(ck), dir / "step-100000000");
}

}  // namespace
}  // namespace origami

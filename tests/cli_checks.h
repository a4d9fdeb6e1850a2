// Checks shared by the end-to-end tests of `origami train` (GoogleTest
// assertions over cli_util.h): a checkpoint's consolidated state as bytes,
// and a run's measured bytes against `origami plan`'s.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

#include "cli_util.h"

namespace origami::testing {

// The step directory a checkpoint.dir holds for `step`.
inline std::string step_dir(const std::string& checkpoint_dir, int step) {
  char name[32];
  std::snprintf(name, sizeof name, "/step-%08d", step);
  return checkpoint_dir + name;
}

// A checkpoint's consolidated parameters and AdamW moments, as the bytes of
// `origami export --optimizer` into `out` (model.safetensors,
// optimizer.safetensors): equal bytes are bitwise-equal state.
inline std::pair<std::string, std::string> consolidated(const std::string& step, const std::string& out) {
  auto r = run_command(std::string(ORIGAMI_BINARY) + " export --optimizer --checkpoint " + step + " --out " + out);
  EXPECT_EQ(r.status, 0) << r.output;
  return {read_file(out + "/model.safetensors"), read_file(out + "/optimizer.safetensors")};
}

// A checkpoint moved: `train(tag, sets)` runs 3 steps saving at step 3
// under `from` (tag "saved"), then loads that checkpoint under `to` and
// saves it again at once (tag "moved"; no step runs). The consolidated
// parameters and moments of the two are bitwise equal. Checkpoints go to
// <scratch>/<tag>-ckpt, exports to <scratch>/<tag>-export.
inline void expect_move_keeps_the_state(const std::function<CommandResult(const std::string&, const std::string&)>& train,
                                        const std::string& scratch, const std::string& saved, const std::string& from,
                                        const std::string& moved, const std::string& to) {
  const std::string save = " --set training.steps=3 --set checkpoint.interval=3";
  const std::string saved_step = step_dir(scratch + "/" + saved + "-ckpt", 3);
  auto r = train(saved, save + " " + from + " --set checkpoint.dir=" + scratch + "/" + saved + "-ckpt");
  ASSERT_EQ(r.status, 0) << r.output;
  r = train(moved, save + " " + to + " --set checkpoint.load=" + saved_step + " --set checkpoint.dir=" + scratch + "/" +
                       moved + "-ckpt");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto want = consolidated(saved_step, scratch + "/" + saved + "-export");
  const auto got = consolidated(step_dir(scratch + "/" + moved + "-ckpt", 3), scratch + "/" + moved + "-export");
  ASSERT_FALSE(want.first.empty());
  EXPECT_TRUE(got.first == want.first) << "consolidated parameters differ after the move";
  EXPECT_TRUE(got.second == want.second) << "consolidated AdamW moments differ after the move";
}

// A step's comm_bytes per group within 1% of the plan's figures for stage 0
// (whose first rank is world rank 0, the rank that logs), and every planned
// group measured. cp exchanges fixed-size K, V blocks: exactly the plan.
inline void expect_comm_bytes_as_planned(const nlohmann::json& record, const nlohmann::json& plan) {
  const auto& predicted = plan.at("comm").at("stages").at(0).at("groups");
  const auto& measured = record.at("comm_bytes");
  for (const auto& [group, bytes] : measured.items()) {
    const double m = bytes.get<double>();
    const double p = predicted.contains(group) ? predicted.at(group).get<double>() : 0.0;
    EXPECT_LE(std::abs(m - p), 0.01 * std::max(p, 1.0)) << group << ": measured " << m << ", planned " << p;
    if (group == "cp") {
      EXPECT_EQ(m, p) << "cp: fixed-size K, V exchanges, so exactly the plan";
    }
  }
  for (const auto& [group, bytes] : predicted.items())
    EXPECT_TRUE(measured.contains(group)) << group << " planned (" << bytes << " bytes) but not measured";
}

// Each pipeline stage's held activations (the record's
// pipeline[s].held_activation_bytes) within 5% of the plan's ledger figure.
inline void expect_held_as_planned(const nlohmann::json& record, const nlohmann::json& plan) {
  const auto& stages = plan.at("ledger").at("stages");
  const auto& measured = record.at("pipeline");
  ASSERT_EQ(measured.size(), stages.size());
  for (size_t s = 0; s < stages.size(); ++s) {
    const double want = stages[s].at("activations").get<double>();
    const double got = measured[s].at("held_activation_bytes").get<double>();
    EXPECT_NEAR(got, want, 0.05 * want) << "stage " << s << " held activations";
    std::printf("  stage %zu: held activations %.0f, planned %.0f (%+.2f%%)\n", s, got, want,
                100 * (got - want) / want);
  }
}

}  // namespace origami::testing

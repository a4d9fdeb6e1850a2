// Checks shared by the end-to-end tests of `origami train` (GoogleTest
// assertions over cli_util.h): a checkpoint's consolidated state as bytes,
// an export against its checkpoint, a run's steps against another's, and a
// run's measured bytes against `origami plan`'s.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "cli_util.h"
#include "engine/safetensors.h"
#include "kernels/bf16.h"

namespace origami::testing {

// The step directory a checkpoint.dir holds for `step`.
inline std::string step_dir(const std::string& checkpoint_dir, int step) {
  char name[32];
  std::snprintf(name, sizeof name, "/step-%08d", step);
  return checkpoint_dir + name;
}

// The records of `run` for steps [first, last] are bitwise those of `base`
// (lm loss, aux loss, grad norm, the samples read).
inline void expect_same_steps(const std::vector<nlohmann::json>& base, const std::vector<nlohmann::json>& run, int first,
                              int last) {
  std::map<int64_t, const nlohmann::json*> by_step;
  for (const auto& r : run) by_step[r.at("step").get<int64_t>()] = &r;
  for (int s = first; s <= last; ++s) {
    ASSERT_TRUE(by_step.count(s)) << "no record of step " << s;
    const nlohmann::json& a = base.at(static_cast<size_t>(s - 1));
    const nlohmann::json& b = *by_step[s];
    ASSERT_EQ(a.at("step"), s);
    for (const char* key : {"lm_loss", "aux_loss", "grad_norm", "lr"})
      EXPECT_EQ(a.at(key).get<double>(), b.at(key).get<double>()) << key << " at step " << s;
    EXPECT_EQ(a.at("samples"), b.at("samples")) << "samples at step " << s;
  }
}

// A checkpoint's consolidated parameters and AdamW moments, as the bytes of
// `origami export --optimizer` into `out` (model.safetensors,
// optimizer.safetensors): equal bytes are bitwise-equal state.
inline std::pair<std::string, std::string> consolidated(const std::string& step, const std::string& out) {
  auto r = run_command(std::string(ORIGAMI_BINARY) + " export --optimizer --checkpoint " + step + " --out " + out);
  EXPECT_EQ(r.status, 0) << r.output;
  return {read_file(out + "/model.safetensors"), read_file(out + "/optimizer.safetensors")};
}

// A run's export (model.safetensors in export_dir, written after its last
// save, or at once after a load that runs no step) holds exactly the
// weights of the checkpoint consolidated into consolidated_dir: its fp32
// master as is, or rounded to nearest even where the run is bf16 (the export
// reads the bf16 working copy); the expert bias, fp32 in either recipe, as
// is. A save that read the weights before the step's update landed, or a
// load that left the working copy stale, differs here.
inline void expect_export_holds_the_checkpoint_weights(const std::string& export_dir,
                                                       const std::string& consolidated_dir, bool bf16) {
  const SafetensorsFile got(export_dir + "/model.safetensors"), want(consolidated_dir + "/model.safetensors");
  EXPECT_EQ(got.entries().size(), want.entries().size());
  int64_t rounded = 0;  // elements the bf16 rounding changed: without any the check proves nothing
  for (const auto& [name, w] : want.entries()) {
    const SafetensorsFile::Entry& g = got.entry(name);
    ASSERT_EQ(g.shape, w.shape) << name;
    ASSERT_EQ(g.end - g.begin, w.end - w.begin) << name;
    const bool exact = !bf16 || name.ends_with(".expert_bias");
    const int64_t n = (w.end - w.begin) / 4;
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      float master = 0, exported = 0;
      std::memcpy(&master, want.data(w) + 4 * i, 4);
      std::memcpy(&exported, got.data(g) + 4 * i, 4);
      const float expected = exact ? master : bf16_value(bf16_bits(master));
      rounded += expected != master;
      bad += std::memcmp(&exported, &expected, 4) != 0;
    }
    EXPECT_EQ(bad, 0) << name << ": " << bad << " of " << n << " exported elements differ from the checkpoint's"
                      << (exact ? "" : " rounded to bf16");
  }
  if (bf16) {
    EXPECT_GT(rounded, 0) << "the master weights are bf16 values already";
  }
}

// A checkpoint moved each way between a one-rank run under `one_sets` (the
// GPU's, say) and a multi-rank one under `many_sets` (CPU ranks, ZeRO-3:
// sharded, resharded on load): each side saves after 3 steps, the other
// loads that and saves again at once (no step runs), and the consolidated
// fp32 parameters and AdamW moments of the two are bitwise equal
// (`origami export --optimizer` of each). Every run also exports, so each
// export must hold its checkpoint's weights
// (expect_export_holds_the_checkpoint_weights). `train(tag, sets)` runs
// one side; tags "<one|many>-<saved|loaded>"; checkpoints and exports under
// <scratch>/<tag>-ckpt, -hf, -export.
using TrainRun = std::function<CommandResult(const std::string& tag, const std::string& sets)>;
inline void expect_moves_keep_the_state(const TrainRun& one, const std::string& one_sets, bool one_bf16,
                                        const TrainRun& many, const std::string& many_sets, bool many_bf16,
                                        const std::string& scratch) {
  struct Side {
    const TrainRun& train;
    std::string name, sets;
    bool bf16;
  };
  const Side sides[] = {{one, "one", one_sets, one_bf16}, {many, "many", many_sets, many_bf16}};
  for (int from = 0; from < 2; ++from) {
    const Side &src = sides[from], &dst = sides[1 - from];
    SCOPED_TRACE(src.name + " -> " + dst.name);
    const auto run = [&](const Side& side, const std::string& tag, const std::string& load) {
      const std::string at = scratch + "/" + tag;
      auto r = side.train(tag, side.sets + " --set training.steps=3 --set checkpoint.interval=3 --set checkpoint.dir=" +
                                   at + "-ckpt --set export.dir=" + at + "-hf" + load);
      EXPECT_EQ(r.status, 0) << r.output;
      return r.status == 0;
    };
    const std::string saved = src.name + "-saved", loaded = dst.name + "-loaded";
    const std::string saved_step = step_dir(scratch + "/" + saved + "-ckpt", 3);
    if (!run(src, saved, "")) return;
    if (!run(dst, loaded, " --set checkpoint.load=" + saved_step)) return;
    const auto want = consolidated(saved_step, scratch + "/" + saved + "-export");
    const auto got = consolidated(step_dir(scratch + "/" + loaded + "-ckpt", 3), scratch + "/" + loaded + "-export");
    ASSERT_FALSE(want.first.empty());
    EXPECT_TRUE(got.first == want.first) << "consolidated parameters differ after the move";
    EXPECT_TRUE(got.second == want.second) << "consolidated AdamW moments differ after the move";
    expect_export_holds_the_checkpoint_weights(scratch + "/" + saved + "-hf", scratch + "/" + saved + "-export",
                                               src.bf16);
    expect_export_holds_the_checkpoint_weights(scratch + "/" + loaded + "-hf", scratch + "/" + saved + "-export",
                                               dst.bf16);
  }
}

// `origami bench kernels --json`'s report on any device: finite, positive
// ceilings, times and rates; each op's fraction of its ceiling is its rate
// over that ceiling; no op read back wrong data; keys unique. The keys.
inline std::set<std::string> expect_bench_kernels_report(const nlohmann::json& j) {
  const double tflops = j["ceilings"]["gemm_tflops"].get<double>(), gbps = j["ceilings"]["copy_gbps"].get<double>();
  EXPECT_TRUE(std::isfinite(tflops) && tflops > 0) << j["ceilings"];
  EXPECT_TRUE(std::isfinite(gbps) && gbps > 0) << j["ceilings"];
  EXPECT_EQ(j["wrong"], 0);
  std::set<std::string> keys;
  for (const auto& op : j.at("ops")) {
    const std::string key = op.at("key");
    EXPECT_TRUE(keys.insert(key).second) << key << " twice";
    const bool compute = op.contains("tflops");
    const double ms = op.at("ms").get<double>(), rate = op.at(compute ? "tflops" : "gbps").get<double>();
    EXPECT_TRUE(std::isfinite(ms) && ms > 0) << op;
    EXPECT_TRUE(std::isfinite(rate) && rate > 0) << op;
    EXPECT_NEAR(op.at("fraction_of_ceiling").get<double>(), rate / (compute ? tflops : gbps), 1e-9 * rate) << op;
    EXPECT_FALSE(op.contains("wrong")) << op;
  }
  return keys;
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
// pipeline[s].held_activation_bytes) equal to the plan's ledger figure, to the byte.
inline void expect_held_as_planned(const nlohmann::json& record, const nlohmann::json& plan) {
  const auto& stages = plan.at("ledger").at("stages");
  const auto& measured = record.at("pipeline");
  ASSERT_EQ(measured.size(), stages.size());
  for (size_t s = 0; s < stages.size(); ++s) {
    const double want = stages[s].at("activations").get<double>();
    const double got = measured[s].at("held_activation_bytes").get<double>();
    EXPECT_EQ(got, want) << "stage " << s << " held activations";
    std::printf("  stage %zu: held activations %.0f, planned %.0f (%+.2f%%)\n", s, got, want,
                100 * (got - want) / want);
  }
}

// Rank 0's ledger (the record's mem, peaks of the step) against stage 0 of
// the plan: the param and grad categories' peaks are the persistent state
// plus ZeRO's working buffers (ledger.stages[0].zero_working, replayed from
// engine/zero.cpp's rules), to the byte; the total peak is the plan's
// within `rtol` (what the plan leaves out: kernel workspaces and a step's
// scalars; with pp > 1, the pipeline's sends in flight, which follow the
// stages' timing).
inline void expect_ledger_as_planned(const nlohmann::json& record, const nlohmann::json& plan, double rtol) {
  const auto& st = plan.at("ledger").at("stages").at(0);
  const auto& mem = record.at("mem");
  for (const char* c : {"param", "grad"})
    EXPECT_EQ(mem.at(c).get<int64_t>(), st.at(c).get<int64_t>() + st.at("zero_working").at(c).get<int64_t>())
        << c << " peak against the plan's state + ZeRO working buffers";
  const double total = mem.at("total").get<double>(), planned = st.at("total").get<double>();
  EXPECT_NEAR(total, planned, rtol * planned) << "the total peak against the plan's";
  std::printf("  rank 0: param %lld, grad %lld as planned; total %.0f, planned %.0f (%+.3f%%)\n",
              static_cast<long long>(mem.at("param").get<int64_t>()),
              static_cast<long long>(mem.at("grad").get<int64_t>()), total, planned,
              100 * (total - planned) / planned);
}

}  // namespace origami::testing

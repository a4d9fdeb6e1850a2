// `origami checkpoint inspect DIR [--verify] [--json]`: what a checkpoint
// holds (step, saving layout, training state, bytes per rank, every tensor
// with its global shape and how it is split); --verify recomputes every
// file's digest.
// `origami export --checkpoint DIR --out DIR [--optimizer]`: consolidated
// Hugging Face safetensors from a checkpoint, one tensor in memory at a time.
// Both run on one process (rank 0 of the job does the work).
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>

#include "engine/checkpoint.h"
#include "engine/metrics.h"
#include "tools/commands.h"

namespace origami::tools {

namespace {

bool is_rank_zero() { return job_rank() == 0; }

// How a tensor is stored: "whole", or the split dimension and slice count,
// then how many shards over how many ranks.
std::string split_of(const SavedTensor& t) {
  std::set<std::pair<int64_t, int64_t>> slices;
  std::set<int> ranks;
  for (const SavedShard& s : t.shards) {
    slices.emplace(s.slice_dim, s.slice_start);
    ranks.insert(s.rank);
  }
  std::string out;
  if (slices.size() == 1 && slices.begin()->first < 0) out = "whole";
  else out = "dim " + std::to_string(slices.begin()->first) + " in " + std::to_string(slices.size()) + " slices";
  out += ", " + std::to_string(t.shards.size()) + (t.shards.size() == 1 ? " shard" : " shards") + " on " +
         std::to_string(ranks.size()) + (ranks.size() == 1 ? " rank" : " ranks");
  return out;
}

void inspect(const std::string& dir, bool verify, bool json) {
  const CheckpointInfo info = read_checkpoint_info(dir);
  // A file missing or cut short would fail the load: said without --verify
  // too, at the cost of a stat per file.
  check_checkpoint_file_sizes(info);
  double verify_s = -1;
  if (verify) {
    const auto t0 = std::chrono::steady_clock::now();
    verify_checkpoint_files(info);
    verify_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  std::map<int, int64_t> rank_bytes;
  int64_t total = 0;
  for (const SavedFile& f : info.files) {
    rank_bytes[f.rank] += f.bytes;
    total += f.bytes;
  }
  if (json) {
    nlohmann::ordered_json j;
    j["dir"] = dir;
    j["step"] = info.step;
    j["layout"] = {{"world", info.world}, {"tp", info.tp}, {"cp", info.cp}, {"pp", info.pp}, {"ep", info.ep},
                   {"etp", info.etp}, {"dp", info.dp}, {"edp", info.edp}, {"zero_stage", info.zero_stage},
                   {"order", info.order}, {"stage_layers", info.stage_layers}};
    j["train"] = {{"step", info.train.step}, {"lr", info.train.lr}, {"consumed_samples", info.train.consumed_samples},
                  {"windows_per_epoch", info.train.windows_per_epoch}, {"seed", info.train.seed}};
    j["bytes_total"] = total;
    nlohmann::ordered_json per_rank = nlohmann::ordered_json::array();
    for (const auto& [r, b] : rank_bytes) per_rank.push_back(b);
    j["bytes_per_rank"] = per_rank;
    nlohmann::ordered_json tensors = nlohmann::ordered_json::object();
    for (const std::string& name : info.order_of_tensors) {
      const SavedTensor& t = info.tensors.at(name);
      tensors[name] = {{"shape", t.global_shape}, {"split", split_of(t)}, {"shards", t.shards.size()}};
    }
    j["tensors"] = tensors;
    if (verify) j["verified"] = {{"files", info.files.size()}, {"seconds", verify_s}};
    std::printf("%s\n", j.dump().c_str());
    return;
  }
  std::printf("checkpoint %s: step %lld\n", dir.c_str(), static_cast<long long>(info.step));
  std::printf("  saved on %lld ranks: tp %lld cp %lld pp %lld (layers per stage", static_cast<long long>(info.world),
              static_cast<long long>(info.tp), static_cast<long long>(info.cp), static_cast<long long>(info.pp));
  for (int64_t n : info.stage_layers) std::printf(" %lld", static_cast<long long>(n));
  std::printf(") dp %lld | ep %lld etp %lld edp %lld | ZeRO %lld | order %s\n", static_cast<long long>(info.dp),
              static_cast<long long>(info.ep), static_cast<long long>(info.etp), static_cast<long long>(info.edp),
              static_cast<long long>(info.zero_stage), info.order.c_str());
  const TrainState& t = info.train;
  std::printf("  training: %lld optimizer steps, lr %.4e, %lld samples consumed (epoch %lld, offset %lld of %lld), seed %llu\n",
              static_cast<long long>(t.step), t.lr, static_cast<long long>(t.consumed_samples),
              static_cast<long long>(t.windows_per_epoch ? t.consumed_samples / t.windows_per_epoch : 0),
              static_cast<long long>(t.windows_per_epoch ? t.consumed_samples % t.windows_per_epoch : 0),
              static_cast<long long>(t.windows_per_epoch), static_cast<unsigned long long>(t.seed));
  int64_t lo = INT64_MAX, hi = 0;
  for (const auto& [r, b] : rank_bytes) lo = std::min(lo, b), hi = std::max(hi, b);
  std::printf("  %zu files, %s in all; per rank %s .. %s\n", info.files.size(), format_bytes(total).c_str(),
              format_bytes(lo).c_str(), format_bytes(hi).c_str());
  std::printf("  %zu tensors:\n", info.tensors.size());
  for (const std::string& name : info.order_of_tensors) {
    const SavedTensor& st = info.tensors.at(name);
    std::printf("    %-64s %-14s %s\n", name.c_str(), shape_string(st.global_shape).c_str(), split_of(st).c_str());
  }
  if (verify) std::printf("verified %zu files in %.2f s: every digest matches\n", info.files.size(), verify_s);
}

}  // namespace

void add_checkpoint_command(CLI::App& app) {
  struct Args {
    std::string dir;
    bool verify = false, json = false;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand("checkpoint", "Look into sharded checkpoints");
  cmd->require_subcommand(1);
  CLI::App* ins = cmd->add_subcommand("inspect", "Step, saving layout, tensors and their shards, bytes per rank");
  ins->add_option("dir", args->dir, "A step directory (<checkpoint.dir>/step-NNNNNNNN)")->required();
  ins->add_flag("--verify", args->verify, "Recompute every file's digest");
  ins->add_flag("--json", args->json, "Print one JSON object");
  ins->callback([args] {
    if (is_rank_zero()) inspect(args->dir, args->verify, args->json);
  });
}

void add_export_command(CLI::App& app) {
  struct Args {
    std::string checkpoint, out;
    bool optimizer = false;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand("export", "Consolidated Hugging Face safetensors from a checkpoint");
  cmd->add_option("--checkpoint", args->checkpoint, "A step directory (<checkpoint.dir>/step-NNNNNNNN)")->required();
  cmd->add_option("--out", args->out, "Output directory (model.safetensors, config.json)")->required();
  cmd->add_flag("--optimizer", args->optimizer, "Also optimizer.safetensors: the AdamW moments, consolidated");
  cmd->callback([args] {
    if (!is_rank_zero()) return;
    export_checkpoint(args->checkpoint, args->out, args->optimizer);
    std::printf("exported %s to %s\n", args->checkpoint.c_str(), args->out.c_str());
  });
}

}  // namespace origami::tools

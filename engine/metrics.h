// Per-step metrics (ARCHITECTURE.md §8): a human step line and one JSON object
// per step in <logging.dir>/metrics.jsonl.
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/files.h"
#include "engine/model.h"
#include "kernels/allocator.h"

namespace origami {

// A checkpoint written after the step (engine/checkpoint.h).
struct CheckpointRecord {
  std::string dir;                // the step directory
  bool background = false;        // checkpoint.async: still being written (bytes: see CheckpointDone)
  int64_t max_rank_bytes = 0;     // the largest rank's files (a background save: rank 0's, JSON rank_bytes)
  int64_t total_bytes = 0;        // every rank's (a background save: 0, not in its JSON)
  double blocked_s = 0;           // how long the save held up training
  int64_t host_staged_bytes = 0;  // this rank's host memory for the save at its peak (CheckpointSaveStats)
};
// A background save that completed at this step boundary.
struct CheckpointDone {
  std::string dir;
  double written_s = 0;  // from its start to complete
  int64_t max_rank_bytes = 0, total_bytes = 0;
};

struct StepMetrics {
  int64_t step = 0, total_steps = 0;
  double lm_loss = 0, grad_norm = 0, lr = 0;
  double aux_loss = 0, z_loss = 0;    // Σ over MoE layers, mean over micro-batches
  std::vector<MoeLayerRecord> moe;    // per MoE layer, summed over the step's micro-batches
  double step_time_s = 0, tokens_per_s = 0, gflops = 0;  // achieved GFLOP/s on this rank
  // Model FLOP utilization: gflops against the compute device's GEMM peak
  // measured at start-up (engine/device_peak.h), both per rank; 0 unknown.
  double peak_gflops = 0, mfu = 0;
  // Seconds of the step this rank stood waiting on communication over the
  // layout's groups (OpStats::exposed_s): what overlap did not hide.
  double comm_exposed_s = 0;
  int64_t tokens = 0;
  // The step's global batch: samples [first_sample, + samples) of the
  // sampler's stream (engine/dataset.h), in epoch `epoch`.
  int64_t first_sample = 0, samples = 0, epoch = 0;
  // The compute device's ledger: peaks over the step; `current` at its end
  // (the persistent state). On a CUDA run also the host's, whose bytes
  // (staging, host metadata) differ.
  LedgerSnapshot mem;
  Device mem_device;
  std::optional<LedgerSnapshot> host_mem;
  // Bytes this rank sent per group during the step (comm/communicator.h's
  // ring convention), for groups of more than one rank, by group name.
  std::vector<std::pair<std::string, int64_t>> comm_bytes;
  // Seconds this rank spent in each group's all-to-alls (OpStats::blocking_s), for groups that ran one.
  std::vector<std::pair<std::string, double>> comm_a2a_s;
  // Per pipeline stage (one entry without pipelining): seconds busy in
  // forward and backward and idle on the pipeline's receives during the
  // step's schedule, as measured on the stage's rank in rank 0's pp group.
  std::vector<StageTiming> stages;
  std::optional<CheckpointRecord> checkpoint;  // when one was written (or started) after this step
  std::optional<CheckpointDone> checkpoint_done;
  std::string stopped_by;  // the preemption signal the run stops after this step for ("SIGTERM"), else ""
};

nlohmann::ordered_json to_json(const StepMetrics& m);
// One MoE layer: layer, tokens_per_expert (routed, before dropping),
// kept_per_expert, tokens_per_ep_rank (kept tokens the experts of each EP
// rank received), dropped_fraction, max_over_mean (routed load).
nlohmann::ordered_json to_json(const MoeLayerRecord& r);
std::string format_step_line(const StepMetrics& m);
std::string format_bytes(int64_t bytes);

// <dir>/metrics.jsonl, one record per step, every write checked
// (engine/files.h): a failure is a UserError naming the file.
class MetricsWriter {
 public:
  // Empty dir: no file is written. Creates the directory and proves it
  // writable (UserError naming logging.dir), and writes config_text (the
  // resolved config) to <dir>/config.toml beside the metrics, which
  // `origami imbalance` reads for the model shape. resumed_step > 0 (a run
  // resumed from that step's checkpoint): the file's records of steps up to
  // it are kept and later ones (steps the resumed run redoes) dropped;
  // otherwise the file starts empty.
  explicit MetricsWriter(const std::string& dir, int64_t resumed_step = 0, const std::string& config_text = "");
  // Warns once on stderr when the file was deleted under the run (the
  // records still "succeed", into a file nobody can read); training goes on.
  // (NFS renames a deleted open file instead: no warning there.)
  void write(const StepMetrics& m);
  // Closes the file, reporting what the last writes did not; further
  // writes are dropped.
  void close();

 private:
  std::unique_ptr<OutputFile> out_;
  bool warned_unlinked_ = false;
};

}  // namespace origami

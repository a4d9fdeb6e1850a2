// Config: the TOML file's sections as typed option structs, validated once at
// load (ARCHITECTURE.md §1: nothing below engine/ reads the file). Unknown
// keys, wrong types, out-of-range values and inconsistent sizes are
// UserErrors naming the file, the key and the rule.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/pipeline.h"
#include "kernels/device.h"
#include "dense/cp_comm.h"
#include "moe/options.h"
#include "moe/placement.h"

namespace origami {

struct ModelConfig {
  int64_t vocab_size = 257;       // byte-level 256 + EOD
  int64_t hidden_size = 128;
  int64_t num_layers = 2;
  int64_t num_heads = 4;
  int64_t num_kv_heads = 4;       // GQA: divides num_heads
  int64_t ffn_hidden_size = 384;  // dense SwiGLU width
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  double init_std = 0.02;
  int64_t head_dim() const { return hidden_size / num_heads; }
};

// The router's and capacity's options are the structs moe/ and the kernels
// read (moe/options.h); the [moe] keys name their fields (moe.top_k fills
// router.top_k, moe.capacity_factor capacity.capacity_factor, ...).
struct MoeConfig {
  // num_experts (0: every layer is dense), top_k, score_function ("softmax" |
  // "sigmoid"), normalize_topk, topk_scaling, num_groups (group-limited
  // routing when > 1; divides num_experts), group_topk (1 <= group_topk <=
  // num_groups), load_balancing ("aux_loss" | "seq_aux_loss" |
  // "global_aux_loss" | "none"), aux_loss_coeff, z_loss_coeff.
  moe::RouterOptions router = file_router_defaults();
  // capacity_factor (absent: dropless), drop_policy ("probs" | "position"),
  // pad_to_capacity (requires capacity_factor).
  moe::CapacityOptions capacity;
  int64_t ffn_hidden_size = 0;  // per-expert width; 0 means model.ffn_hidden_size
  int64_t first_dense_layers = 0;
  int64_t layer_freq = 1;       // layer l is MoE iff l >= first_dense_layers and (l - first) % freq == 0
  int64_t shared_expert_hidden_size = 0;  // 0: no shared expert
  bool expert_bias = false;       // aux-loss-free balancing (DeepSeek-V3)
  double bias_update_rate = 1e-3;
  // moe.expert_placement, resolved (a placement file read, every rule
  // checked): which EP rank holds which experts of the listed MoE layers,
  // for ep = parallel.ep. Where the experts live, never the math; not part
  // of the model's shape (a checkpoint loads under any placement).
  moe::ExpertPlacements expert_placement;

  int64_t expert_ffn(int64_t dense_ffn) const { return ffn_hidden_size > 0 ? ffn_hidden_size : dense_ffn; }
  bool is_moe_layer(int64_t l) const {
    return router.num_experts > 0 && l >= first_dense_layers && (l - first_dense_layers) % layer_freq == 0;
  }

  // The file's defaults where they differ from the modules' own: an aux loss
  // of weight 1e-2 unless the file says otherwise (a module's RouterOptions
  // has none unless asked).
  static moe::RouterOptions file_router_defaults() {
    moe::RouterOptions r;
    r.aux_loss_coeff = 1e-2;
    return r;
  }
};

struct ParallelConfig {
  // etp unset in the file: equals tp (Megatron's expert_tensor_parallel_size
  // default), so layouts carry over; an explicit value is kept.
  int64_t tp = 1, cp = 1, pp = 1, ep = 1, etp = 1;
  std::string order = "tp-cp-ep-dp-pp";
  int64_t zero_stage = 3;
  // Layers per pipeline stage: pp counts >= 0 summing to model.num_layers.
  // Empty: even split, the first num_layers % pp stages one layer more.
  std::vector<int64_t> pp_layers;
  // ZeRO-3 only. true: free each gathered unit after its forward and regather
  // it for backward (per micro-batch). false: keep it whole from its first
  // gather until the step's gradients are done (one gather per unit per
  // step, at the memory of the whole stage's params).
  bool reshard_after_forward = true;
  // ZeRO 2-3: each unit's gradient reduce-scatter runs while the next unit's
  // backward computes (one in flight; on CUDA on the communication stream),
  // at the memory of a second whole gradient (Megatron's
  // overlap_grad_reduce). Same sums in the same order: bitwise the same run.
  bool overlap_grad_reduce = false;
  // The pipeline schedule (engine/pipeline.h): "1f1b", "interleaved" (with
  // virtual_stages >= 2 model chunks per rank; pp_layers then lists
  // pp·virtual_stages counts) or "zb-h1" (weight gradients deferred).
  PipeSchedule pp_schedule = PipeSchedule::one_f_one_b;
  int64_t virtual_stages = 1;
  // How CP attention moves K and V over the cp group: "all_gather" (gather
  // K, V once per layer, keep them whole for backward) or "ring" (pass
  // blocks rank to rank, overlapped with compute; keeps only the local K, V).
  dense::CpComm cp_comm = dense::CpComm::all_gather;
};

// training.recompute: activations backward recomputes instead of keeping.
// none: keep all; full: keep each layer's input only and re-run the layer's
// forward in its backward; moe: recompute only the MoE layers' expert
// activations (the [rows, F] SwiGLU tensors of routed and shared experts).
enum class Recompute { none, full, moe };

struct TrainingConfig {
  int64_t steps = 100;
  int64_t seq_len = 64;
  int64_t global_batch = 8;  // samples per optimizer step
  int64_t micro_batch = 8;   // samples per forward/backward; global_batch % (micro_batch·DP) == 0
  uint64_t seed = 1234;
  Recompute recompute = Recompute::none;
};

struct OptimizerConfig {
  double lr = 3e-3;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;  // tensors of rank >= 2 only
  double clip_grad = 1.0;     // global grad-norm clip; 0 disables
};

struct LrScheduleConfig {
  int64_t warmup_steps = 0;   // linear warmup lr·t/warmup at 1-based step t
  int64_t decay_steps = 0;    // cosine from warmup to this step; 0 means training.steps
  double min_lr = 3e-4;        // unset in a config: optimizer.lr / 10 (parse_config)
};

struct DataConfig {
  std::string path;  // dataset prefix: <path>.bin / <path>.idx
  bool shuffle = true;
};

// engine/checkpoint.h: what a checkpoint holds and how it is laid out.
struct CheckpointConfig {
  std::string dir;        // empty: no checkpoints
  int64_t interval = 0;   // save after every `interval` steps and after the last; 0: never
  int64_t keep = 0;       // complete checkpoints kept (the newest); 0: all
  // "" : start fresh; "latest": the one <dir>/latest names (fresh when there
  // is none); else a step directory (as given or under dir).
  std::string load;
  // Write in the background: a step is blocked only while the rank's pieces
  // are copied (memory: one more copy of the rank's share, until written).
  bool async = false;
  // A consolidated Hugging Face directory (model.safetensors, or sharded
  // with model.safetensors.index.json) to start from instead of the random
  // init; a run that resumes from a checkpoint ignores it.
  std::string init_from_hf;
};

struct ExportConfig {
  std::string dir;  // empty: no export; else HF safetensors + config.json at the end
};

struct LoggingConfig {
  std::string dir;        // empty: no metrics.jsonl
  int64_t interval = 1;   // print a step line every N steps (JSONL gets every step)
};

// runtime.device: where the training path runs. auto = cuda when this build
// has the CUDA backend and the machine a device, else cpu. One GPU per rank:
// rank -> cuda:(local rank mod visible devices), the local rank its index on
// its node (kernels/threads.h).
enum class RuntimeDevice { cpu, cuda, auto_ };
// runtime.precision: fp32 everywhere (the CPU engine's recipe; on CUDA it
// compares exactly with a CPU run), or bf16 weights, gradients and
// activations with fp32 master weights, moments and statistics (the GPU
// recipe; on the CPU emulated, op by op). auto = bf16 on CUDA, fp32 on CPU.
enum class Precision { auto_, fp32, bf16 };

struct RuntimeConfig {
  int64_t threads = 0;  // 0: max(1, cores / ranks on the node)
  double collective_timeout_s = 300.0;
  // The wait of a meeting whose length is file I/O on some ranks: start-up
  // (partial saves removed), checkpoint saves and loads, init_from_hf, the
  // export (rank 0 writes the whole model while the others wait).
  double io_timeout_s = 3600.0;
  RuntimeDevice device = RuntimeDevice::cpu;
  Precision precision = Precision::auto_;
};

// Where the values of a rule on several keys came from, for its message:
// the file when it wrote them all, the overrides when they wrote them all,
// else "c.toml with --set moe.num_groups=3" (the file and the overrides).
std::string origins_of(const std::string& file, const std::map<std::string, std::string>& set_by,
                       std::initializer_list<std::string_view> keys);

struct Config {
  std::string source;  // file the config came from (for messages)
  // Keys written by --set overrides: "optimizer.lr" -> "--set optimizer.lr=1e-3".
  std::map<std::string, std::string> set_by;
  // Where `key`'s value came from: its --set override, else the file.
  const std::string& origin(std::string_view key) const {
    auto it = set_by.find(std::string(key));
    return it == set_by.end() ? source : it->second;
  }
  std::string origin_of(std::initializer_list<std::string_view> keys) const { return origins_of(source, set_by, keys); }
  // The file and every override: where a rule of many keys (a layout, a
  // memory need) came from, "c.toml with --set parallel.tp=2".
  std::string sources() const {
    std::set<std::string> sets;  // an override may be recorded under its section too
    for (const auto& [key, set] : set_by) sets.insert(set);
    std::string s = source;
    for (const std::string& set : sets) s += (s.size() == source.size() ? " with " : ", ") + set;
    return s;
  }
  ModelConfig model;
  MoeConfig moe;
  ParallelConfig parallel;
  TrainingConfig training;
  OptimizerConfig optimizer;
  LrScheduleConfig lr_schedule;
  DataConfig data;
  CheckpointConfig checkpoint;
  ExportConfig exp;  // [export]
  LoggingConfig logging;
  RuntimeConfig runtime;
};

// Loads `path`, applies `overrides` ("section.key=value", value parsed as a
// TOML value; a bare word is a string), validates everything, and returns the
// config. Relative data.path / logging.dir / export.dir stay relative to the
// current directory. Throws UserError.
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});

// Same, from TOML text (tests); `source` names it in messages.
Config parse_config(const std::string& toml_text, const std::string& source,
                    const std::vector<std::string>& overrides = {});

// Every key and its resolved value, one "section.key = value" line each (TOML
// values, schema order; an absent optional key is left out): what ranks
// compare to prove they run the same config, and what a run records.
std::string canonical_text(const Config& cfg);

// moe.load_balancing's value as the config spells it ("aux_loss", ...).
std::string_view load_balancing_name(moe::LoadBalancing lb);

// Validation that needs the machine: runtime.threads at most the logical
// CPUs here, and a model whose training state could never fit in this
// node's memory refused up front with the bytes it needs (a lower bound:
// the §6 ledger of perfectly balanced shards for the layout of `world_size`
// ranks, `ranks_per_node` of them sharing this node's memory).
// On CUDA the bound is of one device's memory (one GPU per rank). For
// training (`trains`), then also the plan's state and held activations of
// the worst pipeline stage under training.recompute (engine/plan.h: equal to
// the measured ledger), so a run whose activations cannot fit is refused
// before it allocates them (on a CPU, where Linux overcommits, it would
// otherwise meet the OOM killer).
void validate_for_machine(const Config& cfg, int world_size, int ranks_per_node, bool trains = true);
// runtime.threads against this machine's logical CPUs (part of
// validate_for_machine; alone for a command that runs a part of the model).
void validate_threads(const Config& cfg);

// For programs that size their own buffers (benchmarks): refuses, naming
// `source`, each part of the need and `advice`, a host need per rank (the
// parts' sum) that this node's memory, shared by `ranks_per_node` ranks,
// cannot hold, before anything is allocated (where Linux overcommits, the
// allocation would succeed and the OOM killer end the run instead).
struct MemoryNeed {
  std::string what;
  long double bytes = 0;
};
void check_fits_host_memory(const std::string& source, std::span<const MemoryNeed> parts, const std::string& advice,
                            int ranks_per_node);

// Where a rank trains and in which recipe, as this machine resolves
// runtime.device and runtime.precision (never auto).
struct RunPlacement {
  Device device;  // cpu, or cuda:(local rank mod visible devices)
  Precision precision = Precision::fp32;
};
// For the rank `local_rank` of the `ranks_per_node` on this node: CUDA device
// local_rank mod the visible devices. UserError naming the key and the rule
// when the machine cannot: a build without CUDA, no device. (Two ranks on one
// GPU: check_one_rank_per_gpu, engine/preflight.h.) Precision auto is bf16 on
// CUDA and fp32 on the CPU.
RunPlacement resolve_placement(const Config& cfg, int local_rank, int ranks_per_node);

// The rule that running this model and training shape with `parallel` on
// `world_size` ranks breaks, or "" when it can run: comm::Layout's rules
// (ARCHITECTURE.md §3), the pipeline stages, heads and (with dense layers)
// the dense ffn over tp, seq_len over 2·cp, a micro-batch's tokens over tp
// (sequence parallelism), seq_aux_loss only at tp·cp = 1, the expert ffn
// over etp, global_batch over micro_batch·DP, padded capacity rows within
// i32. The one statement of the layout rules: train (validate_for_world),
// `origami plan` (the configured layout and every ranked candidate) and
// `origami groups --config` all ask it, so they accept and reject the same
// layouts with the same message.
std::string layout_problem(const ModelConfig& model, const MoeConfig& moe, const TrainingConfig& training,
                           const ParallelConfig& parallel, int64_t world_size);
std::string layout_problem(const Config& cfg, int64_t world_size);

// layout_problem as a UserError: "<source>: on W rank(s): <rule>".
void validate_for_world(const Config& cfg, int world_size);

// The rule of training alone: training.steps > 0 needs data.path. Not a
// rule of every config: eval reads --data, and plan, groups and the
// benchmarks read no data, so a config without data.path serves them.
void validate_for_training(const Config& cfg);

}  // namespace origami

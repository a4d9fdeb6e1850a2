// Pipeline parallelism (ARCHITECTURE.md §7): which layers a pipeline rank
// runs (one range per model chunk), the schedules as data (1F1B, interleaved
// 1F1B, ZB-H1), a discrete-event simulation of them, and the loop that runs
// one step of a schedule over the `pp` group.
//
// A stage's ranks all run the same schedule (the stage index is the only
// input besides the spec), so every collective inside a forward or backward
// (tp, cp, ep, etp, ZeRO) is issued in the same order on every rank of its
// group. Boundary tensors go virtual stage u → u+1 (activations, tag
// activation_tag(receiving chunk)) and u+1 → u (their gradients,
// gradient_tag); each (source, destination, tag) queue carries one chunk's
// tensors of one kind in micro-batch order, so a receive always matches the
// send the schedule meant.
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/groups.h"
#include "kernels/allocator.h"
#include "kernels/tensor.h"

namespace origami {

// The layers pipeline rank `index` of `count` runs: one range per model
// chunk (parallel.virtual_stages; one chunk unless interleaved). Chunk c is
// virtual stage c·count + index. The embedding sits on rank 0's chunk 0, the
// final norm, head and loss on rank count − 1's last chunk.
struct LayerRange {
  int64_t first_layer = 0, end_layer = 0;  // [first_layer, end_layer)
  bool contains(int64_t l) const { return l >= first_layer && l < end_layer; }
};
struct PipelineStage {
  int64_t index = 0, count = 1;
  std::vector<LayerRange> chunks{LayerRange{}};
  int64_t virtual_stages() const { return static_cast<int64_t>(chunks.size()); }
  bool first() const { return index == 0; }
  bool last() const { return index == count - 1; }
  // The chunk holding the embedding (first()) / the head (last()).
  bool first_chunk(int64_t c) const { return first() && c == 0; }
  bool last_chunk(int64_t c) const { return last() && c == virtual_stages() - 1; }
  bool owns_layer(int64_t l) const {
    return std::any_of(chunks.begin(), chunks.end(), [&](const LayerRange& r) { return r.contains(l); });
  }
  int64_t num_layers() const {
    int64_t n = 0;
    for (const LayerRange& r : chunks) n += r.end_layer - r.first_layer;
    return n;
  }
};

// Pipeline rank `index` of `pp` with `virtual_stages` chunks under
// `pp_layers` (layers per virtual stage, pp·virtual_stages entries in
// virtual-stage order; empty: even split with the first num_layers %
// (pp·v) virtual stages one layer longer — the rule of plan::stage_layers,
// which validates an explicit list).
PipelineStage pipeline_stage(int64_t num_layers, int64_t pp, int64_t index, const std::vector<int64_t>& pp_layers = {},
                             int64_t virtual_stages = 1);

// The first rank of this rank's stage (every coordinate 0 but pp): it
// gathers the stage's weights for export. Stage roots form world rank 0's pp
// group, in stage order.
int stage_root_rank(const comm::Groups& groups);

// How a step's micro-batches move through the stages
// (parallel.pp_schedule):
//  one_f_one_b  PipeDream-flush / Megatron's non-interleaved 1F1B.
//  interleaved  Megatron's interleaved 1F1B over v = parallel.virtual_stages
//               model chunks per rank; needs m % pp == 0.
//  zb_h1        1F1B's order of forwards and input-gradient backwards with
//               each backward's weight-gradient half (W) deferred into the
//               slots where 1F1B idles (Qi et al., "Zero Bubble Pipeline
//               Parallelism", ZB-H1).
enum class PipeSchedule { one_f_one_b, interleaved, zb_h1 };
const char* schedule_name(PipeSchedule s);  // the config's name: "1f1b", "interleaved", "zb-h1"

struct PipeScheduleSpec {
  PipeSchedule kind = PipeSchedule::one_f_one_b;
  int64_t stages = 1;          // pp: pipeline ranks
  int64_t micro_batches = 1;   // m
  int64_t virtual_stages = 1;  // v: model chunks per rank (interleaved only; else 1)
  Device device = Device::cpu();  // where received boundary tensors are allocated (the compute device)
  DType dtype = DType::f32;       // and their dtype (the data dtype)
  int64_t chunks() const { return stages * virtual_stages; }  // p·v virtual stages in all
};

// One entry of a pipeline rank's schedule. Chunk c of pipeline rank s is
// virtual stage c·pp + s (Megatron's assignment): its input comes from the
// virtual stage before, which is rank s − 1's chunk c, or for s = 0 rank
// pp − 1's chunk c − 1. A `backward` computes the input gradient and, in a
// schedule without `weight` ops, the weight gradients too; with them (zb_h1)
// the weight half runs in the micro-batch's later `weight` op.
struct PipeOp {
  enum Kind { forward, backward, weight } kind;
  int64_t micro_batch;
  int64_t chunk = 0;
  bool operator==(const PipeOp&) const = default;
};

// 1F1B (PipeDream-flush, Megatron's non-interleaved schedule) for `stage` of
// `stages` with m micro-batches: warm-up of min(stages − stage − 1, m)
// forwards, then alternate one forward and one backward, then cool-down
// backwards. Stage s never holds more than min(stages − s, m) micro-batches'
// activations.
std::vector<PipeOp> one_f_one_b(int64_t stage, int64_t stages, int64_t micro_batches);

// Megatron's interleaved 1F1B for pipeline rank `stage`: the rank's k-th
// forward runs chunk (k mod p·v) / p of micro-batch ⌊k / p·v⌋·p + k mod p
// (micro-batches advance through the chunks in groups of p), its k-th
// backward the same micro-batch on chunk v − 1 − (k mod p·v) / p. Warm-up:
// (p − s − 1)·2 + (v − 1)·p forwards (all m·v when m = p), then one forward
// and one backward alternately, then the remaining backwards. With equal
// chunks the bubble is (p − 1)/(v·m + p − 1). UserError unless m % p == 0.
std::vector<PipeOp> interleaved_one_f_one_b(int64_t stage, int64_t stages, int64_t micro_batches,
                                            int64_t virtual_stages);

// ZB-H1 for `stage`: the forwards and backwards of one_f_one_b in the same
// order (the same warm-up, so at most min(p − s, m) micro-batches' saved
// activations), and each micro-batch's W after its backward, placed by
// running the whole pipeline with T_F = T_B = T_W: a stage whose next
// forward or backward has no input yet runs its oldest pending W instead,
// and it runs one before anything else once p W's are pending. With
// m >= p and equal op times the makespan is 3m + p − 1 op times (1F1B's
// 3(m + p − 1) with B and W fused): the bubble (p − 1)/(3m + p − 1).
// Memory bound: saved activations of at most min(p − s, m) micro-batches
// plus the W operands of at most min(p, m) (plan::ActivationBytes states
// both per micro-batch).
std::vector<PipeOp> zb_h1(int64_t stage, int64_t stages, int64_t micro_batches);

// The schedule `spec` gives pipeline rank `stage`; checks the spec (a
// UserError names parallel.pp_schedule / virtual_stages and the rule).
std::vector<PipeOp> pipeline_schedule(const PipeScheduleSpec& spec, int64_t stage);

// The predicted bubble of `spec` with equal stages: 1F1B (p − 1)/(m + p − 1),
// interleaved (p − 1)/(v·m + p − 1), ZB-H1 the simulated idle share of its
// schedule under op times (t_f, t_b, t_w) for one micro-batch on one rank
// (t_b: input gradients only; t_w: weight gradients).
double predicted_bubble(const PipeScheduleSpec& spec, double t_f = 1, double t_b = 1, double t_w = 1);

// A discrete-event run of every rank's schedule under run_pipeline's
// protocol (below): an op starts when its rank is free and its input has
// arrived (sent, and its receive posted: each rank keeps the receives of its
// next two input-needing ops posted); sends never block. Op times per
// micro-batch and chunk: t_f, t_b, t_w (without W ops, a backward takes
// t_b + t_w). Each message travels on the (source rank, destination rank,
// tag) queue run_pipeline uses, so a receive popping another micro-batch's
// message is an error.
struct PipelineSimulation {
  bool finished = false;       // every op ran (false: deadlock)
  std::string error;           // first mismatched receive, if any
  double makespan = 0;
  std::vector<double> busy, finish;  // per rank
  std::vector<int64_t> max_saved, max_pending_w;  // per rank: micro-batch·chunks held (F done, B not; B done, W not)
  // Per rank and op: boundary tensors alive while the op computes besides
  // its own input — receives posted for later ops, and sends the receiver
  // has not yet taken, as run_pipeline frees them (after each op, the sends
  // whose receiving op has started).
  std::vector<std::vector<int64_t>> boundary_buffers;
  double idle_fraction(size_t rank) const { return makespan > 0 ? 1.0 - busy[rank] / makespan : 0.0; }
};
PipelineSimulation simulate_pipeline(const PipeScheduleSpec& spec, double t_f, double t_b, double t_w);

// Whether run_pipeline's messages arrive right without tags, as NCCL
// delivers them: on its own channel per direction (comm::CommOptions::ring_p2p)
// the n-th message stage s sends to stage d, in s's op order, is taken by the
// n-th receive d posts from s, in d's op order. Holds when, for every such
// pair, those two are the same message (tag and micro-batch); then the
// channels pair sends and receives as MPI's tags do, and simulate_pipeline's
// run (no deadlock, the expected micro-batch on every receive) carries over:
// a send waits for its receive to be posted, and posting never waits on a
// send. Empty: it holds; else the first pair and message where it does not.
std::string untagged_order_problem(const PipeScheduleSpec& spec);
// The same over given op lists, one per stage (tests reorder them).
std::string untagged_order_problem(const PipeScheduleSpec& spec, const std::vector<std::vector<PipeOp>>& stage_ops);

// Where a stage's time went in one step's schedule: busy inside forward and
// backward (their own collectives included), idle waiting on the pipeline's
// receives, the final sends and the flush (every stage waits until the
// pipeline has drained). In a balanced pipeline with a core per rank every
// stage's idle fraction is the bubble (p − 1) / (m + p − 1); ranks sharing
// cores run the steady state slower than the fill and drain, which lowers it.
// On CUDA the host only queues work (the compute stream waits for the
// receives), so the trainer replaces both with the device's: idle = the
// compute stream's stalls at the pp group's waits plus the wait for the
// last stage after a device synchronization, busy = the rest.
struct StageTiming {
  double busy_s = 0, idle_s = 0;
  int64_t held_activation_bytes = 0;  // HeldActivations::peak_bytes of the step (0: not measured)
  double idle_fraction() const { return busy_s + idle_s > 0 ? idle_s / (busy_s + idle_s) : 0.0; }
};

// A chunk's forward of one micro-batch: takes the previous virtual stage's
// output (undefined on the first), returns its own (undefined on the last).
using StageForward = std::function<Tensor(int64_t chunk, int64_t micro_batch, Tensor h_in)>;
// A chunk's backward: takes the gradient of its output (undefined on the
// last virtual stage), returns the gradient of its input (undefined on the
// first). Under zb_h1 it computes input gradients only.
using StageBackward = std::function<Tensor(int64_t chunk, int64_t micro_batch, Tensor dh_out)>;
// zb_h1's deferred weight-gradient half of a backward.
using StageWeight = std::function<void(int64_t chunk, int64_t micro_batch)>;

// Message tags: one per direction and receiving chunk, so each (source,
// destination, tag) queue carries one chunk's boundary tensors in
// micro-batch order.
inline constexpr int kActivationTag = 71, kGradientTag = 72;
inline int activation_tag(int64_t chunk) { return kActivationTag + 2 * static_cast<int>(chunk); }
inline int gradient_tag(int64_t chunk) { return kGradientTag + 2 * static_cast<int>(chunk); }

// Where a pipeline rank's held activations stood: the activation ledger's
// current bytes sampled after every op of the schedule (once its send is
// done, not counting the next receive's buffer), the largest seen. This is
// what plan::StageMemory::activations predicts: the saved activations (and
// pending W operands) of the micro-batches in flight between ops.
struct HeldActivations {
  TrackedAllocator* ledger = nullptr;
  int64_t peak_bytes = 0;
};

// Runs one step's schedule `spec` over `pp` (null: one stage; spec.stages
// must be the group's size). boundary is the shape of the tensors between
// virtual stages ([rows, hidden] of one micro-batch). `weight` is required
// when the schedule has W ops. held, if given, records the activation
// ledger's bytes after each op.
StageTiming run_pipeline(comm::Communicator* pp, const PipeScheduleSpec& spec, const Shape& boundary,
                         const StageForward& forward, const StageBackward& backward, const StageWeight& weight = {},
                         HeldActivations* held = nullptr);

}  // namespace origami

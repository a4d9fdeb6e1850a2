// Training loop (see trainer.h); evaluation is evaluate.cpp.
#include "engine/trainer.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <sstream>

#include "comm/agreement.h"
#include "comm/groups.h"
#include "comm/mpi_communicator.h"
#include "comm/nccl_communicator.h"
#include "engine/checkpoint.h"
#include "engine/dataset.h"
#include "engine/device_peak.h"
#include "engine/export.h"
#include "engine/files.h"
#include "engine/indexed_dataset.h"
#include "engine/model.h"
#include "engine/moe_records.h"
#include "engine/optimizer.h"
#include "engine/pipeline.h"
#include "engine/preflight.h"
#include "engine/run_context.h"
#include "engine/stop_signals.h"
#include "engine/zero.h"
#include "kernels/device.h"
#include "kernels/threads.h"

namespace origami {

namespace {

using Clock = std::chrono::steady_clock;

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int world_size() {
  int w = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &w);
  return w;
}

// The ledger the mem record reports: the compute device's, and the host's
// beside it when they differ.
void snapshot_memory(const ExecContext& ctx, StepMetrics& m) {
  m.mem_device = ctx.device();
  m.mem = TrackedAllocator::of(ctx.device()).snapshot();
  if (!ctx.device().is_host()) m.host_mem = TrackedAllocator::host().snapshot();
}

comm::Layout make_layout(const Config& cfg, int world) {
  const ParallelConfig& p = cfg.parallel;
  return comm::Layout(world, comm::LayoutOptions{p.tp, p.cp, p.pp, p.ep, p.etp, p.order, cfg.moe.router.num_experts});
}

// Groups over the world: MPI only on the host; on CUDA each group also gets
// an NCCL communicator whose ops order after the context's stream.
// On the host stand-in device the groups communicate as NCCL would: under
// the in-flight check (comm/in_flight_check.h: no buffer touched between an
// op's launch and its completion) and with point-to-point messages matched
// by order alone, so the parity runs prove what the GPU run's
// communication needs.
comm::Groups make_groups(const Config& cfg, const ExecContext& ctx, int world) {
  comm::GroupsOptions o;
  o.comm.timeout_s = o.setup_timeout_s = cfg.runtime.collective_timeout_s;
  const bool stand_in = ctx.device().is_host() && ctx.device() != Device::cpu();
  o.comm.check_in_flight = o.comm.p2p_by_order = stand_in;
  if (!ctx.device().is_host()) {
    o.compute_device = ctx.device();
    o.comm.compute_stream = ctx.stream();
  }
  return comm::Groups::create(make_layout(cfg, world), MPI_COMM_WORLD, o);
}

// Seconds this rank has stood waiting on `c`'s communication, every op
// (stream waits included once their stream has passed them).
double exposed_seconds(comm::Communicator& c) {
  c.settle_stream_waits();
  double s = 0;
  for (int op = 0; op < comm::kNumCommOps; ++op) s += c.stats(static_cast<comm::CommOp>(op)).exposed_s;
  return s;
}

// Every stage's timing (stage order), from its ranks in this rank's pp group.
std::vector<StageTiming> every_stage(const StageTiming& mine, comm::Communicator* pp) {
  if (!pp) return {mine};
  double local[3] = {mine.busy_s, mine.idle_s, static_cast<double>(mine.held_activation_bytes)};
  std::vector<double> all(3 * static_cast<size_t>(pp->size()));
  pp->all_gather(std::span<const double>(local, 3), std::span<double>(all));
  std::vector<StageTiming> out(static_cast<size_t>(pp->size()));
  for (size_t s = 0; s < out.size(); ++s)
    out[s] = {all[3 * s], all[3 * s + 1], static_cast<int64_t>(all[3 * s + 2])};  // bytes < 2^53: exact
  return out;
}

// Empty when every value of the step is finite; else why the run stops (step,
// which values, the settings that usually cause it).
std::string divergence(const Config& cfg, int64_t step, double lm_loss, double aux_loss, double z_loss,
                       double grad_norm) {
  const std::pair<const char*, double> values[] = {
      {"lm loss", lm_loss}, {"aux loss", aux_loss}, {"z loss", z_loss}, {"grad norm", grad_norm}};
  std::string bad, shown;
  for (const auto& [name, v] : values) {
    const std::string text = std::isnan(v) ? "nan" : std::isinf(v) ? (v > 0 ? "inf" : "-inf") : detail::concat(v);
    if (!std::isfinite(v)) bad += std::string(bad.empty() ? "" : ", ") + name;
    shown += detail::concat(shown.empty() ? "" : ", ", name, " ", text);
  }
  if (bad.empty()) return {};
  const auto& o = cfg.optimizer;
  std::string causes = detail::concat("a learning rate too high for this model (optimizer.lr = ", o.lr,
                                      "; lower it, or warm up longer: lr_schedule.warmup_steps = ",
                                      cfg.lr_schedule.warmup_steps, "), too large an init scale (model.init_std = ",
                                      cfg.model.init_std, ")");
  if (cfg.moe.router.num_experts > 0)
    causes += detail::concat(", too large a routed-output scale (moe.topk_scaling = ", cfg.moe.router.topk_scaling,
                             ")");
  if (o.clip_grad == 0) causes += ", no gradient clipping (optimizer.clip_grad = 0)";
  return detail::concat("training diverged at step ", step, " of ", cfg.training.steps, ": ", bad,
                        bad.find(',') == std::string::npos ? " is" : " are", " not finite (", shown,
                        "); the run stopped before the optimizer applied this step (weights and metrics are ",
                        step == 1 ? "untouched" : detail::concat("those of step ", step - 1),
                        "). Likely causes: ", causes);
}

// A failure of work done on one rank only (rank 0's metrics file), kept until
// the next meeting of every rank, where it stops them all.
struct PendingFailure {
  int status = 0;
  std::string message;
  void take(const UserError& e) {
    if (status == 0) status = e.exit_status(), message = e.what();
  }
};

}  // namespace

// One run's state, in construction order (members are built by the
// constructor's meetings before any collective of training).
struct Trainer::Run {
  Config cfg;  // a copy: the trainer outlives no caller's config
  TrainOptions opts;
  int rank = 0, world = 1;
  std::unique_ptr<comm::Communicator> everyone;
  std::unique_ptr<IndexedDataset> indexed;
  std::unique_ptr<GptDataset> data;
  std::optional<MetricsWriter> metrics;
  std::optional<ExecContext> ctx;
  std::optional<comm::Groups> groups;
  std::optional<Model> model;
  std::optional<ZeroStore> zero;
  std::optional<AdamW> optimizer;
  GradNormGroups norm_groups;
  comm::Communicator* pp = nullptr;
  std::vector<comm::Communicator*> counted;  // every group of more than one rank, for the comm volume
  int64_t dp = 1, dp_rank = 0, accum = 1, micro_batches = 1;
  float grad_scale = 1, aux_scale = 1;
  StepFlops flops;  // per rank
  GemmPeak peak;    // the compute device's, for MFU
  Shape boundary;
  PendingFailure pending;
  TrainSummary summary;
  int64_t step = 0;
  // Sample index of the first sample of global batch 0 as this run counts
  // them: consumed_samples − step · global_batch at resume (0 unless the
  // global batch changed on resume), so the data continues where it stopped.
  int64_t sample_base = 0;
  std::optional<std::string> resume_dir;  // the checkpoint this run loaded
  int64_t saved_step = -1;                // the last step checkpointed into checkpoint.dir
  Clock::time_point start;
  StopSignals signals;
  std::optional<CheckpointWriter> writer;  // checkpoint.dir set
  std::vector<std::unique_ptr<DirectoryLock>> locks;  // rank 0: logging.dir and checkpoint.dir, for the run
  int stop_signal = 0;  // agreed over every rank after each step
  std::string last_checkpoint;

  Run(const Config& c, const TrainOptions& o) : cfg(c), opts(o), rank(world_rank()), world(world_size()) {}
  void print_banner() const;
  void resume();
  CheckpointRecord save();
  // What a step's communication figures are differences against.
  struct CommCounters {
    std::vector<int64_t> bytes;  // per counted group
    std::vector<double> a2a_s;   // per counted group: blocking all-to-all seconds
    double exposed_s = 0;        // over every counted group
  };
  CommCounters comm_counters() const;
  // This stage's part of the step: every micro-batch through the pipeline
  // schedule; Σ token LM loss lands in loss_sum_dev (last stage only).
  StageTiming run_schedule(int64_t step, ForwardStats& fstats, const Tensor& loss_sum_dev);
  // The step's losses, as its record and the divergence check read them.
  struct StepLosses {
    double lm = 0, aux = 0, z = 0;
  };
  // The step's record: its figures, the communication since `before`, the
  // completed background save and the save this step makes.
  StepMetrics record(int64_t step, double seconds, const StepLosses& losses, const StepStats& st,
                     std::vector<MoeLayerRecord> moe, const StageTiming& timing, const CommCounters& before);
  // Rank 0 writes the record and prints the step line; then on_step.
  void publish(const StepMetrics& m);
};

Trainer::Trainer(const Config& cfg, const TrainOptions& opts) : run_(std::make_unique<Run>(cfg, opts)) {
  Run& r = *run_;
  const TrainingConfig& tc = cfg.training;
  // The run's meetings of every rank (comm/agreement.h): first that all
  // ranks run the same binary and config, then everything that can fail on
  // some ranks only (a data file one node cannot read, an output directory
  // rank 0 cannot write), before any rank commits to a collective of training.
  r.everyone = comm::whole_mpi(MPI_COMM_WORLD, "everyone", comm::CommOptions{cfg.runtime.collective_timeout_s});
  check_same_run(*r.everyone, cfg);
  comm::run_agreed(*r.everyone, [&] {
    validate_for_world(cfg, r.world);
    validate_for_machine(cfg, r.world, ranks_on_this_node());
    validate_for_training(cfg);
    if (tc.steps > 0) {
      try {
        r.indexed = std::make_unique<IndexedDataset>(IndexedDataset::open(cfg.data.path, cfg.model.vocab_size));
      } catch (const UserError& e) {
        ORIGAMI_USER_ERROR(cfg.origin("data.path"), ": data.path: ", e.what());
      }
      r.data = std::make_unique<GptDataset>(*r.indexed, tc.seq_len, cfg.data.shuffle, tc.seed);
    }
    const CheckpointConfig& ck = cfg.checkpoint;
    // One run per output directory, before anything in them is removed or
    // written (files.h, DirectoryLock). Not export.dir: the shipped configs
    // share a default one, and an export's files are locked while written
    // (WriterLock).
    if (r.rank == 0) {
      if (!cfg.logging.dir.empty()) r.locks.push_back(std::make_unique<DirectoryLock>(cfg.logging.dir, "logging.dir"));
      std::error_code ec;
      if (!ck.dir.empty() && !(r.locks.size() == 1 && std::filesystem::equivalent(ck.dir, cfg.logging.dir, ec)))
        r.locks.push_back(std::make_unique<DirectoryLock>(ck.dir, "checkpoint.dir"));
    }
    // A save killed midway, or one that filled the disk, is removed before
    // the probe, which would otherwise find that disk full. With a dir and
    // no interval a preempted run still saves there.
    if (r.rank == 0 && !ck.dir.empty()) {
      remove_partial_checkpoints(ck.dir);
      check_writable_dir(ck.dir, "checkpoint.dir");
    }
    if (r.rank == 0 && !cfg.exp.dir.empty()) {
      check_writable_dir(cfg.exp.dir, "export.dir");
      for (const char* file : {"/model.safetensors", "/config.json"}) ReplacedFiles::check_replaceable(cfg.exp.dir + file);
    }
  }, io_meeting_wait(cfg));  // rank 0 may remove a partial save of any size
  // The same relative path can name different files on different ranks.
  if (r.indexed) check_same_corpus(*r.everyone, r.indexed->num_documents(), r.indexed->num_tokens());
  check_shared_checkpoint_dir(*r.everyone, cfg, io_meeting_wait(cfg));
  // Its own meeting, after rank 0's clean-up: every rank then reads the
  // checkpoint directory as rank 0 left it (a repaired save in place).
  const CheckpointConfig& ck = cfg.checkpoint;
  comm::run_agreed(*r.everyone, [&] { r.resume_dir = resolve_load(ck); }, io_meeting_wait(cfg));
  // Ranks that disagree on whether to resume would call different
  // collectives; which save each resumes from is compared as it loads.
  check_same_lines(*r.everyone, r.resume_dir ? "checkpoint.load = resumes from a checkpoint\n"
                                             : "checkpoint.load = finds no checkpoint (a fresh start)\n",
                   "the ranks of this job resolved checkpoint.load differently (rule: every rank resumes from one "
                   "save, or none does: checkpoint.dir and checkpoint.load name the same place on every rank)");
  r.ctx.emplace(make_context(cfg));
  {
    const auto node = comm::node_mpi(MPI_COMM_WORLD, "node", comm::CommOptions{cfg.runtime.collective_timeout_s});
    // runtime.device = "auto" resolves on each rank: a node without a GPU
    // (or a rank with CUDA_VISIBLE_DEVICES empty) would leave its ranks out
    // of the CUDA ranks' collectives below, so every rank compares first.
    const Device d = r.ctx->device();
    check_same_lines(*r.everyone, d.is_host() ? "runtime.device resolves to = cpu\n" : "runtime.device resolves to = cuda\n",
                     "the ranks of this job resolved runtime.device to different devices (rule: every rank trains on "
                     "a GPU or none; with runtime.device = \"auto\" each rank looks for a GPU of its own: set "
                     "\"cuda\" or \"cpu\", or give every rank a device)");
    if (!d.is_host()) {  // every rank's alike now
      const auto env = [](const char* name) -> const char* { return std::getenv(name); };
      check_same_nccl_setup(*r.everyone, nccl_setup_lines(env, comm::nccl_library_version()));
      comm::run_agreed(*r.everyone, [&] {
        check_one_rank_per_gpu(*node, cfg, cuda_device_uuid(d.index));
        check_cuda_streams_run_apart(cfg);
      });
    }
    r.peak = measure_gemm_peak(*r.ctx, node.get());
  }
  r.groups.emplace(make_groups(cfg, *r.ctx, r.world));
  const comm::Groups& groups = *r.groups;
  r.dp = groups.layout().dp();
  r.dp_rank = groups.coords().dp;
  r.accum = tc.global_batch / (tc.micro_batch * r.dp);
  for (comm::GroupKind k : comm::kAllGroupKinds)
    if (comm::Communicator* c = comm::multi_rank(groups, k)) r.counted.push_back(c);

  r.model.emplace(*r.ctx, cfg.model, tc.seed, cfg.moe,
                  ModelPlacement{.groups = &groups,
                                 .zero_stage = static_cast<int>(cfg.parallel.zero_stage),
                                 .pp_layers = cfg.parallel.pp_layers,
                                 .virtual_stages = cfg.parallel.virtual_stages});
  r.model->set_recompute(tc.recompute);
  r.model->set_cp_comm(cfg.parallel.cp_comm);
  r.pp = comm::multi_rank(groups, comm::GroupKind::pp);
  // Gradient reductions (SUMs, §6) and ZeRO sharding: dense units over dp-cp,
  // expert units over edp.
  r.zero.emplace(*r.ctx, r.model->params(), groups,
                 ZeroOptions{.reshard_after_forward = cfg.parallel.reshard_after_forward,
                             .overlap_grad_reduce = cfg.parallel.overlap_grad_reduce});
  r.norm_groups = {comm::multi_rank(groups, comm::GroupKind::dp_cp), comm::multi_rank(groups, comm::GroupKind::edp),
                   comm::multi_rank(groups, comm::GroupKind::tp_ep), comm::multi_rank(groups, comm::GroupKind::tp),
                   r.pp};
  r.optimizer.emplace(cfg.optimizer, cfg.lr_schedule, tc.steps);
  r.summary.params = r.model->units().counts().total;  // the whole model, every stage and expert

  r.grad_scale = 1.0f / static_cast<float>(tc.global_batch * tc.seq_len);
  // Each micro-batch's aux and z losses enter the objective divided by the
  // number of micro-batches in the global batch (ARCHITECTURE.md §6).
  r.micro_batches = r.accum * r.dp;
  r.aux_scale = 1.0f / static_cast<float>(r.micro_batches);
  // Per rank: tp and cp ranks share each DP rank's tokens, pipeline stages
  // its layers (taken as equal shares).
  r.flops = r.model->training_flops(tc.global_batch / r.dp, tc.seq_len);
  const double split = static_cast<double>(groups.layout().tp() * groups.layout().cp() * groups.layout().pp());
  r.flops.matmul /= split;
  r.flops.attention /= split;
  r.boundary = r.model->boundary_shape(tc.micro_batch, tc.seq_len);
  if (r.resume_dir) {
    r.resume();
  } else if (!cfg.checkpoint.init_from_hf.empty()) {
    load_hf_init(cfg.checkpoint.init_from_hf, cfg, *r.model, groups, *r.everyone);
    if (r.rank == 0 && opts.print_steps && !opts.json_lines)
      std::printf("origami: initial weights from %s\n", cfg.checkpoint.init_from_hf.c_str());
  }
  comm::run_agreed(*r.everyone, [&] {
    if (r.rank == 0) r.metrics.emplace(cfg.logging.dir, r.step, canonical_text(cfg));
    else r.metrics.emplace(std::string(), r.step);
  });
  // What start-up freed (the GEMM peak's operands, the parameters' fp32
  // init scratch, a checkpoint's read buffers: gigabytes on a GPU config)
  // goes back to its source: a step asks for other sizes, and those blocks
  // would sit cached beside a config that fills the device, or be handed
  // out, slack and all, to a request the device refused.
  TrackedAllocator::of(r.ctx->device()).release_cached();
  if (!r.ctx->device().is_host()) TrackedAllocator::host().release_cached();
  r.print_banner();
  r.start = Clock::now();
}

Trainer::~Trainer() = default;

namespace {

// "key: saved -> now" for each setting of the forward pass (beyond the shape,
// which a load enforces) that differs from the saving run's, "" when none.
// Changing one on resume can be deliberate (a capacity factor, top-k); the
// weights then continue under another model than they were trained as, and
// eval of them refuses the mix, so the run says so.
std::string forward_changes(const std::string& saved_text, const Config& cfg) {
  static constexpr const char* kForward[] = {"model.rope_theta", "model.norm_eps", "moe.top_k", "moe.score_function",
                                             "moe.normalize_topk", "moe.topk_scaling", "moe.num_groups",
                                             "moe.group_topk", "moe.capacity_factor", "moe.drop_policy"};
  auto values = [](const std::string& text) {
    std::map<std::string, std::string> out;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);)
      if (const size_t eq = line.find(" = "); eq != std::string::npos) out[line.substr(0, eq)] = line.substr(eq + 3);
    return out;
  };
  const auto saved = values(saved_text), now = values(canonical_text(cfg));
  std::string changes;
  for (const char* key : kForward) {
    const auto s = saved.find(key), n = now.find(key);
    const std::string was = s == saved.end() ? "(unset)" : s->second, is = n == now.end() ? "(unset)" : n->second;
    if (was != is) changes += detail::concat(changes.empty() ? "" : ", ", key, " ", was, " -> ", is);
  }
  return changes;
}

// What changes the learning rate of the first resumed step against the
// saving run's own schedule ("" when nothing does, or the saved config does
// not parse): "training.steps 60 -> 100: step 41 runs at lr 2.566e-03 where
// the saving run's schedule gives 1.632e-03", with the setting that keeps the
// old curve when the change is the cosine's length alone.
std::string schedule_change(const std::string& saved_text, const Config& cfg, int64_t step) {
  Config saved;
  try {
    saved = parse_config(saved_text, "(saved config)");
  } catch (const UserError&) {
    return "";
  }
  const int64_t next = step + 1;
  if (next > cfg.training.steps) return "";
  const double was = learning_rate(saved.optimizer, saved.lr_schedule, saved.training.steps, next);
  const double is = learning_rate(cfg.optimizer, cfg.lr_schedule, cfg.training.steps, next);
  if (std::abs(was - is) <= 1e-9 * std::max(std::abs(was), std::abs(is))) return "";
  std::string keys;
  auto compare = [&](const char* key, auto a, auto b) {
    if (a != b) keys += detail::concat(keys.empty() ? "" : ", ", key, " ", a, " -> ", b);
  };
  compare("optimizer.lr", saved.optimizer.lr, cfg.optimizer.lr);
  compare("lr_schedule.warmup_steps", saved.lr_schedule.warmup_steps, cfg.lr_schedule.warmup_steps);
  compare("lr_schedule.decay_steps", saved.lr_schedule.decay_steps, cfg.lr_schedule.decay_steps);
  compare("lr_schedule.min_lr", saved.lr_schedule.min_lr, cfg.lr_schedule.min_lr);
  const bool length_only = keys.empty();  // the cosine ran to training.steps in both
  compare("training.steps", saved.training.steps, cfg.training.steps);
  char lrs[160];
  std::snprintf(lrs, sizeof lrs, "step %lld runs at lr %.3e where the saving run's schedule gives %.3e",
                static_cast<long long>(next), is, was);
  std::string out = keys + ": " + lrs;
  if (length_only && saved.lr_schedule.decay_steps == 0 && saved.training.steps > saved.lr_schedule.warmup_steps)
    out += detail::concat("; --set lr_schedule.decay_steps=", saved.training.steps, " keeps its curve");
  return out;
}

}  // namespace

void Trainer::Run::resume() {
  const TrainState st = load_checkpoint(*resume_dir, cfg, *model, *groups, *everyone);
  const TrainingConfig& tc = cfg.training;
  // Every rank read the same metadata, so all refuse alike. At exactly
  // training.steps the run is complete (a finished job started again): no
  // step, the summary says so.
  if (st.step > tc.steps)
    ORIGAMI_USER_ERROR(*resume_dir, ": the checkpoint is at step ", st.step, ", past training.steps = ", tc.steps,
                       " (", cfg.origin("training.steps"), "; rule: a resumed run continues up to training.steps, ",
                       "so it must be at least the checkpoint's step)");
  summary.resumed_step = st.step;
  step = st.step;
  optimizer->restore_steps(st.step);
  sample_base = st.consumed_samples - st.step * tc.global_batch;
  if (std::filesystem::path(*resume_dir).parent_path() == std::filesystem::path(cfg.checkpoint.dir))
    saved_step = st.step;  // already in checkpoint.dir: the end of a run that ends here need not save it again
  if (rank != 0 || !opts.print_steps) return;
  // Under --json standard output holds JSON records only: the note goes to
  // standard error there, and the warning always does.
  std::fprintf(opts.json_lines ? stderr : stdout, "origami: resumed from %s at step %lld (%lld samples consumed)\n",
               resume_dir->c_str(), static_cast<long long>(st.step), static_cast<long long>(st.consumed_samples));
  const int64_t windows = data ? data->num_windows() : 0;
  if (data && (st.windows_per_epoch != windows || st.seed != tc.seed || st.shuffle != cfg.data.shuffle))
    std::fprintf(stderr, "origami: warning: the data order differs from the saving run's (windows per epoch %lld -> %lld, "
                "seed %llu -> %llu, shuffle %d -> %d): the resumed run reads other samples\n",
                static_cast<long long>(st.windows_per_epoch), static_cast<long long>(windows),
                static_cast<unsigned long long>(st.seed), static_cast<unsigned long long>(tc.seed), st.shuffle,
                cfg.data.shuffle);
  if (const std::string changes = forward_changes(st.config, cfg); !changes.empty())
    std::fprintf(stderr, "origami: warning: the model's forward pass differs from the saving run's (%s): the weights "
                 "continue under settings they were not trained with\n", changes.c_str());
  if (const std::string change = schedule_change(st.config, cfg, st.step); !change.empty())
    std::fprintf(stderr, "origami: warning: the learning-rate schedule differs from the saving run's (%s)\n",
                 change.c_str());
}

CheckpointRecord Trainer::Run::save() {
  if (!writer) writer.emplace(cfg.checkpoint.dir, cfg.checkpoint.keep, cfg.checkpoint.async, io_meeting_wait(cfg));
  const TrainingConfig& tc = cfg.training;
  TrainState st;
  st.step = step;
  st.lr = learning_rate(cfg.optimizer, cfg.lr_schedule, tc.steps, step);
  st.consumed_samples = sample_base + step * tc.global_batch;
  st.windows_per_epoch = data ? data->num_windows() : 0;
  st.seed = tc.seed;
  st.shuffle = cfg.data.shuffle;
  // A directory moved away mid-run would let a second run in beside this
  // one (files.h, DirectoryLock::check_held).
  comm::run_agreed(*everyone, [&] {
    for (const auto& lock : locks) lock->check_held();
  }, io_meeting_wait(cfg));
  const CheckpointSaveStats s = writer->save(cfg, *model, st, *groups, *everyone);
  saved_step = step;
  last_checkpoint = s.dir;
  return {s.dir, s.background, s.background ? s.rank_bytes : s.max_rank_bytes, s.total_bytes, s.seconds,
          s.host_staged_bytes};
}

int64_t Trainer::steps_done() const { return run_->step; }
bool Trainer::stop_requested() const { return run_->stop_signal != 0; }

void Trainer::Run::print_banner() const {
  if (rank != 0 || !opts.print_steps || opts.json_lines) return;
  const TrainingConfig& tc = cfg.training;
  std::printf("origami: %lld parameters, %lld steps of %lld samples x %lld tokens, %d rank(s), %d thread(s)\n",
              static_cast<long long>(summary.params), static_cast<long long>(tc.steps),
              static_cast<long long>(tc.global_batch), static_cast<long long>(tc.seq_len), world, ctx->threads());
  const LedgerSnapshot s = TrackedAllocator::of(ctx->device()).snapshot();
  std::printf("origami: persistent state per rank (ZeRO stage %lld): param %s grad %s optim %s\n",
              static_cast<long long>(cfg.parallel.zero_stage),
              format_bytes(s.current[static_cast<int>(MemCategory::param)]).c_str(),
              format_bytes(s.current[static_cast<int>(MemCategory::grad)]).c_str(),
              format_bytes(s.current[static_cast<int>(MemCategory::optim)]).c_str());
  const bool bf16 = ctx->data_dtype() == DType::bf16;
  const char* recipe = !bf16 ? "fp32" : ctx->device().is_host() ? "bf16 (emulated: f32 kernels, rounded)" : "bf16";
  std::printf(
      "origami: training on %s in %s; MFU against its %s GEMM peak measured at start-up, %.1f GFLOP/s (%lld^3)\n",
      to_string(ctx->device()).c_str(), recipe, std::string(to_string(peak.dtype)).c_str(), peak.flops_per_s / 1e9,
      static_cast<long long>(peak.n));
}

Trainer::Run::CommCounters Trainer::Run::comm_counters() const {
  CommCounters c;
  for (comm::Communicator* g : counted) {
    c.bytes.push_back(g->total_bytes());
    c.a2a_s.push_back(g->stats(comm::CommOp::all_to_all_v).blocking_s);
    c.exposed_s += exposed_seconds(*g);
  }
  return c;
}

StageTiming Trainer::Run::run_schedule(int64_t step, ForwardStats& fstats, const Tensor& loss_sum_dev) {
  const TrainingConfig& tc = cfg.training;
  const ExecContext& c = *ctx;
  // One stage: forward and backward of each micro-batch in turn. Every
  // chunk's forward reads the micro-batch's tokens (§8 indices; positions
  // and targets live there).
  const int64_t chunks = cfg.parallel.virtual_stages;
  std::vector<ModelSaved> saved(static_cast<size_t>(accum * chunks));
  auto slot = [&](int64_t chunk, int64_t a) -> ModelSaved& { return saved[static_cast<size_t>(chunk * accum + a)]; };
  const bool split = cfg.parallel.pp_schedule == PipeSchedule::zb_h1;  // B and W apart
  std::vector<WeightPass> pending_w(split ? static_cast<size_t>(accum) : 0);
  auto forward = [&](int64_t chunk, int64_t a, Tensor h_in) {
    StageIO io;
    io.chunk = chunk;
    io.tokens_BS1 = device_micro_batch(c, *data, tc.micro_batch, tc.seq_len, [&](int64_t i) {
      return sample_base + sample_index(step - 1, tc.global_batch, a, dp, dp_rank, tc.micro_batch, i);
    });
    io.h_in = std::move(h_in);
    io.stats = &fstats;
    io.hooks = &*zero;
    io.loss_sum = loss_sum_dev;
    model->forward(io, slot(chunk, a));
    return io.h_out;
  };
  auto backward = [&](int64_t chunk, int64_t a, Tensor dh_out) {
    StageGradIO io;
    io.lm_grad_scale = grad_scale;
    io.aux_scale = aux_scale;
    io.hooks = &*zero;
    io.dh_out = std::move(dh_out);
    if (split) io.defer = &pending_w[static_cast<size_t>(a)];
    model->backward(io, slot(chunk, a));
    return io.dh_in;
  };
  // zb-h1: the weight-gradient half of each backward, run where the schedule puts it.
  auto weight = [&](int64_t, int64_t a) { model->weight_backward(pending_w[static_cast<size_t>(a)], &*zero); };
  const PipeScheduleSpec spec{cfg.parallel.pp_schedule, comm::group_size(pp), accum, chunks, c.device(),
                              c.data_dtype()};
  HeldActivations held{&TrackedAllocator::of(c.device())};
  const bool device_pipeline = pp && pp->compute_stream();
  const double pp_exposed_before = device_pipeline ? exposed_seconds(*pp) : 0;
  const auto pipeline_t0 = Clock::now();
  StageTiming timing =
      run_pipeline(pp, spec, boundary, forward, backward, split ? StageWeight(weight) : StageWeight{}, &held);
  if (device_pipeline) {  // the host ran ahead: the stage's time is the device's
    auto since = [&] { return std::chrono::duration<double>(Clock::now() - pipeline_t0).count(); };
    c.synchronize();
    const double done_s = since();
    const double stalls_s = exposed_seconds(*pp) - pp_exposed_before;  // at the receives
    pp->barrier();  // the drain: idle until the last stage is done
    timing.idle_s = stalls_s + (since() - done_s);
    timing.busy_s = std::max(0.0, done_s - stalls_s);
  }
  return timing;
}

StepMetrics Trainer::run_step() {
  Run& r = *run_;
  const Config& cfg = r.cfg;
  const TrainingConfig& tc = cfg.training;
  ORIGAMI_CHECK(r.step < tc.steps, "run_step after the last of ", tc.steps, " steps");
  ORIGAMI_CHECK(r.stop_signal == 0, "run_step after a preemption stop was agreed (stop_requested())");
  const int64_t step = ++r.step;
  const ExecContext& ctx = *r.ctx;
  Model& model = *r.model;
  ZeroStore& zero = *r.zero;
  const auto t0 = Clock::now();
  TrackedAllocator::of(ctx.device()).reset_peaks();
  if (!ctx.device().is_host()) TrackedAllocator::host().reset_peaks();
  const Run::CommCounters before = r.comm_counters();
  zero.begin_step();
  // Σ token LM loss of the step's micro-batches, added on the device (last
  // stage only; zero elsewhere) and read once, after the pipeline.
  Tensor loss_sum_dev = ctx.zeros({1}, DType::f64, MemCategory::workspace);
  ForwardStats fstats;
  const StageTiming timing = r.run_schedule(step, fstats, loss_sum_dev);
  HostRead loss_read = ctx.read_later(loss_sum_dev);  // the step's scalar metrics: a named host point
  zero.finish_gradients();
  double loss_sum = loss_read.scalar_f64();
  if (comm::Communicator* c = comm::multi_rank(*r.groups, comm::GroupKind::dp_cp))
    c->all_reduce(std::span<double>(&loss_sum, 1));
  if (r.pp) r.pp->all_reduce(std::span<double>(&loss_sum, 1));  // from the last stage to all
  reduce_moe_records(fstats.moe, *r.groups);
  fstats.moe = whole_model_records(fstats.moe, cfg, r.groups->layout().ep(), r.pp);
  Run::StepLosses losses;
  losses.lm = loss_sum / static_cast<double>(tc.global_batch * tc.seq_len);
  // Fault injection for the divergence tests: ORIGAMI_FAULT_NAN_AT_STEP=<step>.
  if (const char* at = std::getenv("ORIGAMI_FAULT_NAN_AT_STEP"); at && std::to_string(step) == at)
    losses.lm = std::nan("");
  losses.aux = fstats.aux_loss() / static_cast<double>(r.micro_batches);
  losses.z = fstats.z_loss() / static_cast<double>(r.micro_batches);
  const double grad_norm = r.optimizer->grad_norm(ctx, model.params(), r.norm_groups);
  // Every rank's verdict on this step, and any failure left from the last,
  // meet here before the weights change: a diverged step stops the run
  // (kExitDiverged) with the weights of the step before.
  {
    const std::string diverged = divergence(cfg, step, losses.lm, losses.aux, losses.z, grad_norm);
    int status = r.pending.status;
    std::string message = r.pending.message;
    if (!diverged.empty()) {
      status = std::max(status, kExitDiverged);
      message += (message.empty() ? "" : "; ") + diverged;
    }
    try {
      comm::agree(*r.everyone, status, message);
    } catch (const JobError& stop) {
      // Every rank stops here alike. A background save still in flight holds
      // an earlier, finished step: it completes first, so `latest` is the
      // step before this one as with synchronous saves (a .tmp would be
      // removed by the restart, which would go back a save further).
      if (r.writer && r.writer->pending()) {
        try {
          // Its record will not come (this step has none): a note says it completed.
          if (const auto done = r.writer->wait(*r.everyone); done && r.rank == 0)
            std::fprintf(stderr, "origami: the checkpoint being written, %s, completed before the job stopped\n",
                         done->dir.c_str());
        } catch (const JobError& save) {
          throw JobError(detail::concat(stop.what(), "\n", save.what()),
                         std::max(stop.exit_status(), save.exit_status()));
        }
      }
      throw;
    }
  }
  const StepStats st = r.optimizer->update(ctx, model.params(), grad_norm);
  zero.finish_step();
  model.update_expert_bias(fstats.moe);  // the global batch's loads
  int stop = first_stop_signal();
  r.everyone->all_reduce(std::span<int>(&stop, 1), comm::ReduceOp::max);
  // The last step is not preempted: training is done, and the run ends as a
  // finished one (its interval save, its export), not as a stopped one.
  r.stop_signal = step == tc.steps ? 0 : stop;
  // CUDA: the step's last work (the update, ZeRO's gathers, queued behind
  // stream waits) is still on the device; the step time includes it.
  ctx.synchronize();
  const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
  StepMetrics m = r.record(step, dt, losses, st, std::move(fstats.moe), timing, before);
  r.publish(m);
  return m;
}

StepMetrics Trainer::Run::record(int64_t step, double seconds, const StepLosses& losses, const StepStats& st,
                                 std::vector<MoeLayerRecord> moe, const StageTiming& timing,
                                 const CommCounters& before) {
  const TrainingConfig& tc = cfg.training;
  StepMetrics m;
  m.step = step;
  m.total_steps = tc.steps;
  m.lm_loss = losses.lm;
  m.aux_loss = losses.aux;
  m.z_loss = losses.z;
  m.moe = std::move(moe);
  m.grad_norm = st.grad_norm;
  m.lr = st.lr;
  m.tokens = tc.global_batch * tc.seq_len;
  m.first_sample = sample_base + (step - 1) * tc.global_batch;
  m.samples = tc.global_batch;
  m.epoch = m.first_sample / data->num_windows();
  m.step_time_s = seconds;
  m.tokens_per_s = static_cast<double>(m.tokens) / seconds;
  m.gflops = flops.total() / seconds / 1e9;
  m.peak_gflops = peak.flops_per_s / 1e9;
  m.mfu = m.peak_gflops > 0 ? m.gflops / m.peak_gflops : 0;
  for (comm::Communicator* c : counted) m.comm_exposed_s += exposed_seconds(*c);
  m.comm_exposed_s -= before.exposed_s;
  snapshot_memory(*ctx, m);
  m.stages = every_stage(timing, pp);
  const CheckpointConfig& ck = cfg.checkpoint;
  if (writer && writer->pending())  // a background save whose files every rank has written completes
    if (auto done = writer->poll(*everyone))
      m.checkpoint_done = CheckpointDone{done->dir, done->written_s, done->max_rank_bytes, done->total_bytes};
  // A preempted run checkpoints whenever checkpoint.dir is set, here, so
  // that its last record names the save.
  if ((ck.interval > 0 && (step % ck.interval == 0 || step == tc.steps)) || (stop_signal && !ck.dir.empty()))
    m.checkpoint = save();
  if (stop_signal) m.stopped_by = stop_signal_name(stop_signal);
  for (size_t g = 0; g < counted.size(); ++g) {
    m.comm_bytes.emplace_back(counted[g]->name(), counted[g]->total_bytes() - before.bytes[g]);
    const double a2a = counted[g]->stats(comm::CommOp::all_to_all_v).blocking_s - before.a2a_s[g];
    if (a2a > 0) m.comm_a2a_s.emplace_back(counted[g]->name(), a2a);
  }
  return m;
}

void Trainer::Run::publish(const StepMetrics& m) {
  summary.losses.push_back(m.lm_loss);
  if (rank == 0) {
    try {
      metrics->write(m);
    } catch (const UserError& e) {
      pending.take(e);
    }
    const bool due = m.step % cfg.logging.interval == 0 || m.step == 1 || m.step == m.total_steps;
    if (opts.print_steps && (due || stop_signal)) {
      std::printf("%s\n", opts.json_lines ? to_json(m).dump().c_str() : format_step_line(m).c_str());
      // A reader gone (`| head`: EPIPE, SIGPIPE being ignored) or a full
      // disk stops the run at the step's meeting, as a metrics write does,
      // rather than training on with its output lost.
      if (std::fflush(stdout) != 0 || std::ferror(stdout))
        pending.take(UserError(detail::concat("writing standard output failed: ", std::strerror(errno))));
    }
  }
  if (opts.on_step) opts.on_step(m);
}

TrainSummary Trainer::finish() {
  Run& r = *run_;
  // A run that ends on a step it has not saved (resumed at its last step
  // from elsewhere, into another checkpoint.dir) saves it: the end of every
  // checkpointed run is a checkpoint. (A preempted run saved in its step.)
  const CheckpointConfig& ck = r.cfg.checkpoint;
  if (ck.interval > 0 && r.saved_step != r.step) r.save();
  if (r.writer) r.writer->wait(*r.everyone);  // the last save completes before the run ends
  r.summary.seconds = std::chrono::duration<double>(Clock::now() - r.start).count();
  r.summary.stop_signal = r.stop_signal;
  r.summary.checkpoint = r.last_checkpoint;
  // The last meetings: a failure of the last step's metrics or of closing
  // the file, then of rank 0's export write, stops every rank alike.
  comm::run_agreed(*r.everyone, [&] {
    if (r.pending.status != 0) throw UserError(r.pending.message, r.pending.status);
    r.metrics->close();
  });
  const std::string& dir = r.cfg.exp.dir;
  if (!dir.empty() && !r.stop_signal) {  // a preempted run is not finished: no export
    r.zero->gather_all();
    // Collective, then rank 0 alone writes the consolidated model: its
    // failure reaches every rank at this meeting.
    comm::run_agreed(*r.everyone, [&] { export_hf(*r.model, dir, &*r.groups); }, io_meeting_wait(r.cfg));
    r.zero->release_all();
    if (r.rank == 0 && r.opts.print_steps && !r.opts.json_lines)
      std::printf("exported Hugging Face weights to %s\n", dir.c_str());
  }
  return r.summary;
}

TrainSummary train(const Config& cfg, const TrainOptions& opts) {
  Trainer trainer(cfg, opts);
  while (trainer.steps_done() < cfg.training.steps && !trainer.stop_requested()) trainer.run_step();
  return trainer.finish();
}

}  // namespace origami

// Sharded checkpoints (see checkpoint.h).
#include "engine/checkpoint.h"

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdlib>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <thread>
#include <nlohmann/json.hpp>

#include "comm/agreement.h"
#include "engine/files.h"
#include "engine/pipeline.h"
#include "engine/plan.h"
#include "kernels/allocator.h"

namespace origami {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kFormatVersion = 1;
constexpr const char* kFormat = "origami-checkpoint";

std::string rank_file(int rank, bool optim) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "rank-%05d-%s.safetensors", rank, optim ? "optim" : "model");
  return buf;
}

std::string moment_key(const std::string& name, const std::string& moment) {
  return moment.empty() ? name : name + "." + moment;
}

// The config keys that fix the model's tensors, with their values.
std::map<std::string, int64_t> shape_keys(const Config& cfg) {
  const ModelConfig& m = cfg.model;
  const MoeConfig& e = cfg.moe;
  return {{"model.vocab_size", m.vocab_size},
          {"model.hidden_size", m.hidden_size},
          {"model.num_layers", m.num_layers},
          {"model.num_heads", m.num_heads},
          {"model.num_kv_heads", m.num_kv_heads},
          {"model.ffn_hidden_size", m.ffn_hidden_size},
          {"moe.num_experts", e.router.num_experts},
          {"moe.ffn_hidden_size", e.router.num_experts > 0 ? e.expert_ffn(m.ffn_hidden_size) : 0},
          {"moe.first_dense_layers", e.first_dense_layers},
          {"moe.layer_freq", e.layer_freq},
          {"moe.shared_expert_hidden_size", e.shared_expert_hidden_size},
          {"moe.expert_bias", e.expert_bias ? 1 : 0}};
}

std::vector<int64_t> stage_layers_of(const Config& cfg) {
  return plan::stage_layers(cfg.model.num_layers, cfg.parallel.pp * cfg.parallel.virtual_stages, cfg.parallel.pp_layers);
}

// The unit table's index of each unit by name.
std::map<std::string, size_t> unit_index(const UnitTable& table) {
  std::map<std::string, size_t> out;
  for (size_t u = 0; u < table.units().size(); ++u) out[table.units()[u].name] = u;
  return out;
}

// The world rank that stores layer l's expert bias: the first rank of the
// stage holding it.
int bias_rank(const comm::Layout& layout, const std::vector<int64_t>& stage_layers, int64_t layer) {
  int64_t stage = 0, end = 0;  // the virtual stage, on pipeline rank stage % pp
  while (layer >= (end += stage_layers[static_cast<size_t>(stage)])) ++stage;
  return layout.group_of(comm::GroupKind::pp, 0).at(static_cast<size_t>(stage % layout.pp()));
}

nlohmann::ordered_json shard_json(const SliceRange& r) {
  const Shape& g = r.global_shape();
  std::vector<int64_t> offsets(g.size(), 0);
  if (r.slice.shard.dim >= 0) offsets[static_cast<size_t>(r.slice.shard.dim)] = r.slice.shard.start;
  return {{"global_shape", g}, {"saved_offsets", offsets}, {"slice_shape", r.slice.shape},
          {"flat_range", {r.begin, r.end}}};
}

// ---- save ---------------------------------------------------------------------------------------

// One rank's part of a save: the tensors of its two files (views into the
// live state, or copies for a background save) and their sharding info.
struct RankFiles {
  std::vector<NamedTensor> params, moments;
  nlohmann::ordered_json info = nlohmann::ordered_json::object(), optim_info = nlohmann::ordered_json::object();
  int64_t bytes() const {
    int64_t n = 0;
    for (const auto* list : {&params, &moments})
      for (const NamedTensor& t : *list) n += static_cast<int64_t>(t.tensor.nbytes());
    return n;
  }
};

// The stored pieces of params and moments, and the stage root's expert biases.
RankFiles collect_rank_files(const Config& cfg, const Model& model, const comm::Groups& groups) {
  const UnitTable& table = model.units();
  const comm::Layout& layout = groups.layout();
  const int rank = groups.world_rank();
  const std::vector<int64_t> stages = stage_layers_of(cfg);
  const std::map<std::string, size_t> index = unit_index(table);
  RankFiles f;
  for (const ParamUnit& pu : model.params().units()) {
    const UnitSpec& spec = table.units()[index.at(pu.name)];
    for (const UnitPiece& p : stored_pieces(table, spec, layout, rank, stages)) {
      const std::string& name = spec.tensors[p.tensor].name;
      const int64_t n = p.range.numel();
      const UnitShard& s = pu.shard;
      ORIGAMI_CHECK(!s.optim || (p.unit_offset >= s.begin && p.unit_offset + n <= s.begin + s.size), "checkpoint: ",
                    name, " piece [", p.unit_offset, ", +", n, ") outside the rank's ZeRO slice of ", pu.name);
      const int64_t param_at = p.unit_offset - (s.params ? s.begin : 0), moment_at = p.unit_offset - (s.optim ? s.begin : 0);
      // The parameters' fp32 state: the master weights of the bf16 recipe
      // (shaped like the moments), else the params: a checkpoint is the
      // same whatever the precision that wrote it or loads it.
      if (pu.master.defined())
        f.params.push_back({name, pu.master.flat_view(moment_at, n, {n})});
      else
        f.params.push_back({name, (s.params ? pu.param_shard : pu.param).flat_view(param_at, n, {n})});
      f.moments.push_back({moment_key(name, "exp_avg"), pu.exp_avg.flat_view(moment_at, n, {n})});
      f.moments.push_back({moment_key(name, "exp_avg_sq"), pu.exp_avg_sq.flat_view(moment_at, n, {n})});
      f.info[name] = shard_json(p.range);
      f.optim_info[moment_key(name, "exp_avg")] = f.optim_info[moment_key(name, "exp_avg_sq")] = f.info[name];
    }
  }
  for (size_t l = 0; l < model.expert_bias().size(); ++l) {
    const Tensor& bias = model.expert_bias()[l];
    if (!bias.defined() || bias_rank(layout, stages, static_cast<int64_t>(l)) != rank) continue;
    const std::string name = expert_bias_name(static_cast<int64_t>(l));
    f.params.push_back({name, bias});
    f.info[name] = shard_json(whole_range(bias.shape()));
  }
  return f;
}

// A copy of every tensor (a background save writes these while training
// changes the originals).
RankFiles snapshot(const RankFiles& live) {
  RankFiles copy = live;
  for (auto* list : {&copy.params, &copy.moments})
    for (NamedTensor& t : *list) {
      Tensor c = Tensor::empty(t.tensor.shape(), DType::f32, MemCategory::comm);
      c.copy_from(t.tensor);
      t.tensor = c;
    }
  return copy;
}

std::pair<FileDigest, FileDigest> write_rank_files(const std::string& dir, int rank, int64_t world, int64_t step,
                                                   const RankFiles& f) {
  const FileDigest m = write_safetensors(dir + "/" + rank_file(rank, false), f.params,
                                         {{"format", "pt"}, {"DCP_SHARDING_INFO", f.info.dump()}});
  // Fault injection for the crash tests: ORIGAMI_FAULT_KILL_IN_SAVE=<step>
  // kills the last rank midway through that step's save (one file written).
  if (const char* at = std::getenv("ORIGAMI_FAULT_KILL_IN_SAVE"); at && rank == world - 1 && std::to_string(step) == at)
    ::raise(SIGKILL);
  const FileDigest o = write_safetensors(dir + "/" + rank_file(rank, true), f.moments,
                                         {{"format", "pt"}, {"DCP_SHARDING_INFO", f.optim_info.dump()}});
  return {m, o};
}

// metadata.json: every rank's pieces from the unit table (the same rule the
// ranks wrote by), the files' digests, the state.
nlohmann::ordered_json metadata_json(const Config& cfg, const Model& model, const TrainState& state,
                                     const comm::Layout& layout) {
  const std::vector<int64_t> stages = stage_layers_of(cfg);
  const int world = static_cast<int>(layout.world());
  nlohmann::ordered_json j;
  j["format"] = kFormat;
  j["version"] = kFormatVersion;
  j["step"] = state.step;
  j["layout"] = {{"world", layout.world()}, {"tp", layout.tp()},   {"cp", layout.cp()},
                 {"pp", layout.pp()},       {"ep", layout.ep()},   {"etp", layout.etp()},
                 {"dp", layout.dp()},       {"edp", layout.edp()}, {"order", layout.order()},
                 {"zero_stage", cfg.parallel.zero_stage}, {"stage_layers", stages}};
  j["model"] = shape_keys(cfg);
  j["train"] = {{"step", state.step},
                {"lr", state.lr},
                {"consumed_samples", state.consumed_samples},
                {"windows_per_epoch", state.windows_per_epoch},
                {"epoch", state.windows_per_epoch > 0 ? state.consumed_samples / state.windows_per_epoch : 0},
                {"epoch_offset", state.windows_per_epoch > 0 ? state.consumed_samples % state.windows_per_epoch : 0},
                {"seed", state.seed},
                {"shuffle", state.shuffle}};
  j["config"] = canonical_text(cfg);
  j["files"] = nlohmann::ordered_json::array();  // filled once every rank has written (files_json)
  nlohmann::ordered_json tensors = nlohmann::ordered_json::object();
  const UnitTable& table = model.units();
  for (const UnitSpec& u : table.units()) {
    for (const TensorSpec& t : u.tensors) tensors[t.name] = {{"shape", t.global_shape}, {"shards", nlohmann::ordered_json::array()}};
    for (int r = 0; r < world; ++r)
      for (const UnitPiece& p : stored_pieces(table, u, layout, r, stages)) {
        nlohmann::ordered_json s = shard_json(p.range);
        s.erase("global_shape");
        s["rank"] = r;
        tensors[u.tensors[p.tensor].name]["shards"].push_back(std::move(s));
      }
  }
  if (cfg.moe.expert_bias)
    for (int64_t l = 0; l < cfg.model.num_layers; ++l) {
      if (!cfg.moe.is_moe_layer(l)) continue;
      const Shape shape{cfg.moe.router.num_experts};
      nlohmann::ordered_json s = shard_json(whole_range(shape));
      s.erase("global_shape");
      s["rank"] = bias_rank(layout, stages, l);
      tensors[expert_bias_name(l)] = {{"shape", shape}, {"state", true}, {"shards", {s}}};
    }
  j["tensors"] = std::move(tensors);
  return j;
}

// Every rank's two files: (bytes, digest) × 2 per rank, in rank order.
nlohmann::ordered_json files_json(const std::vector<int64_t>& digests) {
  nlohmann::ordered_json files = nlohmann::ordered_json::array();
  for (size_t r = 0; r < digests.size() / 4; ++r)
    for (size_t optim = 0; optim < 2; ++optim) {
      const size_t at = 4 * r + 2 * optim;
      files.push_back({{"name", rank_file(static_cast<int>(r), optim != 0)},
                       {"rank", r},
                       {"bytes", digests[at]},
                       {"xxh3", digest_hex(static_cast<uint64_t>(digests[at + 1]))}});
    }
  return files;
}

int64_t step_of(const std::string& name) {
  if (name.size() != 13 || name.rfind("step-", 0) != 0) return -1;
  for (size_t i = 5; i < name.size(); ++i)
    if (name[i] < '0' || name[i] > '9') return -1;
  return std::stoll(name.substr(5));
}

// Deletes all but the newest `keep` complete checkpoints of `dir`.
void prune(const std::string& dir, int64_t keep) {
  if (keep <= 0) return;
  std::vector<std::pair<int64_t, fs::path>> complete;
  for (const auto& e : fs::directory_iterator(dir)) {
    const int64_t step = step_of(e.path().filename().string());
    if (step >= 0 && e.is_directory() && fs::exists(e.path() / "metadata.json")) complete.emplace_back(step, e.path());
  }
  std::sort(complete.begin(), complete.end());
  for (size_t i = 0; i + static_cast<size_t>(keep) < complete.size(); ++i) {
    std::error_code ec;
    fs::remove_all(complete[i].second, ec);
    if (ec) ORIGAMI_USER_ERROR(complete[i].second.string(), ": cannot remove an old checkpoint (checkpoint.keep = ",
                               keep, "): ", ec.message());
  }
}

void write_text_durably(const std::string& path, const std::string& text) {
  OutputFile out(path, OutputFile::Mode::truncate);
  out.write(text);
  out.sync();
  out.close();
}

}  // namespace

std::string step_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

// A save between its start and its completion.
struct CheckpointWriter::Pending {
  std::string name, tmp, done;
  int64_t step = 0;
  bool background = false;
  Clock::time_point started;
  double blocked_s = 0;
  // Rank 0 builds metadata.json (but its "files") while the files are
  // written, from a copy of the config and state and the model's unit table
  // (immutable while the model lives, which outlives the writer).
  std::function<nlohmann::ordered_json()> describe;
  nlohmann::ordered_json metadata;
  RankFiles files;  // a background save's copies
  std::thread thread;
  std::atomic<bool> written{false};
  std::pair<FileDigest, FileDigest> digests;
  int status = 0;  // a failure of the writing, reported at completion
  std::string message;
  void write(int rank, int64_t world, const RankFiles& f) {
    try {
      std::error_code ec;
      fs::create_directories(tmp, ec);  // every rank: no meeting needed before the writing
      if (ec) ORIGAMI_USER_ERROR("checkpoint.dir: cannot create ", tmp, ": ", ec.message());
      digests = write_rank_files(tmp, rank, world, step, f);
      if (describe) metadata = describe();
    } catch (const UserError& e) {
      status = e.exit_status();
      message = e.what();
    }
    written.store(true);
  }
};

CheckpointWriter::CheckpointWriter(std::string dir, int64_t keep, bool background)
    : dir_(std::move(dir)), keep_(keep), background_(background) {}

CheckpointWriter::~CheckpointWriter() {
  if (pending_ && pending_->thread.joinable()) pending_->thread.join();  // not completed: the .tmp stays
}

CheckpointSaveStats CheckpointWriter::save(const Config& cfg, const Model& model, const TrainState& state,
                                           const comm::Groups& groups, comm::Communicator& world) {
  if (pending_) wait(world);
  const auto t0 = Clock::now();
  auto p = std::make_unique<Pending>();
  p->name = step_dir_name(state.step);
  p->tmp = dir_ + "/" + p->name + ".tmp";
  p->done = dir_ + "/" + p->name;
  p->step = state.step;
  p->background = background_;
  p->started = t0;
  const int rank = groups.world_rank();
  if (rank == 0)
    p->describe = [cfg, state, layout = groups.layout(), &model] { return metadata_json(cfg, model, state, layout); };
  const RankFiles live = collect_rank_files(cfg, model, groups);
  const int64_t world_size = groups.layout().world();
  TrackedAllocator& host = TrackedAllocator::host();
  const int64_t host_before = host.snapshot().current_total;
  host.reset_peaks();  // the step's peaks are already recorded (trainer: before the save)
  auto staged = [&] { return host.snapshot().peak_total - host_before; };
  CheckpointSaveStats stats;
  stats.dir = p->done;
  stats.background = background_;
  if (background_) {
    // Only the copy blocks training; the thread writes and syncs the files.
    p->files = snapshot(live);
    Pending* raw = p.get();
    p->thread = std::thread([raw, rank, world_size] { raw->write(rank, world_size, raw->files); });
    pending_ = std::move(p);
    stats.host_staged_bytes = staged();
    stats.rank_bytes = live.bytes();  // every rank's: at completion (no meeting while training waits)
    stats.seconds = pending_->blocked_s = std::chrono::duration<double>(Clock::now() - t0).count();
    return stats;
  }
  // Device state goes through host copies one tensor at a time (the
  // checkpoint's named host point): a rank's whole state may not fit in
  // host memory (the Mixtral-like config on one H200: ~90 GB of fp32
  // master weights and moments).
  p->write(rank, world_size, live);
  const int64_t host_staged = staged();
  pending_ = std::move(p);
  stats = *wait(world);
  stats.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  stats.host_staged_bytes = host_staged;
  return stats;
}

std::optional<CheckpointSaveStats> CheckpointWriter::poll(comm::Communicator& world) {
  if (!pending_) return std::nullopt;
  int written = pending_->written.load() ? 1 : 0;
  world.all_reduce(std::span<int>(&written, 1), comm::ReduceOp::sum);
  if (written < world.size()) return std::nullopt;
  return wait(world);
}

std::optional<CheckpointSaveStats> CheckpointWriter::wait(comm::Communicator& world) {
  if (!pending_) return std::nullopt;
  std::unique_ptr<Pending> p = std::move(pending_);
  if (p->thread.joinable()) p->thread.join();
  int64_t local[4] = {p->digests.first.bytes, static_cast<int64_t>(p->digests.first.xxh3), p->digests.second.bytes,
                      static_cast<int64_t>(p->digests.second.xxh3)};
  std::vector<int64_t> all(4 * static_cast<size_t>(world.size()));
  world.all_gather(std::span<const int64_t>(local, 4), std::span<int64_t>(all));
  CheckpointSaveStats stats;
  stats.dir = p->done;
  stats.background = p->background;
  stats.rank_bytes = local[0] + local[2];
  for (size_t r = 0; r < all.size() / 4; ++r) {
    stats.total_bytes += all[4 * r] + all[4 * r + 2];
    stats.max_rank_bytes = std::max(stats.max_rank_bytes, all[4 * r] + all[4 * r + 2]);
  }
  // Every rank's files are synced (or a rank failed, and all stop here):
  // metadata.json, then the rename, then latest.
  comm::run_agreed(world, [&] {
    if (p->status != 0) throw UserError(p->message, p->status);
    if (world.rank() != 0) return;
    p->metadata["files"] = files_json(all);
    write_text_durably(p->tmp + "/metadata.json", p->metadata.dump(1) + "\n");
    sync_dir(p->tmp);
    std::error_code ec;
    if (fs::exists(p->done)) fs::remove_all(p->done, ec);
    if (ec) ORIGAMI_USER_ERROR(p->done, ": cannot replace the existing checkpoint: ", ec.message());
    // Both renames in one directory, made durable by one sync of it.
    if (::rename(p->tmp.c_str(), p->done.c_str()) != 0)
      ORIGAMI_USER_ERROR(p->tmp, ": cannot rename to ", p->done, ": ", std::strerror(errno));
    write_text_durably(dir_ + "/latest.tmp", p->name + "\n");
    rename_durably(dir_ + "/latest.tmp", dir_ + "/latest");
    prune(dir_, keep_);
  });
  stats.seconds = p->blocked_s;
  stats.written_s = std::chrono::duration<double>(Clock::now() - p->started).count();
  return stats;
}

std::optional<std::string> resolve_load(const CheckpointConfig& ck) {
  if (ck.load.empty()) return std::nullopt;
  if (ck.load == "latest") {
    const std::string latest = ck.dir + "/latest";
    if (!fs::exists(latest)) return std::nullopt;  // nothing saved yet: a restart loop's first start
    const InputFile in(latest, "checkpoint latest file");
    std::string name = in.read_all(4096);
    while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
    if (step_of(name) < 0)
      ORIGAMI_USER_ERROR(latest, ": holds \"", shorten(name), "\" (rule: the name of a step directory, step-NNNNNNNN)");
    const std::string dir = ck.dir + "/" + name;
    if (!fs::is_directory(dir))
      ORIGAMI_USER_ERROR(latest, ": names ", name, ", but ", dir, " does not exist (removed by hand?)");
    return dir;
  }
  if (fs::is_directory(ck.load)) return ck.load;
  if (!ck.dir.empty() && fs::is_directory(ck.dir + "/" + ck.load)) return ck.dir + "/" + ck.load;
  ORIGAMI_USER_ERROR("checkpoint.load = \"", shorten(ck.load), "\": no such checkpoint directory",
                     ck.dir.empty() ? "" : " (nor under checkpoint.dir = \"" + shorten(ck.dir) + "\")",
                     " (rule: \"latest\" or a step directory)");
}

void remove_partial_checkpoints(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (e.is_directory() && n.size() > 4 && n.ends_with(".tmp") && step_of(n.substr(0, n.size() - 4)) >= 0)
      fs::remove_all(e.path(), ec);
  }
}


// ---- read ---------------------------------------------------------------------------------------

namespace {

// metadata.json's fields, each checked: UserError naming the file and key.
struct MetaReader {
  std::string path;
  [[noreturn]] void bad(const std::string& key, const std::string& rule) const {
    ORIGAMI_USER_ERROR(path, ": ", key, ": ", rule, " (the checkpoint is damaged or not one Origami wrote)");
  }
  const nlohmann::ordered_json& at(const nlohmann::ordered_json& j, const std::string& key, const std::string& where) const {
    if (!j.is_object() || !j.contains(key)) bad(where.empty() ? key : where + "." + key, "missing");
    return j[key];
  }
  int64_t integer(const nlohmann::ordered_json& j, const std::string& key, const std::string& where = "") const {
    const nlohmann::ordered_json& v = at(j, key, where);
    if (!v.is_number_integer()) bad(where.empty() ? key : where + "." + key, "must be an integer, got " + shorten(v.dump(), 40));
    return v.get<int64_t>();
  }
  std::string text(const nlohmann::ordered_json& j, const std::string& key, const std::string& where = "") const {
    const nlohmann::ordered_json& v = at(j, key, where);
    if (!v.is_string()) bad(where.empty() ? key : where + "." + key, "must be a string");
    return v.get<std::string>();
  }
  std::vector<int64_t> ints(const nlohmann::ordered_json& j, const std::string& key, const std::string& where) const {
    const nlohmann::ordered_json& v = at(j, key, where);
    std::vector<int64_t> out;
    if (!v.is_array()) bad(where + "." + key, "must be an array of integers");
    for (const auto& x : v) {
      if (!x.is_number_integer() || x.get<int64_t>() < 0) bad(where + "." + key, "must be an array of integers >= 0");
      out.push_back(x.get<int64_t>());
    }
    return out;
  }
};

SavedShard parse_shard(const MetaReader& m, const nlohmann::ordered_json& s, const std::string& where, const Shape& global,
                       int64_t world) {
  SavedShard out;
  out.rank = static_cast<int>(m.integer(s, "rank", where));
  const std::vector<int64_t> offsets = m.ints(s, "saved_offsets", where);
  out.slice_shape = m.ints(s, "slice_shape", where);
  const std::vector<int64_t> range = m.ints(s, "flat_range", where);
  if (out.rank < 0 || out.rank >= world) m.bad(where + ".rank", "outside the saving world of " + std::to_string(world));
  if (offsets.size() != global.size() || out.slice_shape.size() != global.size())
    m.bad(where, "saved_offsets and slice_shape need one entry per dimension of " + shape_string(global));
  for (size_t d = 0; d < global.size(); ++d) {
    if (offsets[d] + out.slice_shape[d] > global[d]) m.bad(where, "the slice exceeds the global shape " + shape_string(global));
    if (out.slice_shape[d] == global[d]) continue;
    if (out.slice_dim >= 0) m.bad(where, "a slice splits at most one dimension");
    out.slice_dim = static_cast<int64_t>(d);
    out.slice_start = offsets[d];
  }
  if (range.size() != 2 || range[0] > range[1] || range[1] > shape_numel(out.slice_shape))
    m.bad(where + ".flat_range", "must be [begin, end] within the slice's elements");
  out.begin = range[0];
  out.end = range[1];
  return out;
}

SliceRange range_of(const SavedShard& s, const Shape& global) {
  SliceRange r;
  r.slice.held = true;
  r.slice.shape = s.slice_shape;
  if (s.slice_dim >= 0) r.slice.shard = ShardSpec{static_cast<int>(s.slice_dim), s.slice_start, global};
  r.begin = s.begin;
  r.end = s.end;
  return r;
}

}  // namespace

CheckpointInfo read_checkpoint_info(const std::string& step_dir) {
  CheckpointInfo info;
  info.dir = step_dir;
  const std::string path = step_dir + "/metadata.json";
  if (!fs::exists(path))
    ORIGAMI_USER_ERROR(path, ": missing (rule: a checkpoint is complete only once rank 0 wrote metadata.json, "
                             "after every rank's files; this directory is an unfinished save or not a checkpoint)");
  const InputFile in(path, "checkpoint metadata");
  nlohmann::ordered_json j;
  try {
    j = nlohmann::ordered_json::parse(in.read_all(int64_t{1} << 31));
  } catch (const nlohmann::ordered_json::exception& e) {
    ORIGAMI_USER_ERROR(path, ": not valid JSON: ", e.what());
  }
  const MetaReader m{path};
  if (m.text(j, "format") != kFormat) m.bad("format", std::string("must be \"") + kFormat + "\"");
  if (m.integer(j, "version") != kFormatVersion)
    m.bad("version", "this build reads version " + std::to_string(kFormatVersion));
  info.step = m.integer(j, "step");
  const nlohmann::ordered_json& lay = m.at(j, "layout", "");
  info.world = m.integer(lay, "world", "layout");
  info.tp = m.integer(lay, "tp", "layout");
  info.cp = m.integer(lay, "cp", "layout");
  info.pp = m.integer(lay, "pp", "layout");
  info.ep = m.integer(lay, "ep", "layout");
  info.etp = m.integer(lay, "etp", "layout");
  info.dp = m.integer(lay, "dp", "layout");
  info.edp = m.integer(lay, "edp", "layout");
  info.zero_stage = m.integer(lay, "zero_stage", "layout");
  info.order = m.text(lay, "order", "layout");
  info.stage_layers = m.ints(lay, "stage_layers", "layout");
  if (info.world < 1) m.bad("layout.world", "must be >= 1");
  const nlohmann::ordered_json& model = m.at(j, "model", "");
  if (!model.is_object()) m.bad("model", "must be an object");
  for (const auto& [k, v] : model.items()) info.model[k] = m.integer(model, k, "model");
  const nlohmann::ordered_json& train = m.at(j, "train", "");
  info.train.step = m.integer(train, "step", "train");
  const nlohmann::ordered_json& lr = m.at(train, "lr", "train");
  if (!lr.is_number()) m.bad("train.lr", "must be a number");
  info.train.lr = lr.get<double>();
  info.train.consumed_samples = m.integer(train, "consumed_samples", "train");
  info.train.windows_per_epoch = m.integer(train, "windows_per_epoch", "train");
  info.train.seed = static_cast<uint64_t>(m.integer(train, "seed", "train"));
  const nlohmann::ordered_json& shuffle = m.at(train, "shuffle", "train");
  if (!shuffle.is_boolean()) m.bad("train.shuffle", "must be true or false");
  info.train.shuffle = shuffle.get<bool>();
  if (info.train.step != info.step) m.bad("train.step", "differs from step");
  info.config = m.text(j, "config");
  const nlohmann::ordered_json& files = m.at(j, "files", "");
  if (!files.is_array()) m.bad("files", "must be an array");
  for (size_t i = 0; i < files.size(); ++i) {
    const std::string where = "files[" + std::to_string(i) + "]";
    SavedFile f;
    f.name = m.text(files[i], "name", where);
    f.rank = static_cast<int>(m.integer(files[i], "rank", where));
    f.bytes = m.integer(files[i], "bytes", where);
    const std::string hex = m.text(files[i], "xxh3", where);
    if (hex.size() != 16 || hex.find_first_not_of("0123456789abcdef") != std::string::npos)
      m.bad(where + ".xxh3", "must be 16 hex digits");
    f.xxh3 = std::stoull(hex, nullptr, 16);
    if (f.name.find('/') != std::string::npos) m.bad(where + ".name", "must be a file name in the directory");
    info.files.push_back(std::move(f));
  }
  const nlohmann::ordered_json& tensors = m.at(j, "tensors", "");
  if (!tensors.is_object()) m.bad("tensors", "must be an object");
  for (const auto& [name, t] : tensors.items()) {
    const std::string where = "tensors." + name;
    SavedTensor st;
    st.global_shape = m.ints(t, "shape", where);
    st.state = t.contains("state") && t["state"].is_boolean() && t["state"].get<bool>();
    const nlohmann::ordered_json& shards = m.at(t, "shards", where);
    if (!shards.is_array()) m.bad(where + ".shards", "must be an array");
    for (size_t i = 0; i < shards.size(); ++i)
      st.shards.push_back(parse_shard(m, shards[i], where + ".shards[" + std::to_string(i) + "]", st.global_shape, info.world));
    info.order_of_tensors.push_back(name);
    info.tensors.emplace(name, std::move(st));
  }
  return info;
}

void verify_checkpoint_files(const CheckpointInfo& info, int rank, int ranks) {
  for (size_t i = 0; i < info.files.size(); ++i) {
    if (static_cast<int>(i % static_cast<size_t>(ranks)) != rank) continue;
    const SavedFile& f = info.files[i];
    const std::string path = info.dir + "/" + f.name;
    if (!fs::exists(path))
      ORIGAMI_USER_ERROR(path, ": missing (", info.dir, "/metadata.json lists it with ", f.bytes, " bytes)");
    const MappedFile map(path, "checkpoint shard");
    if (map.size() != f.bytes)
      ORIGAMI_USER_ERROR(path, ": ", map.size(), " bytes, but ", info.dir, "/metadata.json records ", f.bytes,
                         " (the file was truncated or replaced after the save)");
    const uint64_t got = digest_of(map.data(), map.size());
    if (got != f.xxh3)
      ORIGAMI_USER_ERROR(path, ": XXH3 digest ", digest_hex(got), ", but ", info.dir, "/metadata.json records ",
                         digest_hex(f.xxh3), " (the file's bytes changed after the save: a damaged disk or copy)");
  }
}

CheckpointReader::CheckpointReader(const CheckpointInfo& info) : info_(info) {}
CheckpointReader::~CheckpointReader() = default;

const SafetensorsFile& CheckpointReader::file(int rank, bool optim) {
  auto& slot = files_[{rank, optim}];
  if (slot) return *slot;
  const std::string name = rank_file(rank, optim);
  const auto it = std::find_if(info_.files.begin(), info_.files.end(), [&](const SavedFile& f) { return f.name == name; });
  if (it == info_.files.end()) ORIGAMI_USER_ERROR(info_.dir, "/metadata.json: files: no entry for ", name);
  const std::string path = info_.dir + "/" + name;
  if (!fs::exists(path)) ORIGAMI_USER_ERROR(path, ": missing (metadata.json lists it with ", it->bytes, " bytes)");
  if (static_cast<int64_t>(fs::file_size(path)) != it->bytes)
    ORIGAMI_USER_ERROR(path, ": ", fs::file_size(path), " bytes, but metadata.json records ", it->bytes,
                       " (the file was truncated or replaced after the save)");
  slot = std::make_unique<SafetensorsFile>(path);
  return *slot;
}

void CheckpointReader::read(const std::string& name, const std::string& moment, const SliceRange& dst_range,
                            float* dst) {
  const std::string meta = info_.dir + "/metadata.json";
  const auto it = info_.tensors.find(name);
  if (it == info_.tensors.end())
    ORIGAMI_USER_ERROR(meta, ": has no tensor '", name, "' (rule: the checkpoint holds every tensor of the configured model)");
  const SavedTensor& t = it->second;
  if (t.global_shape != dst_range.global_shape())
    ORIGAMI_USER_ERROR(meta, ": tensor '", name, "' has shape ", shape_string(t.global_shape), ", the config needs ",
                       shape_string(dst_range.global_shape()));
  int64_t copied = 0;
  for (const SavedShard& s : t.shards) {
    const SafetensorsFile& f = file(s.rank, !moment.empty());
    const std::string key = moment_key(name, moment);
    const SafetensorsFile::Entry& e = f.entry(key);
    if (e.end - e.begin != (s.end - s.begin) * static_cast<int64_t>(sizeof(float)))
      ORIGAMI_USER_ERROR(f.path(), ": tensor '", key, "' holds ", (e.end - e.begin) / 4, " elements, metadata.json says ",
                         s.end - s.begin);
    copied += copy_overlap(range_of(s, t.global_shape), reinterpret_cast<const float*>(f.data(e)), dst_range, dst);
  }
  if (copied != dst_range.numel())
    ORIGAMI_USER_ERROR(meta, ": the shards of '", name, "' cover ", copied, " of the ", dst_range.numel(),
                       " elements this rank needs (rule: every element is saved exactly once)");
}

namespace {

void check_model_shape(const CheckpointInfo& info, const Config& cfg) {
  for (const auto& [key, value] : shape_keys(cfg)) {
    const auto it = info.model.find(key);
    if (it == info.model.end()) ORIGAMI_USER_ERROR(info.dir, "/metadata.json: model.", key, ": missing");
    if (it->second != value)
      ORIGAMI_USER_ERROR(info.dir, "/metadata.json: the checkpoint was saved with ", key, " = ", it->second, ", but ",
                         cfg.origin(key), " configures ", key, " = ", value,
                         " (rule: a checkpoint loads into the model shape it was saved from; the layout may change, "
                         "the model may not)");
  }
}

}  // namespace

void fill_held_state(Model& model, const comm::Groups& groups, bool with_moments, const ReadFn& read) {
  const UnitTable& table = model.units();
  const std::map<std::string, size_t> index = unit_index(table);
  // Elements [begin, end) of the rank's flat unit buffer, `dst` holding element `begin`.
  // Device state (and a bf16 working copy) is read into a host f32 image of
  // itself (so elements no piece covers keep their values), then copied
  // back (rounded): the checkpoint's named host point.
  auto read_into = [](Tensor dst, const std::function<void(float*)>& read_host) {
    Tensor host = dst.on_host_f32();  // dst itself when it is an f32 tensor on plain cpu
    read_host(host.f32());
    if (dst.device() != Device::cpu() || dst.dtype() != DType::f32) dst.assign_f32(host);
  };
  // Elements [begin, end) of the rank's flat unit buffer `buf`, whose
  // element 0 is unit element `first`.
  auto fill = [&](const UnitSpec& spec, const LocalUnit& local, int64_t begin, int64_t end, const std::string& moment,
                  const Tensor& buf, int64_t first) {
    if (end <= begin) return;
    read_into(buf.flat_view(begin - first, end - begin, {end - begin}), [&](float* dst) {
      for (const UnitPiece& p : pieces_in(local, begin, end))
        read(spec.tensors[p.tensor].name, moment, p.range, dst + (p.unit_offset - begin));
    });
  };
  for (ParamUnit& pu : model.params().units()) {
    const UnitSpec& spec = table.units()[index.at(pu.name)];
    const LocalUnit local = table.local_unit(spec, groups.layout(), groups.coords());
    const UnitShard& s = pu.shard;
    // What the rank holds: the parameters whole unless ZeRO-3 shards them,
    // the moments whole unless ZeRO 1-3 shard them.
    // bf16 recipe: the fp32 master takes the saved values, the bf16 params
    // the same values rounded (what the optimizer leaves after a step).
    const int64_t owned_end = std::min(pu.numel, s.begin + s.size);
    const int64_t mb = s.optim ? s.begin : 0, me = s.optim ? owned_end : pu.numel;
    if (pu.master.defined()) fill(spec, local, mb, me, "", pu.master, mb);
    if (s.params) fill(spec, local, s.begin, owned_end, "", pu.param_shard, s.begin);
    else fill(spec, local, 0, pu.numel, "", pu.param, 0);
    if (!with_moments) continue;
    fill(spec, local, mb, me, "exp_avg", pu.exp_avg, mb);
    fill(spec, local, mb, me, "exp_avg_sq", pu.exp_avg_sq, mb);
  }
  for (size_t l = 0; l < model.expert_bias().size(); ++l) {
    const Tensor& bias = model.expert_bias()[l];
    if (bias.defined())
      read_into(bias, [&](float* dst) { read(expert_bias_name(static_cast<int64_t>(l)), "", whole_range(bias.shape()), dst); });
  }
}

TrainState load_checkpoint(const std::string& step_dir, const Config& cfg, Model& model, const comm::Groups& groups,
                           comm::Communicator& world) {
  CheckpointInfo info;
  comm::run_agreed(world, [&] {
    info = read_checkpoint_info(step_dir);
    check_model_shape(info, cfg);
    verify_checkpoint_files(info, groups.world_rank(), world.size());
  });
  comm::run_agreed(world, [&] {
    CheckpointReader reader(info);
    fill_held_state(model, groups, /*with_moments=*/true,
                    [&](const std::string& name, const std::string& moment, const SliceRange& range, float* dst) {
                      reader.read(name, moment, range, dst);
                    });
  });
  return info.train;
}

}  // namespace origami

// Sharded checkpoints (see checkpoint.h): saving, background and
// synchronous, and which checkpoint to load. Reading one is
// checkpoint_read.cpp; the names both use, checkpoint_format.h.
#include "engine/checkpoint.h"

#include <algorithm>
#include <charconv>
#include <atomic>
#include <csignal>
#include <cstdlib>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <functional>
#include <optional>
#include <random>
#include <sstream>
#include <thread>
#include <nlohmann/json.hpp>

#include "comm/agreement.h"
#include "engine/checkpoint_format.h"
#include "engine/files.h"
#include "engine/pipeline.h"
#include "engine/plan.h"
#include "kernels/allocator.h"

namespace origami {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using namespace checkpoint_format;

namespace {

std::vector<int64_t> stage_layers_of(const Config& cfg) {
  return plan::stage_layers(cfg.model.num_layers, cfg.parallel.pp * cfg.parallel.virtual_stages, cfg.parallel.pp_layers);
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

// checkpoint.dir/committing: "step-NNNNNNNN <save_id>" while rank 0 puts a
// finished save in place and moves `latest` (CheckpointWriter::wait).
constexpr const char* kJournal = "committing";

// 64 random bits in hex: a save's id in its metadata.json and the journal.
std::string fresh_save_id() {
  std::random_device rd;
  const uint64_t id = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(id));
  return hex;
}

// Removes a step directory (or a partial one): its metadata.json first, so
// a removal cut short never leaves a complete-looking remnant. A symbolic
// link (a step kept on another disk) goes alone: what it points to is the
// user's, outside checkpoint.dir, and is left whole.
void remove_save(const fs::path& p, std::error_code& ec) {
  if (fs::is_symlink(p, ec)) {
    fs::remove(p, ec);
    return;
  }
  fs::remove(p / "metadata.json", ec);
  fs::remove_all(p, ec);
}

// Keeps the newest `keep` complete checkpoints up to `saved`, the step just
// written (and named by latest). Later steps are another trajectory's (a run
// resumed from an earlier checkpoint): never counted, so the one just saved
// is never the one removed, and left as they are.
void prune(const std::string& dir, int64_t keep, int64_t saved) {
  if (keep <= 0) return;
  std::vector<std::pair<int64_t, fs::path>> complete;
  for (const auto& e : fs::directory_iterator(dir)) {
    const int64_t step = step_of(e.path().filename().string());
    if (step >= 0 && step <= saved && e.is_directory() && fs::exists(e.path() / "metadata.json"))
      complete.emplace_back(step, e.path());
  }
  std::sort(complete.begin(), complete.end());
  // The save is done; an old one that will not go (a file a reader holds
  // open on NFS, permissions) costs disk, not the run: a warning.
  for (size_t i = 0; i + static_cast<size_t>(keep) < complete.size(); ++i) {
    std::error_code ec;
    // Renamed to a partial's name first: a removal cut short leaves what the
    // next start clears away, never a step directory without its metadata.
    const fs::path going = complete[i].second.string() + ".stale-" + std::to_string(::getpid()) + "-0.tmp";
    fs::path removing = complete[i].second;
    if (::rename(removing.c_str(), going.c_str()) == 0) removing = going;
    remove_save(removing, ec);
    if (ec)
      std::fprintf(stderr, "origami: warning: %s: cannot remove an old checkpoint (checkpoint.keep = %lld): %s; left as %s\n",
                   complete[i].second.c_str(), static_cast<long long>(keep), ec.message().c_str(), removing.c_str());
  }
}

// Puts the finished save `tmp` in place of the step directory `done`. When
// `done` exists (a run resumed from an earlier step saves that step again),
// `latest` may name it, so it is never missing: the two are swapped in one
// atomic rename where the file system can (RENAME_EXCHANGE), else the old
// one is moved aside first (a name of its own, step-N.replaced-<pid>.tmp)
// and a kill between the two renames is repaired at the next start
// (remove_partial_checkpoints). The old one, no longer marked complete
// (its metadata.json removed first), is removed last; if it will not go, a
// warning.
void publish_step_dir(const std::string& tmp, const std::string& done) {
  std::string old;
  if (!fs::exists(done)) {
    if (::rename(tmp.c_str(), done.c_str()) != 0)
      ORIGAMI_USER_ERROR(tmp, ": cannot rename to ", done, ": ", std::strerror(errno));
  } else if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, done.c_str(), RENAME_EXCHANGE) == 0) {
    old = tmp;
  } else {
    // A name no earlier leftover holds (pids repeat across restarts).
    for (int n = 0;; ++n) {
      old = done + ".replaced-" + std::to_string(::getpid()) + "-" + std::to_string(n) + ".tmp";
      if (::rename(done.c_str(), old.c_str()) == 0) break;
      if ((errno != EEXIST && errno != ENOTEMPTY) || n == 999)
        ORIGAMI_USER_ERROR(done, ": cannot move the existing checkpoint aside to replace it: ", std::strerror(errno));
    }
    if (::rename(tmp.c_str(), done.c_str()) != 0)
      ORIGAMI_USER_ERROR(tmp, ": cannot rename to ", done, ": ", std::strerror(errno));
  }
  sync_dir(fs::path(done).parent_path().string());
  if (old.empty()) return;
  std::error_code ec;
  remove_save(old, ec);
  if (ec)
    std::fprintf(stderr, "origami: warning: %s: cannot remove the checkpoint this save replaced: %s; left in place\n",
                 old.c_str(), ec.message().c_str());
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

int64_t step_of(const std::string& name) {
  if (name.size() < 13 || name.size() > 24 || name.rfind("step-", 0) != 0) return -1;
  int64_t step = -1;
  const char* end = name.data() + name.size();
  if (auto [at, ec] = std::from_chars(name.data() + 5, end, step); ec != std::errc() || at != end || step < 0)
    return -1;
  return step_dir_name(step) == name ? step : -1;  // the one spelling a save writes
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
      // metadata.json marks a .tmp complete (remove_partial_checkpoints): one
      // left from a save that could not be cleared away must not mark this one.
      if (rank == 0 && fs::exists(tmp + "/metadata.json") && !fs::remove(tmp + "/metadata.json", ec))
        ORIGAMI_USER_ERROR(tmp, "/metadata.json: cannot remove a stale one: ", ec.message());
      digests = write_rank_files(tmp, rank, world, step, f);
      if (describe) metadata = describe();
    } catch (const UserError& e) {
      status = e.exit_status();
      message = e.what();
    } catch (const fs::filesystem_error& e) {
      status = kExitUserError;
      message = e.what();
    } catch (const std::exception& e) {  // on the writer thread: ends the job here, not through std::terminate
      abort_job(kExitInternal, detail::concat("[rank ", rank, "] internal error writing checkpoint ", tmp, ": ", e.what()));
    }
    written.store(true);
  }
};

CheckpointWriter::CheckpointWriter(std::string dir, int64_t keep, bool background, comm::MeetingWait io_wait)
    : dir_(std::move(dir)), keep_(keep), background_(background), io_wait_(std::move(io_wait)) {}

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
  // Every rank's files are synced, or a rank failed and all stop here. The
  // wait is for the slowest disk, not a collective: the I/O timeout.
  comm::agree(world, p->status, p->message, io_wait_);
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
  // Rank 0: metadata.json, then the rename, then latest.
  comm::run_agreed(world, [&] {
    if (world.rank() != 0) return;
    p->metadata["files"] = files_json(all);
    // This save's own id: a start after a kill tells its copy from another
    // of the same step (the one a swap replaced, an abandoned run's).
    const std::string save_id = fresh_save_id();
    p->metadata["save_id"] = save_id;
    // Whole or absent (written aside, then renamed): its presence marks the
    // save complete, for the repair at the next start.
    write_text_durably(p->tmp + "/metadata.json.tmp", p->metadata.dump(1) + "\n");
    rename_durably(p->tmp + "/metadata.json.tmp", p->tmp + "/metadata.json");
    // The journal (finish_commit): from here a kill leaves a save the next
    // start completes, `latest` included, rather than one it redoes.
    write_text_durably(dir_ + "/" + kJournal, p->name + " " + save_id + "\n");
    publish_step_dir(p->tmp, p->done);
    write_text_durably(dir_ + "/latest.tmp", p->name + "\n");
    rename_durably(dir_ + "/latest.tmp", dir_ + "/latest");
    std::error_code ec;
    fs::remove(dir_ + "/" + kJournal, ec);
    prune(dir_, keep_, p->step);
  }, io_wait_);
  stats.seconds = p->blocked_s;
  stats.written_s = std::chrono::duration<double>(Clock::now() - p->started).count();
  return stats;
}

std::optional<std::string> resolve_load(const CheckpointConfig& ck) {
  if (ck.load.empty()) return std::nullopt;
  if (ck.load == "latest") {
    const std::string latest = ck.dir + "/latest";
    if (!fs::exists(latest)) {
      // No `latest`: nothing saved yet (a restart loop's first start), or the
      // first save's step directory was renamed into place and the job died
      // before `latest` was written. A step directory exists only complete
      // (a save renames it last), so the newest one is where to resume;
      // starting afresh would prune it away.
      std::optional<std::string> newest;
      int64_t newest_step = -1;
      std::error_code ec;
      if (fs::is_directory(ck.dir, ec))
        for (const auto& e : fs::directory_iterator(ck.dir))
          if (const int64_t st = step_of(e.path().filename().string());
              st > newest_step && e.is_directory() && fs::exists(e.path() / "metadata.json"))
            newest_step = st, newest = e.path().string();
      return newest;
    }
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

namespace {

// The save_id of dir/metadata.json: nullopt when the file is absent or not
// whole JSON (a save not finished); "" for one without an id (an older
// binary's). A file there that cannot be read is a UserError: never a
// reason to remove what may be the only complete copy.
std::optional<std::string> save_mark(const fs::path& dir) {
  std::error_code ec;
  const fs::path meta = dir / "metadata.json";
  const bool there = fs::exists(meta, ec);
  if (ec) ORIGAMI_USER_ERROR(meta.string(), ": cannot tell whether it exists: ", ec.message());
  if (!there) return std::nullopt;
  const nlohmann::json j = nlohmann::json::parse(
      InputFile(meta.string(), "checkpoint metadata file").read_all(int64_t{1} << 31), nullptr, false);
  if (j.is_discarded() || !j.is_object()) return std::nullopt;
  return j.contains("save_id") && j["save_id"].is_string() ? j["save_id"].get<std::string>() : std::string();
}

// A save the journal names (CheckpointWriter::wait): its copy, told by its
// save_id from any other of that step, goes in place (swapped where another
// is there: a rollback's abandoned step, or the old copy a swap left), and
// `latest` names it, as the kill interrupted.
void finish_commit(const fs::path& root) {
  std::error_code ec;
  const fs::path journal = root / kJournal;
  if (!fs::exists(journal, ec)) return;
  std::istringstream words(InputFile(journal.string(), "checkpoint commit journal").read_all(4096));
  std::string name, id;
  words >> name >> id;
  if (step_of(name) >= 0 && !id.empty()) {
    const fs::path done = root / name, tmp = root / (name + ".tmp");
    if (save_mark(tmp) == id) publish_step_dir(tmp.string(), done.string());
    std::string named;
    try {
      named = InputFile((root / "latest").string(), "checkpoint latest file").read_all(4096);
    } catch (const UserError&) {
    }
    if (save_mark(done) == id && named != name + "\n") {
      write_text_durably((root / "latest.tmp").string(), name + "\n");
      rename_durably((root / "latest.tmp").string(), (root / "latest").string());
      std::fprintf(stderr, "origami: %s: a save interrupted while being committed, completed\n", done.c_str());
    }
  }
  fs::remove(journal, ec);
}

}  // namespace

void remove_partial_checkpoints(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return;
  finish_commit(dir);
  fs::remove(dir + "/latest.tmp", ec);
  // step-NNNNNNNN.tmp (a save, or the old copy a swap left),
  // step-NNNNNNNN.replaced-<pid>-<n>.tmp (what a save moved aside,
  // publish_step_dir) and step-NNNNNNNN.stale-<pid>-<n>.tmp (a partial one
  // that would not go, below).
  std::vector<fs::path> partial;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (e.is_directory() && n.ends_with(".tmp") && step_of(n.substr(0, n.find('.'))) >= 0) partial.push_back(e.path());
  }
  // Plain .tmp first, then what a swap moved aside: a complete copy whose
  // step directory is missing (a kill before its rename, or between the two
  // renames of a swap without RENAME_EXCHANGE) is put in place, not thrown
  // away. `latest` is the journal's to move, never a guess from step
  // numbers (a rollback's abandoned steps are higher).
  const auto plain = [](const fs::path& p) { return p.stem().extension().empty(); };
  std::sort(partial.begin(), partial.end(), [&](const fs::path& a, const fs::path& b) {
    return plain(a) != plain(b) ? plain(a) : a < b;
  });
  std::vector<fs::path> removable;
  for (const fs::path& p : partial) {
    const std::string n = p.filename().string();
    const fs::path done = p.parent_path() / n.substr(0, n.find('.'));
    if (n.find(".stale-") != std::string::npos || fs::exists(done, ec) || !save_mark(p)) {
      removable.push_back(p);
      continue;
    }
    if (::rename(p.c_str(), done.c_str()) != 0)
      ORIGAMI_USER_ERROR(p.string(), ": a complete save that a kill stopped before its rename, and it cannot be put in "
                         "place: ", std::strerror(errno));
    sync_dir(dir);
    std::fprintf(stderr, "origami: %s: a complete save interrupted before its rename, put in place\n", done.c_str());
  }
  // What will not go (a file an NFS reader holds open) is moved aside under
  // a name of its own, so the next save of that step starts in an empty
  // directory, and said; a later start tries it again.
  for (const fs::path& p : removable) {
    remove_save(p, ec);
    if (!ec) continue;
    const std::string n = p.filename().string();
    std::string aside;
    if (n.find(".stale-") == std::string::npos)
      for (int k = 0; k < 1000; ++k) {
        const std::string candidate = dir + "/" + n.substr(0, n.find('.')) + ".stale-" + std::to_string(::getpid()) +
                                      "-" + std::to_string(k) + ".tmp";
        if (::rename(p.c_str(), candidate.c_str()) == 0) {
          aside = candidate;
          break;
        }
        if (errno != EEXIST && errno != ENOTEMPTY) break;
      }
    std::fprintf(stderr, "origami: warning: %s: cannot remove a partial save (%s)%s\n", p.c_str(), ec.message().c_str(),
                 aside.empty() ? "; left in place" : ("; moved aside as " + aside).c_str());
  }
}


}  // namespace origami

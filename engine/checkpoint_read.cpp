// Reading sharded checkpoints (see checkpoint.h): metadata.json checked key
// by key, the files' digests, and each rank's held state filled from the
// pieces that overlap it, whatever layout wrote them.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <utility>
#include <nlohmann/json.hpp>

#include "comm/agreement.h"
#include "engine/checkpoint.h"
#include "engine/checkpoint_format.h"
#include "engine/export.h"
#include "engine/files.h"
#include "engine/optimizer.h"
#include "engine/plan.h"
#include "engine/preflight.h"
#include "engine/safetensors.h"

namespace origami {

namespace fs = std::filesystem;
using namespace checkpoint_format;

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
  const int64_t rank = m.integer(s, "rank", where);
  if (rank < 0 || rank >= world) m.bad(where + ".rank", "outside the saving world of " + std::to_string(world));
  out.rank = static_cast<int>(rank);
  const std::vector<int64_t> offsets = m.ints(s, "saved_offsets", where);
  out.slice_shape = m.ints(s, "slice_shape", where);
  const std::vector<int64_t> range = m.ints(s, "flat_range", where);
  if (offsets.size() != global.size() || out.slice_shape.size() != global.size())
    m.bad(where, "saved_offsets and slice_shape need one entry per dimension of " + shape_string(global));
  for (size_t d = 0; d < global.size(); ++d) {
    if (out.slice_shape[d] > global[d] || offsets[d] > global[d] - out.slice_shape[d])  // no overflow: all >= 0
      m.bad(where, "the slice exceeds the global shape " + shape_string(global));
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

// The shards of one tensor tile its global elements exactly once: each
// shard's flat range, mapped into the global row-major order (pieces of
// slice_shape[d]·inner contiguous elements when it slices dimension d), and
// the pieces of all shards sorted, run from 0 to the tensor's size without
// a gap or an overlap. (Reading counts each rank's copied elements; an
// overlap beside a hole of the same size would pass that count.)
void check_tiling(const MetaReader& m, const SavedTensor& t, const std::string& where) {
  const int64_t numel = shape_numel(t.global_shape);  // below 2^53: checked before the shards were parsed
  constexpr size_t kMaxPieces = size_t{1} << 24;  // a real model's tensors need far fewer
  std::vector<std::pair<int64_t, int64_t>> pieces;  // [begin, end) in the global order
  for (const SavedShard& s : t.shards) {
    if (s.begin == s.end) continue;
    if (s.slice_dim < 0) {
      pieces.emplace_back(s.begin, s.end);
      continue;
    }
    const size_t d = static_cast<size_t>(s.slice_dim);
    int64_t inner = 1;
    for (size_t i = d + 1; i < t.global_shape.size(); ++i) inner *= t.global_shape[i];
    const int64_t run = s.slice_shape[d] * inner, row = t.global_shape[d] * inner;  // run > 0: s.end > s.begin
    for (int64_t at = s.begin; at < s.end;) {
      const int64_t outer = at / run, within = at % run, take = std::min(run - within, s.end - at);
      const int64_t global_at = outer * row + s.slice_start * inner + within;
      pieces.emplace_back(global_at, global_at + take);
      if (pieces.size() > kMaxPieces) m.bad(where + ".shards", "split into more than 2^24 pieces");
      at += take;
    }
  }
  std::sort(pieces.begin(), pieces.end());
  const std::string rule = " (rule: the shards hold every element exactly once)";
  int64_t next = 0;
  for (const auto& [begin, end] : pieces) {
    if (begin < next) m.bad(where + ".shards", "hold element " + std::to_string(begin) + " twice" + rule);
    if (begin > next)
      m.bad(where + ".shards", "hold none of elements " + std::to_string(next) + ".." + std::to_string(begin - 1) + rule);
    next = end;
  }
  if (next != numel)
    m.bad(where + ".shards", "cover " + std::to_string(next) + " of the " + std::to_string(numel) +
                                 " elements (rule: the shards hold every element exactly once)");
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

// A user who names a checkpoint.dir, or its `latest` file, where a step
// directory belongs: the step `latest` names, as " (... DIR/step-N)", or "".
std::string latest_hint(const fs::path& latest_file, const char* what) {
  std::error_code ec;
  if (!fs::is_regular_file(latest_file, ec)) return "";
  std::ifstream in(latest_file);
  std::string name;
  std::getline(in, name);
  while (!name.empty() && (name.back() == ' ' || name.back() == '\r')) name.pop_back();
  if (name.rfind("step-", 0) != 0 || name.size() > 64) return "";
  return std::string(" (") + what + ": name one of its steps, as `latest` does: " +
         (latest_file.parent_path() / name).string() + ")";
}

}  // namespace

CheckpointInfo read_checkpoint_info(const std::string& step_dir) {
  CheckpointInfo info;
  info.dir = step_dir;
  const std::string path = step_dir + "/metadata.json";
  if (std::error_code ec; !fs::is_directory(step_dir, ec))
    ORIGAMI_USER_ERROR(step_dir, ": no such checkpoint directory",
                       fs::exists(step_dir, ec) ? " (it is a file)" : "", " (rule: a step directory, step-NNNNNNNN)",
                       fs::path(step_dir).filename() == "latest" ? latest_hint(step_dir, "a checkpoint.dir's latest file")
                                                                 : "");
  if (!fs::exists(path))
    ORIGAMI_USER_ERROR(path, ": missing (rule: a checkpoint is complete only once rank 0 wrote metadata.json, "
                             "after every rank's files; this directory is an unfinished save or not a checkpoint)",
                       latest_hint(fs::path(step_dir) / "latest", "this is a checkpoint.dir"));
  const std::string text = InputFile(path, "checkpoint metadata").read_all(int64_t{1} << 31);
  info.metadata_xxh3 = digest_of(text.data(), static_cast<int64_t>(text.size()));
  nlohmann::ordered_json j;
  try {
    j = nlohmann::ordered_json::parse(text);
  } catch (const nlohmann::ordered_json::exception& e) {
    ORIGAMI_USER_ERROR(path, ": not valid JSON: ", e.what());
  }
  const MetaReader m{path};
  if (m.text(j, "format") != kFormat) m.bad("format", std::string("must be \"") + kFormat + "\"");
  if (m.integer(j, "version") != kFormatVersion)
    m.bad("version", "this build reads version " + std::to_string(kFormatVersion));
  info.step = m.integer(j, "step");
  info.save_id = j.contains("save_id") && j["save_id"].is_string() ? j["save_id"].get<std::string>() : "";
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
  const std::pair<const char*, int64_t> sizes[] = {{"tp", info.tp}, {"cp", info.cp},   {"pp", info.pp},  {"ep", info.ep},
                                                   {"etp", info.etp}, {"dp", info.dp}, {"edp", info.edp}};
  for (const auto& [key, size] : sizes)
    if (size < 1 || size > info.world)
      m.bad(std::string("layout.") + key, "must be in 1..layout.world (" + std::to_string(info.world) + "), got " +
                                             std::to_string(size));
  if (info.tp * info.cp * info.dp * info.pp != info.world || info.etp * info.ep * info.edp * info.pp != info.world)
    m.bad("layout", "tp·cp·dp·pp and etp·ep·edp·pp must both equal world (" + std::to_string(info.world) + ")");
  if (info.zero_stage < 0 || info.zero_stage > 3)
    m.bad("layout.zero_stage", "must be in 0..3, got " + std::to_string(info.zero_stage));
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
  const int64_t seed = m.integer(train, "seed", "train");
  if (seed < 0) m.bad("train.seed", "must be in 0..2^63 - 1 (training.seed's range), got " + std::to_string(seed));
  info.train.seed = static_cast<uint64_t>(seed);
  const nlohmann::ordered_json& shuffle = m.at(train, "shuffle", "train");
  if (!shuffle.is_boolean()) m.bad("train.shuffle", "must be true or false");
  info.train.shuffle = shuffle.get<bool>();
  if (info.train.step != info.step) m.bad("train.step", "differs from step");
  // Counts of steps and samples: a resumed run computes sample indices from
  // them (consumed_samples + steps · global_batch), so far below 2^63.
  constexpr int64_t kMaxCount = int64_t{1} << 53;
  const std::pair<const char*, int64_t> counts[] = {{"step", info.step},
                                                    {"train.consumed_samples", info.train.consumed_samples},
                                                    {"train.windows_per_epoch", info.train.windows_per_epoch}};
  for (const auto& [key, value] : counts)
    if (value < 0 || value > kMaxCount) m.bad(key, "must be in 0..2^53, got " + std::to_string(value));
  info.config = m.text(j, "config");
  const nlohmann::ordered_json& files = m.at(j, "files", "");
  if (!files.is_array()) m.bad("files", "must be an array");
  for (size_t i = 0; i < files.size(); ++i) {
    const std::string where = "files[" + std::to_string(i) + "]";
    SavedFile f;
    f.name = m.text(files[i], "name", where);
    const int64_t rank = m.integer(files[i], "rank", where);
    f.bytes = m.integer(files[i], "bytes", where);
    if (f.bytes < 0) m.bad(where + ".bytes", "must be >= 0, got " + std::to_string(f.bytes));
    const std::string hex = m.text(files[i], "xxh3", where);
    if (hex.size() != 16 || hex.find_first_not_of("0123456789abcdef") != std::string::npos)
      m.bad(where + ".xxh3", "must be 16 hex digits");
    f.xxh3 = std::stoull(hex, nullptr, 16);
    if (f.name.find('/') != std::string::npos) m.bad(where + ".name", "must be a file name in the directory");
    if (rank < 0 || rank >= info.world)
      m.bad(where + ".rank", "must be in 0..layout.world - 1 = " + std::to_string(info.world - 1) + ", got " +
                                 std::to_string(rank));
    f.rank = static_cast<int>(rank);
    if (f.name != rank_file(f.rank, false) && f.name != rank_file(f.rank, true))
      m.bad(where + ".name", "\"" + shorten(f.name) + "\" is not one of rank " + std::to_string(f.rank) + "'s files (" +
                                 rank_file(f.rank, false) + ", " + rank_file(f.rank, true) + ")");
    for (const SavedFile& earlier : info.files)
      if (earlier.name == f.name) m.bad(where + ".name", "\"" + shorten(f.name) + "\" is listed twice");
    info.files.push_back(std::move(f));
  }
  // Every rank writes its two files at every save: listed once each, all of them.
  if (static_cast<int64_t>(info.files.size()) != 2 * info.world)
    m.bad("files", "lists " + std::to_string(info.files.size()) + " files; a save of " + std::to_string(info.world) +
                       " rank(s) writes " + std::to_string(2 * info.world) + " (each rank's model and optimizer file)");
  const nlohmann::ordered_json& tensors = m.at(j, "tensors", "");
  if (!tensors.is_object()) m.bad("tensors", "must be an object");
  for (const auto& [name, t] : tensors.items()) {
    const std::string where = "tensors." + name;
    SavedTensor st;
    st.global_shape = m.ints(t, "shape", where);
    int64_t numel = 1;
    for (int64_t n : st.global_shape)
      if (!checked_mul(numel, n, &numel) || numel > (int64_t{1} << 53))
        m.bad(where + ".shape", "has more than 2^53 elements: " + shape_string(st.global_shape));
    st.state = t.contains("state") && t["state"].is_boolean() && t["state"].get<bool>();
    const nlohmann::ordered_json& shards = m.at(t, "shards", where);
    if (!shards.is_array()) m.bad(where + ".shards", "must be an array");
    for (size_t i = 0; i < shards.size(); ++i)
      st.shards.push_back(parse_shard(m, shards[i], where + ".shards[" + std::to_string(i) + "]", st.global_shape, info.world));
    check_tiling(m, st, where);
    info.order_of_tensors.push_back(name);
    info.tensors.emplace(name, std::move(st));
  }
  // Exactly the tensors of the model the config describes (export and
  // loading look tensors up by the model's names: an extra one would be
  // ignored silently).
  // The config text is not covered by any digest either: it must parse, and
  // name the model shape recorded beside it (export writes config.json from it).
  const Config saved = parse_config(info.config, path + " (config)");
  for (const auto& [key, value] : shape_keys(saved)) {
    const auto it = info.model.find(key);  // the JSON key is the config key
    if (it == info.model.end()) m.bad("model." + key, "missing");
    if (it->second != value)
      m.bad("config", "its " + key + " = " + std::to_string(value) + " differs from the " + std::to_string(it->second) +
                          " recorded under \"model\"");
  }
  // The layout and the training state beside it are the saved config's:
  // the layout's sizes and its stages' layers (which unit each rank saved),
  // the schedule's learning rate at this step, the data position's epoch.
  const ParallelConfig& par = saved.parallel;
  const std::pair<const char*, std::pair<int64_t, int64_t>> same[] = {
      {"tp", {info.tp, par.tp}}, {"cp", {info.cp, par.cp}}, {"pp", {info.pp, par.pp}}, {"ep", {info.ep, par.ep}},
      {"etp", {info.etp, par.etp}}, {"zero_stage", {info.zero_stage, par.zero_stage}}};
  for (const auto& [key, v] : same)
    if (v.first != v.second)
      m.bad(std::string("layout.") + key, std::to_string(v.first) + " differs from the config's parallel." + key +
                                              " = " + std::to_string(v.second));
  if (info.order != par.order)
    m.bad("layout.order",
          "\"" + shorten(info.order) + "\" differs from the config's parallel.order = \"" + par.order + "\"");
  const std::vector<int64_t> stages =
      plan::stage_layers(saved.model.num_layers, par.pp * par.virtual_stages, par.pp_layers);
  if (info.stage_layers != stages)
    m.bad("layout.stage_layers", shape_string(info.stage_layers) + " differs from the config's stages " +
                                     shape_string(stages) + " (model.num_layers, parallel.pp, pp_layers, virtual_stages)");
  // Within 1e-9 of the peak rate, not of this step's: near a cosine's end,
  // where 1 + cos(πp) is tiny, another libm's last bit of cos is a large
  // share of the rate (a save on x86 resumed on aarch64).
  const double scheduled = learning_rate(saved.optimizer, saved.lr_schedule, saved.training.steps, info.step);
  const double peak_lr = std::max(std::abs(saved.optimizer.lr), std::abs(saved.lr_schedule.min_lr));
  if (!(std::abs(info.train.lr - scheduled) <= 1e-9 * peak_lr))
    m.bad("train.lr",
          detail::concat(info.train.lr, " differs from the config's schedule at step ", info.step, ": ", scheduled));
  const int64_t windows = info.train.windows_per_epoch, consumed = info.train.consumed_samples;
  for (const auto& [key, value] : {std::pair<const char*, int64_t>{"epoch", windows > 0 ? consumed / windows : 0},
                                   {"epoch_offset", windows > 0 ? consumed % windows : 0}})
    if (train.contains(key) && m.integer(train, key, "train") != value)
      m.bad(std::string("train.") + key, detail::concat(m.integer(train, key, "train"), " differs from ", value,
                                                        ", what consumed_samples and windows_per_epoch give"));
  const std::vector<std::string> names = export_tensor_order(UnitTable(saved.model, saved.moe), saved.model, saved.moe);
  const std::set<std::string> expected(names.begin(), names.end());
  for (const std::string& name : info.order_of_tensors)
    if (!expected.count(name)) m.bad("tensors." + name, "is not a tensor of the model its config describes");
  for (const std::string& name : names)
    if (!info.tensors.count(name)) m.bad("tensors", "has no '" + name + "', a tensor of the model its config describes");
  return info;
}

namespace {
void check_size(const std::string& path, int64_t bytes, const CheckpointInfo& info, const SavedFile& f) {
  if (bytes != f.bytes)
    ORIGAMI_USER_ERROR(path, ": ", bytes, " bytes, but ", info.dir, "/metadata.json records ", f.bytes,
                       " (the file was truncated or replaced after the save)");
}
std::string existing(const CheckpointInfo& info, const SavedFile& f) {
  const std::string path = info.dir + "/" + f.name;
  if (std::error_code ec; !fs::exists(path, ec))
    ORIGAMI_USER_ERROR(path, ": missing (", info.dir, "/metadata.json lists it with ", f.bytes, " bytes)");
  return path;
}
}  // namespace

void check_checkpoint_file_sizes(const CheckpointInfo& info) {
  for (const SavedFile& f : info.files) {
    const std::string path = existing(info, f);
    std::error_code ec;
    const auto bytes = fs::file_size(path, ec);
    if (ec) ORIGAMI_USER_ERROR(path, ": cannot read its size: ", ec.message());
    check_size(path, static_cast<int64_t>(bytes), info, f);
  }
}

void verify_checkpoint_files(const CheckpointInfo& info, int rank, int ranks) {
  for (size_t i = 0; i < info.files.size(); ++i) {
    if (static_cast<int>(i % static_cast<size_t>(ranks)) != rank) continue;
    const SavedFile& f = info.files[i];
    const std::string path = existing(info, f);
    const MappedFile map(path, "checkpoint shard");
    check_size(path, map.size(), info, f);
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
    // A step directory renamed by hand: the name would say one step and
    // the run resume at another (and `latest`-less resolution, newest by
    // name, pick it over a later save).
    if (const int64_t named = step_of(fs::path(step_dir).filename().string()); named >= 0 && named != info.step)
      ORIGAMI_USER_ERROR(step_dir, ": named for step ", named, ", but its metadata.json holds step ", info.step,
                         " (rule: a step directory keeps the name its save gave it, step_dir_name(step); renamed by "
                         "hand?)");
    check_model_shape(info, cfg);
    verify_checkpoint_files(info, groups.world_rank(), world.size());
  }, io_meeting_wait(cfg));
  // Each rank resolved checkpoint.load on its own file system view: copies
  // per node are fine, different saves are not (each rank would continue
  // its own run, or wait at a step the others never reach). metadata.json
  // lists every file's digest, so equal metadata is one save.
  check_same_lines(world,
                   detail::concat("checkpoint.step = ", info.step, "\ncheckpoint.save_id = ", info.save_id,
                                  "\ncheckpoint.metadata_xxh3 = ", digest_hex(info.metadata_xxh3), "\n"),
                   "the ranks of this job resolved checkpoint.load to different checkpoints (rule: every rank loads "
                   "one save: checkpoint.load names the same checkpoint on every rank, e.g. a path on a file "
                   "system every node mounts; a relative path resolves against each rank's working directory)");
  comm::run_agreed(world, [&] {
    CheckpointReader reader(info);
    fill_held_state(model, groups, /*with_moments=*/true,
                    [&](const std::string& name, const std::string& moment, const SliceRange& range, float* dst) {
                      reader.read(name, moment, range, dst);
                    });
  }, io_meeting_wait(cfg));
  info.train.config = info.config;
  return info.train;
}

}  // namespace origami

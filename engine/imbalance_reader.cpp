// Streaming metrics.jsonl into imbalance statistics (see imbalance.h). The
// file is read in blocks into one padded buffer (simdjson needs
// SIMDJSON_PADDING readable bytes past each document); each complete line is
// parsed on demand, fields in file order, and only the fields the report
// needs are touched. What is kept per step is a handful of numbers per
// layer; the heatmap's bins merge pairwise when they run out, so their
// memory is fixed whatever the step count.
#include <simdjson.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <numeric>
#include <toml++/toml.h>

#include "engine/config.h"
#include "engine/files.h"
#include "engine/imbalance.h"
#include "kernels/check.h"

namespace origami::imbalance {

namespace {

namespace od = simdjson::ondemand;

// The numbers of one layer in one record.
struct LayerStep {
  int64_t layer = -1;
  std::vector<int64_t> routed, kept, ep;
};

struct StepRecord {
  int64_t step = -1;
  int64_t tokens = 0;
  double step_time_s = 0, gflops = 0, aux_loss = 0, lm_loss = 0;
  double ep_bytes = 0, ep_a2a_s = 0;  // comm_bytes.ep, comm_a2a_s.ep
  bool has_a2a = false;
  std::vector<LayerStep> moe;
  size_t moe_count = 0;  // entries of moe used this record (the vectors are reused)
};

// Max over mean of a vector of loads, and (max − mean); NaN when empty of tokens.
std::pair<double, double> max_over_mean(const int64_t* v, size_t n) {
  int64_t sum = 0, mx = 0;
  for (size_t i = 0; i < n; ++i) sum += v[i], mx = std::max(mx, v[i]);
  if (sum == 0) return {std::nan(""), 0.0};
  const double mean = static_cast<double>(sum) / static_cast<double>(n);
  return {static_cast<double>(mx) / mean, static_cast<double>(mx) - mean};
}

// Per layer, everything streamed from the selected steps.
struct LayerAcc {
  int64_t layer = 0, experts = 0, ep = 0;
  std::vector<int64_t> routed, kept, ep_tokens, what_if_tokens;
  std::vector<double> vio, ep_mom, ep_excess, what_if_mom, what_if_excess, dropped;  // per selected step
  // Heatmap: routed loads summed per bin of `bin_width` selected steps.
  int64_t bin_width = 1;
  std::vector<std::vector<int64_t>> bins;
};

class RunReader {
 public:
  RunReader(std::string path, const Options& opt) : path_(std::move(path)), opt_(opt) {}

  RunReport read();

 private:
  [[noreturn]] void fail(int64_t line, const std::string& what) const {
    ORIGAMI_USER_ERROR(path_, ":", line, ": ", what);
  }
  // False when the record's step is outside the selection (the rest unread).
  bool parse(od::document& doc, int64_t line, StepRecord& rec);
  void parse_layer(od::object obj, int64_t line, LayerStep& ls);
  void add(const StepRecord& rec, int64_t line);
  void add_to_heat(LayerAcc& a, const LayerStep& ls);
  void check_shape(const RunShape& shape) const;

  std::string path_;
  const Options& opt_;
  // The field being read and the rule for it, for a value of the wrong type
  // (simdjson's own message names neither); null between fields.
  const char* field_ = nullptr;
  int64_t records_ = 0, last_seen_step_ = -1, selected_ = 0;
  std::vector<int64_t> steps_;
  std::vector<double> step_time_, gflops_, aux_, lm_;
  double ep_bytes_ = 0, ep_a2a_s_ = 0;
  bool all_a2a_ = true;
  std::vector<LayerAcc> layers_;
  int64_t top_k_ = 0;  // slots per token in the first MoE record
};

std::vector<int64_t>& read_ints(od::array arr, std::vector<int64_t>& out) {
  out.clear();
  for (auto v : arr) out.push_back(v.get_int64().value());
  return out;
}

// "step" and "layer" before their key is read: told apart from a negative value.
constexpr int64_t kAbsent = std::numeric_limits<int64_t>::min();
// A layer's counts in one record sum to at most this (a real step routes
// ~2^30 tokens at the most), so sums over experts and steps stay far from
// int64's range.
constexpr int64_t kMaxLayerTokens = int64_t{1} << 40;

void RunReader::parse_layer(od::object obj, int64_t line, LayerStep& ls) {
  ls.layer = kAbsent;
  ls.routed.clear(), ls.kept.clear(), ls.ep.clear();
  for (auto field : obj) {
    field_ = nullptr;
    const std::string_view key = field.unescaped_key().value();
    if (key == "layer") {
      field_ = "a moe entry's \"layer\" must be an integer";
      ls.layer = field.value().get_int64().value();
    } else if (key == "tokens_per_expert") {
      field_ = "a moe entry's \"tokens_per_expert\" must be an array of integers";
      read_ints(field.value().get_array().value(), ls.routed);
    } else if (key == "kept_per_expert") {
      field_ = "a moe entry's \"kept_per_expert\" must be an array of integers";
      read_ints(field.value().get_array().value(), ls.kept);
    } else if (key == "tokens_per_ep_rank") {
      field_ = "a moe entry's \"tokens_per_ep_rank\" must be an array of integers";
      read_ints(field.value().get_array().value(), ls.ep);
    }
  }
  field_ = nullptr;
  if (ls.layer == kAbsent) fail(line, "a moe entry without \"layer\"");
  if (ls.layer < 0) fail(line, "a moe entry's \"layer\" is " + std::to_string(ls.layer) + " (rule: >= 0)");
  if (ls.routed.empty()) fail(line, "moe layer " + std::to_string(ls.layer) + " has no tokens_per_expert");
  if (ls.kept.empty()) ls.kept = ls.routed;  // dropless records may omit it
  if (ls.kept.size() != ls.routed.size())
    fail(line, "moe layer " + std::to_string(ls.layer) + ": kept_per_expert has " + std::to_string(ls.kept.size()) +
                   " entries, tokens_per_expert " + std::to_string(ls.routed.size()));
  int64_t routed_sum = 0;
  for (size_t e = 0; e < ls.routed.size(); ++e) {
    if (ls.routed[e] < 0 || ls.kept[e] < 0 || ls.kept[e] > ls.routed[e])
      fail(line, "moe layer " + std::to_string(ls.layer) + " expert " + std::to_string(e) + ": routed " +
                     std::to_string(ls.routed[e]) + ", kept " + std::to_string(ls.kept[e]) +
                     " (counts must be >= 0 and kept <= routed)");
    if (ls.routed[e] > kMaxLayerTokens - routed_sum)
      fail(line, "moe layer " + std::to_string(ls.layer) + ": tokens_per_expert sums past 2^40 at expert " +
                     std::to_string(e) + " (rule: a step routes at most 2^40 tokens in a layer)");
    routed_sum += ls.routed[e];
  }
}

bool RunReader::parse(od::document& doc, int64_t line, StepRecord& rec) {
  rec.step = kAbsent;
  rec.tokens = 0;
  rec.step_time_s = rec.gflops = rec.aux_loss = rec.lm_loss = rec.ep_bytes = rec.ep_a2a_s = 0;
  rec.has_a2a = false;
  rec.moe_count = 0;
  field_ = "the record must be a JSON object";
  od::object obj = doc.get_object().value();
  for (auto field : obj) {
    field_ = nullptr;
    const std::string_view key = field.unescaped_key().value();
    if (key == "step") {
      field_ = "\"step\" must be an integer";
      rec.step = field.value().get_int64().value();
      // Outside the selection: the rest of the record is not needed.
      if ((opt_.first_step && rec.step < *opt_.first_step) || (opt_.last_step && rec.step > *opt_.last_step))
        return false;
    } else if (key == "tokens") {
      field_ = "\"tokens\" must be an integer";
      rec.tokens = field.value().get_int64().value();
    } else if (key == "step_time_s") {
      field_ = "\"step_time_s\" must be a number";
      rec.step_time_s = field.value().get_double().value();
    } else if (key == "gflops") {
      field_ = "\"gflops\" must be a number";
      rec.gflops = field.value().get_double().value();
    } else if (key == "lm_loss") {
      field_ = "\"lm_loss\" must be a number";
      rec.lm_loss = field.value().get_double().value();
    } else if (key == "aux_loss") {
      field_ = "\"aux_loss\" must be a number";
      rec.aux_loss = field.value().get_double().value();
    } else if (key == "comm_bytes") {
      field_ = "\"comm_bytes\" must be an object of numbers by group";
      for (auto g : field.value().get_object().value())
        if (g.unescaped_key().value() == "ep") rec.ep_bytes = g.value().get_double().value();
    } else if (key == "comm_a2a_s") {
      field_ = "\"comm_a2a_s\" must be an object of numbers by group";
      for (auto g : field.value().get_object().value())
        if (g.unescaped_key().value() == "ep") rec.ep_a2a_s = g.value().get_double().value(), rec.has_a2a = true;
    } else if (key == "moe") {
      field_ = "\"moe\" must be an array of objects";
      for (auto entry : field.value().get_array().value()) {
        if (rec.moe_count == rec.moe.size()) rec.moe.emplace_back();
        field_ = "a \"moe\" entry must be an object";
        parse_layer(entry.get_object().value(), line, rec.moe[rec.moe_count++]);
      }
    }
  }
  field_ = nullptr;
  return true;
}

void RunReader::add_to_heat(LayerAcc& a, const LayerStep& ls) {
  const int64_t i = static_cast<int64_t>(a.vio.size()) - 1;  // this step's index in the selection
  int64_t b = i / a.bin_width;
  if (b >= opt_.heatmap_bins) {  // out of bins: pairs merge, bins twice as wide
    std::vector<std::vector<int64_t>> merged((a.bins.size() + 1) / 2, std::vector<int64_t>(a.experts, 0));
    for (size_t j = 0; j < a.bins.size(); ++j)
      for (int64_t e = 0; e < a.experts; ++e) merged[j / 2][e] += a.bins[j][e];
    a.bins = std::move(merged);
    a.bin_width *= 2;
    b = i / a.bin_width;
  }
  if (b == static_cast<int64_t>(a.bins.size())) a.bins.emplace_back(a.experts, 0);
  for (int64_t e = 0; e < a.experts; ++e) a.bins[b][e] += ls.routed[e];
}

void RunReader::add(const StepRecord& rec, int64_t line) {
  if (rec.moe_count == 0) return;  // a dense record (or a dense model: reported at the end)
  const bool first = layers_.empty();
  if (!first && rec.moe_count != layers_.size())
    fail(line, "step " + std::to_string(rec.step) + " has " + std::to_string(rec.moe_count) +
                   " MoE layers, earlier records " + std::to_string(layers_.size()));
  for (size_t l = 0; l < rec.moe_count; ++l) {
    const LayerStep& ls = rec.moe[l];
    if (first) {
      LayerAcc a;
      a.layer = ls.layer;
      a.experts = static_cast<int64_t>(ls.routed.size());
      a.ep = std::max<int64_t>(1, static_cast<int64_t>(ls.ep.size()));
      a.routed.assign(a.experts, 0), a.kept.assign(a.experts, 0), a.ep_tokens.assign(a.ep, 0);
      if (opt_.what_if_ep > 0) {
        if (a.experts % opt_.what_if_ep != 0)
          ORIGAMI_USER_ERROR("--ep ", opt_.what_if_ep, " does not divide layer ", a.layer, "'s ", a.experts,
                             " experts (", path_, ")");
        a.what_if_tokens.assign(opt_.what_if_ep, 0);
      }
      layers_.push_back(std::move(a));
      if (l == 0 && rec.tokens > 0)
        top_k_ = std::llround(static_cast<double>(std::accumulate(ls.routed.begin(), ls.routed.end(), int64_t{0})) /
                              static_cast<double>(rec.tokens));
    }
    LayerAcc& a = layers_[l];
    if (ls.layer != a.layer || static_cast<int64_t>(ls.routed.size()) != a.experts ||
        std::max<int64_t>(1, static_cast<int64_t>(ls.ep.size())) != a.ep) {
      std::string msg = "moe entry " + std::to_string(l) + " is layer " + std::to_string(ls.layer) + " with " +
                        std::to_string(ls.routed.size()) + " experts over " + std::to_string(ls.ep.size()) +
                        " EP ranks; earlier records have layer " + std::to_string(a.layer) + " with " +
                        std::to_string(a.experts) + " over " + std::to_string(a.ep);
      // Only the EP size changed: a resume under another layout, whose
      // parts each read alone.
      if (ls.layer == a.layer && static_cast<int64_t>(ls.routed.size()) == a.experts && steps_.size() >= 2)
        msg += " (the run changed its EP size at step " + std::to_string(rec.step) +
               ", a resume under another layout?: read each part alone, --steps " + std::to_string(steps_.front()) +
               ":" + std::to_string(steps_[steps_.size() - 2]) + " and --steps " + std::to_string(rec.step) + ":)";
      fail(line, msg);
    }
    int64_t routed = 0, kept = 0;
    for (int64_t e = 0; e < a.experts; ++e) {
      a.routed[e] += ls.routed[e], a.kept[e] += ls.kept[e];
      routed += ls.routed[e], kept += ls.kept[e];
    }
    a.vio.push_back(max_over_mean(ls.routed.data(), ls.routed.size()).first - 1.0);
    a.dropped.push_back(routed > 0 ? static_cast<double>(routed - kept) / static_cast<double>(routed) : 0.0);
    // The run's own EP ranks, as measured (one rank: its kept tokens).
    const std::vector<int64_t> one{kept};
    const std::vector<int64_t>& q = ls.ep.empty() ? one : ls.ep;
    for (int64_t p = 0; p < a.ep; ++p) a.ep_tokens[p] += q[p];
    const auto [mom, excess] = max_over_mean(q.data(), q.size());
    a.ep_mom.push_back(mom), a.ep_excess.push_back(excess);
    if (opt_.what_if_ep > 0) {
      const int64_t P = opt_.what_if_ep, per = a.experts / P;
      std::vector<int64_t> w(P, 0);
      for (int64_t e = 0; e < a.experts; ++e) w[e / per] += ls.kept[e];
      for (int64_t p = 0; p < P; ++p) a.what_if_tokens[p] += w[p];
      const auto [wm, wx] = max_over_mean(w.data(), w.size());
      a.what_if_mom.push_back(wm), a.what_if_excess.push_back(wx);
    }
    add_to_heat(a, ls);
  }
}

// Means of the defined (non-NaN) values.
double nan_mean(const std::vector<double>& v, size_t begin, size_t end) {
  double s = 0;
  int64_t n = 0;
  for (size_t i = begin; i < end; ++i)
    if (!std::isnan(v[i])) s += v[i], ++n;
  return n ? s / static_cast<double>(n) : 0.0;
}

EpBalance balance(const std::vector<int64_t>& tokens, const std::vector<double>& mom,
                  const std::vector<double>& excess) {
  EpBalance b;
  b.ranks = static_cast<int64_t>(tokens.size());
  b.rank_tokens = tokens;
  const double m = max_over_mean(tokens.data(), tokens.size()).first;
  b.max_over_mean = std::isnan(m) ? 0.0 : m;
  b.step_max_over_mean = nan_mean(mom, 0, mom.size());
  b.excess_tokens = nan_mean(excess, 0, excess.size());
  return b;
}

// The per-step values thinned to the heatmap's bins.
Series thin(const std::vector<double>& v, const std::vector<int64_t>& steps, int64_t width) {
  Series s;
  for (size_t b = 0; b * width < v.size(); ++b) {
    const size_t lo = b * width, hi = std::min(v.size(), lo + width);
    s.first.push_back(steps[lo]);
    s.last.push_back(steps[hi - 1]);
    s.value.push_back(nan_mean(v, lo, hi));
  }
  return s;
}

RunShape read_shape(const std::filesystem::path& dir) {
  RunShape s;
  const std::filesystem::path file = dir / "config.toml";
  if (!std::filesystem::exists(file)) return s;
  // The config's own loader: every rule a run's config obeys holds here too
  // (a file edited since the run gets the loader's messages, naming the file
  // and key), and the placement comes out resolved.
  const Config cfg = load_config(file.string());
  s.known = true;
  s.num_experts = cfg.moe.router.num_experts;
  s.num_layers = cfg.model.num_layers;
  s.is_moe_layer = [moe = cfg.moe](int64_t l) { return moe.is_moe_layer(l); };
  s.hidden_size = cfg.model.hidden_size;
  s.expert_ffn = cfg.moe.expert_ffn(cfg.model.ffn_hidden_size);
  s.top_k = cfg.moe.router.top_k;
  s.etp = cfg.parallel.etp;
  s.ep = cfg.parallel.ep;
  s.load_balancing = std::string(load_balancing_name(cfg.moe.router.load_balancing));
  s.expert_bias = cfg.moe.expert_bias;
  for (const auto& [layer, placed] : cfg.moe.expert_placement.layers) {
    std::vector<std::vector<int64_t>> ranks;
    for (int64_t r = 0; r < placed.ep(); ++r) ranks.push_back(placed.local_experts(r));
    s.placement.emplace_back(layer, std::move(ranks));
  }
  return s;
}

// The config beside the metrics describes the run that wrote them: its
// estimates (time, top-k, load balancing) are refused for records of
// another model shape (a config edited or copied since; a resume keeps the
// shape, its EP size may change, see read()).
void RunReader::check_shape(const RunShape& shape) const {
  const std::string config = (std::filesystem::path(path_).parent_path() / "config.toml").string();
  auto refuse = [&](const std::string& what) {
    ORIGAMI_USER_ERROR(config, ": ", what, " (rule: the config.toml beside metrics.jsonl is the one of the run that "
                       "wrote it; move or remove a config edited or copied since)");
  };
  for (const LayerAcc& a : layers_) {
    if (a.layer >= shape.num_layers || !shape.is_moe_layer(a.layer))
      refuse(detail::concat(path_, " records MoE layer ", a.layer, ", which is not a MoE layer of this config (",
                            shape.num_layers, " layers)"));
    if (a.experts != shape.num_experts)
      refuse(detail::concat("moe.num_experts = ", shape.num_experts, ", but ", path_, " records ", a.experts,
                            " experts in layer ", a.layer));
  }
}

RunReport RunReader::read() {
  // InputFile refuses what is not a regular file (a FIFO would wait for a
  // writer); the stream then reads from its own descriptor, at offset 0.
  const InputFile in(path_, "metrics file");
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(::fdopen(::dup(in.fd()), "rb"), &std::fclose);
  if (!f) ORIGAMI_USER_ERROR(path_, ": cannot open: ", std::strerror(errno));
  od::parser parser;
  StepRecord rec;
  constexpr size_t kBlock = size_t{8} << 20;
  std::vector<char> buf(kBlock + simdjson::SIMDJSON_PADDING);
  size_t held = 0;  // bytes of buf holding unparsed input
  int64_t line = 0;
  bool eof = false;
  while (!eof || held > 0) {
    if (!eof) {
      if (buf.size() - simdjson::SIMDJSON_PADDING - held < kBlock / 2)  // a line longer than the buffer: grow
        buf.resize(2 * buf.size());
      const size_t room = buf.size() - simdjson::SIMDJSON_PADDING - held;
      const size_t got = std::fread(buf.data() + held, 1, room, f.get());
      if (got < room) {
        if (std::ferror(f.get())) ORIGAMI_USER_ERROR(path_, ": read failed: ", std::strerror(errno));
        eof = true;
      }
      held += got;
    }
    size_t pos = 0;
    while (pos < held) {
      const char* start = buf.data() + pos;
      const char* nl = static_cast<const char*>(std::memchr(start, '\n', held - pos));
      if (!nl && !eof) break;  // the rest of this line is in the next block
      const size_t len = nl ? static_cast<size_t>(nl - start) : held - pos;
      ++line;
      pos += len + (nl ? 1 : 0);
      if (std::all_of(start, start + len, [](char c) { return c == ' ' || c == '\r' || c == '\t'; })) continue;
      try {
        od::document doc = parser.iterate(start, len, buf.size() - static_cast<size_t>(start - buf.data()));
        // Every byte after a whole record must be whitespace (ondemand stops reading where it is done).
        if (parse(doc, line, rec) && !doc.current_location().error()) fail(line, "text after the JSON record");
      } catch (const simdjson::simdjson_error& e) {
        if (!nl) break;  // the last line, still being written
        // A value of the wrong type in valid JSON ("step": "5") names its
        // field and the rule; a syntax error is the line's.
        const bool typed = e.error() == simdjson::INCORRECT_TYPE || e.error() == simdjson::NUMBER_ERROR ||
                           e.error() == simdjson::NUMBER_OUT_OF_RANGE;
        if (typed && field_ != nullptr)
          fail(line, detail::concat(field_, ", as origami train writes it (", e.what(), ")"));
        fail(line, std::string("malformed JSON: ") + e.what());
      }
      if (rec.step == kAbsent) fail(line, "a record without \"step\"");
      if (rec.step < 0) fail(line, "\"step\" is " + std::to_string(rec.step) + " (rule: >= 0)");
      if (rec.step <= last_seen_step_)
        fail(line, "step " + std::to_string(rec.step) + " after step " + std::to_string(last_seen_step_) +
                       " (steps must increase: two runs in one file?)");
      last_seen_step_ = rec.step;
      ++records_;
      if ((opt_.first_step && rec.step < *opt_.first_step) || (opt_.last_step && rec.step > *opt_.last_step))
        continue;
      if (rec.moe_count == 0 && !layers_.empty()) fail(line, "step " + std::to_string(rec.step) + " has no moe records");
      if (rec.moe_count == 0) continue;
      steps_.push_back(rec.step);
      step_time_.push_back(rec.step_time_s), gflops_.push_back(rec.gflops);
      aux_.push_back(rec.aux_loss), lm_.push_back(rec.lm_loss);
      ep_bytes_ += rec.ep_bytes, ep_a2a_s_ += rec.ep_a2a_s;
      all_a2a_ = all_a2a_ && rec.has_a2a;
      add(rec, line);
    }
    if (eof && pos < held) pos = held;  // an unfinished last line was skipped
    std::memmove(buf.data(), buf.data() + pos, held - pos);
    held -= pos;
  }
  if (records_ == 0) ORIGAMI_USER_ERROR(path_, ": no step records (", line, " lines)");
  if (layers_.empty() && steps_.empty() && (opt_.first_step || opt_.last_step))
    ORIGAMI_USER_ERROR(path_, ": no MoE step records in the selected steps (the file's last step is ",
                       last_seen_step_, ")");
  if (layers_.empty())
    ORIGAMI_USER_ERROR(path_, ": no MoE records in ", records_,
                       " step records (a dense model, or metrics from before per-expert logging)");

  RunReport r;
  r.path = path_;
  r.records = records_;
  r.steps = static_cast<int64_t>(steps_.size());
  r.first_step = steps_.front();
  r.last_step = steps_.back();
  r.window = opt_.window > 0 ? std::min(opt_.window, r.steps) : std::max<int64_t>(1, r.steps / 10);
  r.shape = read_shape(std::filesystem::path(path_).parent_path());
  if (r.shape.known) check_shape(r.shape);
  // A run resumed under another EP size rewrote config.toml: the selected
  // steps ran at the records' EP, under the contiguous placement or one
  // this config does not describe.
  if (r.shape.known && !layers_.empty() && layers_.front().ep != r.shape.ep) {
    r.notes.push_back(detail::concat("config.toml has parallel.ep = ", r.shape.ep, " (a resume under another layout); ",
                                     "the selected steps ran at ep ", layers_.front().ep,
                                     ": their placement is taken as contiguous"));
    r.shape.ep = layers_.front().ep;
    r.shape.placement.clear();
  }
  r.top_k = r.shape.top_k > 0 ? r.shape.top_k : std::max<int64_t>(1, top_k_);
  r.mean_aux_loss = nan_mean(aux_, 0, aux_.size());
  r.first_lm_loss = lm_.front();
  r.last_lm_loss = lm_.back();
  const size_t n = steps_.size(), w = static_cast<size_t>(r.window);
  for (LayerAcc& a : layers_) {
    LayerReport L;
    L.layer = a.layer;
    L.experts = a.experts;
    L.routed = a.routed;
    L.kept = a.kept;
    const int64_t total = std::accumulate(a.routed.begin(), a.routed.end(), int64_t{0});
    const int64_t kept = std::accumulate(a.kept.begin(), a.kept.end(), int64_t{0});
    const double mean = static_cast<double>(total) / static_cast<double>(a.experts);
    if (total > 0) {
      const auto [mn, mx] = std::minmax_element(a.routed.begin(), a.routed.end());
      L.utilization_min = static_cast<double>(*mn) / mean;
      L.utilization_max = static_cast<double>(*mx) / mean;
      L.max_vio = (static_cast<double>(*mx) - mean) / mean;
      double ss = 0;
      for (int64_t v : a.routed) ss += (static_cast<double>(v) - mean) * (static_cast<double>(v) - mean);
      L.cv = std::sqrt(ss / static_cast<double>(a.experts)) / mean;
      L.dropped_fraction = static_cast<double>(total - kept) / static_cast<double>(total);
    }
    L.max_vio_batch = nan_mean(a.vio, 0, n);
    for (int64_t e = 0; e < a.experts; ++e)
      if (a.routed[e] == 0) L.dead.push_back(e);
    // Tokens = slots / top_k; top_k from the config, else from the first
    // record's slots per token (routing counts every slot before dropping).
    std::vector<int64_t> order(a.experts);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return a.routed[x] > a.routed[y]; });
    const int64_t k = r.shape.top_k > 0 ? r.shape.top_k : std::max<int64_t>(1, top_k_);
    for (size_t i = 0; i < std::min<size_t>(3, order.size()) && total > 0; ++i)
      L.hottest.push_back({order[i], static_cast<double>(a.routed[order[i]]) * static_cast<double>(k) /
                                         static_cast<double>(total)});
    L.ep = balance(a.ep_tokens, a.ep_mom, a.ep_excess);
    if (opt_.what_if_ep > 0) L.what_if = balance(a.what_if_tokens, a.what_if_mom, a.what_if_excess);
    L.trend_first = nan_mean(a.vio, 0, std::min(w, n));
    L.trend_last = nan_mean(a.vio, n - std::min(w, n), n);
    for (size_t b = 0; b < a.bins.size(); ++b) {
      const size_t lo = b * a.bin_width, hi = std::min(n, lo + a.bin_width);
      L.bin_first.push_back(steps_[lo]);
      L.bin_last.push_back(steps_[hi - 1]);
      const int64_t s = std::accumulate(a.bins[b].begin(), a.bins[b].end(), int64_t{0});
      std::vector<double> u(a.experts, 0.0);
      if (s > 0)
        for (int64_t e = 0; e < a.experts; ++e)
          u[e] = static_cast<double>(a.bins[b][e]) * static_cast<double>(a.experts) / static_cast<double>(s);
      L.heat.push_back(std::move(u));
    }
    std::vector<double> mom(a.vio);
    for (double& v : mom) v += 1.0;
    L.max_over_mean = thin(mom, steps_, a.bin_width);
    L.ep_max_over_mean = thin(a.ep_mom, steps_, a.bin_width);
    L.dropped = thin(a.dropped, steps_, a.bin_width);
    r.layers.push_back(std::move(L));
  }
  // Cost: the busiest EP rank's excess per step, summed over layers.
  for (const LayerReport& L : r.layers) r.cost.excess_tokens += L.ep.excess_tokens;
  r.cost.step_time_s = nan_mean(step_time_, 0, n);
  const double gflops = nan_mean(gflops_, 0, n);
  if (r.shape.known && r.shape.hidden_size > 0 && gflops > 0) {
    r.cost.timed = true;
    const double D = static_cast<double>(r.shape.hidden_size), F = static_cast<double>(r.shape.expert_ffn);
    // A kept slot costs its expert 3 matmuls of D·F (2 FLOPs each) forward, twice that backward.
    r.cost.compute_s = r.cost.excess_tokens * 18.0 * D * F / static_cast<double>(r.shape.etp) / (gflops * 1e9);
    // f32 rows of D: dispatch and combine, forward and backward.
    r.cost.a2a_bytes = r.cost.excess_tokens * 4.0 * D * 4.0;
    if (all_a2a_ && ep_a2a_s_ > 0 && ep_bytes_ > 0) {
      r.cost.a2a_timed = true;
      r.cost.a2a_s = r.cost.a2a_bytes / (ep_bytes_ / ep_a2a_s_);
    }
  }
  return r;
}

}  // namespace

RunReport analyze(const std::string& run, const Options& opt) {
  std::filesystem::path p(run);
  if (std::filesystem::is_directory(p)) p /= "metrics.jsonl";
  if (!std::filesystem::exists(p))
    ORIGAMI_USER_ERROR(run, ": no such file", std::filesystem::is_directory(run) ? " (the run has no metrics.jsonl)" : "");
  RunReader reader(p.string(), opt);
  RunReport r = reader.read();
  finish_report(r, opt);
  return r;
}

}  // namespace origami::imbalance

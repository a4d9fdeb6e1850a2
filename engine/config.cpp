// Config loading: TOML text -> toml::table (+ --set overrides) -> typed structs
// -> validation. Every failure is a UserError that names where the value came
// from (the file, or the `--set` override that wrote it), the full key and the
// rule it broke.
#include "engine/config.h"

#include "comm/layout.h"

#include <toml++/toml.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cfloat>
#include <limits>
#include <map>
#include <numeric>
#include <sstream>
#include <string_view>
#include <thread>
#include <variant>

#include "engine/files.h"
#include "kernels/check.h"

namespace origami {
namespace {

using detail::concat;

// ---- The schema: every section and key, bound to a Config's fields. ----------

// Enum keys are strings from a fixed set (enum_names); an optional float is
// absent unless the file sets it; a list key is an array of integers.
using FieldPtr = std::variant<int64_t*, uint64_t*, double*, bool*, std::string*, std::optional<double>*,
                              std::vector<int64_t>*, moe::ScoreFunction*, moe::LoadBalancing*, moe::DropPolicy*,
                              Recompute*>;
struct Field {
  std::string_view key;
  FieldPtr ptr;
};
struct Section {
  std::string_view name;
  std::vector<Field> fields;
};

template <class E>
using EnumNames = std::vector<std::pair<std::string_view, E>>;
const EnumNames<moe::ScoreFunction>& enum_names(const moe::ScoreFunction*) {
  static const EnumNames<moe::ScoreFunction> n = {{"softmax", moe::ScoreFunction::softmax},
                                                  {"sigmoid", moe::ScoreFunction::sigmoid}};
  return n;
}
const EnumNames<moe::LoadBalancing>& enum_names(const moe::LoadBalancing*) {
  static const EnumNames<moe::LoadBalancing> n = {{"aux_loss", moe::LoadBalancing::aux_loss},
                                                  {"seq_aux_loss", moe::LoadBalancing::seq_aux_loss},
                                                  {"global_aux_loss", moe::LoadBalancing::global_aux_loss},
                                                  {"none", moe::LoadBalancing::none}};
  return n;
}
const EnumNames<Recompute>& enum_names(const Recompute*) {
  static const EnumNames<Recompute> n = {
      {"none", Recompute::none}, {"full", Recompute::full}, {"moe", Recompute::moe}};
  return n;
}
const EnumNames<moe::DropPolicy>& enum_names(const moe::DropPolicy*) {
  static const EnumNames<moe::DropPolicy> n = {{"probs", moe::DropPolicy::probs},
                                               {"position", moe::DropPolicy::position}};
  return n;
}

// Keys are exactly the struct field names; declaration order breaks ties in
// did-you-mean suggestions.
std::vector<Section> schema(Config& c) {
  ModelConfig& m = c.model;
  MoeConfig& e = c.moe;
  ParallelConfig& p = c.parallel;
  TrainingConfig& t = c.training;
  OptimizerConfig& o = c.optimizer;
  LrScheduleConfig& s = c.lr_schedule;
  return {
      {"model",
       {{"vocab_size", &m.vocab_size}, {"hidden_size", &m.hidden_size}, {"num_layers", &m.num_layers},
        {"num_heads", &m.num_heads}, {"num_kv_heads", &m.num_kv_heads}, {"ffn_hidden_size", &m.ffn_hidden_size},
        {"rope_theta", &m.rope_theta}, {"norm_eps", &m.norm_eps}, {"init_std", &m.init_std}}},
      {"moe",
       {{"num_experts", &e.num_experts}, {"top_k", &e.top_k}, {"ffn_hidden_size", &e.ffn_hidden_size},
        {"first_dense_layers", &e.first_dense_layers}, {"layer_freq", &e.layer_freq},
        {"shared_expert_hidden_size", &e.shared_expert_hidden_size}, {"score_function", &e.score_function},
        {"normalize_topk", &e.normalize_topk}, {"topk_scaling", &e.topk_scaling}, {"num_groups", &e.num_groups},
        {"group_topk", &e.group_topk}, {"load_balancing", &e.load_balancing}, {"aux_loss_coeff", &e.aux_loss_coeff},
        {"z_loss_coeff", &e.z_loss_coeff}, {"expert_bias", &e.expert_bias},
        {"bias_update_rate", &e.bias_update_rate}, {"capacity_factor", &e.capacity_factor},
        {"drop_policy", &e.drop_policy}, {"pad_to_capacity", &e.pad_to_capacity}}},
      {"parallel",
       {{"tp", &p.tp}, {"cp", &p.cp}, {"pp", &p.pp}, {"ep", &p.ep}, {"etp", &p.etp}, {"order", &p.order},
        {"zero_stage", &p.zero_stage}, {"pp_layers", &p.pp_layers},
        {"reshard_after_forward", &p.reshard_after_forward}}},
      {"training",
       {{"steps", &t.steps}, {"seq_len", &t.seq_len}, {"global_batch", &t.global_batch},
        {"micro_batch", &t.micro_batch}, {"seed", &t.seed}, {"recompute", &t.recompute}}},
      {"optimizer",
       {{"lr", &o.lr}, {"beta1", &o.beta1}, {"beta2", &o.beta2}, {"eps", &o.eps},
        {"weight_decay", &o.weight_decay}, {"clip_grad", &o.clip_grad}}},
      {"lr_schedule", {{"warmup_steps", &s.warmup_steps}, {"decay_steps", &s.decay_steps}, {"min_lr", &s.min_lr}}},
      {"data", {{"path", &c.data.path}, {"shuffle", &c.data.shuffle}}},
      {"checkpoint", {{"dir", &c.checkpoint.dir}, {"interval", &c.checkpoint.interval}}},
      {"export", {{"dir", &c.exp.dir}}},
      {"logging", {{"dir", &c.logging.dir}, {"interval", &c.logging.interval}}},
      {"runtime", {{"threads", &c.runtime.threads}, {"collective_timeout_s", &c.runtime.collective_timeout_s}}},
  };
}

// ---- Formatting. -------------------------------------------------------------

std::string fmt(int64_t v) { return std::to_string(v); }
std::string fmt(double v) {
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, v);  // shortest round-trip form
  return std::string(buf, r.ptr);
}
std::string fmt(const std::vector<int64_t>& v) {  // [2, 2]
  std::string r = "[";
  for (size_t i = 0; i < v.size(); ++i) r += concat(i ? ", " : "", v[i]);
  return r + ']';
}
std::string fmt(const std::string& v) {  // a TOML basic string: "..." with escapes
  std::string r = "\"";
  for (char ch : v) {
    if (ch == '"' || ch == '\\') {
      r += '\\';
      r += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", ch);
      r += buf;
    } else {
      r += ch;
    }
  }
  return r + '"';
}

std::string type_name(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::string: return "a string";
    case toml::node_type::integer: return "an integer";
    case toml::node_type::floating_point: return "a float";
    case toml::node_type::boolean: return "a boolean";
    case toml::node_type::array: return "an array";
    case toml::node_type::table: return "a table";
    case toml::node_type::date: return "a date";
    case toml::node_type::time: return "a time";
    case toml::node_type::date_time: return "a date-time";
    default: return "nothing";
  }
}

// The value as TOML text, shortened so a large array or table stays readable.
std::string show(const toml::node& n) {
  std::string s;
  if (const auto* str = n.as_string()) {
    s = fmt(str->get());
  } else {
    std::ostringstream os;
    n.visit([&](const auto& v) { os << v; });
    s = os.str();
  }
  std::replace(s.begin(), s.end(), '\n', ' ');
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return s;
}

std::string lower(std::string_view s) {
  std::string r(s);
  for (char& ch : r) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return r;
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

// The closest candidate to a misspelt name, if one is close: within edit
// distance 3 (less for short names, so "x" does not suggest everything), or
// one containing the other ("layers" -> "num_layers", "max_steps" -> "steps").
std::optional<std::string_view> closest(std::string_view typed, const std::vector<std::string_view>& candidates) {
  const std::string t = lower(typed);
  const size_t max_d = std::min<size_t>(3, std::max<size_t>(1, (t.size() + 1) / 2));
  std::optional<std::string_view> best;
  size_t best_d = SIZE_MAX;
  for (std::string_view c : candidates) {
    const std::string cl = lower(c);
    const size_t d = edit_distance(t, cl);
    const bool contains = std::min(t.size(), cl.size()) >= 3 &&
                          (cl.find(t) != std::string::npos || t.find(cl) != std::string::npos);
    if ((d <= max_d || contains) && d < best_d) {
      best = c;
      best_d = d;
    }
  }
  return best;
}

// ---- Where each value came from. ---------------------------------------------

// The file, unless a --set override wrote the key (or created the section).
class Origins {
 public:
  explicit Origins(std::string file) : file_(std::move(file)) {}
  const std::string& file() const { return file_; }
  void set(const std::string& key, std::string origin) { by_key_[key] = std::move(origin); }
  const std::map<std::string, std::string>& overridden() const { return by_key_; }
  const std::string& of(std::string_view key) const {
    auto it = by_key_.find(std::string(key));
    return it == by_key_.end() ? file_ : it->second;
  }
  // For a rule on several keys: the overrides involved, else the file.
  std::string of(std::initializer_list<std::string_view> keys) const {
    std::string r;
    for (std::string_view k : keys) {
      const std::string& o = of(k);
      if (&o != &file_ && r.find(o) == std::string::npos) r += (r.empty() ? "" : ", ") + o;
    }
    return r.empty() ? file_ : r;
  }

 private:
  std::string file_;
  std::map<std::string, std::string> by_key_;
};

// ---- Reading the table into the structs. -------------------------------------

[[noreturn]] void unknown_key(const std::vector<Section>& sections, const Section& sec, std::string_view key,
                              const std::string& origin) {
  const std::string full = concat(sec.name, ".", key);
  std::string hint;
  if (sec.name == "parallel" && (key == "dp" || key == "edp")) {
    hint = " (data-parallel sizes are derived: dp = world / (tp·cp·pp), edp = world / (etp·ep·pp))";
  } else {
    // A key placed in the wrong section is the likeliest slip; then a typo.
    std::string elsewhere;
    for (const Section& s : sections)
      for (const Field& f : s.fields)
        if (&s != &sec && f.key == key) elsewhere += concat(elsewhere.empty() ? "" : " or ", "'", s.name, ".", key, "'");
    if (!elsewhere.empty()) {
      hint = concat(" (did you mean ", elsewhere, "?)");
    } else {
      std::vector<std::string_view> keys;
      for (const Field& f : sec.fields) keys.push_back(f.key);
      if (auto c = closest(key, keys)) hint = concat(" (did you mean '", sec.name, ".", *c, "'?)");
    }
  }
  ORIGAMI_USER_ERROR(origin, ": unknown key '", full, "'", hint);
}

[[noreturn]] void unknown_section(const std::vector<Section>& sections, std::string_view name,
                                  const toml::node& node, const std::string& origin) {
  if (!node.is_table()) {
    // `steps = 10` above every [section]: a key that lost its section header.
    std::string hint;
    for (const Section& s : sections)
      for (const Field& f : s.fields)
        if (f.key == name) hint += concat(hint.empty() ? "" : " or ", "'", s.name, ".", name, "'");
    ORIGAMI_USER_ERROR(origin, ": unknown top-level key '", name, "': every key belongs in a [section]",
                       hint.empty() ? "" : concat(" (did you mean ", hint, "?)"));
  }
  std::vector<std::string_view> names;
  for (const Section& s : sections) names.push_back(s.name);
  auto c = closest(name, names);
  ORIGAMI_USER_ERROR(origin, ": unknown section '", name, "'",
                     c ? concat(" (did you mean '", *c, "'?)") : concat(" (sections: model, moe, parallel, training, "
                                                                       "optimizer, lr_schedule, data, checkpoint, "
                                                                       "export, logging, runtime)"));
}

void assign(const Field& f, const toml::node& v, const std::string& key, const std::string& origin) {
  auto wrong = [&](std::string_view expected) {
    ORIGAMI_USER_ERROR(origin, ": ", key, " = ", show(v), ": expected ", expected, ", got ", type_name(v));
  };
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, int64_t>) {
          if (!v.is_integer()) wrong("an integer");
          *p = v.as_integer()->get();
        } else if constexpr (std::is_same_v<T, uint64_t>) {
          if (!v.is_integer()) wrong("an integer");
          const int64_t i = v.as_integer()->get();
          if (i < 0) ORIGAMI_USER_ERROR(origin, ": ", key, " = ", i, ": must be >= 0");
          *p = static_cast<uint64_t>(i);
        } else if constexpr (std::is_same_v<T, double>) {
          if (v.is_integer()) {
            *p = static_cast<double>(v.as_integer()->get());
          } else if (v.is_floating_point()) {
            *p = v.as_floating_point()->get();
          } else {
            wrong("a number");
          }
        } else if constexpr (std::is_same_v<T, std::optional<double>>) {
          if (v.is_integer()) {
            *p = static_cast<double>(v.as_integer()->get());
          } else if (v.is_floating_point()) {
            *p = v.as_floating_point()->get();
          } else {
            wrong("a number");
          }
        } else if constexpr (std::is_same_v<T, bool>) {
          if (!v.is_boolean()) wrong("a boolean (true or false)");
          *p = v.as_boolean()->get();
        } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
          const toml::array* items = v.as_array();
          if (!items) wrong("an array of integers");
          std::vector<int64_t> values;
          for (size_t i = 0; i < items->size(); ++i) {
            const toml::node& item = *items->get(i);
            if (!item.is_integer())
              ORIGAMI_USER_ERROR(origin, ": ", key, " = ", show(v), ": expected an array of integers, got ",
                                 type_name(item), " at index ", i);
            values.push_back(item.as_integer()->get());
          }
          *p = std::move(values);
        } else if constexpr (std::is_enum_v<T>) {
          const auto& names = enum_names(p);
          std::string allowed;
          std::vector<std::string_view> candidates;
          for (const auto& [name, value] : names) {
            allowed += concat(allowed.empty() ? "" : ", ", fmt(std::string(name)));
            candidates.push_back(name);
          }
          if (!v.is_string()) wrong(concat("a string, one of ", allowed));
          const std::string& text = v.as_string()->get();
          auto it = std::find_if(names.begin(), names.end(), [&](const auto& n) { return n.first == text; });
          if (it == names.end()) {
            const auto c = closest(text, candidates);
            ORIGAMI_USER_ERROR(origin, ": ", key, " = ", fmt(text), ": must be one of ", allowed,
                               c ? concat(" (did you mean \"", *c, "\"?)") : std::string());
          }
          *p = it->second;
        } else {
          if (!v.is_string()) wrong("a string");
          *p = v.as_string()->get();
        }
      },
      f.ptr);
}

void read_table(const toml::table& root, Config& cfg, const Origins& origins) {
  std::vector<Section> sections = schema(cfg);
  for (auto&& [k, node] : root) {
    const std::string name(k.str());
    auto sec = std::find_if(sections.begin(), sections.end(), [&](const Section& s) { return s.name == name; });
    if (sec == sections.end()) unknown_section(sections, name, node, origins.of(name));
    const toml::table* tbl = node.as_table();
    if (!tbl)
      ORIGAMI_USER_ERROR(origins.of(name), ": '", name, "' must be a section ([", name, "]), got ", type_name(node));
    for (auto&& [kk, v] : *tbl) {
      const std::string full = concat(name, ".", kk.str());
      auto f = std::find_if(sec->fields.begin(), sec->fields.end(), [&](const Field& x) { return x.key == kk.str(); });
      if (f == sec->fields.end()) unknown_key(sections, *sec, kk.str(), origins.of(full));
      assign(*f, v, full, origins.of(full));
    }
  }
}

// ---- Overrides. ---------------------------------------------------------------

std::string trim(std::string_view s) {
  const char* ws = " \t\r\n";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string_view::npos) return {};
  return std::string(s.substr(b, s.find_last_not_of(ws) - b + 1));
}

// Applies "section.key=value" onto the parsed table, before any checking, so an
// override meets the same unknown-key, type and range rules as the file.
void apply_override(toml::table& root, const std::string& ov, Origins& origins) {
  const std::string origin = "--set " + shorten(ov);
  const size_t eq = ov.find('=');
  const std::string lhs = trim(std::string_view(ov).substr(0, eq));
  const size_t dot = lhs.find('.');
  if (eq == std::string::npos || dot == std::string::npos || dot == 0 || dot + 1 == lhs.size())
    ORIGAMI_USER_ERROR(origin, ": malformed override: expected section.key=value (e.g. --set training.steps=200)");
  const std::string section = lhs.substr(0, dot), key = lhs.substr(dot + 1);
  const std::string text = trim(std::string_view(ov).substr(eq + 1));

  if (!root.contains(section)) {
    root.insert(section, toml::table{});
    origins.set(section, origin);
  }
  toml::table* sec = root.get(section)->as_table();
  if (!sec)
    ORIGAMI_USER_ERROR(origins.of(section), ": '", section, "' must be a section ([", section, "]), got ",
                       type_name(*root.get(section)));

  // A TOML value if the text is one (200, 3e-4, true, "quoted"); otherwise,
  // e.g. a bare word or a path, the text itself as a string.
  std::optional<toml::table> parsed;
  try {
    const std::string doc = "v = " + text;
    parsed = toml::parse(std::string_view(doc), std::string_view("--set"));
  } catch (const toml::parse_error&) {
  }
  if (parsed && parsed->size() == 1 && parsed->contains("v")) {
    sec->insert_or_assign(key, std::move(*parsed->get("v")));
  } else {
    sec->insert_or_assign(key, text);
  }
  origins.set(concat(section, ".", key), origin);
}

// ---- Validation of the loaded values. ----------------------------------------

class Rules {
 public:
  explicit Rules(const Origins& o) : o_(o) {}

  template <class T>
  void need(bool ok, std::string_view key, T value, std::string_view rule) const {
    if (!ok) ORIGAMI_USER_ERROR(o_.of(key), ": ", key, " = ", shorten(fmt(value)), ": ", rule);
  }
  void at_least(std::string_view key, int64_t v, int64_t lo) const { need(v >= lo, key, v, concat("must be >= ", lo)); }
  void between(std::string_view key, int64_t v, int64_t lo, int64_t hi) const {
    need(v >= lo && v <= hi, key, v, concat("must be in ", lo, "..", hi));
  }
  void finite(std::string_view key, double v) const { need(std::isfinite(v), key, v, "must be a finite number"); }
  void positive(std::string_view key, double v) const {
    finite(key, v);
    need(v > 0, key, v, "must be > 0");
  }
  void non_negative(std::string_view key, double v) const {
    finite(key, v);
    need(v >= 0, key, v, "must be >= 0");
  }
  void unit_interval(std::string_view key, double v) const {
    finite(key, v);
    need(v >= 0 && v < 1, key, v, "must be in [0, 1)");
  }
  void at_most(std::string_view key, int64_t v, int64_t hi, std::string_view why) const {
    need(v <= hi, key, v, concat("must be <= ", hi, " (", why, ")"));
  }
  // Values the kernels use as fp32: a double that passes "> 0" may still be
  // 0 or inf as a float (1e-300, 1e300).
  void fp32(std::string_view key, double v, bool zero_ok) const {
    const double a = std::fabs(v);
    need((zero_ok && v == 0) || (a >= FLT_MIN && a <= FLT_MAX), key, v,
         concat("must be representable in fp32, where the kernels use it: ", zero_ok ? "0 or " : "",
                "magnitude in [", fmt(double{FLT_MIN}), ", ", fmt(double{FLT_MAX}), "]"));
  }
  void positive_fp32(std::string_view key, double v) const {
    positive(key, v);
    fp32(key, v, false);
  }
  void non_negative_fp32(std::string_view key, double v) const {
    non_negative(key, v);
    fp32(key, v, true);
  }
  // A rule tying several keys together: message names them all and the rule.
  void need_all(bool ok, std::initializer_list<std::string_view> keys, const std::string& what) const {
    if (!ok) ORIGAMI_USER_ERROR(o_.of(keys), ": ", what);
  }

 private:
  const Origins& o_;
};

// parallel.order: the five axes, each once, joined by '-'.
void check_order(const Rules& r, const std::string& order) {
  static constexpr std::string_view kAxes[] = {"tp", "cp", "ep", "dp", "pp"};
  std::vector<std::string> parts;
  std::string part;
  std::istringstream is(order);
  while (std::getline(is, part, '-')) parts.push_back(part);
  if (!order.empty() && order.back() == '-') parts.push_back("");
  std::string problem;
  for (const std::string& p : parts) {
    if (std::find(std::begin(kAxes), std::end(kAxes), p) == std::end(kAxes)) {
      problem = concat("unknown axis '", p, "'");
      break;
    }
    if (std::count(parts.begin(), parts.end(), p) > 1) {
      problem = concat("axis '", p, "' appears twice");
      break;
    }
  }
  if (problem.empty())
    for (std::string_view a : kAxes)
      if (std::find(parts.begin(), parts.end(), a) == parts.end()) {
        problem = concat("axis '", a, "' is missing");
        break;
      }
  r.need(problem.empty(), "parallel.order", order,
         concat("must be a permutation of tp, cp, ep, dp, pp joined by '-' (e.g. \"tp-cp-ep-dp-pp\"): ", problem));
}

// Pipeline stages: an explicit parallel.pp_layers lists pp counts >= 0
// summing to model.num_layers; the even split (plan::stage_layers) needs
// num_layers >= pp so that no stage is left without a layer.
void check_pipeline_stages(const Rules& r, const ModelConfig& m, const ParallelConfig& p) {
  const std::vector<int64_t>& layers = p.pp_layers;
  if (layers.empty()) {
    r.need_all(m.num_layers >= p.pp, {"model.num_layers", "parallel.pp"},
               concat("model.num_layers = ", m.num_layers, " must be >= parallel.pp = ", p.pp,
                      " (the even split gives every pipeline stage a layer; parallel.pp_layers sets the split "
                      "explicitly)"));
    return;
  }
  const auto stages = static_cast<int64_t>(layers.size());
  r.need_all(stages == p.pp, {"parallel.pp_layers", "parallel.pp"},
             concat("parallel.pp_layers = ", fmt(layers), " lists ", stages,
                    " stages: must list one layer count per pipeline stage, parallel.pp = ", p.pp));
  r.need(std::all_of(layers.begin(), layers.end(), [&](int64_t n) { return n >= 0 && n <= m.num_layers; }),
         "parallel.pp_layers", layers, concat("layer counts must be in 0..model.num_layers = ", m.num_layers));
  const int64_t sum = std::accumulate(layers.begin(), layers.end(), int64_t{0});
  r.need_all(sum == m.num_layers, {"parallel.pp_layers", "model.num_layers"},
             concat("parallel.pp_layers = ", fmt(layers), " sums to ", sum, ": must sum to model.num_layers = ",
                    m.num_layers));
}

// i32 is what the kernels index with: token ids, positions, expert ids,
// routing slots and permuted rows; and a GEMM dimension (cuBLAS takes int).
constexpr int64_t kMaxI32 = std::numeric_limits<int32_t>::max();
constexpr const char* kI32Why = "the kernels index it with i32";
constexpr const char* kGemmWhy = "a GEMM dimension, which BLAS libraries take as a 32-bit int";

// Whole-model parameters, exactly (the §4 shapes at tp = ep = etp = 1), in
// 128 bits so no configured size can wrap it.
struct ModelSize {
  unsigned __int128 dense = 0, expert = 0;  // expert: the routed experts of every MoE layer
  unsigned __int128 total() const { return dense + expert; }
};
ModelSize model_size(const ModelConfig& m, const MoeConfig& e) {
  using U = unsigned __int128;
  const U H = static_cast<U>(m.hidden_size), L = static_cast<U>(m.num_layers), V = static_cast<U>(m.vocab_size);
  const U hd = static_cast<U>(m.head_dim());
  const U attention = H * hd * static_cast<U>(2 * m.num_heads + 2 * m.num_kv_heads) + 2 * H;  // q, o, k, v + norms
  ModelSize s;
  s.dense = 2 * V * H + H;  // embedding, head, final norm
  // Layers l >= first_dense_layers with (l - first) % layer_freq == 0 (MoeConfig::is_moe_layer).
  const int64_t after = m.num_layers - e.first_dense_layers;
  const U moe_layers = e.num_experts > 0 && after > 0 ? static_cast<U>((after - 1) / e.layer_freq + 1) : 0;
  const U dense_layers = L - moe_layers;
  s.dense += L * attention + dense_layers * 3 * H * static_cast<U>(m.ffn_hidden_size);
  if (moe_layers > 0) {
    const U E = static_cast<U>(e.num_experts), Fe = static_cast<U>(e.expert_ffn(m.ffn_hidden_size));
    s.dense += moe_layers * (E * H + 3 * H * static_cast<U>(e.shared_expert_hidden_size));
    s.expert = moe_layers * E * 3 * H * Fe;
  }
  return s;
}

std::string fmt_count(long double n) {  // 2.02e+13
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3Lg", n);
  return buf;
}

std::string fmt_bytes(long double b) {  // 3.2e+14 bytes (320.0 TB)
  char buf[64];
  const char* unit[] = {"B", "KB", "MB", "GB", "TB", "PB", "EB"};
  int u = 0;
  long double v = b;
  while (v >= 1000 && u < 6) v /= 1000, ++u;
  std::snprintf(buf, sizeof buf, "%.3Lg bytes (%.1Lf %s)", b, v, unit[u]);
  return buf;
}

void validate(const Config& c, const Origins& o) {
  const Rules r(o);
  const ModelConfig& m = c.model;
  r.at_least("model.vocab_size", m.vocab_size, 2);
  r.at_most("model.vocab_size", m.vocab_size, kMaxI32, "token ids are i32");
  r.at_least("model.hidden_size", m.hidden_size, 1);
  r.at_most("model.hidden_size", m.hidden_size, kMaxI32, kGemmWhy);
  r.at_least("model.num_layers", m.num_layers, 1);
  r.at_most("model.num_layers", m.num_layers, kMaxI32, kI32Why);
  r.at_least("model.num_heads", m.num_heads, 1);
  r.at_most("model.num_heads", m.num_heads, kMaxI32, kI32Why);
  r.at_least("model.num_kv_heads", m.num_kv_heads, 1);
  r.at_most("model.num_kv_heads", m.num_kv_heads, kMaxI32, kI32Why);
  r.at_least("model.ffn_hidden_size", m.ffn_hidden_size, 1);
  r.at_most("model.ffn_hidden_size", m.ffn_hidden_size, kMaxI32, kGemmWhy);
  r.positive_fp32("model.rope_theta", m.rope_theta);
  r.positive_fp32("model.norm_eps", m.norm_eps);
  r.positive_fp32("model.init_std", m.init_std);

  const MoeConfig& e = c.moe;
  r.at_least("moe.num_experts", e.num_experts, 0);
  r.at_most("moe.num_experts", e.num_experts, kMaxI32, "expert ids are i32");
  if (e.num_experts > 0) r.between("moe.top_k", e.top_k, 1, e.num_experts);
  r.at_least("moe.ffn_hidden_size", e.ffn_hidden_size, 0);
  r.at_most("moe.ffn_hidden_size", e.ffn_hidden_size, kMaxI32, kGemmWhy);
  r.at_least("moe.first_dense_layers", e.first_dense_layers, 0);
  r.at_least("moe.layer_freq", e.layer_freq, 1);
  r.at_least("moe.shared_expert_hidden_size", e.shared_expert_hidden_size, 0);
  r.at_most("moe.shared_expert_hidden_size", e.shared_expert_hidden_size, kMaxI32, kGemmWhy);
  r.positive_fp32("moe.topk_scaling", e.topk_scaling);
  r.at_least("moe.num_groups", e.num_groups, 1);
  r.between("moe.group_topk", e.group_topk, 1, e.num_groups);
  r.non_negative_fp32("moe.aux_loss_coeff", e.aux_loss_coeff);
  r.non_negative_fp32("moe.z_loss_coeff", e.z_loss_coeff);
  r.non_negative_fp32("moe.bias_update_rate", e.bias_update_rate);
  if (e.capacity_factor) {
    r.positive_fp32("moe.capacity_factor", *e.capacity_factor);
    if (e.num_experts > 0)
      r.need(*e.capacity_factor <= static_cast<double>(e.num_experts), "moe.capacity_factor", *e.capacity_factor,
             concat("must be <= moe.num_experts = ", e.num_experts,
                    " (from num_experts / top_k up, every expert can already take every token; more only pads)"));
  }

  const ParallelConfig& p = c.parallel;
  r.at_least("parallel.tp", p.tp, 1);
  r.at_least("parallel.cp", p.cp, 1);
  r.at_least("parallel.pp", p.pp, 1);
  r.at_least("parallel.ep", p.ep, 1);
  r.at_least("parallel.etp", p.etp, 1);
  r.between("parallel.zero_stage", p.zero_stage, 0, 3);
  check_order(r, p.order);

  const TrainingConfig& t = c.training;
  r.at_least("training.steps", t.steps, 0);
  r.at_least("training.seq_len", t.seq_len, 1);
  r.at_most("training.seq_len", t.seq_len, kMaxI32 - 1, "a sample is seq_len + 1 tokens at i32 positions");
  r.at_least("training.global_batch", t.global_batch, 1);
  r.at_least("training.micro_batch", t.micro_batch, 1);
  {
    // Tokens of a micro-batch are GEMM rows, and with top_k its routing
    // slots are i32 rows; a step's tokens and the run's samples are int64.
    int64_t tokens = 0, slots = 0, step_tokens = 0, samples = 0;
    const int64_t k = e.num_experts > 0 ? e.top_k : 1;
    r.need_all(checked_mul(t.micro_batch, t.seq_len, &tokens) && tokens <= kMaxI32 &&
                   checked_mul(tokens, k, &slots) && slots <= kMaxI32,
               {"training.micro_batch", "training.seq_len", "moe.top_k"},
               concat("training.micro_batch · seq_len", e.num_experts > 0 ? " · moe.top_k" : "", " = ", t.micro_batch,
                      " · ", t.seq_len, e.num_experts > 0 ? concat(" · ", k) : "", " must be <= ", kMaxI32,
                      " (a micro-batch's tokens and routing slots are i32 rows of the kernels)"));
    r.need_all(checked_mul(t.global_batch, t.seq_len, &step_tokens) && checked_mul(t.steps, t.global_batch, &samples),
               {"training.global_batch", "training.seq_len", "training.steps"},
               concat("training.global_batch = ", t.global_batch, " with seq_len = ", t.seq_len, " and steps = ",
                      t.steps, ": the tokens of a step and the samples of the run must fit in 64-bit counts"));
  }

  const OptimizerConfig& op = c.optimizer;
  r.positive_fp32("optimizer.lr", op.lr);
  r.unit_interval("optimizer.beta1", op.beta1);
  r.unit_interval("optimizer.beta2", op.beta2);
  r.positive_fp32("optimizer.eps", op.eps);
  r.non_negative_fp32("optimizer.weight_decay", op.weight_decay);
  r.non_negative_fp32("optimizer.clip_grad", op.clip_grad);

  const LrScheduleConfig& s = c.lr_schedule;
  r.at_least("lr_schedule.warmup_steps", s.warmup_steps, 0);
  r.at_least("lr_schedule.decay_steps", s.decay_steps, 0);
  r.non_negative_fp32("lr_schedule.min_lr", s.min_lr);

  r.at_least("checkpoint.interval", c.checkpoint.interval, 0);
  r.at_least("logging.interval", c.logging.interval, 1);
  r.at_least("runtime.threads", c.runtime.threads, 0);
  r.positive("runtime.collective_timeout_s", c.runtime.collective_timeout_s);
  r.need(c.runtime.collective_timeout_s <= 1e6, "runtime.collective_timeout_s", c.runtime.collective_timeout_s,
         "must be <= 1e6 s (a wait of 11 days is a hang)");

  // Parameters of the whole model: every one takes 16 bytes of fp32 training
  // state (param, grad, two AdamW moments), which must be countable in
  // 64-bit sizes (validate_for_machine then asks whether it fits here).
  const unsigned __int128 params = model_size(m, e).total();
  r.need_all(params <= static_cast<unsigned __int128>(INT64_MAX / 16),
             {"model.vocab_size", "model.hidden_size", "model.num_layers", "model.ffn_hidden_size", "moe.num_experts",
              "moe.ffn_hidden_size"},
             concat("the model has ", fmt_count(static_cast<long double>(params)), " parameters: their training state (16 bytes each) does not fit in 64-bit sizes; check "
                    "model.vocab_size, hidden_size, num_layers, ffn_hidden_size and moe.num_experts"));

  // Consistency between keys.
  r.need_all(m.hidden_size % m.num_heads == 0, {"model.hidden_size", "model.num_heads"},
             concat("model.hidden_size = ", m.hidden_size, " must be divisible by model.num_heads = ", m.num_heads));
  r.need_all(m.num_heads % m.num_kv_heads == 0, {"model.num_heads", "model.num_kv_heads"},
             concat("model.num_heads = ", m.num_heads, " must be divisible by model.num_kv_heads = ", m.num_kv_heads,
                    " (each kv head serves num_heads / num_kv_heads query heads)"));
  r.need_all(m.head_dim() % 2 == 0, {"model.hidden_size", "model.num_heads"},
             concat("head_dim = model.hidden_size / model.num_heads = ", m.hidden_size, " / ", m.num_heads, " = ",
                    m.head_dim(), " must be even (RoPE rotates channel pairs)"));
  r.need_all(t.global_batch % t.micro_batch == 0, {"training.global_batch", "training.micro_batch"},
             concat("training.global_batch = ", t.global_batch, " must be a multiple of training.micro_batch = ",
                    t.micro_batch));
  if (e.num_experts > 0) {
    r.need_all(e.num_experts % e.num_groups == 0, {"moe.num_experts", "moe.num_groups"},
               concat("moe.num_experts = ", e.num_experts, " must be divisible by moe.num_groups = ", e.num_groups,
                      " (experts split into equal contiguous groups)"));
    if (e.num_groups > 1) {
      r.need_all(e.top_k % e.group_topk == 0, {"moe.top_k", "moe.group_topk"},
                 concat("moe.top_k = ", e.top_k, " must be divisible by moe.group_topk = ", e.group_topk,
                        " (a group's score sums its top top_k / group_topk experts)"));
      const int64_t reachable = e.group_topk * (e.num_experts / e.num_groups);
      r.need_all(e.top_k <= reachable, {"moe.top_k", "moe.group_topk", "moe.num_groups", "moe.num_experts"},
                 concat("moe.top_k = ", e.top_k, " must be <= moe.group_topk · (moe.num_experts / moe.num_groups) = ",
                        e.group_topk, " · (", e.num_experts, " / ", e.num_groups, ") = ", reachable,
                        " (the experts in the kept groups)"));
    }
  }
  check_pipeline_stages(r, m, c.parallel);
  r.need_all(!e.pad_to_capacity || e.capacity_factor.has_value(), {"moe.pad_to_capacity", "moe.capacity_factor"},
             "moe.pad_to_capacity = true requires moe.capacity_factor (dropless routing has no capacity to pad to)");
  r.need_all(s.min_lr <= op.lr, {"lr_schedule.min_lr", "optimizer.lr"},
             concat("lr_schedule.min_lr = ", fmt(s.min_lr), " must be <= optimizer.lr = ", fmt(op.lr)));

  // Features whose issues have not landed yet.
  r.need(c.checkpoint.interval == 0, "checkpoint.interval", c.checkpoint.interval,
         "checkpointing is not available yet (checkpoint.interval must be 0)");

  r.need_all(t.steps == 0 || !c.data.path.empty(), {"data.path", "training.steps"},
             concat("data.path is required to train (training.steps = ", t.steps,
                    "); set data.path, or training.steps = 0"));
}

Config parse_table(toml::table root, const std::string& source, const std::vector<std::string>& overrides) {
  Origins origins(source);
  for (const std::string& ov : overrides) apply_override(root, ov, origins);
  Config cfg;
  cfg.source = source;
  read_table(root, cfg, origins);
  // Megatron's default: expert_tensor_parallel_size = tensor_model_parallel_size.
  const toml::table* par = root["parallel"].as_table();
  if (!par || !par->contains("etp")) cfg.parallel.etp = cfg.parallel.tp;
  validate(cfg, origins);
  cfg.set_by = origins.overridden();
  return cfg;
}

}  // namespace

Config parse_config(const std::string& toml_text, const std::string& source, const std::vector<std::string>& overrides) {
  toml::table root;
  try {
    root = toml::parse(toml_text, source);
  } catch (const toml::parse_error& err) {
    const toml::source_position& at = err.source().begin;
    ORIGAMI_USER_ERROR(source, ":", at.line, ":", at.column, ": TOML syntax error: ", err.description());
  }
  return parse_table(std::move(root), source, overrides);
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  const InputFile in(path, "config file");
  return parse_config(in.read_all(int64_t{64} << 20), path, overrides);
}

static void check_capacity_rows(const Config& cfg, int64_t tokens_per_rank) {
  const MoeConfig& e = cfg.moe;
  if (e.num_experts == 0 || !e.capacity_factor || !e.pad_to_capacity) return;
  // Megatron's capacity, ceil(T·k/E · cf) (moe::expert_capacity), per expert;
  // padding gives every expert that many rows of the permuted buffer.
  const long double per_expert = static_cast<long double>(tokens_per_rank) * static_cast<long double>(e.top_k) /
                                 static_cast<long double>(e.num_experts) * static_cast<long double>(*e.capacity_factor);
  const long double rows = std::ceil(per_expert) * static_cast<long double>(e.num_experts);
  if (rows > static_cast<long double>(kMaxI32))
    ORIGAMI_USER_ERROR(cfg.origin("moe.capacity_factor"), ": moe.capacity_factor = ", fmt(*e.capacity_factor),
                       " with moe.pad_to_capacity pads each of the ", e.num_experts, " experts to ",
                       fmt_count(std::ceil(per_expert)), " rows for ", tokens_per_rank,
                       " tokens per rank: ", fmt_count(rows), " permuted rows, more than the ", kMaxI32,
                       " that i32 row indices address; lower the capacity factor");
}

std::string canonical_text(const Config& cfg) {
  Config copy = cfg;  // schema() binds mutable pointers; this only reads them
  std::string out;
  for (const Section& sec : schema(copy))
    for (const Field& f : sec.fields) {
      std::string value;
      std::visit(
          [&](auto* p) {
            using T = std::remove_pointer_t<decltype(p)>;
            if constexpr (std::is_same_v<T, bool>) {
              value = *p ? "true" : "false";
            } else if constexpr (std::is_same_v<T, uint64_t>) {
              value = std::to_string(*p);
            } else if constexpr (std::is_same_v<T, std::optional<double>>) {
              if (*p) value = fmt(**p);
            } else if constexpr (std::is_enum_v<T>) {
              for (const auto& [name, v] : enum_names(p))
                if (v == *p) value = fmt(std::string(name));
            } else {
              value = fmt(*p);
            }
          },
          f.ptr);
      if (!value.empty()) out += concat(sec.name, ".", f.key, " = ", value, "\n");
    }
  return out;
}

void validate_for_machine(const Config& cfg, int world_size, int ranks_per_node) {
  const int cpus = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (cfg.runtime.threads > cpus)
    ORIGAMI_USER_ERROR(cfg.origin("runtime.threads"), ": runtime.threads = ", cfg.runtime.threads, ": must be <= ",
                       cpus, ", the logical CPUs of this machine (more threads only time-slice; 0 picks max(1, ",
                       "cores / ranks on the node))");
  // A lower bound of the worst rank's persistent state (§6, no padding, the
  // layout's splits and shards perfectly even): dense parameters split over
  // tp·pp and sharded over dp·cp, experts split over ep·etp·pp and sharded
  // over edp, at fp32 bytes per parameter by ZeRO stage.
  const ParallelConfig& p = cfg.parallel;
  const long double W = world_size, tp = p.tp, cp = p.cp, pp = p.pp, ep = p.ep, etp = p.etp;
  const long double dp = W / (tp * cp * pp), edp = W / (etp * ep * pp);
  auto per_param = [&](long double N) -> long double {
    switch (p.zero_stage) {
      case 0: return 16;
      case 1: return 8 + 8 / N;
      case 2: return 4 + 12 / N;
      default: return 16 / N;
    }
  };
  const ModelSize size = model_size(cfg.model, cfg.moe);
  const long double dense = static_cast<long double>(size.dense), expert = static_cast<long double>(size.expert);
  const long double state = dense / (tp * pp) * per_param(dp * cp) + expert / (ep * etp * pp) * per_param(edp);
  // Activations of one micro-batch, also a lower bound: every layer of the
  // stage keeps at least its input and its normed input ([T, H] fp32 each),
  // the head its logits' vocab slice ([T, V/tp]); T = the rank's tokens.
  const TrainingConfig& t = cfg.training;
  const long double tokens = static_cast<long double>(t.micro_batch) * static_cast<long double>(t.seq_len) / (cp * tp);
  const long double activations =
      tokens * 4 *
      (2 * static_cast<long double>(cfg.model.hidden_size) * static_cast<long double>(cfg.model.num_layers) / pp +
       static_cast<long double>(cfg.model.vocab_size) / tp);
  const long double pages = static_cast<long double>(::sysconf(_SC_PHYS_PAGES));
  const long double memory = pages * static_cast<long double>(::sysconf(_SC_PAGE_SIZE));
  const int sharing = std::max(1, ranks_per_node);
  if (pages > 0 && (state + activations) * sharing > memory)
    ORIGAMI_USER_ERROR(cfg.source, ": the model (", fmt_count(dense + expert), " parameters) needs at least ",
                       fmt_bytes(state + activations), " per rank (training state at ZeRO stage ", p.zero_stage, ": ",
                       fmt_bytes(state), "; activations of one micro-batch: ", fmt_bytes(activations), ") on ",
                       world_size, " rank(s) (tp ", p.tp, ", cp ", p.cp, ", pp ", p.pp, ", ep ", p.ep, ", etp ", p.etp,
                       "), and ", sharing, " rank(s) share this machine's ", fmt_bytes(memory),
                       " of memory; check model.num_layers, hidden_size, ffn_hidden_size, vocab_size, moe.num_experts ",
                       "and training.micro_batch, seq_len, or spread the model over more ranks");
}

void validate_for_world(const Config& cfg, int world_size) {
  const ParallelConfig& p = cfg.parallel;
  const std::string& src = cfg.source;
  // The layout rules of ARCHITECTURE.md §3 first, so a bad layout is reported
  // as such (with its numbers) whatever the engine supports today.
  try {
    comm::Layout layout(world_size, comm::LayoutOptions{p.tp, p.cp, p.pp, p.ep, p.etp, p.order, cfg.moe.num_experts});
    const TrainingConfig& t = cfg.training;
    if (t.global_batch % (t.micro_batch * layout.dp()) != 0)
      ORIGAMI_USER_ERROR("training.global_batch = ", t.global_batch,
                         " must be a multiple of training.micro_batch · DP = ", t.micro_batch, " · ", layout.dp(),
                         " = ", t.micro_batch * layout.dp(), " (DP = world size / (tp·cp·pp))");
  } catch (const UserError& e) {
    ORIGAMI_USER_ERROR(src, ": ", e.what());
  }

  // The stage rules again: callers may edit parallel.pp after loading.
  const Origins origins(src);
  check_pipeline_stages(Rules(origins), cfg.model, p);
  const ModelConfig& m = cfg.model;
  const TrainingConfig& t = cfg.training;
  if (p.tp > 1) {
    if (m.num_heads % p.tp != 0 || m.num_kv_heads % p.tp != 0)
      ORIGAMI_USER_ERROR(src, ": parallel.tp = ", p.tp, " must divide model.num_heads = ", m.num_heads,
                         " and model.num_kv_heads = ", m.num_kv_heads, " (heads split over tp)");
    if (m.ffn_hidden_size % p.tp != 0)
      ORIGAMI_USER_ERROR(src, ": parallel.tp = ", p.tp, " must divide model.ffn_hidden_size = ", m.ffn_hidden_size);
  }
  if (t.seq_len % (2 * p.cp) != 0)
    ORIGAMI_USER_ERROR(src, ": training.seq_len = ", t.seq_len, " must be a multiple of 2·parallel.cp = ", 2 * p.cp,
                       " (context parallelism cuts each sample into 2·cp chunks)");
  if ((t.micro_batch * t.seq_len / p.cp) % p.tp != 0)
    ORIGAMI_USER_ERROR(src, ": training.micro_batch · seq_len / cp = ", t.micro_batch * t.seq_len / p.cp,
                       " tokens must split evenly over parallel.tp = ", p.tp, " (sequence parallelism)");
  if (p.tp * p.cp > 1 && cfg.moe.num_experts > 0 && cfg.moe.load_balancing == moe::LoadBalancing::seq_aux_loss)
    ORIGAMI_USER_ERROR(src, ": moe.load_balancing = \"seq_aux_loss\" needs whole sequences per rank; with parallel.tp·cp = ",
                       p.tp * p.cp, " use aux_loss or global_aux_loss");
  if (cfg.moe.num_experts > 0 && p.etp > 1) {
    const int64_t F = cfg.moe.expert_ffn(cfg.model.ffn_hidden_size);
    if (F % p.etp != 0)
      ORIGAMI_USER_ERROR(src, ": parallel.etp = ", p.etp, " must divide the expert ffn size ", F,
                         " (each expert's w1/w3 rows and w2 columns split over etp)");
  }
  check_capacity_rows(cfg, t.micro_batch * t.seq_len / (p.cp * p.tp));
}

}  // namespace origami

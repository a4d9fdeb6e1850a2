// Config loading: TOML text -> toml::table (+ --set overrides) -> typed structs
// -> validation. Every failure is a UserError that names where the value came
// from (the file, or the `--set` override that wrote it), the full key and the
// rule it broke.
#include "engine/config.h"

#include <simdjson.h>
#include <toml++/toml.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <regex>
#include <sstream>
#include <string_view>
#include <variant>

#include "engine/config_rules.h"
#include "engine/files.h"
#include "kernels/check.h"

namespace origami {

std::string origins_of(const std::string& file, const std::map<std::string, std::string>& set_by,
                       std::initializer_list<std::string_view> keys) {
  std::string overrides;
  bool from_file = false;
  for (std::string_view k : keys) {
    auto it = set_by.find(std::string(k));
    if (it == set_by.end()) from_file = true;
    else if (overrides.find(it->second) == std::string::npos) overrides += (overrides.empty() ? "" : ", ") + it->second;
  }
  if (overrides.empty()) return file;
  return from_file ? file + " with " + overrides : overrides;
}

using detail::concat;

namespace config_detail {

// ---- Formatting (shared with config_rules.cpp). -----------------------------

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
  if (s.size() > 40) {
    s.resize(37);
    s += "...";
  }
  return s;
}

}  // namespace config_detail

namespace {

using config_detail::fmt;
using config_detail::show;
using config_detail::type_name;
using config_detail::Origins;

// ---- The schema: every section and key, bound to a Config's fields. ----------

// Enum keys are strings from a fixed set (enum_names); an optional float is
// absent unless the file sets it; a list key is an array of integers.
using FieldPtr = std::variant<int64_t*, uint64_t*, double*, bool*, std::string*, std::optional<double>*,
                              std::vector<int64_t>*, moe::ScoreFunction*, moe::LoadBalancing*, moe::DropPolicy*,
                              Recompute*, PipeSchedule*, dense::CpComm*, RuntimeDevice*, Precision*>;
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
const EnumNames<RuntimeDevice>& enum_names(const RuntimeDevice*) {
  static const EnumNames<RuntimeDevice> n = {
      {"cpu", RuntimeDevice::cpu}, {"cuda", RuntimeDevice::cuda}, {"auto", RuntimeDevice::auto_}};
  return n;
}
const EnumNames<Precision>& enum_names(const Precision*) {
  static const EnumNames<Precision> n = {
      {"auto", Precision::auto_}, {"fp32", Precision::fp32}, {"bf16", Precision::bf16}};
  return n;
}
const EnumNames<PipeSchedule>& enum_names(const PipeSchedule*) {
  static const EnumNames<PipeSchedule> n = {{"1f1b", PipeSchedule::one_f_one_b},
                                            {"interleaved", PipeSchedule::interleaved},
                                            {"zb-h1", PipeSchedule::zb_h1}};
  return n;
}
const EnumNames<dense::CpComm>& enum_names(const dense::CpComm*) {
  static const EnumNames<dense::CpComm> n = {{"all_gather", dense::CpComm::all_gather},
                                             {"ring", dense::CpComm::ring}};
  return n;
}
const EnumNames<moe::DropPolicy>& enum_names(const moe::DropPolicy*) {
  static const EnumNames<moe::DropPolicy> n = {{"probs", moe::DropPolicy::probs},
                                               {"position", moe::DropPolicy::position}};
  return n;
}

// moe.expert_placement is read apart from the schema: its value is a table
// (or a file holding one) that the rules resolve once every other key is
// known (config_placement.cpp).
constexpr std::string_view kPlacementKey = "expert_placement";

// Keys are exactly the struct field names (the [moe] section's spread over
// MoeConfig and its router and capacity structs); the order here breaks ties
// in did-you-mean suggestions.
std::vector<Section> schema(Config& c) {
  ModelConfig& m = c.model;
  MoeConfig& e = c.moe;
  moe::RouterOptions& r = e.router;  // [moe] keys of the router and capacity name these structs' fields
  moe::CapacityOptions& cap = e.capacity;
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
       {{"num_experts", &r.num_experts}, {"top_k", &r.top_k}, {"ffn_hidden_size", &e.ffn_hidden_size},
        {"first_dense_layers", &e.first_dense_layers}, {"layer_freq", &e.layer_freq},
        {"shared_expert_hidden_size", &e.shared_expert_hidden_size}, {"score_function", &r.score_function},
        {"normalize_topk", &r.normalize_topk}, {"topk_scaling", &r.topk_scaling}, {"num_groups", &r.num_groups},
        {"group_topk", &r.group_topk}, {"load_balancing", &r.load_balancing}, {"aux_loss_coeff", &r.aux_loss_coeff},
        {"z_loss_coeff", &r.z_loss_coeff}, {"expert_bias", &e.expert_bias},
        {"bias_update_rate", &e.bias_update_rate}, {"capacity_factor", &cap.capacity_factor},
        {"drop_policy", &cap.drop_policy}, {"pad_to_capacity", &cap.pad_to_capacity}}},
      {"parallel",
       {{"tp", &p.tp}, {"cp", &p.cp}, {"pp", &p.pp}, {"ep", &p.ep}, {"etp", &p.etp}, {"order", &p.order},
        {"zero_stage", &p.zero_stage}, {"pp_layers", &p.pp_layers},
        {"reshard_after_forward", &p.reshard_after_forward}, {"overlap_grad_reduce", &p.overlap_grad_reduce},
        {"pp_schedule", &p.pp_schedule},
        {"virtual_stages", &p.virtual_stages}, {"cp_comm", &p.cp_comm}}},
      {"training",
       {{"steps", &t.steps}, {"seq_len", &t.seq_len}, {"global_batch", &t.global_batch},
        {"micro_batch", &t.micro_batch}, {"seed", &t.seed}, {"recompute", &t.recompute}}},
      {"optimizer",
       {{"lr", &o.lr}, {"beta1", &o.beta1}, {"beta2", &o.beta2}, {"eps", &o.eps},
        {"weight_decay", &o.weight_decay}, {"clip_grad", &o.clip_grad}}},
      {"lr_schedule", {{"warmup_steps", &s.warmup_steps}, {"decay_steps", &s.decay_steps}, {"min_lr", &s.min_lr}}},
      {"data", {{"path", &c.data.path}, {"shuffle", &c.data.shuffle}}},
      {"checkpoint",
       {{"dir", &c.checkpoint.dir}, {"interval", &c.checkpoint.interval}, {"keep", &c.checkpoint.keep},
        {"load", &c.checkpoint.load}, {"async", &c.checkpoint.async},
        {"init_from_hf", &c.checkpoint.init_from_hf}}},
      {"export", {{"dir", &c.exp.dir}}},
      {"logging", {{"dir", &c.logging.dir}, {"interval", &c.logging.interval}}},
      {"runtime",
       {{"threads", &c.runtime.threads}, {"collective_timeout_s", &c.runtime.collective_timeout_s},
        {"io_timeout_s", &c.runtime.io_timeout_s}, {"device", &c.runtime.device}, {"precision", &c.runtime.precision}}},
  };
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

// The names users bring from Megatron-LM's arguments (dashes as
// underscores, without "--"; "moe_" prefixes kept) and from Hugging Face
// configs, for keys whose names here differ: a suggestion, not an alias (a
// config has one spelling of each key).
const std::map<std::string, std::string, std::less<>>& foreign_names() {
  static const std::map<std::string, std::string, std::less<>> names = {
      {"num_attention_heads", "model.num_heads"}, {"num_query_groups", "model.num_kv_heads"},
      {"num_key_value_heads", "model.num_kv_heads"}, {"intermediate_size", "model.ffn_hidden_size"},
      {"num_hidden_layers", "model.num_layers"}, {"rotary_base", "model.rope_theta"},
      {"norm_epsilon", "model.norm_eps"}, {"rms_norm_eps", "model.norm_eps"}, {"init_method_std", "model.init_std"},
      {"initializer_range", "model.init_std"}, {"padded_vocab_size", "model.vocab_size"},
      {"num_local_experts", "moe.num_experts"}, {"num_experts_per_tok", "moe.top_k"},
      {"moe_router_topk", "moe.top_k"}, {"moe_ffn_hidden_size", "moe.ffn_hidden_size"},
      {"moe_intermediate_size", "moe.ffn_hidden_size"}, {"moe_aux_loss_coeff", "moe.aux_loss_coeff"},
      {"router_aux_loss_coef", "moe.aux_loss_coeff"}, {"moe_z_loss_coeff", "moe.z_loss_coeff"},
      {"moe_router_load_balancing_type", "moe.load_balancing"}, {"moe_expert_capacity_factor", "moe.capacity_factor"},
      {"moe_token_drop_policy", "moe.drop_policy"}, {"moe_pad_expert_input_to_capacity", "moe.pad_to_capacity"},
      {"moe_shared_expert_intermediate_size", "moe.shared_expert_hidden_size"},
      {"moe_router_score_function", "moe.score_function"}, {"moe_router_topk_scaling_factor", "moe.topk_scaling"},
      {"moe_router_num_groups", "moe.num_groups"}, {"moe_router_group_topk", "moe.group_topk"},
      {"moe_router_enable_expert_bias", "moe.expert_bias"}, {"moe_router_bias_update_rate", "moe.bias_update_rate"},
      {"moe_layer_freq", "moe.layer_freq"}, {"tensor_model_parallel_size", "parallel.tp"},
      {"pipeline_model_parallel_size", "parallel.pp"}, {"context_parallel_size", "parallel.cp"},
      {"expert_model_parallel_size", "parallel.ep"}, {"expert_tensor_parallel_size", "parallel.etp"},
      {"virtual_pipeline_model_parallel_size", "parallel.virtual_stages"},
      {"seq_length", "training.seq_len"},
      {"micro_batch_size", "training.micro_batch"}, {"global_batch_size", "training.global_batch"},
      {"train_iters", "training.steps"}, {"max_steps", "training.steps"},
      {"recompute_granularity", "training.recompute"}, {"learning_rate", "optimizer.lr"},
      {"adam_beta1", "optimizer.beta1"}, {"adam_beta2", "optimizer.beta2"}, {"adam_eps", "optimizer.eps"},
      {"adam_epsilon", "optimizer.eps"}, {"max_grad_norm", "optimizer.clip_grad"},
      {"lr_warmup_iters", "lr_schedule.warmup_steps"}, {"warmup_steps", "lr_schedule.warmup_steps"},
      {"lr_decay_iters", "lr_schedule.decay_steps"}, {"data_path", "data.path"}, {"save", "checkpoint.dir"},
      {"save_interval", "checkpoint.interval"}, {"log_interval", "logging.interval"},
  };
  return names;
}

// ---- Reading the table into the structs. -------------------------------------

[[noreturn]] void unknown_key(const std::vector<Section>& sections, const Section& sec, std::string_view key,
                              const std::string& origin) {
  const std::string full = concat(sec.name, ".", key);
  std::string hint;
  std::string foreign = lower(key);
  std::replace(foreign.begin(), foreign.end(), '-', '_');
  if (foreign.starts_with("__")) foreign.erase(0, 2);
  // A key placed in the wrong section is the likeliest slip; then another
  // engine's name; then a typo.
  std::string elsewhere;
  for (const Section& s : sections)
    for (const Field& f : s.fields)
      if (&s != &sec && f.key == key) elsewhere += concat(elsewhere.empty() ? "" : " or ", "'", s.name, ".", key, "'");
  if (sec.name == "parallel" && (key == "dp" || key == "edp")) {
    hint = " (data-parallel sizes are derived: dp = world / (tp·cp·pp), edp = world / (etp·ep·pp))";
  } else if (!elsewhere.empty()) {
    hint = concat(" (did you mean ", elsewhere, "?)");
  } else if (auto it = foreign_names().find(foreign); it != foreign_names().end()) {
    hint = concat(" (Megatron-LM's or Hugging Face's name; origami's key is '", it->second, "')");
  } else {
    std::vector<std::string_view> keys;
    for (const Field& f : sec.fields) keys.push_back(f.key);
    if (sec.name == "moe") keys.push_back(kPlacementKey);
    if (auto c = closest(key, keys)) hint = concat(" (did you mean '", sec.name, ".", *c, "'?)");
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

std::string trim(std::string_view s);  // below, with the overrides

void assign(const Field& f, const toml::node& v, const std::string& key, const std::string& origin) {
  auto wrong = [&](std::string_view expected) {
    // A --set value that reads as TOML is taken as one: 2024 is an integer.
    // The hint quotes what was typed (1e5, not the 100000.0 it parsed to).
    const size_t eq = origin.find('=');
    const bool quote = expected == "a string" && origin.starts_with("--set ") && eq != std::string::npos &&
                       !v.is_table() && !v.is_array();
    ORIGAMI_USER_ERROR(origin, ": ", key, " = ", show(v), ": expected ", expected, ", got ", type_name(v),
                       quote ? concat(" (quote it as TOML: --set '", key, "=\"", trim(origin.substr(eq + 1)), "\"')")
                             : "");
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

// `placement` receives moe.expert_placement as written (kPlacementKey).
void read_table(const toml::table& root, Config& cfg, const Origins& origins,
                config_detail::PlacementInput& placement) {
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
      if (name == "moe" && kk.str() == kPlacementKey) {
        placement = config_detail::read_placement(v, origins.of(full));
        continue;
      }
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
  // A TOML file is UTF-8 (toml++ refuses one that is not); so is an
  // override, which the checkpoint's metadata.json and metrics carry as JSON.
  if (!simdjson::validate_utf8(ov.data(), ov.size())) {
    std::string shown;  // the bytes as the shell's $'...' writes them
    for (const unsigned char c : shorten(ov))
      shown += c >= 0x20 && c < 0x7f ? std::string(1, static_cast<char>(c)) : concat("\\x", "0123456789abcdef"[c >> 4], "0123456789abcdef"[c & 15]);
    ORIGAMI_USER_ERROR("--set ", shown, ": not valid UTF-8 text (rule: config keys and values are UTF-8, as in a TOML file)");
  }
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
  // e.g. a bare word or a path, the text itself as a string. A text that
  // only a TOML value begins or looks like (a quote, a bracket or brace, a
  // number) but does not parse is a mistake, not a string: taken as one, an
  // unclosed quote would become part of a path.
  std::optional<toml::table> parsed;
  std::string parse_problem;
  try {
    const std::string doc = "v = " + text;
    parsed = toml::parse(std::string_view(doc), std::string_view("--set"));
  } catch (const toml::parse_error& err) {
    parse_problem = std::string(err.description());
  }
  if (parsed && parsed->size() == 1 && parsed->contains("v")) {
    sec->insert_or_assign(key, std::move(*parsed->get("v")));
  } else {
    // A number in TOML's form that TOML could not hold (past 64 bits, past
    // a double); "1f1b" or "3rd" stay words.
    // TOML's own grammar: no leading zeros, underscores only between digits
    // ("0001" and "1_" are words).
    static const std::regex number(
        R"([+-]?(0|[1-9](_?[0-9])*)(\.[0-9](_?[0-9])*)?([eE][+-]?[0-9](_?[0-9])*)?)");
    const bool numeric = std::regex_match(text, number);
    if (numeric)
      ORIGAMI_USER_ERROR(origin, ": ", lhs, " = ", shorten(text), ": not a TOML value (", parse_problem,
                         "; rule: a number must be one whole TOML number: integers are 64-bit signed, floats finite "
                         "doubles; where the key takes a string, quote it: --set '", lhs, "=\"", shorten(text), "\"')");
    if (!text.empty() && std::string_view("\"'[{").find(text[0]) != std::string_view::npos) {
      const char closer = text[0] == '[' ? ']' : text[0] == '{' ? '}' : text[0];
      const bool unclosed = text.size() < 2 || text.back() != closer;
      ORIGAMI_USER_ERROR(origin, ": ", lhs, " = ", shorten(text), ": not a TOML value (", parse_problem,
                         "; rule: a value that begins as a string, array or table must be one whole TOML value",
                         unclosed ? concat(": close its ", text[0] == '[' ? "bracket" : text[0] == '{' ? "brace" : "quote")
                                  : std::string(), ")");
    }
    sec->insert_or_assign(key, text);
  }
  origins.set(concat(section, ".", key), origin);
}

Config parse_table(toml::table root, const std::string& source, const std::vector<std::string>& overrides) {
  Origins origins(source);
  for (const std::string& ov : overrides) apply_override(root, ov, origins);
  Config cfg;
  cfg.source = source;
  config_detail::PlacementInput placement;
  read_table(root, cfg, origins, placement);
  // Megatron's default: expert_tensor_parallel_size = tensor_model_parallel_size.
  const toml::table* par = root["parallel"].as_table();
  if (!par || !par->contains("etp")) cfg.parallel.etp = cfg.parallel.tp;
  // The cosine's floor follows the peak unless given: a tenth of it, the
  // usual recipe (Mixtral's, Llama's), so lowering optimizer.lr alone works.
  const toml::table* sched = root["lr_schedule"].as_table();
  // Rounded to 15 digits, so 3e-3 gives 3e-4 as written, not 3.0000000000000003e-4.
  if (!sched || !sched->contains("min_lr")) {
    char tenth[32];
    std::snprintf(tenth, sizeof tenth, "%.15g", cfg.optimizer.lr / 10);
    cfg.lr_schedule.min_lr = std::strtod(tenth, nullptr);
  }
  config_detail::validate(cfg, origins);
  cfg.moe.expert_placement = config_detail::resolve_placement(placement, cfg, origins);
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

std::string_view load_balancing_name(moe::LoadBalancing lb) {
  for (const auto& [name, value] : enum_names(static_cast<const moe::LoadBalancing*>(nullptr)))
    if (value == lb) return name;
  ORIGAMI_CHECK(false, "load balancing ", static_cast<int>(lb), " has no name");
  return {};
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
      // The resolved placement itself, never the path it was read from.
      if (sec.name == "moe" && &f == &sec.fields.back() && cfg.moe.expert_placement.ep > 0)
        out += concat("moe.", kPlacementKey, " = ", config_detail::placement_toml(cfg.moe.expert_placement), "\n");
    }
  return out;
}

}  // namespace origami

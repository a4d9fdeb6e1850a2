// moe.expert_placement (see config_rules.h): reading the table — inline, or
// from the placement file a string value names (what `origami imbalance
// --place` writes) — and the rules that admit it. The format:
//   [moe.expert_placement]
//   ep = 4
//   [moe.expert_placement.layers]
//   1 = [[0, 5], [1, 2], [3, 4], [6, 7]]   # layer 1: EP rank r holds list r
// Every failure is a UserError naming the file (the config, the --set
// override or the placement file), the full key and the rule.
#include <algorithm>
#include <cctype>
#include <charconv>

#include "engine/config_rules.h"
#include "engine/files.h"
#include "kernels/check.h"

namespace origami::config_detail {

using detail::concat;

namespace {

constexpr const char* kKey = "moe.expert_placement";
constexpr int64_t kMaxFileBytes = int64_t{16} << 20;

// The table a placement file holds: [moe.expert_placement] and nothing else
// (a placement file is not a config: a stray key there would be ignored).
const toml::table& placement_table_of_file(const toml::table& root, const std::string& where) {
  for (auto&& [k, v] : root)
    if (k.str() != "moe")
      ORIGAMI_USER_ERROR(where, ": unknown key '", k.str(), "': a placement file holds only the [", kKey, "] table");
  const toml::table* moe = root["moe"].as_table();
  if (moe)
    for (auto&& [k, v] : *moe)
      if (k.str() != "expert_placement")
        ORIGAMI_USER_ERROR(where, ": unknown key 'moe.", k.str(), "': a placement file holds only the [", kKey,
                           "] table");
  const toml::table* table = moe ? (*moe)["expert_placement"].as_table() : nullptr;
  if (!table) ORIGAMI_USER_ERROR(where, ": no [", kKey, "] table (rule: a placement file holds one)");
  return *table;
}

// "1" -> 1: a layer index in bare-key digits.
int64_t layer_index(std::string_view key, const std::string& where) {
  int64_t v = -1;
  const bool digits = !key.empty() && std::all_of(key.begin(), key.end(), [](char ch) {
    return std::isdigit(static_cast<unsigned char>(ch)) != 0;
  });
  const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), v);
  if (!digits || ec != std::errc() || end != key.data() + key.size())
    ORIGAMI_USER_ERROR(where, ": ", kKey, ".layers.", shorten(key),
                       ": keys of the layers table are MoE layer indices (digits, e.g. 1 = [[0, 5], [1, 2]])");
  return v;
}

std::vector<std::vector<int64_t>> rank_lists(const toml::node& v, const std::string& key, const std::string& where) {
  auto wrong = [&](const std::string& what) {
    ORIGAMI_USER_ERROR(where, ": ", key, " = ", show(v), ": expected an array of one expert list per EP rank ",
                       "(e.g. [[0, 5], [1, 2]]), ", what);
  };
  const toml::array* ranks = v.as_array();
  if (!ranks) wrong(concat("got ", type_name(v)));
  std::vector<std::vector<int64_t>> out;
  for (size_t r = 0; r < ranks->size(); ++r) {
    const toml::array* list = ranks->get(r)->as_array();
    if (!list) wrong(concat("got ", type_name(*ranks->get(r)), " for EP rank ", r));
    std::vector<int64_t> experts;
    for (size_t i = 0; i < list->size(); ++i) {
      const toml::node& e = *list->get(i);
      if (!e.is_integer()) wrong(concat("got ", type_name(e), " at EP rank ", r, ", index ", i));
      experts.push_back(e.as_integer()->get());
    }
    out.push_back(std::move(experts));
  }
  return out;
}

}  // namespace

PlacementInput read_placement(const toml::node& value, const std::string& origin) {
  PlacementInput in;
  in.given = true;
  toml::table file_root;  // a placement file's contents
  const toml::table* table = value.as_table();
  if (const auto* path = value.as_string()) {
    const std::string file = path->get();
    if (file.empty())
      ORIGAMI_USER_ERROR(origin, ": ", kKey, " = \"\": an empty path names no placement file (leave the key out "
                         "for contiguous blocks of experts)");
    std::string text;
    try {
      text = InputFile(file, "expert placement file").read_all(kMaxFileBytes);
    } catch (const UserError& e) {
      ORIGAMI_USER_ERROR(origin, ": ", kKey, " = ", fmt(file), ": ", e.what());
    }
    in.where = concat(file, " (", kKey, " of ", origin, ")");
    try {
      file_root = toml::parse(text, file);
    } catch (const toml::parse_error& err) {
      const toml::source_position& at = err.source().begin;
      ORIGAMI_USER_ERROR(file, ":", at.line, ":", at.column, ": TOML syntax error: ", err.description(), " (the ",
                         kKey, " of ", origin, ")");
    }
    table = &placement_table_of_file(file_root, in.where);
  } else if (table) {
    in.where = origin;
  } else {
    ORIGAMI_USER_ERROR(origin, ": ", kKey, " = ", show(value), ": expected a path (a string) to a placement file ",
                       "or the [", kKey, "] table, got ", type_name(value));
  }

  bool has_ep = false;
  for (auto&& [k, v] : *table) {
    const std::string key = concat(kKey, ".", k.str());
    if (k.str() == "ep") {
      if (!v.is_integer())
        ORIGAMI_USER_ERROR(in.where, ": ", key, " = ", show(v), ": expected an integer, got ", type_name(v));
      in.ep = v.as_integer()->get();
      has_ep = true;
    } else if (k.str() == "layers") {
      const toml::table* layers = v.as_table();
      if (!layers)
        ORIGAMI_USER_ERROR(in.where, ": ", key, " = ", show(v), ": expected a table ([", key, "]), got ", type_name(v));
      for (auto&& [lk, lv] : *layers) {
        const std::string lkey = concat(key, ".", lk.str());
        in.layers.push_back({std::string(lk.str()), layer_index(lk.str(), in.where), rank_lists(lv, lkey, in.where)});
      }
    } else {
      ORIGAMI_USER_ERROR(in.where, ": unknown key '", key, "' (the keys of [", kKey, "] are ep and layers)");
    }
  }
  if (!has_ep) ORIGAMI_USER_ERROR(in.where, ": ", kKey, ".ep: missing (the EP size the placement is for)");
  return in;
}

moe::ExpertPlacements resolve_placement(const PlacementInput& in, const Config& c, const Origins& o) {
  if (!in.given) return {};
  const std::string& at = in.where;
  const int64_t E = c.moe.router.num_experts, ep = in.ep;
  if (E == 0) ORIGAMI_USER_ERROR(at, ": ", kKey, ": the model has no MoE layers (moe.num_experts = 0)");
  if (ep < 1) ORIGAMI_USER_ERROR(at, ": ", kKey, ".ep = ", ep, ": must be >= 1");
  if (ep != c.parallel.ep)
    ORIGAMI_USER_ERROR(at, ": ", kKey, ".ep = ", ep, ": must equal parallel.ep = ", c.parallel.ep, " (",
                       o.of("parallel.ep"), "): a placement names the experts of each EP rank of the run's layout");
  if (E % ep != 0)
    ORIGAMI_USER_ERROR(at, ": ", kKey, ".ep = ", ep, ": must divide moe.num_experts = ", E,
                       " (every EP rank holds as many experts)");
  const int64_t El = E / ep;
  std::string moe_layers;  // for the message of a layer that is not MoE
  for (int64_t l = 0, shown = 0; l < c.model.num_layers && shown <= 8; ++l)
    if (c.moe.is_moe_layer(l)) moe_layers += ++shown > 8 ? ", ..." : concat(shown > 1 ? ", " : "", l);

  moe::ExpertPlacements out;
  out.ep = ep;
  for (const PlacementInput::Layer& layer : in.layers) {
    const std::string key = concat(kKey, ".layers.", layer.key);
    const int64_t l = layer.layer;
    if (l >= c.model.num_layers || !c.moe.is_moe_layer(l))
      ORIGAMI_USER_ERROR(at, ": ", key, ": layer ", l, " is not a MoE layer (the MoE layers are ", moe_layers,
                         ": model.num_layers = ", c.model.num_layers, ", moe.first_dense_layers = ",
                         c.moe.first_dense_layers, ", moe.layer_freq = ", c.moe.layer_freq, ")");
    if (out.layers.count(l)) ORIGAMI_USER_ERROR(at, ": ", key, ": layer ", l, " is listed twice");
    const auto& lists = layer.experts_per_rank;
    if (static_cast<int64_t>(lists.size()) != ep)
      ORIGAMI_USER_ERROR(at, ": ", key, ": lists ", lists.size(), " EP rank(s); must list exactly ep = ", ep,
                         " (one list of experts per EP rank, in rank order)");
    std::vector<int64_t> owner(static_cast<size_t>(E), -1);
    for (int64_t r = 0; r < ep; ++r) {
      const std::vector<int64_t>& mine = lists[static_cast<size_t>(r)];
      if (static_cast<int64_t>(mine.size()) != El)
        ORIGAMI_USER_ERROR(at, ": ", key, ": EP rank ", r, " lists ", mine.size(), " expert(s), ", fmt(mine),
                           "; every EP rank holds moe.num_experts / ep = ", E, " / ", ep, " = ", El);
      for (const int64_t e : mine) {
        if (e < 0 || e >= E)
          ORIGAMI_USER_ERROR(at, ": ", key, ": EP rank ", r, " lists expert ", e, ", outside 0..", E - 1,
                             " (moe.num_experts = ", E, ")");
        int64_t& o_e = owner[static_cast<size_t>(e)];
        if (o_e >= 0)
          ORIGAMI_USER_ERROR(at, ": ", key, ": expert ", e, " is listed ",
                             o_e == r ? concat("twice by EP rank ", r) : concat("by EP ranks ", o_e, " and ", r),
                             "; every expert 0..", E - 1, " appears exactly once per layer");
        o_e = r;
      }
    }
    out.layers.emplace(l, moe::ExpertPlacement::from_ranks(lists));
  }
  return out;
}

std::string placement_toml(const moe::ExpertPlacements& p) {
  std::string layers;
  for (const auto& [l, placement] : p.layers) {
    std::string ranks;
    for (int64_t r = 0; r < placement.ep(); ++r) ranks += concat(r ? ", " : "", fmt(placement.local_experts(r)));
    layers += concat(layers.empty() ? "" : ", ", l, " = [", ranks, "]");
  }
  return concat("{ ep = ", p.ep, ", layers = {", layers.empty() ? "" : " ", layers, layers.empty() ? "" : " ", "} }");
}

}  // namespace origami::config_detail

// Internals shared by the config loader (config.cpp: schema, reading,
// overrides) and its rules (config_rules.cpp: validation): where each value
// came from, how values are quoted in messages, and moe.expert_placement
// (config_placement.cpp), which is read apart from the schema. Not for other
// modules.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <toml++/toml.h>

#include "engine/config.h"

namespace origami::config_detail {

// Values as TOML text: 3, 0.003 (shortest round trip), [2, 2], "quoted".
std::string fmt(int64_t v);
std::string fmt(double v);
std::string fmt(const std::vector<int64_t>& v);
std::string fmt(const std::string& v);
// A TOML node for messages: its type ("an integer") and its value as TOML
// text, shortened.
std::string type_name(const toml::node& n);
std::string show(const toml::node& n);

// Where each value came from: the file, unless a --set override wrote the
// key (or created the section).
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
  // For a rule on several keys (origins_of, engine/config.h).
  std::string of(std::initializer_list<std::string_view> keys) const { return origins_of(file_, by_key_, keys); }

 private:
  std::string file_;
  std::map<std::string, std::string> by_key_;
};

// Every rule on the loaded values (ranges, limits, keys tied together);
// UserError naming the origin, the key and the rule.
void validate(const Config& c, const Origins& o);

// moe.expert_placement as written, before the rules that tie it to the rest
// of the config: the [moe.expert_placement] table of the config itself or of
// the placement file its string value names.
struct PlacementInput {
  bool given = false;
  std::string where;  // for messages: the config (or --set), or "<file> (moe.expert_placement of <config>)"
  int64_t ep = 0;
  struct Layer {
    std::string key;  // as written: the layer index in bare-key digits
    int64_t layer = 0;
    std::vector<std::vector<int64_t>> experts_per_rank;
  };
  std::vector<Layer> layers;  // in the table's order
};
// The value of moe.expert_placement (from `origin`): a path (relative to the
// current directory, like data.path) of a TOML file holding only the
// [moe.expert_placement] table, or that table inline. Checks the keys and
// types; UserError naming the file, the key and the rule.
PlacementInput read_placement(const toml::node& value, const std::string& origin);
// The rules against the rest of the config (ep = parallel.ep, MoE layers
// only, one list per EP rank of E/ep experts, each expert once per layer)
// and the placements they admit.
moe::ExpertPlacements resolve_placement(const PlacementInput& in, const Config& c, const Origins& o);
// The resolved placement as one TOML inline table (canonical_text):
// { ep = 4, layers = { 1 = [[0, 5], [1, 2], [3, 4], [6, 7]] } }, each rank's
// experts ascending.
std::string placement_toml(const moe::ExpertPlacements& p);

}  // namespace origami::config_detail

// Internals shared by the config loader (config.cpp: schema, reading,
// overrides) and its rules (config_rules.cpp: validation): where each value
// came from, and how values are quoted in messages. Not for other modules.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "engine/config.h"

namespace origami::config_detail {

// Values as TOML text: 3, 0.003 (shortest round trip), [2, 2], "quoted".
std::string fmt(int64_t v);
std::string fmt(double v);
std::string fmt(const std::vector<int64_t>& v);
std::string fmt(const std::string& v);

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

// Every rule on the loaded values (ranges, limits, keys tied together);
// UserError naming the origin, the key and the rule.
void validate(const Config& c, const Origins& o);

}  // namespace origami::config_detail

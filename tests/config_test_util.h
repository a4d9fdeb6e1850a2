// Shared by the config tests: a minimal valid config and a check that a
// parse fails with a UserError naming every given fragment.
#pragma once
#include <gtest/gtest.h>

#include <initializer_list>
#include <string>
#include <vector>

#include "engine/config.h"
#include "kernels/check.h"

namespace origami::testing {

inline const char* kFile = "test.toml";
// The smallest config that passes validation with every other key defaulted.
inline const char* kMinimal = "[data]\npath = \"data/x\"\n";

// Parses `text` expecting a UserError whose message contains every fragment.
inline void expect_error(const std::string& text, std::initializer_list<std::string> fragments,
                         const std::vector<std::string>& overrides = {}) {
  try {
    parse_config(text, kFile, overrides);
    ADD_FAILURE() << "no UserError for:\n" << text;
  } catch (const UserError& e) {
    const std::string msg = e.what();
    for (const std::string& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "'" << f << "' not in: " << msg;
  }
}

}  // namespace origami::testing

// A whole JSON file read and parsed: the one way the engine reads the JSON
// it is given (checkpoint metadata, Hugging Face config.json and index).
// Invariant: a file that cannot be read, is larger than the caller's bound
// or is not valid JSON is a UserError naming the file.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "engine/files.h"
#include "kernels/check.h"

namespace origami {

// `what` names the file's role in messages ("checkpoint metadata");
// Json: nlohmann::json, or ordered_json to keep the file's key order.
template <class Json = nlohmann::json>
Json read_json_file(const std::string& path, std::string_view what, int64_t max_bytes) {
  const InputFile in(path, what);
  try {
    return Json::parse(in.read_all(max_bytes));
  } catch (const typename Json::exception& e) {
    ORIGAMI_USER_ERROR(path, ": not valid JSON: ", e.what());
  }
}

}  // namespace origami

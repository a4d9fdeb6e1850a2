// Preprocess: text, JSONL or fortune files -> a Megatron indexed dataset with
// the byte-level tokenizer (ARCHITECTURE.md §8).
//
// Invariants of the output:
//   - token = byte value 0..255; kEodToken = 256 ends every document, so the
//     vocabulary is kByteVocabSize = 257 and tokens are stored as u16;
//   - one sequence per document, in input order (files in the order given,
//     records in file order); empty documents are skipped in every format;
//   - outputs appear only when the whole run succeeds (the writer renames its
//     temporaries at the end), so a failed run leaves no half dataset.
// Bad input (missing file, bad JSONL line, no documents at all) is a UserError
// naming the file, the line and byte offset where it applies, and the rule.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace origami {

inline constexpr int32_t kEodToken = 256;
inline constexpr int64_t kByteVocabSize = 257;

struct PreprocessOptions {
  enum class Format {
    text,     // each input file is one document
    jsonl,    // one JSON object per line; its string field "text" is a document
    fortune,  // fortune(6) files: entries separated by lines that are just "%"
  };
  std::vector<std::string> inputs;
  std::string output_prefix;  // writes output_prefix.bin and output_prefix.idx
  Format format = Format::text;
};

struct PreprocessStats {
  int64_t documents = 0;  // sequences written
  int64_t tokens = 0;     // including one EOD per document
  int64_t bytes = 0;      // input bytes read (sum of the input files' sizes)
  std::string bin_path;
  std::string idx_path;
};

// Parses "text" | "jsonl" | "fortune"; UserError otherwise.
PreprocessOptions::Format parse_preprocess_format(std::string_view name);

// Runs the conversion. `progress` (may be empty) is called with input bytes
// done and total, now and then and once at the end with done == total.
PreprocessStats run_preprocess(const PreprocessOptions& options,
                               std::function<void(int64_t bytes_done, int64_t bytes_total)> progress);

}  // namespace origami

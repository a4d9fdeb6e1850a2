// Preprocess: reads text / JSONL / fortune inputs, byte-tokenizes each
// document (+EOD) and streams it into an IndexedDatasetWriter.
#include "engine/preprocess.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "engine/indexed_dataset.h"
#include "kernels/check.h"

namespace origami {

namespace {

constexpr int64_t kProgressEvery = int64_t{1} << 20;  // bytes between progress calls
constexpr int64_t kTextChunkBytes = int64_t{1} << 20;  // a text input is read and written in pieces of this size
// A document's tokens, one per byte and its EOD, are counted by the index's
// i32 size field.
constexpr int64_t kMaxDocumentBytes = std::numeric_limits<int32_t>::max() - 1;
constexpr const char* kJsonlRule = "JSONL input holds one JSON object per line with a string field \"text\"";

std::ifstream open_input(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    ORIGAMI_USER_ERROR(path, ": cannot open: ", std::strerror(errno),
                       " (rule: every input must be an existing, readable file)");
  }
  return in;
}

// getline stops at EOF and at a read error alike: only badbit tells them apart.
void check_read(const std::ifstream& in, const std::string& path, int64_t offset) {
  if (in.bad())
    ORIGAMI_USER_ERROR(path, ": byte offset ", offset, ": read failed: ", std::strerror(errno),
                       " (rule: every input must be an existing, readable file)");
}

bool is_blank(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; });
}

void check_document_bytes(int64_t bytes, const std::string& path, int64_t offset) {
  if (bytes > kMaxDocumentBytes)
    ORIGAMI_USER_ERROR(path, ": byte offset ", offset, ": a document of ", bytes,
                       " bytes (rule: a document holds at most 2^31-1 tokens, one per byte and its EOD, since the "
                       "index stores its size as an i32; split it)");
}

// Tokenizes documents into the writer and reports progress in input bytes.
class Sink {
 public:
  Sink(IndexedDatasetWriter& writer, int64_t total, std::function<void(int64_t, int64_t)>& progress)
      : writer_(writer), total_(total), progress_(progress) {}

  // One whole document found at `offset` of `path`.
  void document(std::string_view text, const std::string& path, int64_t offset) {
    if (text.empty()) return;
    check_document_bytes(static_cast<int64_t>(text.size()), path, offset);
    append(text);
    end_document();
  }
  // A document written in pieces (a text file), then ended.
  void append(std::string_view text) {
    tokens_.clear();
    for (char c : text) tokens_.push_back(static_cast<int32_t>(static_cast<unsigned char>(c)));
    writer_.append(tokens_);
  }
  void end_document() {
    const int32_t eod = kEodToken;
    writer_.append({&eod, 1});
    writer_.end_document();
  }
  void advance(int64_t bytes) {
    done_ = std::min(total_, done_ + bytes);
    if (progress_ && done_ - reported_ >= kProgressEvery) {
      reported_ = done_;
      progress_(done_, total_);
    }
  }
  void finish() {
    done_ = total_;
    if (progress_) progress_(done_, total_);
  }

 private:
  IndexedDatasetWriter& writer_;
  int64_t total_;
  std::function<void(int64_t, int64_t)>& progress_;
  int64_t done_ = 0;
  int64_t reported_ = 0;
  std::vector<int32_t> tokens_;
};

// The whole file is one document, streamed: memory stays at one chunk
// whatever the file's size.
void read_text(const std::string& path, int64_t file_bytes, Sink& sink) {
  if (file_bytes == 0) return;  // an empty document (and run_preprocess checked the size)
  std::ifstream in = open_input(path);
  std::string chunk(static_cast<size_t>(std::min(file_bytes, kTextChunkBytes)), '\0');
  for (int64_t done = 0; done < file_bytes;) {
    const int64_t want = std::min(file_bytes - done, kTextChunkBytes);
    in.read(chunk.data(), want);
    if (in.gcount() != want) {
      const int64_t read = done + in.gcount();
      ORIGAMI_USER_ERROR(path, ": byte offset ", read, ": read ", read, " of ", file_bytes,
                         " bytes (rule: inputs must not change while preprocess runs)");
    }
    sink.append(std::string_view(chunk.data(), static_cast<size_t>(want)));
    done += want;
    sink.advance(want);
  }
  sink.end_document();
}

void read_jsonl(const std::string& path, Sink& sink) {
  std::ifstream in = open_input(path);
  std::string line;
  int64_t line_no = 0;
  int64_t offset = 0;  // byte offset of the current line's start
  while (std::getline(in, line)) {
    ++line_no;
    const int64_t line_bytes = static_cast<int64_t>(line.size()) + 1;
    if (!is_blank(line)) {
      auto where = [&] { return detail::concat(path, ": line ", line_no, " (byte offset ", offset, "): "); };
      nlohmann::json record;
      try {
        record = nlohmann::json::parse(line);
      } catch (const nlohmann::json::parse_error& e) {
        ORIGAMI_USER_ERROR(where(), "not valid JSON: ", e.what(), " (rule: ", kJsonlRule, ")");
      }
      if (!record.is_object()) {
        ORIGAMI_USER_ERROR(where(), "expected a JSON object, got ", record.type_name(), " (rule: ", kJsonlRule,
                           ")");
      }
      auto it = record.find("text");
      if (it == record.end()) {
        ORIGAMI_USER_ERROR(where(), "the object has no field \"text\" (rule: ", kJsonlRule, ")");
      }
      if (!it->is_string()) {
        ORIGAMI_USER_ERROR(where(), "field \"text\" is a JSON ", it->type_name(), ", not a string (rule: ",
                           kJsonlRule, ")");
      }
      sink.document(it->get_ref<const std::string&>(), path, offset);
    }
    offset += line_bytes;
    sink.advance(line_bytes);
  }
  check_read(in, path, offset);
}

// fortune(6) format: an entry is the lines between separator lines "%"; it
// keeps its newlines. Blank entries (e.g. "%\n%\n") are skipped.
void read_fortune(const std::string& path, Sink& sink) {
  std::ifstream in = open_input(path);
  std::string line;
  std::string entry;
  int64_t offset = 0;
  int64_t entry_offset = 0;  // where the entry's first line starts
  auto flush = [&] {
    if (!is_blank(entry)) sink.document(entry, path, entry_offset);
    entry.clear();
  };
  while (std::getline(in, line)) {
    const int64_t line_bytes = static_cast<int64_t>(line.size()) + 1;
    if (line == "%" || line == "%\r") {
      flush();
      entry_offset = offset + line_bytes;
    } else {
      entry += line;
      entry += '\n';
    }
    offset += line_bytes;
    sink.advance(line_bytes);
  }
  check_read(in, path, offset);
  flush();
}

}  // namespace

PreprocessOptions::Format parse_preprocess_format(std::string_view name) {
  if (name == "text") return PreprocessOptions::Format::text;
  if (name == "jsonl") return PreprocessOptions::Format::jsonl;
  if (name == "fortune") return PreprocessOptions::Format::fortune;
  ORIGAMI_USER_ERROR("--format: unknown format \"", name, "\" (rule: one of text, jsonl, fortune)");
}

PreprocessStats run_preprocess(const PreprocessOptions& options,
                               std::function<void(int64_t bytes_done, int64_t bytes_total)> progress) {
  if (options.inputs.empty()) ORIGAMI_USER_ERROR("preprocess: no input files (rule: give at least one --input)");
  if (options.output_prefix.empty()) {
    ORIGAMI_USER_ERROR("preprocess: empty output prefix (rule: --output-prefix names the .bin/.idx pair)");
  }
  // Validate every input before writing anything.
  std::vector<int64_t> sizes;
  int64_t total = 0;
  for (const std::string& path : options.inputs) {
    std::error_code ec;
    const bool regular = std::filesystem::is_regular_file(path, ec);
    const auto bytes = regular ? std::filesystem::file_size(path, ec) : 0;
    if (!regular || ec) {
      ORIGAMI_USER_ERROR(path, ": cannot read: ", ec ? ec.message() : "not a regular file",
                         " (rule: every input must be an existing, readable file)");
    }
    // A text file is one document: one too large is refused before any input is read.
    if (options.format == PreprocessOptions::Format::text) check_document_bytes(static_cast<int64_t>(bytes), path, 0);
    sizes.push_back(static_cast<int64_t>(bytes));
    total += static_cast<int64_t>(bytes);
  }

  IndexedDatasetWriter writer(options.output_prefix, smallest_token_dtype(kByteVocabSize));
  Sink sink(writer, total, progress);
  for (size_t f = 0; f < options.inputs.size(); ++f) {
    const std::string& path = options.inputs[f];
    switch (options.format) {
      case PreprocessOptions::Format::text: read_text(path, sizes[f], sink); break;
      case PreprocessOptions::Format::jsonl: read_jsonl(path, sink); break;
      case PreprocessOptions::Format::fortune: read_fortune(path, sink); break;
    }
  }
  if (writer.num_sequences() == 0) {
    std::string names;
    for (const std::string& p : options.inputs) names += (names.empty() ? "" : ", ") + p;
    ORIGAMI_USER_ERROR(names, ": no documents found (rule: preprocess needs at least one non-empty document)");
  }
  PreprocessStats stats;
  stats.documents = writer.num_sequences();
  stats.tokens = writer.num_tokens();
  stats.bytes = total;
  stats.bin_path = writer.bin_path();
  stats.idx_path = writer.idx_path();
  writer.finalize();
  sink.finish();
  return stats;
}

}  // namespace origami

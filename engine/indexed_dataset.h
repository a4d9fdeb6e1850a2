// Megatron indexed dataset (.bin/.idx): a memory-mapped, validating reader and
// a writer (ARCHITECTURE.md §8).
//
// .idx layout, little endian, packed (so arrays are NOT naturally aligned):
//   [0, 9)    magic "MMIDIDX\0\0"
//   [9, 17)   u64 version = 1
//   [17, 18)  u8 dtype code (IndexDType)
//   [18, 26)  u64 num_sequences
//   [26, 34)  u64 num_documents (length of doc_idx)
//   i32 sizes[num_sequences]; i64 pointers[num_sequences] (byte offsets into
//   .bin); i64 doc_idx[num_documents] (sequence indices where documents
//   start, non-decreasing, at least one entry, the last = num_sequences).
// .bin: the token arrays of every sequence, back to back.
//
// Invariants once open() returns (each one otherwise a UserError naming the
// file, the byte offset and the rule):
//   - pointers[0] == 0 and pointers[i] == pointers[i-1] + sizes[i-1]·itemsize,
//     so the .bin is exactly the concatenated token stream, no gaps;
//   - the .bin holds exactly sum(sizes)·itemsize bytes;
//   - every token t satisfies 0 <= t < vocab_size (so it fits int32).
// The .bin stays mapped for the object's lifetime; reads convert to int32.
#pragma once
#include <cstdint>
#include <cstdio>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/files.h"

namespace origami {

// On-disk token dtype codes, as Megatron numbers them (megatron/core/datasets/
// indexed_dataset.py DType: float64 = 6, float32 = 7). Only u8, u16, i32 and
// i64 are token types we read or write; the others are recognised to name
// them in errors.
enum class IndexDType : uint8_t { u8 = 1, i8 = 2, i16 = 3, i32 = 4, i64 = 5, f64 = 6, f32 = 7, u16 = 8 };

std::string_view to_string(IndexDType dt);
// Bytes per token for a supported token dtype (u8, u16, i32, i64).
int64_t index_dtype_size(IndexDType dt);
// The smallest supported token dtype that holds ids 0 .. vocab_size-1.
IndexDType smallest_token_dtype(int64_t vocab_size);

// Read-only, move-only view of a dataset on disk.
class IndexedDataset {
 public:
  // Opens prefix.idx and prefix.bin, validates both completely (including a
  // scan of every token against vocab_size) and keeps the .bin mapped.
  static IndexedDataset open(const std::string& prefix, int64_t vocab_size);

  IndexedDataset(IndexedDataset&& other) noexcept;
  IndexedDataset& operator=(IndexedDataset&& other) noexcept;
  IndexedDataset(const IndexedDataset&) = delete;
  IndexedDataset& operator=(const IndexedDataset&) = delete;
  ~IndexedDataset();

  const std::string& prefix() const { return prefix_; }
  std::string idx_path() const { return prefix_ + ".idx"; }
  std::string bin_path() const { return prefix_ + ".bin"; }
  IndexDType dtype() const { return dtype_; }
  int64_t vocab_size() const { return vocab_size_; }

  int64_t num_sequences() const { return static_cast<int64_t>(sizes_.size()); }
  int64_t num_documents() const { return static_cast<int64_t>(doc_idx_.size()); }
  int64_t num_tokens() const { return num_tokens_; }
  int64_t sequence_length(int64_t i) const;
  // Position of sequence i's first token in the concatenated stream.
  int64_t sequence_start(int64_t i) const;
  std::span<const int64_t> doc_idx() const { return doc_idx_; }

  // Copies sequence i's tokens into out[0 .. sequence_length(i)).
  void sequence(int64_t i, int32_t* out) const;
  std::vector<int32_t> sequence(int64_t i) const;
  // Copies stream tokens [first, first + count) into out; the stream is all
  // sequences back to back (what the .bin holds, by the invariants above).
  void read_tokens(int64_t first, int64_t count, int32_t* out) const;

 private:
  IndexedDataset() = default;
  void unmap();

  std::string prefix_;
  IndexDType dtype_ = IndexDType::u16;
  int64_t vocab_size_ = 0;
  int64_t num_tokens_ = 0;
  std::vector<int32_t> sizes_;         // tokens per sequence
  std::vector<int64_t> token_starts_;  // prefix sums of sizes_ (stream positions)
  std::vector<int64_t> doc_idx_;
  const uint8_t* bin_ = nullptr;       // mmapped .bin, nullptr when it is empty
  size_t bin_bytes_ = 0;
};

// Writes prefix.bin and prefix.idx. Each add_document() becomes one sequence
// and doc_idx = 0, 1, ..., num_sequences. Output goes to prefix.{bin,idx}.tmp
// and is renamed into place by finalize() once synced, so a crash never
// leaves a half-written pair that looks complete (engine/files.h: every
// write checked, renames durable); without finalize() the temporaries are
// removed.
class IndexedDatasetWriter {
 public:
  IndexedDatasetWriter(std::string prefix, IndexDType dtype);
  IndexedDatasetWriter(const IndexedDatasetWriter&) = delete;
  IndexedDatasetWriter& operator=(const IndexedDatasetWriter&) = delete;
  ~IndexedDatasetWriter();

  // Throws UserError if a token does not fit the dtype, or a document would
  // pass 2^31-1 tokens.
  void add_document(std::span<const int32_t> tokens);
  // The same, for a document written in pieces: append() each, then
  // end_document() (a document whose tokens do not fit memory at once).
  void append(std::span<const int32_t> tokens);
  void end_document();
  void finalize();

  int64_t num_sequences() const { return static_cast<int64_t>(sizes_.size()); }
  int64_t num_tokens() const { return num_tokens_; }
  std::string bin_path() const { return prefix_ + ".bin"; }
  std::string idx_path() const { return prefix_ + ".idx"; }

 private:
  std::string prefix_;
  IndexDType dtype_;
  WriterLock lock_;                  // on prefix.bin.tmp, taken before it is truncated
  std::unique_ptr<OutputFile> bin_;  // prefix.bin.tmp, open until finalize()
  std::vector<int32_t> sizes_;
  std::vector<int64_t> pointers_;
  int64_t num_tokens_ = 0;
  int64_t bin_bytes_ = 0;
  int64_t open_tokens_ = 0;  // tokens appended to the document not yet ended
  bool finalized_ = false;
  std::vector<uint8_t> scratch_;  // one document converted to dtype_
};

}  // namespace origami

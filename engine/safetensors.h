// safetensors files: an 8-byte little-endian header length, a JSON header
// {name: {dtype, shape, data_offsets: [begin, end)}, "__metadata__": {...}},
// then the raw little-endian data. Only F32 tensors are written and read here.
// Every file written reports its size and XXH3-64 digest (checkpoints list
// them in metadata.json); files are read whole (read_safetensors) or mapped
// and read by tensor (SafetensorsFile).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/files.h"

#include "kernels/tensor.h"

namespace origami {

struct NamedTensor {
  std::string name;
  Tensor tensor;  // f32, contiguous
};

// A written file's size and XXH3-64 digest of all its bytes.
struct FileDigest {
  int64_t bytes = 0;
  uint64_t xxh3 = 0;
};
std::string digest_hex(uint64_t xxh3);  // 16 lowercase hex digits
// XXH3-64 of `bytes` bytes.
uint64_t digest_of(const void* data, int64_t bytes);

// Writes, syncs and closes the file (every write checked). Tensors off the
// plain host are copied to it one at a time as they are written.
FileDigest write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                             const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

// Streams a file tensor by tensor: the header from the names and shapes
// first, then each tensor's data in that order, so memory holds one tensor.
class SafetensorsWriter {
 public:
  SafetensorsWriter(const std::string& path, const std::vector<std::pair<std::string, Shape>>& entries,
                    const std::map<std::string, std::string>& metadata = {{"format", "pt"}});
  ~SafetensorsWriter();
  // The next tensor's data (numel must match its shape).
  void write_next(const float* data, int64_t numel);
  // After the last tensor: sync, close.
  FileDigest finish();

 private:
  struct State;
  std::unique_ptr<State> s_;
};

// A file mapped read-only with its header validated as read_safetensors
// validates it; tensors are read in place.
class SafetensorsFile {
 public:
  struct Entry {
    Shape shape;
    int64_t begin = 0, end = 0;  // byte range in the data section
  };
  explicit SafetensorsFile(const std::string& path);
  const std::string& path() const { return map_.path(); }
  int64_t size() const { return map_.size(); }
  const std::map<std::string, Entry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The tensor's entry; UserError naming the file and tensor when absent.
  const Entry& entry(const std::string& name) const;
  // The tensor's data (little-endian F32, possibly unaligned: copy with memcpy).
  const unsigned char* data(const Entry& e) const { return map_.data() + data_start_ + e.begin; }
  // The tensor copied out of the mapping (host f32, of `category`).
  Tensor read(const Entry& e, MemCategory category) const;
  // XXH3-64 of the header and of each tensor's first and last 4 KiB: tells
  // copies of one file from other files (another export, another step's
  // weights change every tensor) without reading gigabytes.
  uint64_t sampled_digest() const;

 private:
  MappedFile map_;
  int64_t data_start_ = 0;
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

// Reads every tensor of the file (category `param`). Throws UserError naming
// the file and the rule for malformed headers or out-of-range offsets.
std::map<std::string, Tensor> read_safetensors(const std::string& path);

// A consolidated Hugging Face directory: model.safetensors, or, without
// one, HF's shards as model.safetensors.index.json's weight_map names them
// (Hugging Face's own order of preference); each file mapped,
// and which holds each tensor. UserError naming the file for a bad index
// (one whose weight_map does not say, for each tensor, the file holding
// it), a malformed file or a tensor in two files.
struct HfFiles {
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::map<std::string, const SafetensorsFile*> by_tensor;
  // "<file> = <bytes> bytes, sampled xxh3 <hex>" per file, by name: what
  // ranks compare to prove they read the same weights.
  std::string identity() const;
};
HfFiles open_hf_dir(const std::string& dir);

}  // namespace origami

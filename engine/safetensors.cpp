// safetensors writer and reader (see safetensors.h). The reader trusts
// nothing in the file: every header field's JSON type and range is checked,
// and the tensors' byte ranges must tile the data section exactly (no
// overlap, no aliasing, no hole, nothing after the last tensor), as the
// format's reference implementation requires.
#include "engine/safetensors.h"

#include <algorithm>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <xxhash.h>

#include "engine/files.h"
#include "engine/json_file.h"

namespace origami {

namespace {

// The reference implementation refuses larger headers.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

std::string show(const nlohmann::json& v) { return shorten(v.dump(), 60); }

// A non-negative JSON integer that fits int64, or nullopt.
std::optional<int64_t> as_index(const nlohmann::json& v) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    if (u <= static_cast<uint64_t>(INT64_MAX)) return static_cast<int64_t>(u);
    return std::nullopt;
  }
  if (v.is_number_integer() && v.get<int64_t>() >= 0) return v.get<int64_t>();
  return std::nullopt;
}

struct ParsedEntry {
  std::string name;
  Shape shape;
  int64_t begin = 0, end = 0;
};

// The header of the data: 8-byte length, JSON padded to 8 bytes.
std::string header_bytes(const nlohmann::ordered_json& header) {
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // data starts 8-byte aligned
  const uint64_t n = text.size();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>(n >> (8 * i));
  return out + text;
}

ParsedEntry parse_entry(const std::string& path, const std::string& name, const nlohmann::json& e) {
  auto bad = [&](const std::string& what) {
    ORIGAMI_USER_ERROR(path, ": tensor '", shorten(name), "': ", what, " (rule: a safetensors header entry is ",
                       "{\"dtype\": \"F32\", \"shape\": [d0, d1, ...], \"data_offsets\": [begin, end]} with integers ",
                       ">= 0)");
  };
  if (!e.is_object()) bad("must be an object, got " + show(e));
  for (const auto& [key, value] : e.items())
    if (key != "dtype" && key != "shape" && key != "data_offsets") bad("unknown field '" + shorten(key) + "'");
  if (!e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets"))
    bad("needs dtype, shape and data_offsets");
  const nlohmann::json& dtype = e["dtype"];
  if (!dtype.is_string()) bad("dtype must be a string, got " + show(dtype));
  if (dtype.get<std::string>() != "F32")
    bad("dtype " + show(dtype) + " is not supported (Origami reads and writes F32 tensors)");
  ParsedEntry out;
  out.name = name;
  const nlohmann::json& shape = e["shape"];
  if (!shape.is_array()) bad("shape must be an array of integers, got " + show(shape));
  int64_t numel = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    const auto d = as_index(shape[i]);
    if (!d) bad("shape must be an array of integers >= 0, got " + show(shape) + " (dimension " + std::to_string(i) + ")");
    out.shape.push_back(*d);
    if (!checked_mul(numel, *d, &numel)) bad("shape " + show(shape) + " has more elements than fit in 64 bits");
  }
  const nlohmann::json& offs = e["data_offsets"];
  if (!offs.is_array() || offs.size() != 2)
    bad("data_offsets must be an array of two integers [begin, end], got " + show(offs));
  const auto b = as_index(offs[0]), en = as_index(offs[1]);
  if (!b || !en) bad("data_offsets must be two integers >= 0, got " + show(offs));
  out.begin = *b;
  out.end = *en;
  int64_t bytes = 0;
  if (out.end < out.begin) bad("data_offsets " + show(offs) + " end before they begin");
  if (!checked_mul(numel, 4, &bytes) || out.end - out.begin != bytes)
    bad(detail::concat("data_offsets ", show(offs), " hold ", out.end - out.begin, " bytes, but shape ", show(shape),
                       " of F32 needs ", numel, " x 4 bytes"));
  return out;
}

}  // namespace

std::string digest_hex(uint64_t xxh3) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(xxh3));
  return buf;
}

uint64_t digest_of(const void* data, int64_t bytes) { return XXH3_64bits(data, static_cast<size_t>(bytes)); }

struct SafetensorsWriter::State {
  OutputFile out;
  XXH3_state_t* hash = XXH3_createState();
  std::vector<int64_t> numels;
  size_t next = 0;
  int64_t bytes = 0;
  explicit State(const std::string& path) : out(path, OutputFile::Mode::truncate) {
    ORIGAMI_CHECK(hash && XXH3_64bits_reset(hash) == XXH_OK, "XXH3 state");
  }
  ~State() { XXH3_freeState(hash); }
  void write(const void* data, size_t n) {
    out.write(data, n);
    XXH3_64bits_update(hash, data, n);
    bytes += static_cast<int64_t>(n);
  }
};

SafetensorsWriter::SafetensorsWriter(const std::string& path, const std::vector<std::pair<std::string, Shape>>& entries,
                                     const std::map<std::string, std::string>& metadata)
    : s_(std::make_unique<State>(path)) {
  nlohmann::ordered_json header;
  header["__metadata__"] = metadata;
  int64_t offset = 0;
  for (const auto& [name, shape] : entries) {
    const int64_t bytes = shape_numel(shape) * static_cast<int64_t>(sizeof(float));
    header[name] = {{"dtype", "F32"}, {"shape", shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    s_->numels.push_back(shape_numel(shape));
  }
  const std::string h = header_bytes(header);
  s_->write(h.data(), h.size());
}

SafetensorsWriter::~SafetensorsWriter() = default;

void SafetensorsWriter::write_next(const float* data, int64_t numel) {
  ORIGAMI_CHECK(s_->next < s_->numels.size() && s_->numels[s_->next] == numel, s_->out.path(), ": tensor ", s_->next,
                " written with ", numel, " elements, out of order or of the wrong size");
  ++s_->next;
  s_->write(data, static_cast<size_t>(numel) * sizeof(float));
}

FileDigest SafetensorsWriter::finish() {
  ORIGAMI_CHECK(s_->next == s_->numels.size(), s_->out.path(), ": finished after ", s_->next, " of ",
                s_->numels.size(), " tensors");
  s_->out.sync();
  s_->out.close();
  return {s_->bytes, XXH3_64bits_digest(s_->hash)};
}

FileDigest write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                             const std::map<std::string, std::string>& metadata) {
  std::vector<std::pair<std::string, Shape>> entries;
  for (const NamedTensor& nt : tensors) {
    ORIGAMI_CHECK(nt.tensor.dtype() == DType::f32, nt.name, " is not f32");
    entries.emplace_back(nt.name, nt.tensor.shape());
  }
  SafetensorsWriter w(path, entries, metadata);
  for (const NamedTensor& nt : tensors) {
    // Device (and stand-in) tensors pass through host memory one at a
    // time: the file's state is never all on the host at once.
    const Tensor host = nt.tensor.on_host();
    w.write_next(host.f32(), host.numel());
  }
  return w.finish();
}

SafetensorsFile::SafetensorsFile(const std::string& path) : map_(path, "safetensors file") {
  const int64_t file_size = map_.size();
  if (file_size < 8) ORIGAMI_USER_ERROR(path, ": ", file_size, " bytes: shorter than the 8-byte header length");
  const unsigned char* len = map_.data();
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(len[i]) << (8 * i);
  if (n > static_cast<uint64_t>(file_size - 8) || n > kMaxHeaderBytes)
    ORIGAMI_USER_ERROR(path, ": byte offset 0: header length ", n, " exceeds the file (", file_size,
                       " bytes) or the format's limit of ", kMaxHeaderBytes, " bytes");
  const std::string text(reinterpret_cast<const char*>(map_.data()) + 8, n);
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    ORIGAMI_USER_ERROR(path, ": header is not valid JSON: ", e.what());
  }
  if (!header.is_object()) ORIGAMI_USER_ERROR(path, ": header must be a JSON object, got ", show(header));
  const int64_t data_start = 8 + static_cast<int64_t>(n), data_bytes = file_size - data_start;

  std::vector<ParsedEntry> entries;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object())
        ORIGAMI_USER_ERROR(path, ": __metadata__ must be an object of strings, got ", show(entry));
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string())
          ORIGAMI_USER_ERROR(path, ": __metadata__ '", shorten(k), "' must be a string, got ", show(v));
        metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    entries.push_back(parse_entry(path, name, entry));
  }
  // The byte ranges, in file order, must tile [0, data_bytes) exactly.
  std::vector<const ParsedEntry*> order;
  for (const ParsedEntry& e : entries) order.push_back(&e);
  std::sort(order.begin(), order.end(), [](const ParsedEntry* a, const ParsedEntry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  int64_t at = 0;
  const ParsedEntry* prev = nullptr;
  for (const ParsedEntry* e : order) {
    if (e->begin < at)
      ORIGAMI_USER_ERROR(path, ": tensor '", shorten(e->name), "' data_offsets [", e->begin, ", ", e->end,
                         ") overlap tensor '", shorten(prev->name), "' [", prev->begin, ", ", prev->end,
                         ") (rule: every byte of the data belongs to exactly one tensor)");
    if (e->begin > at)
      ORIGAMI_USER_ERROR(path, ": tensor '", shorten(e->name), "' starts at data byte ", e->begin, ", leaving bytes [",
                         at, ", ", e->begin, ") unused (rule: the tensors' data follow each other without holes)");
    at = e->end;
    prev = e;
  }
  if (at != data_bytes)
    ORIGAMI_USER_ERROR(path, ": the tensors' data end at data byte ", at, " but the file holds ", data_bytes,
                       " data bytes (rule: the data section is exactly the tensors' bytes)");

  data_start_ = data_start;
  for (ParsedEntry& e : entries) entries_[e.name] = {std::move(e.shape), e.begin, e.end};
}

const SafetensorsFile::Entry& SafetensorsFile::entry(const std::string& name) const {
  const auto it = entries_.find(name);
  if (it == entries_.end()) ORIGAMI_USER_ERROR(path(), ": has no tensor '", shorten(name), "'");
  return it->second;
}

Tensor SafetensorsFile::read(const Entry& e, MemCategory category) const {
  Tensor t = Tensor::empty(e.shape, DType::f32, category);
  std::memcpy(t.raw(), data(e), static_cast<size_t>(e.end - e.begin));
  return t;
}

std::map<std::string, Tensor> read_safetensors(const std::string& path) {
  const SafetensorsFile file(path);
  std::map<std::string, Tensor> out;
  for (const auto& [name, e] : file.entries()) out.emplace(name, file.read(e, MemCategory::param));
  return out;
}

uint64_t SafetensorsFile::sampled_digest() const {
  XXH3_state_t* state = XXH3_createState();
  ORIGAMI_CHECK(state != nullptr && XXH3_64bits_reset(state) == XXH_OK, "XXH3 state");
  auto add = [&](const unsigned char* p, int64_t n) {
    ORIGAMI_CHECK(XXH3_64bits_update(state, p, static_cast<size_t>(n)) == XXH_OK, "XXH3 update");
  };
  constexpr int64_t kSample = 4096;
  add(map_.data(), data_start_);  // length and header: names, shapes, offsets
  for (const auto& [name, e] : entries_) {
    const int64_t n = e.end - e.begin;
    add(data(e), std::min(n, kSample));
    if (n > kSample) add(data(e) + n - std::min(n - kSample, kSample), std::min(n - kSample, kSample));
  }
  const uint64_t digest = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return digest;
}

std::string HfFiles::identity() const {
  std::map<std::string, std::string> lines;  // by file name: the same order on every rank
  for (const auto& f : files)
    lines[std::filesystem::path(f->path()).filename().string()] =
        detail::concat(f->size(), " bytes, sampled xxh3 ", digest_hex(f->sampled_digest()));
  std::string text;
  for (const auto& [name, line] : lines) text += name + " = " + line + "\n";
  return text;
}

HfFiles open_hf_dir(const std::string& dir) {
  HfFiles hf;
  const std::string index = dir + "/model.safetensors.index.json";
  std::vector<std::string> names;
  std::map<std::string, std::string> weight_map;  // tensor -> file, from the index
  // As Hugging Face's loader: the single file first, the index's shards only
  // without one (an export into a sharded download leaves both).
  if (!std::filesystem::exists(dir + "/model.safetensors") && std::filesystem::exists(index)) {
    const nlohmann::json j = read_json_file(index, "Hugging Face index", int64_t{256} << 20);
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      ORIGAMI_USER_ERROR(index, ": weight_map: missing (rule: {\"weight_map\": {tensor: file}})");
    std::set<std::string> files;
    for (const auto& [tensor, file] : j["weight_map"].items()) {
      if (!file.is_string() || file.get<std::string>().find('/') != std::string::npos)
        ORIGAMI_USER_ERROR(index, ": weight_map.", tensor, ": must name a file in ", dir);
      weight_map[tensor] = file.get<std::string>();
      files.insert(file.get<std::string>());
    }
    names.assign(files.begin(), files.end());
  } else {
    names = {"model.safetensors"};
  }
  for (const std::string& n : names) {
    hf.files.push_back(std::make_unique<SafetensorsFile>(dir + "/" + n));
    for (const auto& [tensor, entry] : hf.files.back()->entries()) {
      const auto [it, fresh] = hf.by_tensor.emplace(tensor, hf.files.back().get());
      if (!fresh) ORIGAMI_USER_ERROR(dir, "/", n, ": tensor '", tensor, "' is also in ", it->second->path());
    }
  }
  // The index is what Hugging Face's loader reads: a tensor it places in
  // another file, or leaves out, would load there differently or not at all.
  if (!weight_map.empty()) {
    const std::string rule = " (rule: weight_map names, for every tensor of the shards, the file holding it)";
    for (const auto& [tensor, file] : weight_map) {
      const auto it = hf.by_tensor.find(tensor);
      if (it == hf.by_tensor.end())
        ORIGAMI_USER_ERROR(index, ": weight_map.", tensor, ": names ", file, ", which holds no such tensor", rule);
      if (const std::string holder = std::filesystem::path(it->second->path()).filename().string(); holder != file)
        ORIGAMI_USER_ERROR(index, ": weight_map.", tensor, ": names ", file, ", but the tensor is in ", holder, rule);
    }
    for (const auto& [tensor, file] : hf.by_tensor)
      if (!weight_map.count(tensor))
        ORIGAMI_USER_ERROR(index, ": weight_map: lacks tensor '", tensor, "', which ",
                           std::filesystem::path(file->path()).filename().string(), " holds", rule);
  }
  return hf;
}


}  // namespace origami

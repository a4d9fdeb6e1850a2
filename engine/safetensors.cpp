// safetensors writer and reader (see safetensors.h). The reader trusts
// nothing in the file: every header field's JSON type and range is checked,
// and the tensors' byte ranges must tile the data section exactly (no
// overlap, no aliasing, no hole, nothing after the last tensor), as the
// format's reference implementation requires.
#include "engine/safetensors.h"

#include <algorithm>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>

#include "engine/files.h"

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

struct Entry {
  std::string name;
  Shape shape;
  int64_t begin = 0, end = 0;
};

Entry parse_entry(const std::string& path, const std::string& name, const nlohmann::json& e) {
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
  Entry out;
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

void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header;
  header["__metadata__"] = metadata;
  int64_t offset = 0;
  for (const NamedTensor& nt : tensors) {
    ORIGAMI_CHECK(nt.tensor.dtype() == DType::f32, nt.name, " is not f32");
    const int64_t bytes = static_cast<int64_t>(nt.tensor.nbytes());
    header[nt.name] = {{"dtype", "F32"}, {"shape", nt.tensor.shape()}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // data starts 8-byte aligned
  const uint64_t n = text.size();
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  OutputFile out(path, OutputFile::Mode::truncate);
  out.write(len, 8);
  out.write(text);
  for (const NamedTensor& nt : tensors) out.write(nt.tensor.raw(), nt.tensor.nbytes());
  out.sync();
  out.close();
}

std::map<std::string, Tensor> read_safetensors(const std::string& path) {
  const InputFile in(path, "safetensors file");
  const int64_t file_size = in.size();
  if (file_size < 8) ORIGAMI_USER_ERROR(path, ": ", file_size, " bytes: shorter than the 8-byte header length");
  unsigned char len[8];
  in.read_at(0, len, 8);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(len[i]) << (8 * i);
  if (n > static_cast<uint64_t>(file_size - 8) || n > kMaxHeaderBytes)
    ORIGAMI_USER_ERROR(path, ": byte offset 0: header length ", n, " exceeds the file (", file_size,
                       " bytes) or the format's limit of ", kMaxHeaderBytes, " bytes");
  std::string text(n, '\0');
  in.read_at(8, text.data(), static_cast<int64_t>(n));
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    ORIGAMI_USER_ERROR(path, ": header is not valid JSON: ", e.what());
  }
  if (!header.is_object()) ORIGAMI_USER_ERROR(path, ": header must be a JSON object, got ", show(header));
  const int64_t data_start = 8 + static_cast<int64_t>(n), data_bytes = file_size - data_start;

  std::vector<Entry> entries;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object())
        ORIGAMI_USER_ERROR(path, ": __metadata__ must be an object of strings, got ", show(entry));
      for (const auto& [k, v] : entry.items())
        if (!v.is_string())
          ORIGAMI_USER_ERROR(path, ": __metadata__ '", shorten(k), "' must be a string, got ", show(v));
      continue;
    }
    entries.push_back(parse_entry(path, name, entry));
  }
  // The byte ranges, in file order, must tile [0, data_bytes) exactly.
  std::vector<const Entry*> order;
  for (const Entry& e : entries) order.push_back(&e);
  std::sort(order.begin(), order.end(), [](const Entry* a, const Entry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  int64_t at = 0;
  const Entry* prev = nullptr;
  for (const Entry* e : order) {
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

  std::map<std::string, Tensor> out;
  for (const Entry& e : entries) {
    Tensor t = Tensor::empty(e.shape, DType::f32, MemCategory::param);
    in.read_at(data_start + e.begin, t.raw(), e.end - e.begin);
    out.emplace(e.name, t);
  }
  return out;
}

}  // namespace origami

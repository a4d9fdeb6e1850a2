// safetensors writer and reader (see safetensors.h).
#include "engine/safetensors.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

namespace origami {

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
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) ORIGAMI_USER_ERROR(path, ": cannot open for writing");
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  out.write(reinterpret_cast<const char*>(len), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const NamedTensor& nt : tensors)
    out.write(static_cast<const char*>(nt.tensor.raw()), static_cast<std::streamsize>(nt.tensor.nbytes()));
  if (!out) ORIGAMI_USER_ERROR(path, ": write failed");
}

std::map<std::string, Tensor> read_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) ORIGAMI_USER_ERROR(path, ": cannot open safetensors file");
  const auto file_size = static_cast<int64_t>(std::filesystem::file_size(path));
  unsigned char len[8];
  if (!in.read(reinterpret_cast<char*>(len), 8)) ORIGAMI_USER_ERROR(path, ": shorter than the 8-byte header length");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(len[i]) << (8 * i);
  if (n > static_cast<uint64_t>(file_size - 8))
    ORIGAMI_USER_ERROR(path, ": header length ", n, " exceeds the file size ", file_size);
  std::string text(n, '\0');
  in.read(text.data(), static_cast<std::streamsize>(n));
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    ORIGAMI_USER_ERROR(path, ": header is not valid JSON: ", e.what());
  }
  const int64_t data_start = 8 + static_cast<int64_t>(n), data_bytes = file_size - data_start;
  std::map<std::string, Tensor> out;
  for (auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    if (!entry.is_object() || entry.value("dtype", "") != "F32" || !entry.contains("shape") ||
        !entry.contains("data_offsets"))
      ORIGAMI_USER_ERROR(path, ": tensor '", name, "' must have dtype F32, shape and data_offsets");
    Shape shape = entry["shape"].get<Shape>();
    const auto offs = entry["data_offsets"].get<std::vector<int64_t>>();
    const int64_t bytes = shape_numel(shape) * 4;
    if (offs.size() != 2 || offs[1] - offs[0] != bytes || offs[0] < 0 || offs[1] > data_bytes)
      ORIGAMI_USER_ERROR(path, ": tensor '", name, "' data_offsets do not match its shape ", shape_string(shape),
                         " within ", data_bytes, " data bytes");
    Tensor t = Tensor::empty(shape, DType::f32, MemCategory::param);
    in.seekg(data_start + offs[0]);
    in.read(static_cast<char*>(t.raw()), bytes);
    out.emplace(name, t);
  }
  return out;
}

}  // namespace origami

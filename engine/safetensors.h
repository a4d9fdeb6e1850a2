// safetensors files: an 8-byte little-endian header length, a JSON header
// {name: {dtype, shape, data_offsets: [begin, end)}, "__metadata__": {...}},
// then the raw little-endian data. Only F32 tensors are written and read here.
#pragma once
#include <map>
#include <string>
#include <vector>

#include "kernels/tensor.h"

namespace origami {

struct NamedTensor {
  std::string name;
  Tensor tensor;  // f32, contiguous
};

void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

// Reads every tensor of the file (category `param`). Throws UserError naming
// the file and the rule for malformed headers or out-of-range offsets.
std::map<std::string, Tensor> read_safetensors(const std::string& path);

}  // namespace origami

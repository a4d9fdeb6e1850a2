// Layout-independent initialization (ARCHITECTURE.md §4): element i of the
// parameter `name` is a pure function of (seed, name, i), from a
// counter-based generator (Philox4x32-10), so every rank can generate exactly
// its own shard and any layout produces the same model.
#pragma once
#include <array>
#include <cstdint>
#include <string_view>

#include "kernels/context.h"
#include "kernels/tensor.h"

namespace origami {

uint64_t name_hash(std::string_view name);  // FNV-1a 64

// Philox4x32-10 (Salmon et al., SC'11; Random123's philox4x32 with 10 rounds),
// exposed so tests can check it against the published known-answer vectors.
// init_normal uses key = {lo32, hi32} of name_hash(name) and counter =
// {lo32(i), hi32(i), lo32(seed), hi32(seed)} for global element i.
std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);

// out[j] = std · N(0,1) sample for global element (global_offset + j).
void init_normal(const ExecContext& ctx, Tensor& out, uint64_t seed, std::string_view name, int64_t global_offset,
                 float std);
void init_constant(const ExecContext& ctx, Tensor& out, float value);

}  // namespace origami

// Segment lists chosen for the grouped GEMM's rules (kernels/grouped_gemm.h),
// read by the op × backend harness (against the naive loop) and by
// tests/test_kernels_grouped_gemm.cpp (the schedules, bitwise).
#pragma once
#include <vector>

#include "kernels/grouped_gemm.h"

namespace origami::testing {

using Segments = std::vector<GemmSegment>;

inline int64_t total_rows(const Segments& s) {
  int64_t n = 0;
  for (const GemmSegment& g : s) n += g.rows;
  return n;
}

struct GroupedGemmCase {
  const char* name;
  int64_t G, K, M;  // weights [G, M, K]: forward [N, K] -> [N, M], data gradient [N, M] -> [N, K]
  Segments segs;
};

// More problems than one cuBLAS grouped call takes (2048, kernels/cuda/blas.h):
// 2100 groups of one to three rows each, K and M multiples of 8 so bf16
// rows stay 16-byte aligned and the grouped call (not the per-problem
// fallback) runs, in two chunks, for the forward, data and weight gradients.
inline GroupedGemmCase many_groups_case() {
  GroupedGemmCase c{"2100 groups, one segment each", 2100, 8, 16, {}};
  for (int64_t g = 0; g < c.G; ++g) c.segs.push_back({g, 1 + g % 3});
  return c;
}

// Shapes small enough for the naive loop; segments chosen for the rules.
inline std::vector<GroupedGemmCase> grouped_gemm_cases() {
  return {
      {"one segment per group", 4, 24, 40, {{0, 7}, {1, 33}, {2, 1}, {3, 20}}},
      {"empty segments, unused group", 5, 17, 9, {{0, 0}, {2, 12}, {4, 0}, {1, 5}, {2, 0}}},
      // The expert-parallel layout: by source rank, then expert; groups repeat.
      {"repeated groups", 3, 16, 24, {{0, 6}, {1, 9}, {2, 4}, {0, 11}, {2, 3}, {1, 2}, {0, 5}}},
      {"segment split into items", 3, 12, 20, {{1, 2500}, {0, 30}, {1, 1100}, {2, 3}}},
      {"one group, one segment", 1, 33, 31, {{0, 1500}}},
      {"N = 0, no segments", 3, 8, 6, {}},
      {"N = 0, empty segments", 3, 8, 6, {{0, 0}, {2, 0}}},
      // Y = beta · Y (the forward); an empty dW and dX.
      {"K = 0", 3, 0, 5, {{0, 4}, {2, 3}, {1, 0}}},
      many_groups_case(),
      // One group of 600 used: the weight gradient scales the 599 others by
      // beta, past the 512 slices one launch takes (kernels/cuda/gemm.cu).
      {"600 groups, one used", 600, 8, 16, {{5, 7}}},
  };
}

}  // namespace origami::testing

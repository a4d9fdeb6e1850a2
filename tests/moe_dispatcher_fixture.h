// The fixture of the multi-rank dispatcher tests (test_moe_mpi_dispatcher.cpp):
// every expert layout of the world size with its groups, built once; the
// row-count patterns; exact and relative comparisons across ranks.
#pragma once
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "comm/groups.h"
#include "moe/moe_layer.h"
#include "moe/token_dispatcher.h"
#include "mpi_test_main.h"
#include "test_context.h"

namespace origami::dispatcher_test {

inline const ExecContext& ctx = testing::test_context();

using comm::GroupKind;
using moe::AllToAllDispatcher;
using moe::ExpertWeights;
using moe::MoeLayerOptions;
using moe::MoeLayerWeights;
using testing::random_tensor;

using testing::world_rank;
using testing::world_size;

// Generous timeout: 8 ranks share 2 cores in CI. By NCCL's rules: the
// in-flight check (comm/in_flight_check.h) and messages paired by order.
inline constexpr comm::CommOptions kOptions{.timeout_s = 30.0, .check_in_flight = true, .p2p_by_order = true};
inline constexpr int64_t kD = 8, kF = 12, kK = 2, kSeq = 16, kT = 2 * kSeq;  // tiny: np 8 runs in seconds

// One expert layout and its groups, built once per binary (Groups::create is
// collective and splits 14 communicators); main() frees them before
// MPI_Finalize.
struct Setup {
  int64_t ep, etp;
  comm::Layout layout;
  comm::Groups groups;
  std::string name;
  AllToAllDispatcher dispatcher(int64_t E, const moe::ExpertPlacement& placement = {}) const {
    return AllToAllDispatcher(ctx, E, &groups[GroupKind::ep], &groups[GroupKind::etp], placement);
  }
};

// A placement far from the contiguous blocks: expert e on EP rank
// EP − 1 − e mod EP (one expert per rank: the reversal).
inline moe::ExpertPlacement strided(int64_t E, int64_t EP) {
  std::vector<std::vector<int64_t>> ranks(static_cast<size_t>(EP));
  for (int64_t e = 0; e < E; ++e) ranks[static_cast<size_t>(EP - 1 - e % EP)].push_back(e);
  return moe::ExpertPlacement::from_ranks(ranks);
}

// The placements each test runs under: contiguous, and strided where EP > 1.
inline std::vector<moe::ExpertPlacement> placements(int64_t E, int64_t EP) {
  std::vector<moe::ExpertPlacement> all = {moe::ExpertPlacement::contiguous(E, EP)};
  if (EP > 1) all.push_back(strided(E, EP));
  return all;
}
inline const char* placement_name(const moe::ExpertPlacement& p) { return p.is_contiguous() ? "contiguous" : "strided"; }

inline std::vector<std::pair<int64_t, int64_t>> ep_etp_for(int w) {
  switch (w) {
    case 1: return {{1, 1}};
    case 2: return {{2, 1}, {1, 2}};
    case 4: return {{4, 1}, {2, 2}, {2, 1}};  // the last has EDP = 2
    case 8: return {{8, 1}, {4, 2}, {2, 2}};  // the last has EDP = 2
    default: return {{w, 1}};
  }
}

inline std::vector<std::unique_ptr<Setup>>& setups() {
  static std::vector<std::unique_ptr<Setup>> all;
  if (all.empty())
    for (const auto& [ep, etp] : ep_etp_for(world_size())) {
      comm::LayoutOptions o;
      o.ep = ep;
      o.etp = etp;
      o.num_experts = 6 * ep;  // layout validation only; each test picks its E
      comm::Layout l(world_size(), o);
      comm::Groups g = comm::Groups::create(l, MPI_COMM_WORLD, comm::Backend::mpi, kOptions);
      const std::string name = "EP" + std::to_string(ep) + " ETP" + std::to_string(etp) + " EDP" +
                               std::to_string(l.edp());
      all.push_back(std::make_unique<Setup>(Setup{ep, etp, l, std::move(g), name}));
    }
  return all;
}

inline int64_t sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }

// Row-count patterns. random: 0–4 rows per expert (zeros included; at least
// one row per rank, so no check is vacuous on any rank). starved:
// the same, but the last world rank sends nothing and nobody sends to the last
// EP rank's experts (under `placement`). empty: no rows anywhere.
enum class Pattern { random, starved, empty };
inline constexpr std::array<Pattern, 3> kPatterns = {Pattern::random, Pattern::starved, Pattern::empty};
inline const char* pattern_name(Pattern p) {
  return p == Pattern::random ? "random" : p == Pattern::starved ? "starved" : "empty";
}

inline std::vector<int64_t> my_counts(const moe::ExpertPlacement& placement, Pattern p, uint32_t salt) {
  const int64_t E = placement.num_experts(), El = placement.experts_per_rank();
  std::mt19937 rng(testing::test_seed(1000u * static_cast<uint32_t>(world_rank()) + salt));
  std::uniform_int_distribution<int64_t> d(0, 4);
  std::vector<int64_t> c(static_cast<size_t>(E));
  for (int64_t& n : c) n = p == Pattern::empty ? 0 : d(rng);
  if (p == Pattern::random && sum(c) == 0) c[world_rank() % E] = 2;  // every rank sends something
  if (p == Pattern::starved) {
    if (world_size() > 1 && world_rank() == world_size() - 1) std::fill(c.begin(), c.end(), 0);
    if (E > El)
      for (int64_t e : placement.local_experts(placement.ep() - 1)) c[e] = 0;
    // The other ranks still send something (to EP rank 0, which is fed).
    if (sum(c) == 0 && !(world_size() > 1 && world_rank() == world_size() - 1)) c[placement.local_experts(0)[0]] = 2;
  }
  return c;
}

// Everyone's counts, [world rank][expert], gathered independently of the dispatcher.
inline std::vector<std::vector<int64_t>> all_counts(const std::vector<int64_t>& mine) {
  const int W = world_size(), E = static_cast<int>(mine.size());
  std::vector<int64_t> flat(static_cast<size_t>(W * E));
  MPI_Allgather(mine.data(), E, MPI_INT64_T, flat.data(), E, MPI_INT64_T, MPI_COMM_WORLD);
  std::vector<std::vector<int64_t>> out(W);
  for (int r = 0; r < W; ++r) out[r].assign(flat.begin() + r * E, flat.begin() + (r + 1) * E);
  return out;
}

inline double all_sum(double x) {
  MPI_Allreduce(MPI_IN_PLACE, &x, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  return x;
}

// Bitwise equality; reports the first differing element as (row, column).
inline void expect_bitwise(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const int64_t n = got.numel(), cols = std::max<int64_t>(1, got.cols());
  for (int64_t i = 0; i < n; ++i)
    if (std::memcmp(got.f32() + i, want.f32() + i, sizeof(float)) != 0) {
      ADD_FAILURE() << what << ": row " << i / cols << " col " << i % cols << " is " << got.f32()[i] << ", want "
                    << want.f32()[i];
      return;
    }
}

inline double max_abs(const float* p, int64_t n) {
  double m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::abs(double(p[i])));
  return m;
}
inline bool all_finite(const Tensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i)
    if (!std::isfinite(t.f32()[i])) return false;
  return true;
}

// |got − want| ≤ rtol · max|want| elementwise. The runs differ only in fp32
// reassociation (GEMMs over other row blocks, F split in ETP partials summed
// by reduce_scatter_v), whose error scales with the summands, i.e. with the
// tensor's magnitude, not with an element that happens to cancel to ~0.
template <class T>
inline void expect_close(const T* got, const T* want, int64_t n, double rtol, const std::string& what) {
  double scale = 0;
  for (int64_t i = 0; i < n; ++i) scale = std::max(scale, std::abs(double(want[i])));
  for (int64_t i = 0; i < n; ++i)
    if (!(std::abs(double(got[i]) - double(want[i])) <= rtol * scale)) {
      ADD_FAILURE() << what << ": element " << i << " is " << got[i] << ", want " << want[i] << " (scale " << scale
                    << ")";
      return;
    }
}
inline void expect_close(const Tensor& got, const Tensor& want, double rtol, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  expect_close(got.f32(), want.f32(), got.numel(), rtol, what);
}

inline std::string where(const Setup& s, int64_t E, const char* extra = "") {
  return s.name + " E=" + std::to_string(E) + " " + extra + " [rank " + std::to_string(world_rank()) + "]";
}

}  // namespace origami::dispatcher_test

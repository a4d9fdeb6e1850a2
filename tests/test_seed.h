// The suite's one source of seeds for random test inputs (ARCHITECTURE §9:
// fresh random inputs). Each test process draws one base seed, fresh every run
// from std::random_device, or ORIGAMI_TEST_SEED=<n> to replay a failing run;
// a site mixes its own salt in, so sites draw independent streams and one
// site's stream does not shift when another changes. Invariants: the base is
// the same on every rank of a multi-rank binary (run_mpi_tests broadcasts
// rank 0's before any test) and in the processes a test starts (a death
// test's child re-runs the binary: the base goes into ORIGAMI_TEST_SEED),
// and every failed test prints it.
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>

namespace origami::testing {

namespace detail {

inline std::optional<uint32_t>& test_seed_base_slot() {
  static std::optional<uint32_t> base;
  return base;
}

// ORIGAMI_TEST_SEED, or a fresh draw; a malformed value is a hard error (a
// replay that silently drew a new seed would reproduce nothing).
inline uint32_t draw_test_seed_base() {
  if (const char* env = std::getenv("ORIGAMI_TEST_SEED"); env != nullptr && *env != '\0') {
    char* end = nullptr;
    const unsigned long long v = std::strtoull(env, &end, 10);
    if (*end != '\0' || v > UINT32_MAX)
      throw std::invalid_argument(std::string("ORIGAMI_TEST_SEED='") + env + "': want an integer in [0, 2^32)");
    return static_cast<uint32_t>(v);
  }
  return std::random_device{}();
}

// Prints the base beside each failed test, where a reader of the log looks.
class SeedOnFailure : public ::testing::EmptyTestEventListener {
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (info.result() != nullptr && info.result()->Failed() && test_seed_base_slot())
      std::fprintf(stderr, "%s.%s ran with test inputs from ORIGAMI_TEST_SEED=%u (set it to replay)\n",
                   info.test_suite_name(), info.name(), *test_seed_base_slot());
  }
};

inline const bool seed_listener_installed = [] {
  ::testing::UnitTest::GetInstance()->listeners().Append(new SeedOnFailure);
  return true;
}();

}  // namespace detail

// The process's base seed (drawn on first use).
inline uint32_t test_seed_base() {
  (void)detail::seed_listener_installed;  // an odr-use: its initialization cannot be deferred past this
  auto& base = detail::test_seed_base_slot();
  if (!base) {
    base = detail::draw_test_seed_base();
    setenv("ORIGAMI_TEST_SEED", std::to_string(*base).c_str(), /*overwrite=*/1);
  }
  return *base;
}

// Sets the base: how a multi-rank binary makes every rank agree. Exported
// to ORIGAMI_TEST_SEED for the processes this one starts.
inline void set_test_seed_base(uint32_t base) {
  detail::test_seed_base_slot() = base;
  setenv("ORIGAMI_TEST_SEED", std::to_string(base).c_str(), /*overwrite=*/1);
}

// The seed for one site: the base mixed with the site's salt through
// seed_seq, so nearby salts give unrelated streams.
inline uint32_t test_seed(uint32_t salt) {
  std::seed_seq seq{test_seed_base(), salt};
  uint32_t out = 0;
  seq.generate(&out, &out + 1);
  return out;
}

}  // namespace origami::testing

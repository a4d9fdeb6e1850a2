// The execution context a test file runs its ops on: the host, with the
// OpenMP thread count the test process starts with (CTest sets none, so the
// machine's cores; multi-rank tests get their per-rank default). Tests that
// vary the thread count build their own ExecContext::cpu(n).
#pragma once
#include <omp.h>

#include "kernels/context.h"

namespace origami::testing {

inline const ExecContext& test_context() {
  static const ExecContext ctx = ExecContext::cpu(omp_get_max_threads());
  return ctx;
}

}  // namespace origami::testing

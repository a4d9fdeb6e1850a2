// The CPU backend: one implementation per entry of kernels/backend_ops.inc,
// in kernels/cpu/<op>.cpp. Called only by kernels/dispatch.cpp (and by other
// CPU implementations), which has already checked devices and runs them
// under the context's thread count.
#pragma once
#include <string_view>

#include "kernels/adamw.h"
#include "kernels/attention.h"
#include "kernels/context.h"
#include "kernels/context_parallel.h"
#include "kernels/cross_entropy.h"
#include "kernels/elementwise.h"
#include "kernels/embedding.h"
#include "kernels/gemm.h"
#include "kernels/grouped_gemm.h"
#include "kernels/init.h"
#include "kernels/moe_ops.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"

namespace origami::cpu {

#include "kernels/backend_ops.inc"

// Row-major dnnl_sgemm with leading dimensions and no shape checks, for
// kernels that tile (attention). Single-threaded when called inside an
// OpenMP parallel region.
void sgemm_raw(Trans trans_a, Trans trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
               const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// Megatron's guard in p / Σp and s / Σs (kernels/moe_ops.h), shared by the
// CPU MoE ops (cpu/moe_ops.cpp, cpu/moe_stats.cpp).
inline constexpr float kMoeNormEps = 1e-20f;

}  // namespace origami::cpu

// Grouped GEMM for the MoE experts: a row-stacked operand [N, ·] tiled by
// segments (consecutive row runs, each owned by one group), every segment
// multiplied by its group's matrix of a stacked weight [G, ·, ·]. The three
// products of a linear layer y = x·Wᵀ over groups:
//   forward   Y_s = X_s · W_gᵀ          grouped_gemm(X, W, Trans::yes, ...)
//   data grad dX_s = dY_s · W_g         grouped_gemm(dY, W, Trans::no, ...)
//   weight    dW_g = Σ_s dY_sᵀ · X_s    grouped_gemm_wgrad(dY, X, ...)
// CPU: oneDNN dnnl_sgemm per segment (kernels/cpu/grouped_gemm.cpp says
// which schedule runs when). CUDA: a segment's product that fills the GPU
// alone as one cuBLASLt matmul, the others together in one cuBLAS grouped
// call (cublasGemmGroupedBatchedEx), kernels/cuda/grouped_gemm.cu says why.
// Segment metadata is host-side.
#pragma once
#include <span>

#include "kernels/context.h"
#include "kernels/gemm.h"
#include "kernels/tensor.h"

namespace origami {

// `rows` consecutive rows of the stacked operand that belong to group `group`
// (an index into the weight's first dimension). Several segments may name the
// same group; segments may be empty.
struct GemmSegment {
  int64_t group = 0;
  int64_t rows = 0;
};

// How the CUDA backend runs a call's products (the CPU backend has its own
// rule and ignores this): `automatic` runs each product whose output alone
// gives every multiprocessor a 128x128 tile as its own cuBLASLt matmul and
// the rest in one grouped call; `grouped` and `single` force one way, for
// benchmarks and tests. The result differs between schedules only in the
// last bits (each product's own summation order).
enum class GroupedGemmSchedule : int { automatic, grouped, single };

// Y_NM rows of segment s (rows [o_s, o_s + n_s), o_s = Σ_{s'<s} n_s'):
//   Y_s = X_s · op(W[g_s]) + beta · Y_s
// trans_w = yes: W is [G, M, K] and op(W) = Wᵀ; no: W is [G, K, M].
// X_NK is [N, K] and Y_NM [N, M], all f32 and contiguous; the segments tile
// the N rows exactly (Σ n_s = N). beta = 0 overwrites (NaNs in Y do not
// survive). Deterministic for a given context: bitwise the per-segment gemm
// calls at the context's thread count, or at one thread when the CPU runs
// many small segments side by side (kernels/cpu/grouped_gemm.cpp).
void grouped_gemm(const ExecContext& ctx, const Tensor& X_NK, const Tensor& W, Trans trans_w,
                  std::span<const GemmSegment> segments, Tensor& Y_NM, float beta = 0.0f,
                  GroupedGemmSchedule schedule = GroupedGemmSchedule::automatic);

// dW_GMK[g] = beta · dW_GMK[g] + Σ_{s : g_s = g} dY_sᵀ · X_s for every g < G,
// the segments of one group summed in segment order (so a group fed by
// several segments, as the expert-parallel layout delivers them, gets one
// deterministic result). dY_NM [N, M], X_NK [N, K], dW_GMK [G, M, K]; groups
// no segment names are only scaled by beta. beta = 1 accumulates.
// Deterministic for a given context, as grouped_gemm.
void grouped_gemm_wgrad(const ExecContext& ctx, const Tensor& dY_NM, const Tensor& X_NK,
                        std::span<const GemmSegment> segments, Tensor& dW_GMK, float beta = 1.0f,
                        GroupedGemmSchedule schedule = GroupedGemmSchedule::automatic);

}  // namespace origami

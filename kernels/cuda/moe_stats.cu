// CUDA router statistics and balancing (kernels/moe_ops.h; CPU twin
// kernels/cpu/moe_stats.cpp): moe_routing_stats, moe_routing_totals,
// moe_aux_coefficients, moe_expert_bias_update.
//
// moe_routing_stats keeps the CPU's partition and order, so its counts and
// score sums are bitwise the CPU's: one block per fixed 256-token chunk of a
// segment; the chunk's counts in shared memory (integer atomics, exact),
// sigmoid's per-token 1/(Σ_e s + ε) by one thread per token summing e in
// order (as the CPU), then one thread per expert summing the chunk's tokens
// in order into an fp64 partial (ctx.workspace: chunks · 2E doubles); a
// second kernel adds each segment's chunk partials in chunk order, and
// reduces Σ lse² in fp64 (a fixed-shape block reduction; the CPU's
// sum_squares splits by thread count instead, so that one value may differ
// in the last bits).
// moe_routing_totals: one block reduces the balance term in fp64 (a fixed
// tree, not the CPU's sequential sum: ~S·E·eps64 apart) and writes the three
// totals on the device; the router reads them later without a sync of its
// own (ExecContext::read_later).
// moe_expert_bias_update takes the signs on the host (exact in integers, as
// the CPU) and passes them by value as kernel parameters, so no host buffer
// has to outlive the call.
#include <cub/block/block_reduce.cuh>

#include "kernels/cuda/moe_common.cuh"
#include "kernels/cuda/ops.h"

namespace origami::cuda {

namespace {

using moe::kNormEps;

constexpr int64_t kStatsChunk = 256;  // tokens per chunk: the CPU's partition (cpu/moe_stats.cpp)
constexpr int kThreads = 256;
static_assert(kStatsChunk == kThreads, "one thread per token of a chunk");
constexpr int64_t kSharedExperts = 8192;  // counts of a chunk held in shared memory (32 KiB)

// stats_N must be f64 [2·S·E + 2].
void check_stats(const Tensor& stats_N, int64_t S, int64_t E) {
  ORIGAMI_CHECK(stats_N.defined() && stats_N.dtype() == DType::f64, "router stats_N must be a defined f64 tensor");
  ORIGAMI_CHECK(S >= 0 && E > 0, "router stats of ", S, " segments over ", E, " experts");
  check_shape(stats_N, {2 * S * E + 2}, "router stats_N [2·S·E + 2]");
}

// Block c = chunk i of segment b (tokens [t0, t1)): part[c] = [counts E | score sums E].
__global__ void __launch_bounds__(kThreads)
    stats_chunks_kernel(const float* __restrict__ scores, const int32_t* __restrict__ experts, int E, int K,
                        int64_t seg_len, int64_t chunks_per_seg, bool sigmoid, double* __restrict__ part) {
  extern __shared__ unsigned counts[];  // [E], then inv[kStatsChunk] floats
  float* inv = reinterpret_cast<float*>(counts + E);
  const int64_t c = blockIdx.x, b = c / chunks_per_seg, i = c % chunks_per_seg;
  const int64_t t0 = b * seg_len + i * kStatsChunk;
  const int64_t left = (b + 1) * seg_len - t0;
  const int nt = static_cast<int>(left < kStatsChunk ? left : kStatsChunk);
  for (int e = threadIdx.x; e < E; e += blockDim.x) counts[e] = 0;
  if (sigmoid && static_cast<int>(threadIdx.x) < nt) {
    const float* s = scores + (t0 + threadIdx.x) * E;
    float tot = 0.0f;
    for (int e = 0; e < E; ++e) tot += s[e];
    inv[threadIdx.x] = 1.0f / (tot + kNormEps);
  }
  __syncthreads();
  const int32_t* ex = experts + t0 * K;
  for (int q = threadIdx.x; q < nt * K; q += blockDim.x) {
    const int32_t e = ex[q];
    ORIGAMI_DEVICE_CHECK(e >= 0 && e < E, "moe_routing_stats: expert index outside [0, E)");
    atomicAdd(&counts[e], 1u);
  }
  __syncthreads();
  double* out = part + c * 2 * E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const float* s = scores + t0 * E + e;
    double acc = 0.0;
    if (sigmoid)
      for (int t = 0; t < nt; ++t) acc += static_cast<double>(s[t * static_cast<int64_t>(E)] * inv[t]);
    else
      for (int t = 0; t < nt; ++t) acc += static_cast<double>(s[t * static_cast<int64_t>(E)]);
    out[e] = static_cast<double>(counts[e]);
    out[E + e] = acc;
  }
}

// Block 0: stats[2SE] = T and stats[2SE + 1] = Σ lse² (0 without lse).
// Blocks 1..: entry (b, e) of counts_SE and scores_SE = its segment's chunk
// partials added in chunk order from 0 (zeros when there are none: T = 0).
__global__ void __launch_bounds__(kThreads)
    stats_finish_kernel(const double* __restrict__ part, int64_t SE, int E, int64_t chunks_per_seg,
                        const float* __restrict__ lse, int64_t T, double* __restrict__ stats) {
  if (blockIdx.x == 0) {
    double sq = 0.0;
    if (lse)
      for (int64_t t = threadIdx.x; t < T; t += blockDim.x) {
        const double v = lse[t];
        sq += v * v;
      }
    using Reduce = cub::BlockReduce<double, kThreads>;
    __shared__ typename Reduce::TempStorage tmp;
    sq = Reduce(tmp).Sum(sq);
    if (threadIdx.x == 0) {
      stats[2 * SE] = static_cast<double>(T);
      stats[2 * SE + 1] = sq;
    }
    return;
  }
  const int64_t q = (blockIdx.x - 1) * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (q >= SE) return;
  const int64_t b = q / E, e = q % E;
  double cnt = 0.0, sum = 0.0;
  if (part)
    for (int64_t i = 0; i < chunks_per_seg; ++i) {
      const double* p = part + (b * chunks_per_seg + i) * 2 * E;
      cnt += p[e];
      sum += p[E + e];
    }
  stats[q] = cnt;
  stats[SE + q] = sum;
}

// One block: out = [T, Σ_i f_i·P_i, Σ lse²] from the buffer, f = count /
// (T_b·k), P = score sum / T_b, T_b = T / S.
__global__ void __launch_bounds__(kThreads)
    totals_kernel(const double* __restrict__ stats, int64_t S, int64_t SE, int64_t top_k, double* __restrict__ out) {
  const double tokens = stats[2 * SE];
  double acc = 0.0;
  if (S > 0) {
    const double Tb = tokens / static_cast<double>(S);
    for (int64_t i = threadIdx.x; i < SE; i += blockDim.x)
      acc += stats[i] / (Tb * static_cast<double>(top_k)) * (stats[SE + i] / Tb);
  }
  using Reduce = cub::BlockReduce<double, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  acc = Reduce(tmp).Sum(acc);
  if (threadIdx.x == 0) {
    out[0] = tokens;
    out[1] = acc;
    out[2] = stats[2 * SE + 1];
  }
}

__global__ void aux_kernel(const double* __restrict__ counts, int64_t n, double scale, float* __restrict__ aux) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    aux[i] = static_cast<float>(scale * counts[i]);
}

// Signs of up to kSignsPerLaunch experts, by value (1 KiB of the kernel's
// 4 KiB parameter space).
constexpr int kSignsPerLaunch = 1024;
struct Signs {
  int8_t v[kSignsPerLaunch];
};

__global__ void bias_update_kernel(float* __restrict__ bias, Signs signs, int n, float rate) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e < n) bias[e] += rate * static_cast<float>(signs.v[e]);
}

}  // namespace

void moe_routing_stats(const ExecContext& ctx, const Tensor& scores_TE, const Tensor& expert_TK, const Tensor& lse_T,
                       MoeScore score, int64_t num_segments, Tensor& stats_N) {
  ORIGAMI_CHECK(scores_TE.defined() && scores_TE.dtype() == DType::f32, "router scores must be f32");
  const int64_t T = scores_TE.rows(), E = scores_TE.cols(), S = num_segments, SE = S * E;
  check_stats(stats_N, S, E);
  const cudaStream_t stream = stream_of(ctx);
  double* stats = dev<double>(stats_N, "router stats_N");
  const float* lse = nullptr;
  if (lse_T.defined()) {
    ORIGAMI_CHECK(lse_T.dtype() == DType::f32, "router lse_T must be f32");
    check_shape(lse_T, {T}, "router lse_T");
    lse = dev<const float>(lse_T, "router lse_T");
  }
  Tensor ws;  // the chunk partials; alive until the finishing kernel is enqueued
  const double* part = nullptr;
  int64_t chunks_per_seg = 0;
  if (S > 0 && T > 0) {
    ORIGAMI_CHECK(expert_TK.defined() && expert_TK.dtype() == DType::i32, "router expert_TK must be i32");
    const int64_t K = expert_TK.cols();
    check_shape(expert_TK, {T, K}, "router expert_TK");
    ORIGAMI_CHECK(T % S == 0, "routing stats: ", T, " tokens do not split into ", S, " segments");
    ORIGAMI_CHECK(E <= kSharedExperts, "moe_routing_stats on CUDA counts a chunk's experts in shared memory: E = ", E,
                  " is over ", kSharedExperts);
    const int64_t seg_len = T / S;
    chunks_per_seg = (seg_len + kStatsChunk - 1) / kStatsChunk;
    const int64_t n_chunks = S * chunks_per_seg;
    ORIGAMI_CHECK(n_chunks <= INT32_MAX, "moe_routing_stats: ", n_chunks, " chunks");
    ws = ctx.workspace(static_cast<size_t>(n_chunks * 2 * E) * sizeof(double));
    auto* partials = static_cast<double*>(ws.address());
    const size_t shared = static_cast<size_t>(E) * 4 + kStatsChunk * 4;
    stats_chunks_kernel<<<static_cast<unsigned>(n_chunks), kThreads, shared, stream>>>(
        dev<const float>(scores_TE, "router scores_TE"), dev<const int32_t>(expert_TK, "router expert_TK"),
        static_cast<int>(E), static_cast<int>(K), seg_len, chunks_per_seg, score == MoeScore::sigmoid, partials);
    CUDA_CHECK_LAUNCH();
    part = partials;
  }
  const int64_t blocks = 1 + (SE + kThreads - 1) / kThreads;
  ORIGAMI_CHECK(blocks <= INT32_MAX, "moe_routing_stats: ", SE, " statistics");
  stats_finish_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(part, SE, static_cast<int>(E),
                                                                              chunks_per_seg, lse, T, stats);
  CUDA_CHECK_LAUNCH();
}

void moe_routing_totals(const ExecContext& ctx, const Tensor& stats_N, int64_t num_segments, int64_t num_experts,
                        int64_t top_k, Tensor& totals_3) {
  const int64_t S = num_segments, SE = S * num_experts;
  check_stats(stats_N, S, num_experts);
  ORIGAMI_CHECK(top_k >= 1, "router totals need top_k >= 1, got ", top_k);
  totals_kernel<<<1, kThreads, 0, stream_of(ctx)>>>(dev<const double>(stats_N, "router stats_N"), S, SE, top_k,
                                                    dev<double>(totals_3, "router totals_3"));
  CUDA_CHECK_LAUNCH();
}

void moe_aux_coefficients(const ExecContext& ctx, const Tensor& stats_N, double scale, Tensor& aux_SE) {
  ORIGAMI_CHECK(aux_SE.defined() && aux_SE.dtype() == DType::f32 && aux_SE.dim() == 2, "aux_SE must be f32 [S, E]");
  const int64_t S = aux_SE.size(0), E = aux_SE.size(1);
  check_stats(stats_N, S, E);
  const int64_t n = S * E;
  if (n == 0) return;
  aux_kernel<<<grid_for(n, kThreads), kThreads, 0, stream_of(ctx)>>>(dev<const double>(stats_N, "router stats_N"), n,
                                                                     scale, dev<float>(aux_SE, "aux_SE"));
  CUDA_CHECK_LAUNCH();
}

void moe_expert_bias_update(const ExecContext& ctx, Tensor& bias_E, std::span<const int64_t> load_E, float rate) {
  const int64_t E = static_cast<int64_t>(load_E.size());
  ORIGAMI_CHECK(bias_E.defined() && bias_E.dtype() == DType::f32, "expert bias must be a defined f32 tensor");
  check_shape(bias_E, {E}, "expert bias_E");
  int64_t total = 0;
  for (int64_t l : load_E) total += l;
  float* bias = dev<float>(bias_E, "expert bias_E");
  const cudaStream_t stream = stream_of(ctx);
  for (int64_t e0 = 0; e0 < E; e0 += kSignsPerLaunch) {
    const int n = static_cast<int>(std::min<int64_t>(kSignsPerLaunch, E - e0));
    Signs signs{};
    for (int i = 0; i < n; ++i) {
      const int64_t d = total - E * load_E[e0 + i];  // sign(mean − load_e), exactly
      signs.v[i] = static_cast<int8_t>((d > 0) - (d < 0));
    }
    bias_update_kernel<<<(n + kThreads - 1) / kThreads, kThreads, 0, stream>>>(bias + e0, signs, n, rate);
    CUDA_CHECK_LAUNCH();
  }
}

}  // namespace origami::cuda

// CUDA router top-k (kernels/moe_ops.h; CPU twin kernels/cpu/moe_ops.cpp):
// moe_topk_forward and moe_topk_backward. Router logits, scores and weights
// are f32 whatever the model's data dtype (common.cuh's dtype rule).
//
// One warp per token, grid-stride over tokens; the token's E scores (and the
// selection values, group scores and picks) sit in the warp's slice of
// shared memory, so E is bounded only by 48 KiB a warp (about 6000 experts).
//
// Selection is exactly the CPU's insertion list: K rounds of a warp argmax
// under the CPU's order — value descending, ties to the lower index, only
// values > −inf eligible (the CPU's insertion never takes NaN or −inf) —
// where round j takes the best element strictly after round j−1's winner in
// that order (a strict total order), so no "taken" flags are needed. When a
// round finds nothing (non-finite scores) the remaining slots get the lowest
// unused experts and every weight is NaN, as on the CPU. Group-limited
// selection: one lane per group sums the group's top m values in descending
// order (the CPU's order, so equal inputs give bitwise equal group scores),
// then group_topk warp-argmax rounds keep groups and the rest are masked to
// −inf. The bias enters the selection values only; weights are the scores.
//
// Arithmetic follows the CPU's formulas: exp is the CPU's exp_fast polynomial
// (so scores track the CPU's to an ulp and near-ties break alike), softmax is
// exp·(1/Σ), sigmoid 1/(1+e^−z), lse = max + log Σ. Sums over the K slots run
// sequentially in slot order like the CPU's; sums over E (softmax's Σ, the
// backward's dot products) are warp butterflies: a fixed order, not the
// CPU's sequential one (a few ulp apart).
#include <climits>
#include <cmath>

#include "kernels/cuda/moe_common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/op_shapes.h"

namespace origami::cuda {

namespace {

using moe::kFullWarp;
using moe::kNormEps;

constexpr int kMaxWarpsPerBlock = 8;
constexpr int64_t kSharedPerBlock = 48 * 1024;  // the default dynamic shared memory limit
static_assert(kSharedPerBlock / 4 == kMoeCudaRouterWords, "kernels/moe_ops.h states this kernel's limit");

// The CPU's exp_fast (kernels/cpu/simd.h) on the device: Cody–Waite range
// reduction and a degree-5 polynomial. The clamps keep NaN (as std::min /
// std::max do on the CPU), so a NaN logit gives a NaN score there and here.
__device__ __forceinline__ float exp_fast(float x) {
  const float xc = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const float two_n = __int_as_float((static_cast<int>(n) + 127) << 23);
  return x < -87.3f ? 0.0f : y * two_n;
}

// ---------------------------------------------------------------- selection order

constexpr int kNone = INT_MAX;  // "no element": sorts after every real index

struct Best {
  float v;
  int i;
};

// (v, i) comes strictly after (pv, pi) in the order value descending, index
// ascending. Start from (+inf, −1): everything not NaN comes after it.
__device__ __forceinline__ bool after(float v, int i, float pv, int pi) { return v < pv || (v == pv && i > pi); }

// The best of vals[0, n) strictly after (pv, pi), over the whole warp;
// (−inf, kNone) when no eligible (> −inf) element is left. Each lane scans
// ascending indices with a strict '>' (ties keep the lower index), then the
// butterfly keeps the larger value or, equal, the lower index: a maximum
// under a total order, so every lane gets the same winner.
__device__ Best warp_best(const float* vals, int n, float pv, int pi, int lane) {
  float bv = -INFINITY;
  int bi = kNone;
  for (int e = lane; e < n; e += 32) {
    const float v = vals[e];
    if (v > bv && after(v, e, pv, pi)) bv = v, bi = e;
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    const float ov = __shfl_xor_sync(kFullWarp, bv, off);
    const int oi = __shfl_xor_sync(kFullWarp, bi, off);
    if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
  }
  return {bv, bi};
}

// One lane: Σ of the m best of v[0, n) in descending order, −inf for each
// missing one — the CPU's sum over its m-long insertion list.
__device__ float group_top_sum(const float* v, int n, int m) {
  float sum = 0.0f, pv = INFINITY;
  int pi = -1;
  for (int i = 0; i < m; ++i) {
    float bv = -INFINITY;
    int bi = kNone;
    for (int e = 0; e < n; ++e)
      if (v[e] > bv && after(v[e], e, pv, pi)) bv = v[e], bi = e;
    sum += bv;
    pv = bv, pi = bi;
  }
  return sum;
}

// ---------------------------------------------------------------- forward

struct Forward {
  const float* logits;  // [T, E]
  const float* bias;    // [E] or null
  float* scores;        // [T, E]
  int32_t* experts;     // [T, K]
  float* weights;       // [T, K]
  float* lse;           // [T] or null
  int64_t T;
  int E, K, G, Eg, gk, m;
  bool softmax, normalize;
  float scaling;
};

// Shared words per warp: scores[E], selection values[E], group scores[G],
// kept groups[G], picks[K].
__host__ __device__ int64_t forward_words(int64_t E, int64_t G, int64_t K) { return 2 * E + 2 * G + K; }

__global__ void topk_forward_kernel(Forward a) {
  extern __shared__ float smem[];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int E = a.E, K = a.K;
  float* s = smem + warp * forward_words(E, a.G, K);
  float* sel = s + E;
  float* gscore = sel + E;
  int* gkept = reinterpret_cast<int*>(gscore + a.G);
  int* pick = gkept + a.G;
  const bool pieces = a.softmax || a.lse != nullptr;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * warps + warp; t < a.T;
       t += static_cast<int64_t>(gridDim.x) * warps) {
    const float* z = a.logits + t * E;
    float mx = 0.0f, se = 0.0f;
    if (pieces) {  // row max and Σ exp(z − max): softmax and logsumexp
      float m = -INFINITY;
      for (int e = lane; e < E; e += 32) m = fmaxf(m, z[e]);
      mx = moe::warp_max(m);
      float acc = 0.0f;
      for (int e = lane; e < E; e += 32) {
        const float x = exp_fast(z[e] - mx);
        s[e] = x;
        acc += x;
      }
      se = moe::warp_sum(acc);
    }
    const float inv = 1.0f / se;
    float* st = a.scores + t * E;
    for (int e = lane; e < E; e += 32) {
      const float v = a.softmax ? s[e] * inv : 1.0f / (1.0f + exp_fast(-z[e]));
      s[e] = v;
      st[e] = v;
      sel[e] = v + (a.bias ? a.bias[e] : 0.0f);
    }
    if (a.lse && lane == 0) a.lse[t] = mx + logf(se);
    __syncwarp();

    if (a.G > 1) {
      for (int g = lane; g < a.G; g += 32) {
        gscore[g] = group_top_sum(sel + static_cast<int64_t>(g) * a.Eg, a.Eg, a.m);
        gkept[g] = 0;
      }
      __syncwarp();
      float pv = INFINITY;
      int pi = -1;
      for (int i = 0; i < a.gk; ++i) {  // uniform: every lane holds the same winner
        const Best b = warp_best(gscore, a.G, pv, pi, lane);
        if (b.i == kNone) break;
        if (lane == 0) gkept[b.i] = 1;
        pv = b.v, pi = b.i;
      }
      __syncwarp();
      for (int e = lane; e < E; e += 32)
        if (!gkept[e / a.Eg]) sel[e] = -INFINITY;
      __syncwarp();
    }

    int found = 0;
    {
      float pv = INFINITY;
      int pi = -1;
      for (; found < K; ++found) {
        const Best b = warp_best(sel, E, pv, pi, lane);
        if (b.i == kNone) break;
        if (lane == 0) pick[found] = b.i;
        pv = b.v, pi = b.i;
      }
    }
    int32_t* ex = a.experts + t * K;
    float* w = a.weights + t * K;
    if (found < K) {
      // Non-finite scores (a diverged run): the first experts not yet chosen,
      // in order, keep every index valid; NaN weights report the divergence.
      if (lane == 0) {
        int e = 0;
        for (int j = found; j < K; ++j) {
          for (bool used = true; used;) {
            used = false;
            for (int i = 0; i < j; ++i) used |= pick[i] == e;
            if (used) ++e;
          }
          pick[j] = e;
        }
      }
      __syncwarp();
      for (int j = lane; j < K; j += 32) {
        ex[j] = pick[j];
        w[j] = __int_as_float(0x7FC00000);  // quiet NaN
      }
    } else {
      __syncwarp();
      float scale = a.scaling;
      if (a.normalize) {
        float sum = 0.0f;  // slot order, as the CPU; each lane the same sum
        for (int j = 0; j < K; ++j) sum += s[pick[j]];
        scale = a.scaling / (sum + kNormEps);
      }
      for (int j = lane; j < K; j += 32) {
        const int e = pick[j];
        ex[j] = e;
        w[j] = s[e] * scale;
      }
    }
    __syncwarp();  // the next token rewrites this warp's shared memory
  }
}

// Warps per block for `bytes` of shared memory per warp; 0 when one does not fit.
int warps_for(int64_t bytes) {
  return static_cast<int>(std::min<int64_t>(kMaxWarpsPerBlock, kSharedPerBlock / std::max<int64_t>(bytes, 1)));
}

// ---------------------------------------------------------------- backward

struct Backward {
  const float* logits;     // [T, E]
  const float* scores;     // [T, E]
  const int32_t* experts;  // [T, K]
  const float* dweight;    // [T, K] or null
  const float* aux;        // [T / seg_len, E] or null
  float* dlogits;          // [T, E]
  int64_t T, seg_len;
  int E, K;
  bool softmax, normalize;
  float scaling, z_coef;
};

// Per token, with the selection fixed (see cpu/moe_ops.cpp for the chain
// rule): g = ∂f/∂s in shared memory (the weight terms scattered by lane 0 in
// slot order, so repeated experts add up as on the CPU), then ∂f/∂z through
// softmax or σ, plus the z-loss term 2·z_coef·lse·softmax(z).
__global__ void topk_backward_kernel(Backward a) {
  extern __shared__ float smem[];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int E = a.E, K = a.K;
  float* s = smem + warp * 2 * static_cast<int64_t>(E);
  float* g = s + E;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * warps + warp; t < a.T;
       t += static_cast<int64_t>(gridDim.x) * warps) {
    const float* st = a.scores + t * E;
    for (int e = lane; e < E; e += 32) s[e] = st[e], g[e] = 0.0f;
    __syncwarp();
    if (a.dweight) {
      if (lane == 0) {
        const int32_t* sel = a.experts + t * K;
        const float* R = a.dweight + t * K;
        for (int j = 0; j < K; ++j)
          ORIGAMI_DEVICE_CHECK(sel[j] >= 0 && sel[j] < E, "moe_topk_backward: expert index outside [0, E)");
        if (a.normalize) {
          float sum = 0.0f, rs = 0.0f;
          for (int j = 0; j < K; ++j) sum += s[sel[j]];
          const float den = sum + kNormEps;
          for (int j = 0; j < K; ++j) rs += R[j] * s[sel[j]];
          rs /= den;
          for (int j = 0; j < K; ++j) g[sel[j]] += a.scaling / den * (R[j] - rs);
        } else {
          for (int j = 0; j < K; ++j) g[sel[j]] += a.scaling * R[j];
        }
      }
      __syncwarp();
    }
    // From here each lane touches only its own elements e ≡ lane (mod 32).
    if (a.aux) {
      const float* A = a.aux + (t / a.seg_len) * E;
      if (a.softmax) {
        for (int e = lane; e < E; e += 32) g[e] += A[e];
      } else {
        float tot = 0.0f;
        for (int e = lane; e < E; e += 32) tot += s[e];
        const float inv = 1.0f / (moe::warp_sum(tot) + kNormEps);
        float as = 0.0f;
        for (int e = lane; e < E; e += 32) as += A[e] * s[e] * inv;
        as = moe::warp_sum(as);
        for (int e = lane; e < E; e += 32) g[e] += (A[e] - as) * inv;
      }
    }
    float gs = 0.0f;
    if (a.softmax) {
      for (int e = lane; e < E; e += 32) gs += g[e] * s[e];
      gs = moe::warp_sum(gs);
    }
    const float* z = a.logits + t * E;
    float mx = 0.0f, c = 0.0f;
    if (a.z_coef != 0.0f) {
      float m = -INFINITY;
      for (int e = lane; e < E; e += 32) m = fmaxf(m, z[e]);
      mx = moe::warp_max(m);
      float se = 0.0f;
      for (int e = lane; e < E; e += 32) se += exp_fast(z[e] - mx);
      se = moe::warp_sum(se);
      const float lse = mx + logf(se);
      c = 2.0f * a.z_coef * lse / se;
    }
    float* dz = a.dlogits + t * E;
    for (int e = lane; e < E; e += 32) {
      float d = a.softmax ? s[e] * (g[e] - gs) : g[e] * s[e] * (1.0f - s[e]);
      if (a.z_coef != 0.0f) d += c * exp_fast(z[e] - mx);
      dz[e] = d;
    }
    __syncwarp();  // the next token rewrites this warp's shared memory
  }
}

}  // namespace

void moe_topk_forward(const ExecContext& ctx, const Tensor& logits_TE, const Tensor& bias_E, const MoeTopkParams& p,
                      Tensor& scores_TE, Tensor& expert_TK, Tensor& weight_TK, Tensor& lse_T) {
  moe_topk_forward_shapes(logits_TE, bias_E, p, scores_TE, expert_TK, weight_TK, lse_T);
  const int64_t T = logits_TE.rows(), E = logits_TE.cols(), K = p.top_k;
  if (T == 0) return;
  const int64_t G = p.num_groups, gk = p.group_topk;
  const int64_t bytes = forward_words(E, G, K) * 4;
  const int warps = warps_for(bytes);
  ORIGAMI_CHECK(warps > 0, "moe_topk_forward on CUDA keeps a token's scores in shared memory: E = ", E,
                " experts need ", bytes, " bytes, over the ", kSharedPerBlock, " a block has");
  Forward a{};
  a.logits = dev<const float>(logits_TE, "router logits_TE");
  a.bias = bias_E.defined() ? dev<const float>(bias_E, "router bias_E") : nullptr;
  a.scores = dev<float>(scores_TE, "router scores_TE");
  a.experts = dev<int32_t>(expert_TK, "router expert_TK");
  a.weights = dev<float>(weight_TK, "router weight_TK");
  a.lse = lse_T.defined() ? dev<float>(lse_T, "router lse_T") : nullptr;
  a.T = T;
  a.E = static_cast<int>(E);
  a.K = static_cast<int>(K);
  a.G = static_cast<int>(G);
  a.Eg = static_cast<int>(E / G);
  a.gk = static_cast<int>(gk);
  a.m = G > 1 ? static_cast<int>(K / gk) : 0;
  a.softmax = p.score_function == MoeScore::softmax;
  a.normalize = p.normalize_topk;
  a.scaling = p.scaling_f32();
  topk_forward_kernel<<<grid_for(T, warps), warps * 32, warps * bytes, stream_of(ctx)>>>(a);
  CUDA_CHECK_LAUNCH();
}

void moe_topk_backward(const ExecContext& ctx, const Tensor& logits_TE, const Tensor& scores_TE,
                       const Tensor& expert_TK, const Tensor& dweight_TK, const Tensor& aux_SE, int64_t seg_len,
                       float z_coef, const MoeTopkParams& p, Tensor& dlogits_TE) {
  moe_topk_backward_shapes(logits_TE, scores_TE, expert_TK, dweight_TK, aux_SE, seg_len, p, dlogits_TE);
  const int64_t T = logits_TE.rows(), E = logits_TE.cols(), K = p.top_k;
  if (T == 0 || E == 0) return;
  const int64_t bytes = 2 * E * 4;
  const int warps = warps_for(bytes);
  ORIGAMI_CHECK(warps > 0, "moe_topk_backward on CUDA keeps a token's scores in shared memory: E = ", E,
                " experts need ", bytes, " bytes, over the ", kSharedPerBlock, " a block has");
  Backward a{};
  a.logits = dev<const float>(logits_TE, "router logits_TE");
  a.scores = dev<const float>(scores_TE, "router scores_TE");
  a.experts = dev<const int32_t>(expert_TK, "router expert_TK");
  a.dweight = dweight_TK.defined() ? dev<const float>(dweight_TK, "router dweight_TK") : nullptr;
  a.aux = aux_SE.defined() ? dev<const float>(aux_SE, "router aux_SE") : nullptr;
  a.dlogits = dev<float>(dlogits_TE, "router dlogits_TE");
  a.T = T;
  a.seg_len = aux_SE.defined() ? seg_len : 1;
  a.E = static_cast<int>(E);
  a.K = static_cast<int>(K);
  a.softmax = p.score_function == MoeScore::softmax;
  a.normalize = p.normalize_topk;
  a.scaling = p.scaling_f32();
  a.z_coef = z_coef;
  topk_backward_kernel<<<grid_for(T, warps), warps * 32, warps * bytes, stream_of(ctx)>>>(a);
  CUDA_CHECK_LAUNCH();
}

}  // namespace origami::cuda

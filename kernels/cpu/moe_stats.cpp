// CPU router statistics and balancing (see moe_ops.h): the statistics buffer
// of one forward, the host scalars and gradient coefficients read from it
// after the group's reduction, and the expert-bias update. The buffer is a
// few hundred doubles; only its per-token pass (moe_routing_stats) is
// threaded, over fixed chunks, so every result is independent of the thread
// count. Sums keep the order the router's math was written in (fp64).
#include <algorithm>
#include <vector>

#include "kernels/cpu/ops.h"

namespace origami::cpu {

namespace {

constexpr int64_t kStatsChunk = 256;

// stats_N must be f64 [2·S·E + 2].
const double* check_stats(const Tensor& stats_N, int64_t S, int64_t E) {
  ORIGAMI_CHECK(stats_N.defined() && stats_N.dtype() == DType::f64, "router stats_N must be a defined f64 tensor");
  ORIGAMI_CHECK(S >= 0 && E > 0, "router stats of ", S, " segments over ", E, " experts");
  check_shape(stats_N, {2 * S * E + 2}, "router stats_N [2·S·E + 2]");
  return stats_N.data<double>();
}

}  // namespace

void moe_routing_stats(const ExecContext& ctx, const Tensor& scores_TE, const Tensor& expert_TK, const Tensor& lse_T,
                       MoeScore score, int64_t num_segments, Tensor& stats_N) {
  ORIGAMI_CHECK(scores_TE.defined() && scores_TE.dtype() == DType::f32, "router scores must be f32");
  const int64_t T = scores_TE.rows(), E = scores_TE.cols(), S = num_segments, SE = S * E;
  check_stats(stats_N, S, E);
  double* stats = stats_N.data<double>();
  std::fill(stats, stats + 2 * SE + 2, 0.0);
  if (S > 0 && T > 0) {
    ORIGAMI_CHECK(expert_TK.defined() && expert_TK.dtype() == DType::i32, "router expert_TK must be i32");
    const int64_t K = expert_TK.cols();
    check_shape(expert_TK, {T, K}, "router expert_TK");
    ORIGAMI_CHECK(T % S == 0, "routing stats: ", T, " tokens do not split into ", S, " segments");
    const int64_t seg_len = T / S, chunks_per_seg = (seg_len + kStatsChunk - 1) / kStatsChunk;
    const int64_t n_chunks = S * chunks_per_seg;
    // Per-chunk partials: [counts E | scores E]. Tiny (T / 256 · 2E doubles).
    std::vector<double> part(static_cast<size_t>(n_chunks * 2 * E), 0.0);
    const float* scores = scores_TE.f32();
    const int32_t* experts = expert_TK.i32();
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < n_chunks; ++c) {
      const int64_t b = c / chunks_per_seg, i = c % chunks_per_seg;
      const int64_t t0 = b * seg_len + i * kStatsChunk, t1 = std::min(t0 + kStatsChunk, (b + 1) * seg_len);
      double* cnt = part.data() + c * 2 * E;
      double* sum = cnt + E;
      for (int64_t t = t0; t < t1; ++t) {
        const float* s = scores + t * E;
        for (int64_t j = 0; j < K; ++j) cnt[experts[t * K + j]] += 1.0;
        if (score == MoeScore::softmax) {
          for (int64_t e = 0; e < E; ++e) sum[e] += s[e];
        } else {
          float tot = 0.0f;
          for (int64_t e = 0; e < E; ++e) tot += s[e];
          const float inv = 1.0f / (tot + kMoeNormEps);
          for (int64_t e = 0; e < E; ++e) sum[e] += s[e] * inv;
        }
      }
    }
    double* counts_SE = stats;
    double* scores_SE = stats + SE;
    for (int64_t c = 0; c < n_chunks; ++c) {
      const int64_t b = c / chunks_per_seg;
      const double* cnt = part.data() + c * 2 * E;
      for (int64_t e = 0; e < E; ++e) {
        counts_SE[b * E + e] += cnt[e];
        scores_SE[b * E + e] += cnt[E + e];
      }
    }
  }
  stats[2 * SE] = static_cast<double>(T);
  if (lse_T.defined()) {
    ORIGAMI_CHECK(lse_T.dtype() == DType::f32, "router lse_T must be f32");
    check_shape(lse_T, {T}, "router lse_T");
    stats[2 * SE + 1] = cpu::sum_squares(ctx, lse_T);
  }
}

void moe_routing_totals(const ExecContext& ctx, const Tensor& stats_N, int64_t num_segments, int64_t num_experts,
                        int64_t top_k, Tensor& totals_3) {
  const int64_t S = num_segments, SE = S * num_experts;
  const double* b = check_stats(stats_N, S, num_experts);
  ORIGAMI_CHECK(top_k >= 1, "router totals need top_k >= 1, got ", top_k);
  const double tokens = b[2 * SE];
  double balance = 0.0;
  if (S > 0) {
    // f_be · P_be summed in buffer order, one fp64 accumulator (the order of
    // the aux loss as written; no reassociation).
    const double Tb = tokens / static_cast<double>(S);
    for (int64_t i = 0; i < SE; ++i) balance += b[i] / (Tb * static_cast<double>(top_k)) * (b[SE + i] / Tb);
  }
  double* out = totals_3.data<double>();  // the order of MoeRoutingTotals
  out[0] = tokens;
  out[1] = balance;
  out[2] = b[2 * SE + 1];
}

void moe_aux_coefficients(const ExecContext& ctx, const Tensor& stats_N, double scale, Tensor& aux_SE) {
  ORIGAMI_CHECK(aux_SE.defined() && aux_SE.dtype() == DType::f32 && aux_SE.dim() == 2, "aux_SE must be f32 [S, E]");
  const int64_t S = aux_SE.size(0), E = aux_SE.size(1);
  const double* counts = check_stats(stats_N, S, E);
  float* aux = aux_SE.f32();
  for (int64_t i = 0; i < S * E; ++i) aux[i] = static_cast<float>(scale * counts[i]);
}

void moe_expert_bias_update(const ExecContext& ctx, Tensor& bias_E, std::span<const int64_t> load_E, float rate) {
  const int64_t E = static_cast<int64_t>(load_E.size());
  ORIGAMI_CHECK(bias_E.defined() && bias_E.dtype() == DType::f32, "expert bias must be a defined f32 tensor");
  check_shape(bias_E, {E}, "expert bias_E");
  int64_t total = 0;
  for (int64_t l : load_E) total += l;
  float* b = bias_E.f32();
  for (int64_t e = 0; e < E; ++e) {
    const int64_t d = total - E * load_E[e];
    b[e] += rate * static_cast<float>((d > 0) - (d < 0));
  }
}

}  // namespace origami::cpu

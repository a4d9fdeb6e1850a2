// GptDataset windows, the seeded per-epoch shuffle and the §8 batch rule.
// The shuffle uses only 64-bit integer arithmetic we write ourselves
// (SplitMix64 + rejection-sampled bounds), never <random> distributions,
// whose outputs differ between standard libraries.
#include "engine/dataset.h"

#include <numeric>
#include <utility>

#include "kernels/check.h"

namespace origami {

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next() { return mix64(state_ += kGolden); }
  // Uniform in [0, bound) without modulo bias: reject the low 2^64 mod bound
  // values so the accepted range is a whole number of periods.
  uint64_t below(uint64_t bound) {
    const uint64_t threshold = (0 - bound) % bound;
    for (;;) {
      const uint64_t r = next();
      if (r >= threshold) return r % bound;
    }
  }

 private:
  uint64_t state_;
};

}  // namespace

std::vector<int64_t> shuffled_order(int64_t n, uint64_t seed, int64_t epoch) {
  ORIGAMI_CHECK(n >= 0 && epoch >= 0, "n ", n, " epoch ", epoch);
  std::vector<int64_t> perm(n);
  std::iota(perm.begin(), perm.end(), int64_t{0});
  // Distinct (seed, epoch) pairs give unrelated streams: the epoch is folded
  // in after one full mix of the seed.
  SplitMix64 rng(mix64(mix64(seed + kGolden) + static_cast<uint64_t>(epoch)));
  for (int64_t i = n - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(rng.below(static_cast<uint64_t>(i) + 1));
    std::swap(perm[i], perm[j]);
  }
  return perm;
}

GptDataset::GptDataset(const IndexedDataset& data, int64_t seq_len, bool shuffle, uint64_t seed)
    : data_(&data), seq_len_(seq_len), shuffle_(shuffle), seed_(seed), cache_(std::make_unique<EpochCache>()) {
  ORIGAMI_CHECK(seq_len > 0, "seq_len ", seq_len);
  const int64_t tokens = data.num_tokens();
  // Window w needs w·L + L + 1 <= tokens, so there are (tokens - 1) / L.
  num_windows_ = tokens > seq_len ? (tokens - 1) / seq_len : 0;
  if (num_windows_ == 0) {
    ORIGAMI_USER_ERROR(data.prefix(), ": ", tokens, " tokens hold no sample of seq_len ", seq_len,
                       " (rule: a sample needs seq_len + 1 = ", seq_len + 1,
                       " consecutive tokens; use more data or a shorter seq_len)");
  }
}

int64_t GptDataset::window_of(int64_t sample) const {
  ORIGAMI_CHECK(sample >= 0, "negative sample index ", sample);
  const int64_t epoch = sample / num_windows_;
  const int64_t pos = sample % num_windows_;
  if (!shuffle_) return pos;
  std::lock_guard<std::mutex> lock(cache_->mu);
  if (cache_->epoch != epoch) {
    cache_->perm = shuffled_order(num_windows_, seed_, epoch);
    cache_->epoch = epoch;
  }
  return cache_->perm[pos];
}

void GptDataset::get(int64_t sample, int32_t* out) const {
  data_->read_tokens(window_of(sample) * seq_len_, seq_len_ + 1, out);
}

int64_t sample_index(int64_t global_batch_index, int64_t global_batch, int64_t accum_step, int64_t dp_size,
                     int64_t dp_rank, int64_t micro_batch, int64_t i_in_micro) {
  ORIGAMI_CHECK(global_batch_index >= 0 && global_batch > 0 && dp_size > 0 && micro_batch > 0,
                "g ", global_batch_index, " B ", global_batch, " DP ", dp_size, " mb ", micro_batch);
  ORIGAMI_CHECK(global_batch % (micro_batch * dp_size) == 0, "global_batch ", global_batch,
                " is not a multiple of micro_batch*DP = ", micro_batch * dp_size);
  const int64_t accum_steps = global_batch / (micro_batch * dp_size);
  ORIGAMI_CHECK(accum_step >= 0 && accum_step < accum_steps, "accum_step ", accum_step, " of ", accum_steps);
  ORIGAMI_CHECK(dp_rank >= 0 && dp_rank < dp_size, "dp_rank ", dp_rank, " of ", dp_size);
  ORIGAMI_CHECK(i_in_micro >= 0 && i_in_micro < micro_batch, "row ", i_in_micro, " of micro_batch ", micro_batch);
  return global_batch_index * global_batch + (accum_step * dp_size + dp_rank) * micro_batch + i_in_micro;
}

}  // namespace origami

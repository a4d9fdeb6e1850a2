// GptDataset: an indexed dataset seen as fixed-length training samples, and
// the batch rule that maps (global batch, accumulation step, DP rank, row)
// to a sample (ARCHITECTURE.md §8).
//
// Invariants:
//   - The stream is every sequence back to back (preprocess already put an
//     EOD after each document). Window w is stream tokens
//     [w·seq_len, w·seq_len + seq_len + 1): consecutive windows share one
//     boundary token, so inputs = window[0, seq_len) and targets =
//     window[1, seq_len + 1). The trailing partial window is dropped.
//   - Sample s >= 0 is window perm_e[s mod W] of epoch e = s / W, where perm_e
//     is a Fisher-Yates shuffle driven by a SplitMix64 stream seeded by
//     (seed, e) — bit-identical on every platform and compiler — or the
//     identity when shuffling is off. So a sample index alone (e.g. from a
//     checkpoint) says which tokens it is, independent of layout.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "engine/indexed_dataset.h"

namespace origami {

class GptDataset {
 public:
  // `data` must outlive this object. Throws UserError naming the data path,
  // its token count and seq_len when not even one window fits.
  GptDataset(const IndexedDataset& data, int64_t seq_len, bool shuffle, uint64_t seed);

  int64_t seq_len() const { return seq_len_; }
  // Windows per epoch.
  int64_t num_windows() const { return num_windows_; }
  // The window that sample s (>= 0) reads.
  int64_t window_of(int64_t sample) const;
  // Writes the sample's seq_len + 1 tokens to out. Thread-safe.
  void get(int64_t sample, int32_t* out /* (seq_len + 1) */) const;

 private:
  struct EpochCache {
    std::mutex mu;
    int64_t epoch = -1;
    std::vector<int64_t> perm;  // (num_windows) window order of `epoch`
  };

  const IndexedDataset* data_;
  int64_t seq_len_;
  int64_t num_windows_;
  bool shuffle_;
  uint64_t seed_;
  std::unique_ptr<EpochCache> cache_;  // the most recent epoch's order
};

// The window order of one epoch: a permutation of 0 .. n-1 from Fisher-Yates
// over SplitMix64 seeded by (seed, epoch). Exposed so tests can pin it.
std::vector<int64_t> shuffled_order(int64_t n, uint64_t seed, int64_t epoch);

// The §8 batch rule: global batch g holds samples [g·B, (g+1)·B); DP rank r at
// accumulation step a takes rows (a·DP + r)·mb ... + mb of it. Requires
// B % (mb·DP) == 0, 0 <= a < B/(mb·DP), 0 <= r < DP, 0 <= i < mb.
int64_t sample_index(int64_t global_batch_index, int64_t global_batch, int64_t accum_step, int64_t dp_size,
                     int64_t dp_rank, int64_t micro_batch, int64_t i_in_micro);

}  // namespace origami

// A step's MoE statistics across ranks (see moe_records.h). The pipeline
// spread packs every layer's vectors into one buffer per element type (two
// collectives whatever the layer count); the per-layer sums stay per layer,
// the order the loss bits were measured with.
#include "engine/moe_records.h"

#include <algorithm>
#include <span>

namespace origami {

void reduce_moe_records(std::vector<MoeLayerRecord>& records, const comm::Groups& g) {
  comm::Communicator* tokens = comm::multi_rank(g, comm::GroupKind::tp_dp_cp);
  comm::Communicator* batches = comm::multi_rank(g, comm::GroupKind::dp);
  for (MoeLayerRecord& r : records) {
    if (tokens) {
      for (auto* v : {&r.routed_per_expert, &r.kept_per_expert, &r.tokens_per_ep_rank})
        tokens->all_reduce(std::span<int64_t>(*v));
    }
    if (batches) {
      double losses[2] = {r.aux_loss, r.z_loss};
      batches->all_reduce(std::span<double>(losses, 2));
      r.aux_loss = losses[0];
      r.z_loss = losses[1];
    }
  }
}

std::vector<MoeLayerRecord> whole_model_records(const std::vector<MoeLayerRecord>& own, const Config& cfg,
                                                int64_t ep, comm::Communicator* pp) {
  if (!pp) return own;
  const int64_t E = cfg.moe.router.num_experts;
  std::vector<MoeLayerRecord> all;
  for (int64_t l = 0; l < cfg.model.num_layers; ++l)
    if (cfg.moe.is_moe_layer(l))
      all.push_back({l, std::vector<int64_t>(E), std::vector<int64_t>(E), std::vector<int64_t>(ep), 0.0, 0.0});
  for (const MoeLayerRecord& r : own)
    for (MoeLayerRecord& a : all)
      if (a.layer == r.layer) a = r;
  std::vector<int64_t> counts;
  std::vector<double> losses;
  for (const MoeLayerRecord& r : all) {
    for (auto* v : {&r.routed_per_expert, &r.kept_per_expert, &r.tokens_per_ep_rank})
      counts.insert(counts.end(), v->begin(), v->end());
    losses.insert(losses.end(), {r.aux_loss, r.z_loss});
  }
  pp->all_reduce(std::span<int64_t>(counts));
  pp->all_reduce(std::span<double>(losses));
  auto next = counts.begin();
  auto li = losses.begin();
  for (MoeLayerRecord& r : all) {
    for (auto* v : {&r.routed_per_expert, &r.kept_per_expert, &r.tokens_per_ep_rank}) {
      std::copy_n(next, v->size(), v->begin());
      next += static_cast<std::ptrdiff_t>(v->size());
    }
    r.aux_loss = *li++;
    r.z_loss = *li++;
  }
  return all;
}

}  // namespace origami

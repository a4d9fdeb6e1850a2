// A step's MoE statistics across ranks (see moe_records.h). Both reductions
// pack every layer's vectors into one buffer per element type (two
// collectives whatever the layer count); the sums stay per element.
#include "engine/moe_records.h"

#include <algorithm>
#include <span>

namespace origami {

namespace {

// Every record's count vectors end to end, and its two losses, in record
// order; and back.
struct Packed {
  std::vector<int64_t> counts;
  std::vector<double> losses;
};

Packed pack(const std::vector<MoeLayerRecord>& records) {
  Packed p;
  for (const MoeLayerRecord& r : records) {
    for (auto* v : {&r.routed_per_expert, &r.kept_per_expert, &r.tokens_per_ep_rank})
      p.counts.insert(p.counts.end(), v->begin(), v->end());
    p.losses.insert(p.losses.end(), {r.aux_loss, r.z_loss});
  }
  return p;
}

void unpack(const Packed& p, std::vector<MoeLayerRecord>& records) {
  auto next = p.counts.begin();
  auto li = p.losses.begin();
  for (MoeLayerRecord& r : records) {
    for (auto* v : {&r.routed_per_expert, &r.kept_per_expert, &r.tokens_per_ep_rank}) {
      std::copy_n(next, v->size(), v->begin());
      next += static_cast<std::ptrdiff_t>(v->size());
    }
    r.aux_loss = *li++;
    r.z_loss = *li++;
  }
}

}  // namespace

void reduce_moe_records(std::vector<MoeLayerRecord>& records, const comm::Groups& g) {
  comm::Communicator* tokens = comm::multi_rank(g, comm::GroupKind::tp_dp_cp);
  comm::Communicator* batches = comm::multi_rank(g, comm::GroupKind::dp);
  if (records.empty() || (!tokens && !batches)) return;
  Packed p = pack(records);
  if (tokens) tokens->all_reduce(std::span<int64_t>(p.counts));
  if (batches) batches->all_reduce(std::span<double>(p.losses));
  unpack(p, records);
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
  Packed p = pack(all);
  pp->all_reduce(std::span<int64_t>(p.counts));
  pp->all_reduce(std::span<double>(p.losses));
  unpack(p, all);
  return all;
}

}  // namespace origami

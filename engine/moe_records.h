// A step's MoE statistics across ranks (ARCHITECTURE.md §6, §9): each rank
// records its own tokens' routing per MoE layer of its stage (MoeLayerRecord,
// engine/model.h); these sum them into the global batch's and spread every
// stage's layers to every rank, so the metrics and the expert-bias update see
// the whole model. Host vectors over MPI: metadata, not tensors.
#pragma once
#include <vector>

#include "comm/groups.h"
#include "engine/config.h"
#include "engine/model.h"

namespace origami {

// Sums the records over the ranks that saw distinct tokens. Routing counts
// are of distinct tokens on every rank of tp-dp-cp (the router sees its rank's
// own tokens); a micro-batch's aux and z losses are already the value over
// its tp-cp group, so they sum over dp only.
void reduce_moe_records(std::vector<MoeLayerRecord>& records, const comm::Groups& groups);

// Every MoE layer's record of the whole model, in layer order, on every rank:
// each pipeline stage contributes its own layers (already reduced over its
// ranks) and zeros for the others over `pp`. pp null: `own` as it is.
std::vector<MoeLayerRecord> whole_model_records(const std::vector<MoeLayerRecord>& own, const Config& cfg,
                                                int64_t ep, comm::Communicator* pp);

}  // namespace origami

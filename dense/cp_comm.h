// How context-parallel attention moves K and V over the cp group
// (parallel.cp_comm; dense/attention_cp.h, dense/attention_ring.h). One
// definition from the config file to the module, like moe/options.h.
#pragma once

namespace origami::dense {

enum class CpComm {
  // Llama-3 style: K, V all-gathered in forward and kept whole for backward,
  // dK, dV reduce-scattered. Saves 2·B·S·Hkv·hd floats per layer.
  all_gather,
  // Ring attention: K, V blocks passed rank to rank, each overlapped with the
  // attention of the block before; backward passes K, V and the dK, dV being
  // summed. Saves only the local 2·B·(S/cp)·Hkv·hd floats.
  ring,
};

}  // namespace origami::dense

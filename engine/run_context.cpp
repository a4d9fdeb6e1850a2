// make_context (run_context.h).
#include "engine/run_context.h"

#include <cstdlib>
#include <string>

#include "engine/preflight.h"
#include "kernels/threads.h"

namespace origami {

ExecContext make_context(const Config& cfg) {
  const RuntimeConfig& rt = cfg.runtime;
  const int threads = rt.threads > 0 ? static_cast<int>(rt.threads) : default_threads_per_rank();
  set_num_threads(threads);
  const RunPlacement placement = resolve_placement(cfg, local_rank_on_this_node(), ranks_on_this_node());
  const char* stand_in = std::getenv("ORIGAMI_HOST_STAND_IN");
  ExecContext ctx = !placement.device.is_host()               ? ExecContext::cuda(placement.device.index, threads)
                    : stand_in && std::string(stand_in) == "1" ? ExecContext::host_stand_in(threads)
                                                               : ExecContext::cpu(threads);
  ctx.set_data_dtype(placement.precision == Precision::bf16 ? DType::bf16 : DType::f32);
  return ctx;
}

}  // namespace origami

// NCCL_CHECK: NCCL's member of the engine's one error family
// (kernels/check.h): file:line, rank, the call, NCCL's error text and its
// own account of the last error, then the whole job aborts.
#pragma once
#if ORIGAMI_WITH_NCCL
#include <nccl.h>

#include "kernels/check.h"

#define NCCL_CHECK(call)                                                                                   \
  do {                                                                                                     \
    const ncclResult_t origami_nccl_rc_ = (call);                                                          \
    if (origami_nccl_rc_ != ncclSuccess) [[unlikely]]                                                      \
      ::origami::fail_check(__FILE__, __LINE__, #call,                                                     \
                            ::origami::detail::concat(ncclGetErrorString(origami_nccl_rc_), " (",          \
                                                      ncclGetLastError(nullptr), ")"));                    \
  } while (0)

#endif  // ORIGAMI_WITH_NCCL

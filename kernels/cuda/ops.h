// The CUDA backend: one implementation per entry of kernels/backend_ops.inc,
// each in kernels/cuda/<op>.cu (the dtype rule: common.cuh). Called only by
// kernels/dispatch.cpp, which has already checked that every tensor is on
// the context's device.
#pragma once
#include <string_view>

#include "kernels/adamw.h"
#include "kernels/attention.h"
#include "kernels/context.h"
#include "kernels/context_parallel.h"
#include "kernels/cross_entropy.h"
#include "kernels/elementwise.h"
#include "kernels/embedding.h"
#include "kernels/gemm.h"
#include "kernels/grouped_gemm.h"
#include "kernels/init.h"
#include "kernels/moe_ops.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"

namespace origami::cuda {

#include "kernels/backend_ops.inc"

}  // namespace origami::cuda

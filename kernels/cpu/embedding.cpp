// CPU embedding gather and scatter-add for a vocab shard [vocab_start,
// vocab_start + V_local). Backward splits the columns, not the tokens, over
// threads: every table element then accumulates its tokens in token order, so
// the result is deterministic and independent of the thread count, with no
// atomics and no scratch.
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "kernels/cpu/ops.h"

namespace origami::cpu {

namespace {

void check_args(const Tensor& ids_T, const Tensor& table_VD, const Tensor& rows_TD, const char* what) {
  ORIGAMI_CHECK(ids_T.defined() && ids_T.dtype() == DType::i32 && ids_T.dim() == 1, what,
                " ids must be i32 [T], got ", shape_string(ids_T.shape()));
  ORIGAMI_CHECK(table_VD.defined() && table_VD.dtype() == DType::f32 && table_VD.dim() == 2, what,
                " table must be f32 [V, D], got ", shape_string(table_VD.shape()));
  ORIGAMI_CHECK(rows_TD.defined() && rows_TD.dtype() == DType::f32, what, " rows must be f32");
  check_shape(rows_TD, {ids_T.numel(), table_VD.size(1)}, what);
}

}  // namespace

void embedding_forward(const ExecContext& ctx, const Tensor& ids_T, const Tensor& table_VD, int64_t vocab_start,
                       Tensor& out_TD) {
  check_args(ids_T, table_VD, out_TD, "embedding_forward");
  const int64_t T = ids_T.numel(), V = table_VD.size(0), D = table_VD.size(1);
  const int32_t* ids = ids_T.i32();
  const float* table = table_VD.f32();
  float* out = out_TD.f32();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t row = static_cast<int64_t>(ids[t]) - vocab_start;
    float* dst = out + t * D;
    if (row >= 0 && row < V)
      std::memcpy(dst, table + row * D, static_cast<size_t>(D) * sizeof(float));
    else
      std::fill(dst, dst + D, 0.0f);
  }
}

void embedding_backward(const ExecContext& ctx, const Tensor& ids_T, const Tensor& dout_TD, int64_t vocab_start,
                        Tensor& dtable_VD) {
  check_args(ids_T, dtable_VD, dout_TD, "embedding_backward");
  const int64_t T = ids_T.numel(), V = dtable_VD.size(0), D = dtable_VD.size(1);
  const int32_t* ids = ids_T.i32();
  const float* dout = dout_TD.f32();
  float* dtable = dtable_VD.f32();
  // Column blocks of 16 floats (one cache line) so threads never share a line.
  const int64_t n_blocks = (D + 15) / 16;
#pragma omp parallel
  {
    const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t c0 = std::min(D, n_blocks * tid / nt * 16), c1 = std::min(D, n_blocks * (tid + 1) / nt * 16);
    if (c0 < c1) {
      for (int64_t t = 0; t < T; ++t) {
        const int64_t row = static_cast<int64_t>(ids[t]) - vocab_start;
        if (row < 0 || row >= V) continue;
        float* __restrict dst = dtable + row * D;
        const float* __restrict src = dout + t * D;
        for (int64_t c = c0; c < c1; ++c) dst[c] += src[c];
      }
    }
  }
}

}  // namespace origami::cpu

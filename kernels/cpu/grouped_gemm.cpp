// CPU grouped GEMM (kernels/grouped_gemm.h) on oneDNN's dnnl_sgemm, in one
// of two schedules, chosen from the shapes and the context's thread count:
//  - per segment (the default): each segment's product is one dnnl_sgemm on
//    all of the context's threads, segments in order — exactly the loop the
//    experts ran before, so its bits and speed are the loop's;
//  - items in parallel, when there are many small segments (at least
//    kMinItemsPerThread work items per thread, each at most kSmallRows rows):
//    every item is one single-threaded dnnl_sgemm and items run side by side.
//    oneDNN's threads cannot fill the cores on products that small (measured
//    on 2 threads: 64 segments of 128 rows, 2.5x the per-segment loop), while
//    on segments of hundreds of rows its threaded kernel is the faster one
//    (16 segments of 512 rows: the loop 1.1x the items).
// Both are deterministic for a given context. Neither is bitwise independent
// of the thread count: oneDNN 2.6's threaded sgemm itself is not (it
// partitions some shapes differently at 3+ threads, and 1-row products at 2),
// which the per-segment loop always inherited. An item is a whole segment
// (row products) or a whole group's output (weight gradient, its segments
// accumulated in order): the item schedule's bits are the per-segment loop's
// at one thread, whatever the thread count.
#include "kernels/cpu/ops.h"
#include "kernels/op_shapes.h"

#include <omp.h>

#include <algorithm>
#include <vector>

namespace origami::cpu {

namespace {

// The item schedule's thresholds (see the file comment).
constexpr int64_t kSmallRows = 256;
constexpr int64_t kMinItemsPerThread = 4;

bool items_schedule(const ExecContext& ctx, std::span<const GemmSegment> segments) {
  int64_t items = 0;
  for (const GemmSegment& s : segments) {
    if (s.rows > kSmallRows) return false;
    items += s.rows > 0;
  }
  return ctx.threads() > 1 && items >= kMinItemsPerThread * ctx.threads();
}

struct Item {
  int64_t group;
  int64_t begin, end;  // rows of the segment (row products) or of the group's output (weight gradient)
  int64_t work;        // for the largest-first order only
};

// Largest first, so the last items handed out are the small ones; the order
// does not affect any result (items write disjoint outputs).
void order_items(std::vector<Item>& items) {
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.work > b.work; });
}

// Items in parallel (each sgemm_raw single-threaded on its thread inside the
// region), or in order from serial code, each on all threads.
template <class F>
void run_items(const std::vector<Item>& items, bool in_parallel, F&& f) {
  const int64_t n = static_cast<int64_t>(items.size());
  if (!in_parallel) {
    for (int64_t i = 0; i < n; ++i) f(items[i]);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i) f(items[i]);
}

void check_f32_cpu(const Tensor& t, const char* op, const char* name) {
  ORIGAMI_CHECK(t.defined(), op, ": ", name, " is undefined");
  ORIGAMI_CHECK(t.dtype() == DType::f32, op, " is fp32 on CPU; ", name, " is ", to_string(t.dtype()));
  ORIGAMI_CHECK(t.device().is_host(), "CPU ", op, " on a device tensor (", name, ")");
}

}  // namespace

// The schedule argument is the CUDA backend's: the rule above is the CPU's.
void grouped_gemm(const ExecContext& ctx, const Tensor& X_NK, const Tensor& W, Trans trans_w, std::span<const GemmSegment> segments,
                  Tensor& Y_NM, float beta, GroupedGemmSchedule) {
  constexpr const char* op = "grouped_gemm";
  check_f32_cpu(X_NK, op, "X");
  check_f32_cpu(W, op, "W");
  check_f32_cpu(Y_NM, op, "Y");
  // Plain locals, not a structured binding: the lambdas below capture them.
  const GroupedGemmDims dims = grouped_gemm_shapes(X_NK, W, trans_w, segments, Y_NM);
  const int64_t M = dims.M, K = dims.K;

  const bool in_parallel = items_schedule(ctx, segments);
  std::vector<Item> items;
  int64_t off = 0;
  for (const GemmSegment& s : segments) {
    if (s.rows > 0) items.push_back({s.group, off, off + s.rows, s.rows});
    off += s.rows;
  }
  if (items.empty()) return;
  if (in_parallel) order_items(items);

  const float* x = X_NK.f32();
  const float* w = W.f32();
  float* y = Y_NM.f32();
  const int64_t ldw = W.size(2);
  run_items(items, in_parallel, [&](const Item& it) {
    const int64_t n = it.end - it.begin;
    sgemm_raw(Trans::no, trans_w, n, M, K, 1.0f, x + it.begin * K, K, w + it.group * M * K, ldw, beta,
              y + it.begin * M, M);
  });
}

void grouped_gemm_wgrad(const ExecContext& ctx, const Tensor& dY_NM, const Tensor& X_NK, std::span<const GemmSegment> segments,
                        Tensor& dW_GMK, float beta, GroupedGemmSchedule) {
  constexpr const char* op = "grouped_gemm_wgrad";
  check_f32_cpu(dY_NM, op, "dY");
  check_f32_cpu(X_NK, op, "X");
  check_f32_cpu(dW_GMK, op, "dW");
  // Plain locals, not a structured binding: the lambdas below capture them.
  const GroupedGemmDims dims = grouped_gemm_wgrad_shapes(dY_NM, X_NK, segments, dW_GMK);
  const int64_t G = dims.G, M = dims.M, K = dims.K;

  // Each group's non-empty segments as (first row, rows), in segment order.
  struct Run {
    int64_t begin, rows;
  };
  std::vector<std::vector<Run>> runs(G);
  std::vector<int64_t> rows_of(G, 0);
  int64_t off = 0;
  for (const GemmSegment& s : segments) {
    if (s.rows > 0) runs[s.group].push_back({off, s.rows});
    rows_of[s.group] += s.rows;
    off += s.rows;
  }
  const bool in_parallel = items_schedule(ctx, segments);
  std::vector<Item> items;
  for (int64_t g = 0; g < G; ++g) {
    if (runs[g].empty() && beta == 1.0f) continue;
    items.push_back({g, 0, M, rows_of[g]});  // an unused group with beta != 1: dW[g] = beta · dW[g]
  }
  if (items.empty()) return;
  if (in_parallel) order_items(items);

  const float* dy = dY_NM.f32();
  const float* x = X_NK.f32();
  float* dw = dW_GMK.f32();
  run_items(items, in_parallel, [&](const Item& it) {
    float* c = dw + (it.group * M + it.begin) * K;
    const int64_t m = it.end - it.begin;
    if (runs[it.group].empty()) {
      sgemm_raw(Trans::yes, Trans::no, m, K, 0, 1.0f, nullptr, 1, nullptr, 1, beta, c, K);  // K = 0: C = beta · C
      return;
    }
    float b = beta;
    for (const Run& r : runs[it.group]) {
      sgemm_raw(Trans::yes, Trans::no, m, K, r.rows, 1.0f, dy + r.begin * M + it.begin, M, x + r.begin * K, K, b, c,
                K);
      b = 1.0f;
    }
  });
}

}  // namespace origami::cpu

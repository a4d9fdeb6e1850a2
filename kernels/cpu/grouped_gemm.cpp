// CPU grouped GEMM (kernels/grouped_gemm.h) on oneDNN's dnnl_sgemm.
//
// Determinism: a threaded dnnl_sgemm does not give the same bits at every
// thread count (oneDNN 2.6 partitions some shapes differently at 3+ threads,
// and M = 1 products already at 2), and a single-threaded one does not give
// the same bits for a tile of a product as for the whole (its kernel choice
// depends on the shape). So each call is cut into work items by a rule that
// reads only the shapes and the segments — never the thread count — and every
// item is one single-threaded sgemm; items run in parallel (largest first).
// The result is then a function of the inputs alone.
//
// The cut: an item is a whole segment (row products) or a whole group's
// output (weight gradient, its segments accumulated in order) unless it spans
// more than kItemRows rows, in which case it is split into equal pieces of at
// most kItemRows rows (row products: rows of the segment; weight gradient:
// rows of the group's output, each piece still summing over all the group's
// rows in segment order). Below the cap an item makes exactly the sgemm call
// the per-segment loop made, so at one thread the results are those of
// calling gemm per segment, bit for bit.
#include "kernels/grouped_gemm.h"

#include <omp.h>

#include <algorithm>
#include <vector>

namespace origami {

namespace {

// Rows per work item before a segment (or a group's weight gradient) is
// split. 1024 rows of a [·, 512] × [512, 704] product is ~0.7 GFLOP, a few ms
// single-threaded: large enough that oneDNN's single-thread kernel runs at
// speed, small enough that a lone segment of a few thousand rows (the shared
// expert) still spreads over the cores.
constexpr int64_t kItemRows = 1024;

int64_t pieces_of(int64_t rows) { return std::max<int64_t>(1, (rows + kItemRows - 1) / kItemRows); }

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

template <class F>
void run_items(const std::vector<Item>& items, F&& f) {
  const int64_t n = static_cast<int64_t>(items.size());
  if (n == 1) {
    // One item: the single-threaded call, without a team waiting on it.
    const int saved = omp_get_max_threads();
    omp_set_num_threads(1);
    f(items[0]);
    omp_set_num_threads(saved);
    return;
  }
  // sgemm_raw runs single-threaded on the calling thread inside a parallel region.
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i) f(items[i]);
}

void check_f32_cpu(const Tensor& t, const char* op, const char* name) {
  ORIGAMI_CHECK(t.defined(), op, ": ", name, " is undefined");
  ORIGAMI_CHECK(t.dtype() == DType::f32, op, " is fp32 on CPU; ", name, " is ", to_string(t.dtype()));
  ORIGAMI_CHECK(t.device() == Device::cpu(), "CPU ", op, " on a device tensor (", name, ")");
}

// The segments tile `N` rows and name groups in [0, G).
void check_segments(std::span<const GemmSegment> segments, int64_t G, int64_t N, const char* op) {
  int64_t total = 0;
  for (const GemmSegment& s : segments) {
    ORIGAMI_CHECK(s.group >= 0 && s.group < G, op, ": segment group ", s.group, " outside [0, ", G, ")");
    ORIGAMI_CHECK(s.rows >= 0, op, ": negative segment of ", s.rows, " rows");
    total += s.rows;
  }
  ORIGAMI_CHECK(total == N, op, ": segments cover ", total, " rows but the operand has ", N);
}

}  // namespace

void grouped_gemm(const Tensor& X_NK, const Tensor& W, Trans trans_w, std::span<const GemmSegment> segments,
                  Tensor& Y_NM, float beta) {
  constexpr const char* op = "grouped_gemm";
  check_f32_cpu(X_NK, op, "X");
  check_f32_cpu(W, op, "W");
  check_f32_cpu(Y_NM, op, "Y");
  ORIGAMI_CHECK(W.dim() == 3, op, ": W must be [G, rows, cols], got ", shape_string(W.shape()));
  const int64_t G = W.size(0);
  const int64_t M = trans_w == Trans::yes ? W.size(1) : W.size(2);
  const int64_t K = trans_w == Trans::yes ? W.size(2) : W.size(1);
  const int64_t N = X_NK.rows();
  ORIGAMI_CHECK(X_NK.cols() == K, op, ": X ", shape_string(X_NK.shape()), " should be [N, ", K, "] for W ",
                shape_string(W.shape()), trans_w == Trans::yes ? " (transposed)" : "");
  ORIGAMI_CHECK(Y_NM.rows() == N && Y_NM.cols() == M, op, ": Y ", shape_string(Y_NM.shape()), " should be [", N,
                ", ", M, "]");
  check_segments(segments, G, N, op);

  std::vector<Item> items;
  int64_t off = 0;
  for (const GemmSegment& s : segments) {
    const int64_t p = pieces_of(s.rows);
    for (int64_t i = 0; i < p && s.rows > 0; ++i)
      items.push_back({s.group, off + s.rows * i / p, off + s.rows * (i + 1) / p, s.rows / p});
    off += s.rows;
  }
  if (items.empty()) return;
  order_items(items);

  const float* x = X_NK.f32();
  const float* w = W.f32();
  float* y = Y_NM.f32();
  const int64_t ldw = W.size(2);
  run_items(items, [&](const Item& it) {
    const int64_t n = it.end - it.begin;
    sgemm_raw(Trans::no, trans_w, n, M, K, 1.0f, x + it.begin * K, K, w + it.group * M * K, ldw, beta,
              y + it.begin * M, M);
  });
}

void grouped_gemm_wgrad(const Tensor& dY_NM, const Tensor& X_NK, std::span<const GemmSegment> segments,
                        Tensor& dW_GMK, float beta) {
  constexpr const char* op = "grouped_gemm_wgrad";
  check_f32_cpu(dY_NM, op, "dY");
  check_f32_cpu(X_NK, op, "X");
  check_f32_cpu(dW_GMK, op, "dW");
  ORIGAMI_CHECK(dW_GMK.dim() == 3, op, ": dW must be [G, M, K], got ", shape_string(dW_GMK.shape()));
  const int64_t G = dW_GMK.size(0), M = dW_GMK.size(1), K = dW_GMK.size(2);
  const int64_t N = dY_NM.rows();
  ORIGAMI_CHECK(dY_NM.cols() == M, op, ": dY ", shape_string(dY_NM.shape()), " should be [N, ", M, "] for dW ",
                shape_string(dW_GMK.shape()));
  ORIGAMI_CHECK(X_NK.rows() == N && X_NK.cols() == K, op, ": X ", shape_string(X_NK.shape()), " should be [", N,
                ", ", K, "]");
  check_segments(segments, G, N, op);

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
  std::vector<Item> items;
  for (int64_t g = 0; g < G; ++g) {
    if (runs[g].empty()) {
      if (beta != 1.0f) items.push_back({g, 0, M, 0});  // dW[g] = beta · dW[g]
      continue;
    }
    const int64_t p = std::min(pieces_of(rows_of[g]), std::max<int64_t>(M, 1));
    for (int64_t i = 0; i < p; ++i) items.push_back({g, M * i / p, M * (i + 1) / p, rows_of[g] / p});
  }
  if (items.empty()) return;
  order_items(items);

  const float* dy = dY_NM.f32();
  const float* x = X_NK.f32();
  float* dw = dW_GMK.f32();
  run_items(items, [&](const Item& it) {
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

}  // namespace origami

// Grouped GEMM (kernels/grouped_gemm.h) beyond a plain reference comparison
// (the three products against a naive fp64 loop, overwriting and
// accumulating, over the segment lists of tests/grouped_gemm_cases.h, live in
// the op × backend harness, tests/backend_ops/ops_gemm.cpp): accumulating
// into groups no segment names leaves them bitwise untouched; at 1, 2 and 3
// threads the results are bitwise those of calling gemm per segment (the
// loop the experts ran before) at the same thread count in the per-segment
// schedule, and those of the loop at one thread in the item schedule (many
// small segments); bad segment lists fail naming the rule; thousands of
// signals landing in the GEMMs leave the heap and the results intact.
#include <gtest/gtest.h>
#include <omp.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "kernels/grouped_gemm.h"
#include "kernels/threads.h"
#include "grouped_gemm_cases.h"
#include "test_context.h"
#include "test_seed.h"

namespace origami {
namespace {

const ExecContext& ctx = testing::test_context();
using testing::GroupedGemmCase;
using testing::Segments;
using testing::total_rows;

Tensor make(Shape s) { return Tensor::empty(std::move(s), DType::f32, MemCategory::activation); }

// Inputs drawn from N(0, 1): never all zeros, no exact cancellations.
Tensor randn(Shape s, std::mt19937& g) {
  Tensor t = make(std::move(s));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = nd(g);
  return t;
}

// Accumulating into a group no segment names leaves it bitwise untouched.
TEST(KernelsGroupedGemm, WeightGradientLeavesUnusedGroupsAlone) {
  std::mt19937 rng(testing::test_seed(7));
  const Segments segs{{2, 9}, {0, 0}, {2, 4}};
  const Tensor dY = randn({13, 5}, rng), X = randn({13, 6}, rng), dW0 = randn({3, 5, 6}, rng);
  Tensor dW = make({3, 5, 6});
  dW.copy_from(dW0);
  grouped_gemm_wgrad(ctx, dY, X, segs, dW, 1.0f);
  EXPECT_EQ(0, std::memcmp(dW.f32(), dW0.f32(), 2 * 5 * 6 * sizeof(float))) << "groups 0 and 1 changed";
  EXPECT_NE(0, std::memcmp(dW.f32() + 2 * 30, dW0.f32() + 2 * 30, 30 * sizeof(float))) << "group 2 unchanged";
}

// Every output of one call sequence, at a given thread count.
std::vector<float> run_all(const GroupedGemmCase& c, int threads, bool per_segment_gemm) {
  std::mt19937 rng(testing::test_seed(99));
  const int64_t N = total_rows(c.segs);
  const Tensor X = randn({N, c.K}, rng), W = randn({c.G, c.M, c.K}, rng), Wn = randn({c.G, c.M, c.K}, rng);
  const Tensor dY = randn({N, c.M}, rng);
  Tensor Y = make({N, c.M}), dX = randn({N, c.K}, rng), dW = randn({c.G, c.M, c.K}, rng);
  const ExecContext local = ExecContext::cpu(threads);
  const ExecContext& ctx = local;
  if (!per_segment_gemm) {
    grouped_gemm(ctx, X, W, Trans::yes, c.segs, Y);
    grouped_gemm(ctx, dY, Wn, Trans::no, c.segs, dX, 1.0f);
    grouped_gemm_wgrad(ctx, dY, X, c.segs, dW, 1.0f);
  } else {  // the experts' former loop: one gemm per non-empty segment, in order
    int64_t off = 0;
    for (const auto [g, n] : c.segs) {
      if (n == 0) continue;
      Tensor y = Y.slice(off, n), dx = dX.slice(off, n);
      Tensor dw = dW.flat_view(g * c.M * c.K, c.M * c.K, {c.M, c.K});
      gemm(ctx, X.slice(off, n), Trans::no, W.flat_view(g * c.M * c.K, c.M * c.K, {c.M, c.K}), Trans::yes, y);
      gemm(ctx, dY.slice(off, n), Trans::no, Wn.flat_view(g * c.M * c.K, c.M * c.K, {c.M, c.K}), Trans::no, dx, 1.0f,
           1.0f);
      gemm(ctx, dY.slice(off, n), Trans::yes, X.slice(off, n), Trans::no, dw, 1.0f, 1.0f);
      off += n;
    }
  }
  std::vector<float> out;
  for (const Tensor& t : {Y, dX, dW}) out.insert(out.end(), t.f32(), t.f32() + t.numel());
  return out;
}

void expect_bitwise(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << what << ", element " << i;
}

// Per segment (few or large segments): bitwise the per-segment gemm loop at
// the same thread count. "bench-like" holds shapes where a threaded
// dnnl_sgemm itself differs between thread counts (1-row products,
// 64 × 704 × 512).
TEST(KernelsGroupedGemm, PerSegmentScheduleIsTheLoopAtEveryThreadCount) {
  std::vector<GroupedGemmCase> cs = testing::grouped_gemm_cases();
  cs.push_back({"bench-like", 3, 512, 704, {{0, 64}, {1, 1}, {2, 200}, {0, 64}}});
  for (const GroupedGemmCase& c : cs) {
    SCOPED_TRACE(c.name);
    for (int threads : {1, 2, 3}) {
      SCOPED_TRACE(threads);
      expect_bitwise(run_all(c, threads, true), run_all(c, threads, false), "grouped vs per-segment gemm");
    }
  }
}

// Many small segments run as single-threaded items in parallel: bitwise the
// loop at one thread, whatever the thread count.
TEST(KernelsGroupedGemm, ItemScheduleIsTheOneThreadLoopAtEveryThreadCount) {
  Segments many;
  for (int i = 0; i < 40; ++i) many.push_back({i % 7, 1 + (i * 37) % 90});
  const GroupedGemmCase c{"many small segments", 7, 48, 40, many};
  const std::vector<float> loop = run_all(c, 1, true);
  for (int threads : {1, 2, 3}) {
    SCOPED_TRACE(threads);
    expect_bitwise(loop, run_all(c, threads, false), "grouped vs one-thread per-segment gemm");
  }
}

TEST(KernelsGroupedGemm, RejectsBadSegments) {
  std::mt19937 rng(testing::test_seed(3));
  const Tensor X = randn({10, 4}, rng), W = randn({2, 6, 4}, rng);
  Tensor Y = make({10, 6}), dW = make({2, 6, 4});
  const Segments short_segs{{0, 4}, {1, 5}}, bad_group{{0, 4}, {2, 6}};
  EXPECT_DEATH(grouped_gemm(ctx, X, W, Trans::yes, short_segs, Y), "segments cover 9 rows but the operand has 10");
  EXPECT_DEATH(grouped_gemm(ctx, X, W, Trans::yes, bad_group, Y), "segment group 2 outside \\[0, 2\\)");
  EXPECT_DEATH(grouped_gemm(ctx, X, W, Trans::no, Segments{{0, 10}}, Y), "X \\[10, 4\\] should be \\[N, 6\\]");
  EXPECT_DEATH(grouped_gemm_wgrad(ctx, Y, X, short_segs, dW), "segments cover 9 rows");
}

std::atomic<long> g_signals_handled{0};
extern "C" void count_signal(int) { g_signals_handled.fetch_add(1, std::memory_order_relaxed); }

// oneDNN's JIT GEMM points rsp into the heap (oneDNN issue #4845): a handler
// run on the interrupted stack writes its frame over heap memory, which broke
// the trainer's SIGTERM test about one run in six. With install_signal_stacks
// and SA_ONSTACK, a signal every 100 µs for about a second, process-directed
// so it lands on any thread of the team, leaves every product bitwise equal
// to the first and the heap intact (glibc aborts on a corrupted chunk when
// the per-iteration tensors are freed).
TEST(GroupedGemmSignals, HandlersOnTheirOwnStacksLeaveTheHeapAndResultsIntact) {
  install_signal_stacks();
  struct sigaction sa {}, old {};
  sa.sa_handler = count_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART | SA_ONSTACK;
  ASSERT_EQ(sigaction(SIGUSR1, &sa, &old), 0);

  std::mt19937 g(testing::test_seed(20261202));
  const int64_t G = 4, M = 96, K = 128, N = 512;
  const Tensor X = randn({N, K}, g), dY = randn({N, M}, g);
  const std::vector<GemmSegment> segments = {{0, 100}, {1, 150}, {2, 62}, {3, 200}};
  Tensor first = make({G, M, K});
  grouped_gemm_wgrad(ctx, dY, X, segments, first, 0.0f);  // overwrite the uninitialized tensor

  std::atomic<bool> done{false};
  std::thread sender([&] {
    while (!done.load()) {
      kill(getpid(), SIGUSR1);
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  });
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1200);
  int iterations = 0, mismatches = 0;
  while (std::chrono::steady_clock::now() < until) {
    Tensor dW = make({G, M, K});  // allocated and freed each round, so heap damage surfaces
    grouped_gemm_wgrad(ctx, dY, X, segments, dW, 0.0f);
    if (std::memcmp(dW.f32(), first.f32(), sizeof(float) * dW.numel()) != 0) ++mismatches;
    ++iterations;
  }
  done.store(true);
  sender.join();
  ASSERT_EQ(sigaction(SIGUSR1, &old, nullptr), 0);
  EXPECT_EQ(mismatches, 0) << "of " << iterations;
  EXPECT_GT(g_signals_handled.load(), 100) << "too few signals arrived to test anything";
  std::printf("%d products under %ld signals\n", iterations, g_signals_handled.load());
}

}  // namespace
}  // namespace origami

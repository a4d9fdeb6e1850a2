// The op × backend harness's driver: one named case per (op, backend), e.g.
// BackendOps/Run.Matches/gemm_cpu. The CPU case runs every problem of the
// op's entry (tests/backend_ops/) against its naive fp64 reference; the CUDA
// case draws the same problems (fresh inputs, tests/test_seed.h), runs them
// on cuda:0 (copied with Tensor::to) and on the CPU in the same process, and
// compares the two, or skips naming why (built
// without CUDA / no CUDA device). CTest runs the halves as BackendOps.cpu
// and BackendOps.cuda (tests/CMakeLists.txt). bf16 problems run on both
// backends against the reference (the CPU's by emulation). Each call's
// arguments sit between sentinel regions that must come back bitwise
// intact, overwritten outputs start poisoned and must be written
// everywhere, and inputs must come back unchanged.
// ORIGAMI_HARNESS_VERBOSE=1 prints each output's largest error against its
// bound (to size tolerances) and each problem's time.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <regex>
#include <sstream>

#include "backend_ops/harness.h"
#include "kernels/init.h"
#include "test_context.h"
#include "test_seed.h"

namespace origami::testing::backend_ops {
namespace {

constexpr int64_t kGuard = 16;  // sentinel elements on each side of every argument

enum class Backend { cpu, cuda };

bool verbose() { return std::getenv("ORIGAMI_HARNESS_VERBOSE") != nullptr; }

const std::vector<OpEntry>& all_ops() {
  static const std::vector<OpEntry> ops = [] {
    std::vector<OpEntry> all;
    for (auto part : {gemm_ops, elementwise_ops, dense_ops, update_init_ops, loss_ops, attention_ops, moe_ops,
                      moe_stats_ops, context_parallel_ops})
      for (OpEntry& e : part()) all.push_back(std::move(e));
    return all;
  }();
  return ops;
}

// Every problem runs a second time with every argument one element off
// 16-byte alignment, as a parameter's view at an odd offset of its unit is,
// or a row of a bf16 tensor with an odd width: the CUDA kernels take
// 16-byte packs (kernels/cuda/pack.cuh), cuBLASLt's and the tensor-core
// attention's aligned algorithms, or the grouped cuBLAS call, only where
// every pointer allows, and must fall back to their scalar paths (or
// cuBLASLt plans for the alignment) elsewhere with the same results. No op
// of kernels/backend_ops.inc requires more than its dtype's own alignment
// (workspaces excepted: they come from the context, 256-byte aligned).

struct Case {
  size_t op;
  Backend backend;
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << all_ops()[c.op].name << (c.backend == Backend::cpu ? " on cpu" : " on cuda");
}

std::string no_cuda_reason() {
  if (!built_with_cuda()) return "built without CUDA";
  if (cuda_device_count() == 0) return "no CUDA device";
  return "";
}

const ExecContext& cuda_context() {
  static const ExecContext ctx = ExecContext::cuda(0);
  return ctx;
}

// Two bit patterns per dtype. The sentinel of the guard regions is a finite
// float (−1980596.6), so a stray in-place update changes its bits (NaN × a
// keeps a NaN's) and a stray read shows as a huge value; the poison of
// overwritten outputs is a NaN whose payload no op writes, counted by its
// bits (so a NaN the reference expects cannot hide it). Integers get 0xA5 bytes for both (no valid index, count or flag).
enum class Pattern { sentinel, poison };

void fill(void* p, DType dt, int64_t n, Pattern which) {
  const size_t size = dtype_size(dt);
  unsigned char bits[8];
  std::memset(bits, 0xA5, sizeof bits);
  const bool sentinel = which == Pattern::sentinel;
  if (dt == DType::f32) {
    const uint32_t v = sentinel ? 0xC9F1C5A5u : 0x7FC0A5A5u;
    std::memcpy(bits, &v, 4);
  } else if (dt == DType::f64) {
    const uint64_t v = sentinel ? 0xC13E38B4A5A5A5A5ull : 0x7FF8A5A5A5A5A5A5ull;
    std::memcpy(bits, &v, 8);
  } else if (dt == DType::bf16) {
    const uint16_t v = sentinel ? 0xC9F1 : 0x7FC5;
    std::memcpy(bits, &v, 2);
  }
  for (int64_t i = 0; i < n; ++i) std::memcpy(static_cast<char*>(p) + i * size, bits, size);
}

bool is(const void* p, DType dt, Pattern which) {
  unsigned char want[8];
  fill(want, dt, 1, which);
  return std::memcmp(p, want, dtype_size(dt)) == 0;
}

// Runs the problem on ctx; returns host copies of every argument after the call.
// Every argument at element kGuard + shift of its buffer: shift 0 keeps it
// 16-byte aligned, shift 1 puts it off the CUDA kernels' 16-byte packs (a
// parameter view at an odd offset of its unit), onto their scalar paths.
Bound execute(const Problem& p, const ExecContext& ctx, int64_t shift = 0) {
  struct Placed {
    Tensor buffer, view;
  };
  std::vector<Placed> placed;
  Bound bound;
  for (const Arg& a : p.args) {
    const int64_t n = a.value.numel();
    const size_t size = dtype_size(a.value.dtype());
    const int64_t lead = kGuard + shift;
    Tensor host = empty({n + lead + kGuard}, a.value.dtype());
    char* bytes = static_cast<char*>(host.raw());
    fill(bytes, a.value.dtype(), lead, Pattern::sentinel);
    fill(bytes + (lead + n) * size, a.value.dtype(), kGuard, Pattern::sentinel);
    if (a.role == Role::out)
      fill(bytes + lead * size, a.value.dtype(), n, Pattern::poison);
    else if (n > 0)
      std::memcpy(bytes + lead * size, a.value.raw(), a.value.nbytes());
    const bool on_host = a.where == Where::host || ctx.device().is_host();
    Tensor buffer = on_host ? host : host.to(ctx.device());
    Tensor view = buffer.flat_view(lead, n, a.value.shape());
    placed.push_back({buffer, view});
    bound[a.name] = view;
  }
  p.call(ctx, bound);
  ctx.synchronize();
  Bound after;
  for (size_t i = 0; i < p.args.size(); ++i) {
    const Arg& a = p.args[i];
    const Tensor back = placed[i].buffer.device().is_host() ? placed[i].buffer : placed[i].buffer.to(Device::cpu());
    const int64_t n = a.value.numel();
    const size_t size = dtype_size(a.value.dtype());
    const char* bytes = static_cast<const char*>(back.raw());
    const int64_t lead = kGuard + shift;
    int64_t guards_hit = 0, unwritten = 0;
    for (int64_t j = 0; j < lead; ++j) guards_hit += !is(bytes + j * size, a.value.dtype(), Pattern::sentinel);
    for (int64_t j = 0; j < kGuard; ++j)
      guards_hit += !is(bytes + (lead + n + j) * size, a.value.dtype(), Pattern::sentinel);
    EXPECT_EQ(guards_hit, 0) << a.name << ": the op wrote " << guards_hit << " of the sentinel elements around it";
    const Tensor view = back.flat_view(lead, n, a.value.shape());
    if (a.role == Role::in) {
      EXPECT_TRUE(n == 0 || std::memcmp(view.raw(), a.value.raw(), a.value.nbytes()) == 0)
          << a.name << ": an input changed";
    } else if (a.role == Role::out) {
      for (int64_t j = 0; j < n; ++j) unwritten += is(bytes + (lead + j) * size, a.value.dtype(), Pattern::poison);
      EXPECT_EQ(unwritten, 0) << a.name << ": " << unwritten << " of " << n << " elements never written";
    }
    after[a.name] = view;
  }
  return after;
}

void expect_close(const std::string& what, const Tensor& got, const Ref& want, const Tol& tol) {
  const std::vector<double> g = values(got);
  ASSERT_EQ(g.size(), want.value.size()) << what << ": the reference has the wrong size";
  ASSERT_TRUE(want.scale.empty() || want.scale.size() == g.size()) << what << ": the scale has the wrong size";
  double tensor_scale = 0.0;
  bool any_nonzero = false;
  for (double w : want.value) {
    if (std::isfinite(w)) tensor_scale = std::max(tensor_scale, std::abs(w));
    any_nonzero |= w != 0.0;
  }
  int64_t bad = 0;
  double worst = 0.0;  // largest error / bound
  std::ostringstream first;
  first << std::setprecision(9);
  for (size_t i = 0; i < g.size(); ++i) {
    const double w = want.value[i];
    if (g[i] == w) continue;  // exact, infinities included
    if (std::isnan(g[i]) && std::isnan(w)) continue;  // NaN where the reference has it (a diverged router)
    const double bound = tol.rel * (want.scale.empty() ? tensor_scale : want.scale[i]) + tol.abs;
    const double err = std::abs(g[i] - w);
    worst = std::max(worst, bound > 0 ? err / bound : INFINITY);
    if (err <= bound) continue;  // NaN never is
    if (bad++ < 5) first << "\n  [" << i << "] got " << g[i] << ", want " << w << ", bound " << bound;
  }
  if (verbose())
    std::printf("  %-60s worst error / bound %.3g\n", what.c_str(), worst);
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << g.size() << " elements outside the tolerance (rel "
                    << tol.rel << ", abs " << tol.abs << ": " << tol.why << ")" << first.str();
  EXPECT_TRUE(g.empty() || any_nonzero || want.may_be_zero)
      << what << ": the reference is all zeros, so the comparison would prove nothing";
}

class Run : public ::testing::TestWithParam<Case> {};

TEST_P(Run, Matches) {
  const OpEntry& entry = all_ops()[GetParam().op];
  const Backend backend = GetParam().backend;
  if (backend == Backend::cuda) {
    const std::string reason = no_cuda_reason();
    if (!reason.empty()) GTEST_SKIP() << reason;
  }
  std::mt19937 rng(testing::test_seed(static_cast<uint32_t>(name_hash(entry.name))));  // fresh per op, the same on every backend
  const std::vector<Problem> problems = entry.problems(rng);
  ASSERT_FALSE(problems.empty());
  for (const Problem& p : problems) {
    const std::string where = entry.name + " [" + p.label + "]";
    SCOPED_TRACE(where);
    Bound inputs;
    for (const Arg& a : p.args) inputs[a.name] = a.value;
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    Refs want;
    p.reference(inputs, want);
    const auto t1 = clock::now();
    const ExecContext& ctx = backend == Backend::cpu ? test_context() : cuda_context();
    const Bound got = execute(p, ctx);
    const bool against_cpu = backend == Backend::cuda && !p.bf16;
    const Bound cpu = against_cpu ? execute(p, test_context()) : Bound{};
    if (verbose())
      std::printf("%s: reference %.1f ms, backend %.1f ms\n", where.c_str(),
                  std::chrono::duration<double, std::milli>(t1 - t0).count(),
                  std::chrono::duration<double, std::milli>(clock::now() - t1).count());
    const auto expect_outputs = [&](const Bound& outputs, const std::string& placement) {
      for (const Arg& a : p.args) {
        if (a.role == Role::in) continue;
        ASSERT_TRUE(want.count(a.name)) << where << ": no reference for " << a.name;
        Ref r = want.at(a.name);
        Tol tol = a.tol;
        if (against_cpu) {
          // Against the CPU result, which carries its own error: twice the bound.
          r.value = values(cpu.at(a.name));
          tol.rel *= 2;
          tol.abs *= 2;
        }
        expect_close(where + placement + " " + a.name, outputs.at(a.name), r, tol);
      }
    };
    expect_outputs(got, "");
    expect_outputs(execute(p, ctx, 1), " (one element off alignment)");
  }
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (size_t i = 0; i < all_ops().size(); ++i)
    for (Backend b : {Backend::cpu, Backend::cuda}) cases.push_back({i, b});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(BackendOps, Run, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return all_ops()[info.param.op].name +
                                  (info.param.backend == Backend::cpu ? "_cpu" : "_cuda");
                         });

// Every entry point of kernels/backend_ops.inc has an entry, read from the
// list itself so a new op without one fails here (the workspace-size queries
// are exercised by the ops that take the workspace).
TEST(BackendOpsTable, CoversEveryBackendOp) {
  std::ifstream inc(ORIGAMI_SOURCE_DIR "/kernels/backend_ops.inc");
  ASSERT_TRUE(inc.good()) << "cannot read kernels/backend_ops.inc";
  const std::regex decl(R"(^\w+ (\w+)\(const ExecContext& ctx)");
  std::vector<std::string> declared, covered;
  for (std::string line; std::getline(inc, line);) {
    std::smatch m;
    if (std::regex_search(line, m, decl) && !m[1].str().ends_with("_workspace_bytes")) declared.push_back(m[1]);
  }
  for (const OpEntry& e : all_ops()) covered.push_back(e.name);
  EXPECT_GT(declared.size(), 30u) << "the declarations of kernels/backend_ops.inc no longer parse";
  std::sort(declared.begin(), declared.end());
  std::sort(covered.begin(), covered.end());
  EXPECT_EQ(covered, declared);
}

}  // namespace
}  // namespace origami::testing::backend_ops

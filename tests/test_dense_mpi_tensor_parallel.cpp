// Multi-rank tests of the tensor + sequence parallel dense modules
// (dense/tensor_parallel.h), run whole by CTest under `mpirun -np N`, N = 1,
// 2, 4, with tp = N. Every rank generates the same full weights and inputs
// from the job's test seed (rank 0's, tests/test_seed.h), runs the single-rank module on the full micro-batch as
// the reference, and runs the TP function on its SP shard and weight slices:
//  - outputs and input gradients: this rank's rows equal the reference rows
//    (so the gathered tensors are equal);
//  - weight gradients: this rank's slice equals the same slice of the
//    reference gradient;
//  - the loss is the reference's and bitwise the same on every tp rank;
//  - one all-gather and one reduce-scatter per pass (backward never
//    re-gathers its input);
//  - a null tp communicator is bitwise the single-rank module;
//  - a whole pre-norm block (embedding → norm → attention → norm → MLP →
//    norm → head) with the norm gradients all-reduced over tp.
// Tolerance: 1e-5 relative to the tensor's largest element. TP reassociates
// fp32 sums (partial products over heads / F / vocab summed by the
// reduce-scatter, vocab-parallel sum-exp) — a few ulps, ~1e-7 relative; a
// misrouted row or slice is off by O(1).
// Every group communicates by NCCL's rules (the host stand-in's): under the
// in-flight check (comm/in_flight_check.h), where a buffer touched between
// an op's launch and its wait fails these tests, and with point-to-point
// messages paired by order alone (CommOptions::p2p_by_order).
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>

#include "comm/groups.h"
#include "dense/attention.h"
#include "dense/embedding.h"
#include "dense/lm_head.h"
#include "dense/mlp.h"
#include "dense/norm.h"
#include "dense/tensor_parallel.h"
#include "grad_check.h"
#include "kernels/elementwise.h"
#include "kernels/threads.h"
#include "mpi_test_main.h"
#include "test_context.h"

namespace origami {
namespace {

const ExecContext& ctx = testing::test_context();

using comm::GroupKind;
using dense::TpRange;
using testing::random_tensor;

using testing::world_rank;
using testing::world_size;

// Hq, Hkv, hd, D, F, V, B, S of the brief: V = 67 is not divisible by 2 or 4.
constexpr int64_t kHq = 8, kHkv = 4, kHd = 8, kD = 32, kF = 48, kV = 67, kB = 2, kS = 8, kT = kB * kS;
constexpr double kRtol = 1e-5;

// tp = world, built once (Groups::create is collective); freed before MPI_Finalize.
std::unique_ptr<comm::Groups>& groups() {
  static std::unique_ptr<comm::Groups> g;
  if (!g) {
    comm::LayoutOptions o;
    o.tp = world_size();
    g = std::make_unique<comm::Groups>(comm::Groups::create(comm::Layout(world_size(), o), MPI_COMM_WORLD,
                                                            comm::Backend::mpi,
                                                            comm::CommOptions{.timeout_s = 30.0,
                                                                              .check_in_flight = true,
                                                                              .p2p_by_order = true}));
  }
  return g;
}
comm::Communicator* tp() { return &(*groups())[GroupKind::tp]; }

Tensor zeros_like(const Tensor& t) { return Tensor::zeros(t.shape(), DType::f32, MemCategory::grad); }

// Copies of row / column blocks of a matrix (weights are [out, in]).
Tensor rows_of(const Tensor& m, TpRange r) {
  Tensor out = Tensor::empty({r.count, m.cols()}, DType::f32, MemCategory::param);
  std::copy_n(m.f32() + r.start * m.cols(), r.count * m.cols(), out.f32());
  return out;
}
Tensor cols_of(const Tensor& m, TpRange c) {
  Tensor out = Tensor::empty({m.rows(), c.count}, DType::f32, MemCategory::param);
  for (int64_t i = 0; i < m.rows(); ++i) std::copy_n(m.f32() + i * m.cols() + c.start, c.count, out.f32() + i * c.count);
  return out;
}
TpRange my_tokens() { return dense::tp_token_range(kT, tp()); }

double max_abs(const Tensor& t) {
  double m = 0;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::abs(double(t.f32()[i])));
  return m;
}

// max |got − want| <= kRtol · max |want|, and want is not all zeros.
void expect_close(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const double scale = max_abs(want);
  ASSERT_GT(scale, 0.0) << what << ": reference is all zeros; the check would be vacuous";
  double worst = 0;
  int64_t at = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double d = std::abs(double(got.f32()[i]) - want.f32()[i]);
    if (d > worst) worst = d, at = i;
  }
  EXPECT_LE(worst, kRtol * scale) << what << ": element " << at << " (row " << at / want.cols() << ") is "
                                  << got.f32()[at] << ", want " << want.f32()[at] << " (tp rank " << tp()->rank()
                                  << ")";
}

void expect_bitwise(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  EXPECT_TRUE(std::equal(got.f32(), got.f32() + got.numel(), want.f32())) << what << " differs";
}

Tensor positions(int64_t first) {
  Tensor pos = Tensor::empty({kS}, DType::i32, MemCategory::activation);
  for (int64_t s = 0; s < kS; ++s) pos.i32()[s] = static_cast<int32_t>(first + s);
  return pos;
}

// Ids uniform in [0, V), plus both ends of every rank's vocab range and a
// repeated id (the embedding backward must accumulate it).
Tensor ids_covering(int64_t V, std::mt19937& rng) {
  Tensor ids = testing::random_tokens(1, kT, V, rng).view({kT});
  int64_t t = 0;
  for (int r = 0; r < world_size() && t + 2 < kT; ++r) {
    const TpRange v = dense::tp_vocab_range(V, r, world_size());
    if (v.count == 0) continue;
    ids.i32()[t++] = static_cast<int32_t>(v.start);
    ids.i32()[t++] = static_cast<int32_t>(v.start + v.count - 1);
  }
  ids.i32()[kT - 1] = ids.i32()[kT - 2];
  return ids;
}

struct CallCounts {
  int64_t gathers, scatters, reduces;
  static CallCounts now() {
    return {tp()->stats(comm::CommOp::all_gather).calls, tp()->stats(comm::CommOp::reduce_scatter).calls,
            tp()->stats(comm::CommOp::all_reduce).calls};
  }
};
void expect_calls(const CallCounts& before, int64_t gathers, int64_t scatters, const char* what) {
  if (tp()->size() == 1) gathers = scatters = 0;  // one rank: no collectives at all
  const CallCounts after = CallCounts::now();
  EXPECT_EQ(after.gathers - before.gathers, gathers) << what << ": all-gathers";
  EXPECT_EQ(after.scatters - before.scatters, scatters) << what << ": reduce-scatters";
}

TEST(TensorParallel, ShardRules) {
  for (int n = 1; n <= 8; ++n) {
    const int64_t per = (kV + n - 1) / n;
    int64_t next = 0;
    for (int r = 0; r < n; ++r) {
      const TpRange v = dense::tp_vocab_range(kV, r, n);
      EXPECT_EQ(v.start, next) << "n " << n << " rank " << r;
      EXPECT_EQ(v.count, std::min(per, kV - v.start)) << "n " << n << " rank " << r;
      next += v.count;
    }
    EXPECT_EQ(next, kV) << "n " << n;
  }
  const int64_t small[4] = {2, 2, 1, 0};  // V = 5 over 4: the last rank holds nothing
  for (int r = 0; r < 4; ++r) EXPECT_EQ(dense::tp_vocab_range(5, r, 4).count, small[r]);
  const dense::TpAttentionShard s = dense::tp_attention_shard({kHq, kHkv, kHd, 1e4f}, tp());
  const int64_t n = tp()->size(), r = tp()->rank();
  EXPECT_EQ(s.local.num_heads, kHq / n);
  EXPECT_EQ(s.q_rows.start, r * kHq / n * kHd);
  EXPECT_EQ(s.kv_rows.start, r * kHkv / n * kHd);
  EXPECT_EQ(my_tokens().start, r * kT / n);
}

TEST(TensorParallel, AttentionMatchesSingleRank) {
  std::mt19937 rng(testing::test_seed(11));
  const dense::AttentionOptions opt{kHq, kHkv, kHd, 10000.0f};
  dense::AttentionWeights w{random_tensor({kHq * kHd, kD}, rng, 0.3f), random_tensor({kHkv * kHd, kD}, rng, 0.3f),
                            random_tensor({kHkv * kHd, kD}, rng, 0.3f), random_tensor({kD, kHq * kHd}, rng, 0.3f)};
  const Tensor x = random_tensor({kT, kD}, rng), dy = random_tensor({kT, kD}, rng), pos = positions(5);
  dense::AttentionSaved ref_saved;
  const Tensor y_ref = dense::attention_module_forward(ctx, opt, w, x, kB, pos, ref_saved);
  dense::AttentionWeights g_ref{zeros_like(w.wq), zeros_like(w.wk), zeros_like(w.wv), zeros_like(w.wo)};
  const Tensor dx_ref = dense::attention_module_backward(ctx, opt, w, ref_saved, dy, g_ref);

  const dense::TpAttentionShard s = dense::tp_attention_shard(opt, tp());
  const dense::AttentionWeights wl{rows_of(w.wq, s.q_rows), rows_of(w.wk, s.kv_rows), rows_of(w.wv, s.kv_rows),
                                   cols_of(w.wo, s.q_rows)};
  dense::AttentionWeights gl{zeros_like(wl.wq), zeros_like(wl.wk), zeros_like(wl.wv), zeros_like(wl.wo)};
  const TpRange tok = my_tokens();
  const CallCounts before = CallCounts::now();
  dense::AttentionSaved saved;
  const Tensor y = dense::tp_attention_forward(ctx, opt, wl, x.slice(tok.start, tok.count), kB, pos, tp(), saved);
  EXPECT_EQ(saved.x_TD.rows(), kT) << "the gathered input is saved";
  const Tensor dx = dense::tp_attention_backward(ctx, opt, wl, saved, dy.slice(tok.start, tok.count), tp(), gl);
  expect_calls(before, 2, 2, "attention forward + backward");

  expect_close(y, y_ref.slice(tok.start, tok.count), "y");
  expect_close(dx, dx_ref.slice(tok.start, tok.count), "dx");
  expect_close(gl.wq, rows_of(g_ref.wq, s.q_rows), "dWq slice");
  expect_close(gl.wk, rows_of(g_ref.wk, s.kv_rows), "dWk slice");
  expect_close(gl.wv, rows_of(g_ref.wv, s.kv_rows), "dWv slice");
  expect_close(gl.wo, cols_of(g_ref.wo, s.q_rows), "dWo slice");
}

TEST(TensorParallel, MlpMatchesSingleRank) {
  std::mt19937 rng(testing::test_seed(12));
  dense::MlpWeights w{random_tensor({kF, kD}, rng, 0.3f), random_tensor({kF, kD}, rng, 0.3f),
                      random_tensor({kD, kF}, rng, 0.3f)};
  const Tensor x = random_tensor({kT, kD}, rng), dy = random_tensor({kT, kD}, rng);
  dense::MlpSaved ref_saved;
  const Tensor y_ref = dense::mlp_module_forward(ctx, w, x, ref_saved);
  dense::MlpWeights g_ref{zeros_like(w.gate), zeros_like(w.up), zeros_like(w.down)};
  const Tensor dx_ref = dense::mlp_module_backward(ctx, w, ref_saved, dy, g_ref);

  const TpRange f = dense::tp_mlp_range(kF, tp()), tok = my_tokens();
  const dense::MlpWeights wl{rows_of(w.gate, f), rows_of(w.up, f), cols_of(w.down, f)};
  dense::MlpWeights gl{zeros_like(wl.gate), zeros_like(wl.up), zeros_like(wl.down)};
  const CallCounts before = CallCounts::now();
  dense::MlpSaved saved;
  const Tensor y = dense::tp_mlp_forward(ctx, wl, x.slice(tok.start, tok.count), tp(), saved);
  const Tensor dx = dense::tp_mlp_backward(ctx, wl, saved, dy.slice(tok.start, tok.count), tp(), gl);
  expect_calls(before, 2, 2, "mlp forward + backward");

  expect_close(y, y_ref.slice(tok.start, tok.count), "y");
  expect_close(dx, dx_ref.slice(tok.start, tok.count), "dx");
  expect_close(gl.gate, rows_of(g_ref.gate, f), "dWgate slice");
  expect_close(gl.up, rows_of(g_ref.up, f), "dWup slice");
  expect_close(gl.down, cols_of(g_ref.down, f), "dWdown slice");
}

// Embedding and LM head at one vocabulary size (67, or 5: zero rows on rank 3 of 4).
void check_vocab_parallel(int64_t V, uint32_t seed) {
  std::mt19937 rng(testing::test_seed(seed));
  const Tensor table = random_tensor({V, kD}, rng), head = random_tensor({V, kD}, rng, 0.3f);
  const Tensor ids = ids_covering(V, rng), targets = ids_covering(V, rng);
  const Tensor dx = random_tensor({kT, kD}, rng), y = random_tensor({kT, kD}, rng);
  const TpRange v = dense::tp_vocab_range(V, tp()), tok = my_tokens();
  const float scale = 1.0f / kT;

  // Embedding.
  const Tensor x_ref = dense::embedding_module_forward(ctx, ids, table);
  Tensor dtable_ref = Tensor::zeros({V, kD}, DType::f32, MemCategory::grad);
  dense::embedding_module_backward(ctx, ids, dx, dtable_ref);
  const Tensor x = dense::tp_embedding_forward(ctx, ids, rows_of(table, v), V, tp());
  Tensor dtable = Tensor::zeros({v.count, kD}, DType::f32, MemCategory::grad);
  dense::tp_embedding_backward(ctx, ids, dx.slice(tok.start, tok.count), V, tp(), dtable);
  expect_bitwise(x, x_ref.slice(tok.start, tok.count), "embedding x (one non-zero partial per row: exact)");
  if (v.count > 0) expect_close(dtable, rows_of(dtable_ref, v), "embedding dtable slice");

  // LM head + vocab-parallel cross-entropy.
  dense::LmHeadSaved ref_saved;
  Tensor loss_ref_T;
  const double loss_ref = dense::lm_head_forward(ctx, head, y, targets, ref_saved, &loss_ref_T);
  Tensor dw_ref = zeros_like(head);
  const Tensor dy_ref = dense::lm_head_backward(ctx, head, ref_saved, scale, dw_ref);
  const Tensor wl = rows_of(head, v);
  Tensor dwl = zeros_like(wl), loss_T;
  dense::TpLmHeadSaved saved;
  const CallCounts before = CallCounts::now();
  const double loss =
      dense::tp_lm_head_forward(ctx, wl, V, y.slice(tok.start, tok.count), targets, tp(), saved, &loss_T);
  const Tensor dy = dense::tp_lm_head_backward(ctx, wl, saved, scale, tp(), dwl);
  expect_calls(before, 1, 1, "lm head forward + backward");
  if (tp()->size() > 1) {
    EXPECT_EQ(CallCounts::now().reduces - before.reduces, 2) << "MAX, then one SUM of sum-exp and target logits";
  }

  EXPECT_NEAR(loss, loss_ref, kRtol * std::abs(loss_ref)) << "V " << V;
  expect_close(loss_T, loss_ref_T, "per-token losses");
  double lo = loss, hi = loss;
  MPI_Allreduce(MPI_IN_PLACE, &lo, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(MPI_IN_PLACE, &hi, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  EXPECT_EQ(lo, hi) << "the loss must be bitwise the same on every tp rank";
  expect_close(dy, dy_ref.slice(tok.start, tok.count), "lm head dy");
  if (v.count > 0) expect_close(dwl, rows_of(dw_ref, v), "lm head dW slice");
}

TEST(TensorParallel, VocabParallelEmbeddingAndHeadMatchSingleRank) { check_vocab_parallel(kV, 13); }
TEST(TensorParallel, VocabSmallerThanCeilLeavesEmptyRanks) { check_vocab_parallel(5, 14); }

TEST(TensorParallel, NullCommunicatorIsTheSingleRankModule) {
  std::mt19937 rng(testing::test_seed(15));
  const dense::AttentionOptions opt{kHq, kHkv, kHd, 10000.0f};
  dense::AttentionWeights w{random_tensor({kHq * kHd, kD}, rng, 0.3f), random_tensor({kHkv * kHd, kD}, rng, 0.3f),
                            random_tensor({kHkv * kHd, kD}, rng, 0.3f), random_tensor({kD, kHq * kHd}, rng, 0.3f)};
  const Tensor x = random_tensor({kT, kD}, rng), head = random_tensor({kV, kD}, rng, 0.3f);
  const Tensor targets = ids_covering(kV, rng), pos = positions(0);
  dense::AttentionSaved s1, s2;
  expect_bitwise(dense::tp_attention_forward(ctx, opt, w, x, kB, pos, nullptr, s1),
                 dense::attention_module_forward(ctx, opt, w, x, kB, pos, s2), "attention");
  dense::LmHeadSaved h1;
  dense::TpLmHeadSaved h2;
  EXPECT_EQ(dense::tp_lm_head_forward(ctx, head, kV, x, targets, nullptr, h2),
            dense::lm_head_forward(ctx, head, x, targets, h1));
  Tensor dw1 = zeros_like(head), dw2 = zeros_like(head);
  expect_bitwise(dense::tp_lm_head_backward(ctx, head, h2, 0.5f, nullptr, dw2),
                 dense::lm_head_backward(ctx, head, h1, 0.5f, dw1), "lm head dy");
  expect_bitwise(dw2, dw1, "lm head dW");
}

// A pre-norm block end to end. Norm weights are replicated: the TP run's norm
// gradients come from T/n tokens each and must be all-reduced over tp.
TEST(TensorParallel, PreNormBlockWithReplicatedNormGrads) {
  std::mt19937 rng(testing::test_seed(16));
  const dense::AttentionOptions opt{kHq, kHkv, kHd, 10000.0f};
  const float eps = 1e-5f;
  const Tensor table = random_tensor({kV, kD}, rng), head = random_tensor({kV, kD}, rng, 0.3f);
  dense::AttentionWeights aw{random_tensor({kHq * kHd, kD}, rng, 0.3f), random_tensor({kHkv * kHd, kD}, rng, 0.3f),
                             random_tensor({kHkv * kHd, kD}, rng, 0.3f), random_tensor({kD, kHq * kHd}, rng, 0.3f)};
  dense::MlpWeights mw{random_tensor({kF, kD}, rng, 0.3f), random_tensor({kF, kD}, rng, 0.3f),
                       random_tensor({kD, kF}, rng, 0.3f)};
  const Tensor n1 = random_tensor({kD}, rng, 0.2f), n2 = random_tensor({kD}, rng, 0.2f),
               n3 = random_tensor({kD}, rng, 0.2f);
  for (const Tensor* n : {&n1, &n2, &n3})
    for (int64_t i = 0; i < kD; ++i) n->f32()[i] += 1.0f;
  const Tensor ids = ids_covering(kV, rng), targets = ids_covering(kV, rng), pos = positions(0);

  struct Result {
    double loss;
    Tensor dn1, dn2, dn3, dtable, dwq, dwo, dgate, ddown, dhead;
  };
  // One block with whatever weights this rank holds; tp null = the reference.
  auto run = [&](comm::Communicator* c, const Tensor& tab, const dense::AttentionWeights& a,
                 const dense::MlpWeights& m, const Tensor& hw) {
    Result r{0, zeros_like(n1), zeros_like(n2), zeros_like(n3), zeros_like(tab), zeros_like(a.wq),
             zeros_like(a.wo), zeros_like(m.gate), zeros_like(m.down), zeros_like(hw)};
    dense::AttentionWeights ag{r.dwq, zeros_like(a.wk), zeros_like(a.wv), r.dwo};
    dense::MlpWeights mg{r.dgate, zeros_like(m.up), r.ddown};
    dense::RmsNormSaved s1, s2, s3;
    dense::AttentionSaved sa;
    dense::MlpSaved sm;
    dense::TpLmHeadSaved sh;
    Tensor h = dense::tp_embedding_forward(ctx, ids, tab, kV, c);  // (T/n, D) from here on
    Tensor a1 =
        dense::tp_attention_forward(ctx, opt, a, dense::rmsnorm_module_forward(ctx, h, n1, eps, s1), kB, pos, c, sa);
    add_inplace(ctx, a1, h);
    Tensor m1 = dense::tp_mlp_forward(ctx, m, dense::rmsnorm_module_forward(ctx, a1, n2, eps, s2), c, sm);
    add_inplace(ctx, m1, a1);
    r.loss =
        dense::tp_lm_head_forward(ctx, hw, kV, dense::rmsnorm_module_forward(ctx, m1, n3, eps, s3), targets, c, sh);
    const Tensor dm1 = dense::rmsnorm_module_backward(
        ctx, dense::tp_lm_head_backward(ctx, hw, sh, 1.0f / kT, c, r.dhead), n3, s3, r.dn3);
    Tensor da1 = dense::rmsnorm_module_backward(ctx, dense::tp_mlp_backward(ctx, m, sm, dm1, c, mg), n2, s2, r.dn2);
    add_inplace(ctx, da1, dm1);
    Tensor dh =
        dense::rmsnorm_module_backward(ctx, dense::tp_attention_backward(ctx, opt, a, sa, da1, c, ag), n1, s1, r.dn1);
    add_inplace(ctx, dh, da1);
    dense::tp_embedding_backward(ctx, ids, dh, kV, c, r.dtable);
    for (Tensor* g : {&r.dn1, &r.dn2, &r.dn3}) dense::tp_all_reduce_replicated_grad(*g, c);
    return r;
  };
  const Result ref = run(nullptr, table, aw, mw, head);
  const dense::TpAttentionShard s = dense::tp_attention_shard(opt, tp());
  const TpRange f = dense::tp_mlp_range(kF, tp()), v = dense::tp_vocab_range(kV, tp());
  const Result got = run(tp(), rows_of(table, v),
                         {rows_of(aw.wq, s.q_rows), rows_of(aw.wk, s.kv_rows), rows_of(aw.wv, s.kv_rows),
                          cols_of(aw.wo, s.q_rows)},
                         {rows_of(mw.gate, f), rows_of(mw.up, f), cols_of(mw.down, f)}, rows_of(head, v));
  EXPECT_NEAR(got.loss, ref.loss, kRtol * std::abs(ref.loss));
  expect_close(got.dn1, ref.dn1, "dnorm1 (all-reduced)");
  expect_close(got.dn2, ref.dn2, "dnorm2 (all-reduced)");
  expect_close(got.dn3, ref.dn3, "dnorm3 (all-reduced)");
  expect_close(got.dtable, rows_of(ref.dtable, v), "dtable slice");
  expect_close(got.dwq, rows_of(ref.dwq, s.q_rows), "dWq slice");
  expect_close(got.dwo, cols_of(ref.dwo, s.q_rows), "dWo slice");
  expect_close(got.dgate, rows_of(ref.dgate, f), "dWgate slice");
  expect_close(got.ddown, cols_of(ref.ddown, f), "dWdown slice");
  expect_close(got.dhead, rows_of(ref.dhead, v), "dhead slice");
}


}  // namespace
}  // namespace origami

int main(int argc, char** argv) {
  return origami::testing::run_mpi_tests(argc, argv, 0, [] { origami::groups().reset(); });
}

// `origami bench moe-layer --config C [--ep N] [--etp N] [--steps N]
// [--warmup W] [--json]`: one MoE layer (the config's router, capacity and
// experts, on micro_batch · seq_len tokens of width hidden_size per rank),
// forward + backward. Reports the median layer time and tokens/s, and the
// split of the time: router (forward and backward), permute/un-permute
// (capacity, permutation, gathers and their backward), expert GEMMs (grouped
// SwiGLU forward and backward), dispatch/combine (the four exchange steps;
// under mpirun only), and the rest (the whole layer's median minus those,
// measured in the same run).
//
// Under mpirun the layer runs with expert parallelism from [parallel] (ep,
// etp; --ep / --etp override them; tp = cp = pp = 1): each rank draws its own
// tokens and holds the F/ETP slices of its E/EP experts. Each repeat times
// the whole layer, then its steps one by one twice: once through the
// dispatcher, once with the bare collectives in the dispatcher's place —
// all_to_all_v over ep (and all_gather_v / reduce_scatter_v over etp) with
// the same element counts, no counts exchange — and the same compute around
// them, so each bare exchange starts in the same state as the step it stands
// for (on an oversubscribed node the first collective after a compute phase
// pays for the ranks being rescheduled: ~7 ms at 4 ranks on 2 cores, as much
// as the exchange itself). The two passes alternate which goes first.
// Every timed exchange starts from a barrier over the ep × etp group.
// Bandwidth = bytes this rank sends over ep (Σ_{p ≠ me} rows_p · D · 4, the
// ep communicator's counter; mean over ranks) / time; ratio = bare time /
// step time, the ratio of the bandwidths for the same bytes. Figures are each
// rank's median over repeats, then the slowest rank's. The two passes must
// produce bitwise the same layer outputs (a data check; non-zero exit otherwise).
#include <mpi.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <span>

#include "comm/agreement.h"
#include "comm/groups.h"
#include "comm/mpi_communicator.h"
#include "engine/config.h"
#include "engine/preflight.h"
#include "kernels/init.h"
#include "kernels/threads.h"
#include "moe/moe_layer.h"
#include "tools/commands.h"

namespace origami::tools {

namespace {

using Clock = std::chrono::steady_clock;
using comm::Communicator;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

Tensor random_param(const ExecContext& ctx, Shape shape, const std::string& name, float std,
                    int64_t global_offset = 0) {
  Tensor t = Tensor::empty(std::move(shape), DType::f32, MemCategory::param);
  init_normal(ctx, t, 7, name, global_offset, std);
  return t;
}

// This rank's part of the expert weights `name` ([E, F, D] w1/w3, [E, D, F]
// w2): experts [e0, e0 + El), F rows [f0, f0 + Fl). Each element is drawn by
// its global index, so the layer's math does not depend on the layout.
moe::ExpertWeights expert_slice(const ExecContext& ctx, int64_t e0, int64_t El, int64_t F, int64_t f0, int64_t Fl,
                                int64_t D, const std::string& name, float std) {
  auto efd = [&](const std::string& n) {
    Tensor t = Tensor::empty({El, Fl, D}, DType::f32, MemCategory::param);
    for (int64_t e = 0; e < El; ++e) {
      Tensor part = t.flat_view(e * Fl * D, Fl * D, {Fl * D});
      init_normal(ctx, part, 7, n, ((e0 + e) * F + f0) * D, std);
    }
    return t;
  };
  Tensor w2 = Tensor::empty({El, D, Fl}, DType::f32, MemCategory::param);
  for (int64_t e = 0; e < El; ++e)
    for (int64_t d = 0; d < D; ++d) {
      Tensor part = w2.flat_view((e * D + d) * Fl, Fl, {Fl});
      init_normal(ctx, part, 7, name + ".w2", ((e0 + e) * D + d) * F + f0, std);
    }
  return {efd(name + ".w1"), efd(name + ".w3"), std::move(w2)};
}

moe::ExpertWeights zero_like(const moe::ExpertWeights& w) {
  return {Tensor::zeros(w.w1_EFD.shape(), DType::f32, MemCategory::grad),
          Tensor::zeros(w.w3_EFD.shape(), DType::f32, MemCategory::grad),
          Tensor::zeros(w.w2_EDF.shape(), DType::f32, MemCategory::grad)};
}

std::span<const float> cspan(const Tensor& t) { return {t.f32(), static_cast<size_t>(t.numel())}; }
std::span<float> mspan(const Tensor& t) { return {t.f32(), static_cast<size_t>(t.numel())}; }

std::vector<int64_t> times(const std::vector<int64_t>& rows, int64_t D) {
  std::vector<int64_t> out(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) out[i] = rows[i] * D;
  return out;
}

// Σ_{p ≠ me} rows[p] · D · 4: what all_to_all_v sends (the self block stays).
int64_t sent_bytes(const std::vector<int64_t>& rows, int me, int64_t D) {
  int64_t n = 0;
  for (size_t p = 0; p < rows.size(); ++p) n += static_cast<int>(p) == me ? 0 : rows[p];
  return n * D * static_cast<int64_t>(sizeof(float));
}

// The communicators of the expert exchange. `sync` is the ep × etp group
// (every rank one dispatch involves); each timed exchange starts from a
// barrier on it. On one rank everything has size 1 and nothing synchronizes.
struct Exchange {
  Communicator* ep = nullptr;
  Communicator* etp = nullptr;
  Communicator* sync = nullptr;
  bool active() const { return sync->size() > 1; }
  void enter_together() const {
    if (active()) sync->barrier();
  }
};

// Runs f with the clock on after the ranks have met; adds the time to `acc`.
template <class F>
auto timed(const Exchange& x, double& acc, F&& f) {
  x.enter_together();
  const auto t0 = Clock::now();
  auto r = f();
  acc += seconds_since(t0);
  return r;
}

// The four exchange steps, in the layer's order.
enum Step : int { kDispatch, kCombine, kCombineBackward, kDispatchBackward, kNumSteps };

// The exchange steps through the dispatcher.
struct DispatcherSteps {
  const moe::AllToAllDispatcher& d;
  moe::Dispatched dispatch(const Tensor& x_ND, const std::vector<int64_t>& rows_per_expert) {
    return d.dispatch(x_ND, rows_per_expert);
  }
  Tensor combine(const moe::DispatchHandle& h, const Tensor& y_MD) { return d.combine(h, y_MD); }
  Tensor combine_backward(const moe::DispatchHandle& h, const Tensor& dy_ND) { return d.combine_backward(h, dy_ND); }
  Tensor dispatch_backward(const moe::DispatchHandle& h, const Tensor& dx_MD) {
    return d.dispatch_backward(h, dx_MD);
  }
};

// The same steps as bare collectives: the counts of a handle the dispatcher
// returned for the same tokens (no counts exchange, no bookkeeping), the
// dispatcher's collectives in its order, into buffers from the same caching
// allocator (a cache hit, ~1 µs). Buffers held across repeats instead were
// measured 15-20% slower at np 2: their memory has gone cold, where the
// allocator hands back a block freed moments before.
class BareSteps {
 public:
  BareSteps(const Exchange& x, moe::DispatchHandle h, int64_t D) : x_(x), h_(std::move(h)), D_(D) {
    send_ = times(h_.send_rows_per_ep, D);
    recv_ = times(h_.recv_rows_per_ep, D);
    etp_ = times(h_.recv_rows_per_etp, D);
    received_ = std::accumulate(h_.recv_rows_per_ep.begin(), h_.recv_rows_per_ep.end(), int64_t{0});
  }
  const moe::DispatchHandle& handle() const { return h_; }

  moe::Dispatched dispatch(const Tensor& x_ND, const std::vector<int64_t>&) { return {h_, forward(x_ND)}; }
  Tensor combine(const moe::DispatchHandle&, const Tensor& y_MD) { return reverse(y_MD); }
  Tensor combine_backward(const moe::DispatchHandle&, const Tensor& dy_ND) { return forward(dy_ND); }
  Tensor dispatch_backward(const moe::DispatchHandle&, const Tensor& dx_MD) { return reverse(dx_MD); }

 private:
  int ep() const { return x_.ep->size(); }
  int etp() const { return x_.etp->size(); }
  Tensor rows(int64_t n, MemCategory cat) const { return Tensor::empty({n, D_}, DType::f32, cat); }

  Tensor forward(const Tensor& rows_ND) {  // all_to_all_v over ep, all_gather_v over etp
    Tensor received = rows_ND;
    if (ep() > 1) {
      received = rows(received_, etp() > 1 ? MemCategory::comm : MemCategory::activation);
      x_.ep->all_to_all_v(cspan(rows_ND), send_, mspan(received), recv_);
    }
    if (etp() == 1) return received;
    Tensor gathered = rows(h_.num_rows_out, MemCategory::activation);
    x_.etp->all_gather_v(cspan(received), mspan(gathered), etp_);
    return gathered;
  }
  Tensor reverse(const Tensor& rows_MD) {  // reduce_scatter_v over etp, all_to_all_v over ep
    Tensor mine = rows_MD;
    if (etp() > 1) {
      mine = rows(received_, ep() > 1 ? MemCategory::comm : MemCategory::activation);
      x_.etp->reduce_scatter_v(cspan(rows_MD), mspan(mine), etp_);
    }
    if (ep() == 1) return mine;
    Tensor out = rows(h_.num_rows_in, MemCategory::activation);
    x_.ep->all_to_all_v(cspan(mine), recv_, mspan(out), send_);
    return out;
  }

  Exchange x_;
  moe::DispatchHandle h_;
  int64_t D_ = 0, received_ = 0;            // received_: rows this rank gets over ep
  std::vector<int64_t> send_, recv_, etp_;  // elements
};

struct Split {
  double router = 0, permute = 0, experts = 0;
  std::array<double, kNumSteps> exchange{};
};

struct Pass {
  Split split;
  moe::DispatchHandle handle;
  Tensor y_TD, dx_TD;  // outputs, for the data check
};

// The layer's steps one by one, in the layer's order, timed per category;
// `steps` does the exchange.
template <class Steps>
Pass time_components(const ExecContext& ctx, const moe::MoeLayerOptions& opt, const moe::MoeLayerWeights& w,
                     moe::MoeLayerWeights& g, const Tensor& x_TD, int64_t seq_len, const Tensor& dy_TD, Steps& steps,
                     const Exchange& xch) {
  Pass pass;
  Split& s = pass.split;
  const int64_t T = x_TD.rows(), E = opt.router.num_experts;
  auto t0 = Clock::now();
  moe::RouterSaved rs;
  moe::Routing routing = moe::router_forward(ctx, opt.router, x_TD, w.gate_ED, w.bias_E, seq_len, rs);
  s.router += seconds_since(t0);

  t0 = Clock::now();
  const int64_t C = moe::expert_capacity(opt.capacity, T, opt.router.top_k, E);
  Tensor kept = moe::apply_capacity(ctx, opt.capacity, routing.expert_TK, routing.weight_TK, E, C);
  moe::Permutation perm = moe::make_permutation(ctx, routing.expert_TK, kept, E, C, opt.capacity.pad_to_capacity);
  moe::router_losses(opt.router, rs);  // as the layer: after the counts' read
  Tensor x_ND = moe::permute_rows(ctx, x_TD, perm);  // (N, D)
  s.permute += seconds_since(t0);

  moe::Dispatched d = timed(xch, s.exchange[kDispatch], [&] { return steps.dispatch(x_ND, perm.rows_per_expert); });
  const moe::DispatchHandle& h = d.handle;

  t0 = Clock::now();
  moe::ExpertsSaved es;
  Tensor y_MD = moe::experts_forward(ctx, w.experts, d.x_MD, h.segments, es);  // (M, D)
  s.experts += seconds_since(t0);

  Tensor y_ND = timed(xch, s.exchange[kCombine], [&] { return steps.combine(h, y_MD); });  // (N, D)

  t0 = Clock::now();
  pass.y_TD = moe::unpermute_rows(ctx, y_ND, perm, routing.weight_TK, T);  // (T, D)
  Tensor dy_ND, dweight;                                              // (N, D), (T, k)
  moe::unpermute_rows_backward(ctx, dy_TD, y_ND, perm, routing.weight_TK, dy_ND, dweight);
  s.permute += seconds_since(t0);

  Tensor dy_MD =  // (M, D)
      timed(xch, s.exchange[kCombineBackward], [&] { return steps.combine_backward(h, dy_ND); });

  t0 = Clock::now();
  Tensor dx_MD = moe::experts_backward(ctx, w.experts, es, dy_MD, g.experts);  // (M, D)
  s.experts += seconds_since(t0);

  Tensor dx_ND =  // (N, D)
      timed(xch, s.exchange[kDispatchBackward], [&] { return steps.dispatch_backward(h, dx_MD); });

  t0 = Clock::now();
  pass.dx_TD = Tensor::zeros(x_TD.shape(), DType::f32, MemCategory::activation);  // (T, D)
  moe::permute_rows_backward(ctx, dx_ND, perm, pass.dx_TD);
  s.permute += seconds_since(t0);

  t0 = Clock::now();
  moe::router_backward(ctx, opt.router, rs, w.gate_ED, dweight, 1.0f, g.gate_ED);
  s.router += seconds_since(t0);
  pass.handle = h;
  return pass;
}

int64_t count_different(const Tensor& a, const Tensor& b) {
  int64_t n = 0;
  for (int64_t i = 0; i < a.numel(); ++i) n += std::memcmp(a.f32() + i, b.f32() + i, sizeof(float)) != 0;
  return n;
}

struct MoeBenchArgs {
  std::string config;
  std::vector<std::string> overrides;
  int64_t ep = 0, etp = 0;  // 0: the config's
  int steps = 5, warmup = 2;
  bool json = false;
};

void run_bench_moe_layer(const MoeBenchArgs& a) {
  std::vector<std::string> overrides = a.overrides;
  if (a.ep > 0) overrides.push_back("parallel.ep=" + std::to_string(a.ep));
  if (a.etp > 0) overrides.push_back("parallel.etp=" + std::to_string(a.etp));
  Config cfg = load_config(a.config, overrides);
  require_host_engine(cfg, "bench moe-layer");
  validate_threads(cfg);
  // Every rank benchmarks the same layer, or the exchange tables mean nothing.
  auto everyone = comm::whole_mpi(MPI_COMM_WORLD, "everyone", comm::CommOptions{cfg.runtime.collective_timeout_s});
  check_same_run(*everyone, cfg);

  const MoeConfig& m = cfg.moe;
  const ParallelConfig& par = cfg.parallel;
  if (m.router.num_experts == 0)
    ORIGAMI_USER_ERROR(a.config, ": moe.num_experts = 0: bench moe-layer needs MoE layers");
  if (par.tp != 1 || par.cp != 1 || par.pp != 1)
    ORIGAMI_USER_ERROR(a.config, ": parallel.tp = ", par.tp, ", cp = ", par.cp, ", pp = ", par.pp,
                       ": bench moe-layer runs expert parallelism only (parallel.ep, parallel.etp); set tp = cp = "
                       "pp = 1");
  int world = 1, rank = 0;
  MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world));
  MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  const int threads = cfg.runtime.threads > 0 ? static_cast<int>(cfg.runtime.threads) : default_threads_per_rank();
  set_num_threads(threads);
  const ExecContext ctx = ExecContext::cpu(threads);
  const int64_t D = cfg.model.hidden_size, E = m.router.num_experts, F = m.expert_ffn(cfg.model.ffn_hidden_size);
  const int64_t S = cfg.training.seq_len, T = cfg.training.micro_batch * S;
  const float std = static_cast<float>(cfg.model.init_std);

  std::optional<comm::Layout> layout;
  try {
    layout.emplace(world, comm::LayoutOptions{1, 1, 1, par.ep, par.etp, par.order, E});
  } catch (const UserError& e) {
    ORIGAMI_USER_ERROR(a.config, ": ", e.what());
  }
  if (F % par.etp != 0)
    ORIGAMI_USER_ERROR(a.config, ": expert ffn width ", F, " does not divide over parallel.etp = ", par.etp);
  {
    // What the loop below allocates, at least: this rank's experts and the
    // gate, each with its gradient, and per micro-batch its tokens and
    // output gradient, and the T·k routed rows (balanced routing) that the
    // experts' backward keeps (input, gate and up outputs). Agreed: a rank
    // whose node cannot hold it stops every rank before the exchanges.
    const int64_t El = E / par.ep, Fl = F / par.etp;
    const long double weights = 2.0L * 4 *
                                (static_cast<long double>(El) * 3 * Fl * D + static_cast<long double>(E) * D +
                                 3.0L * m.shared_expert_hidden_size * D);
    const long double rows = static_cast<long double>(T) * m.router.top_k;
    const long double activations = 4.0L * (2.0L * T * D + rows * (D + 2.0L * Fl));
    const MemoryNeed need[] = {
        {detail::concat("this rank's ", El, " experts of 3 x ", Fl, " x ", D, " and the router, with their gradients"),
         weights},
        {detail::concat("one micro-batch's ", T, " tokens and ", static_cast<int64_t>(rows), " routed rows"),
         activations}};
    comm::run_agreed(*everyone, [&] {
      check_fits_host_memory(cfg.sources() + ": bench moe-layer", need,
                             "check moe.num_experts, moe.ffn_hidden_size, training.micro_batch and seq_len, or "
                             "spread the experts over more ranks (--ep)",
                             ranks_on_this_node());
    });
    everyone.reset();
  }
  comm::Groups groups = comm::Groups::create(*layout, MPI_COMM_WORLD, comm::Backend::mpi,
                                             comm::CommOptions{cfg.runtime.collective_timeout_s});
  const Exchange xch{&groups[comm::GroupKind::ep], &groups[comm::GroupKind::etp], &groups[comm::GroupKind::tp_ep]};
  const moe::AllToAllDispatcher disp(ctx, E, xch.ep, xch.etp);
  const int64_t El = disp.num_local_experts(), Fl = F / par.etp;

  moe::MoeLayerOptions opt;
  opt.router = m.router;
  opt.capacity = m.capacity;
  moe::MoeLayerWeights w;
  w.gate_ED = random_param(ctx, {E, D}, "bench.gate", std);
  if (m.expert_bias) w.bias_E = Tensor::zeros({E}, DType::f32, MemCategory::param);
  // The contiguous placement: this rank's experts are [front, front + El).
  w.experts =
      expert_slice(ctx, disp.local_experts().front(), El, F, disp.etp_rank() * Fl, Fl, D, "bench.experts", std);
  if (m.shared_expert_hidden_size > 0) {
    const int64_t Fs = m.shared_expert_hidden_size;
    w.shared = expert_slice(ctx, 0, 1, Fs, 0, Fs, D, "bench.shared", std);
  }
  moe::MoeLayerWeights g;
  g.gate_ED = Tensor::zeros({E, D}, DType::f32, MemCategory::grad);
  g.experts = zero_like(w.experts);
  if (w.has_shared()) g.shared = zero_like(w.shared);

  // Each rank's own tokens: this rank's rows of a global [world · T, D] tensor.
  Tensor x = random_param(ctx, {T, D}, "bench.x", 1.0f, rank * T * D);    // (T, D)
  Tensor dy = random_param(ctx, {T, D}, "bench.dy", 1.0f, rank * T * D);  // (T, D)
  const bool ep_run = xch.active();
  std::vector<double> layer_t;
  std::vector<Split> splits, bare_splits;
  std::optional<BareSteps> bare;
  int64_t bytes_fwd = 0, bytes_rev = 0, wrong = 0;  // this rank's ep bytes per exchange; data check
  for (int i = 0; i < a.warmup + a.steps; ++i) {
    moe::MoeLayerSaved saved;
    moe::MoeLayerStats stats;
    double layer_s = 0;
    timed(xch, layer_s, [&] {
      moe::moe_layer_forward(ctx, opt, w, x, S, saved, stats, nullptr, &disp);
      return moe::moe_layer_backward(ctx, opt, w, saved, dy, 1.0f, g, &disp);
    });
    // The bare pass needs the counts of a first dispatcher pass; after that
    // the two alternate which goes first, so neither always runs in the
    // other's wake.
    DispatcherSteps through{disp};
    std::optional<Pass> b;
    auto bare_pass = [&] {
      xch.ep->reset_stats();
      b.emplace(time_components(ctx, opt, w, g, x, S, dy, *bare, xch));
      const int64_t counted = xch.ep->stats(comm::CommOp::all_to_all_v).bytes;
      ORIGAMI_CHECK(counted == 2 * (bytes_fwd + bytes_rev), "bench: ep counted ", counted, " bytes, the counts say ",
                    2 * (bytes_fwd + bytes_rev));
    };
    const bool bare_first = bare && i % 2 == 1;
    if (bare_first) bare_pass();
    const Pass p = time_components(ctx, opt, w, g, x, S, dy, through, xch);
    if (ep_run) {
      // Same tokens and weights every repeat, so the counts never change.
      if (!bare) {
        bare.emplace(xch, p.handle, D);
        bytes_fwd = sent_bytes(p.handle.send_rows_per_ep, xch.ep->rank(), D);
        bytes_rev = sent_bytes(p.handle.recv_rows_per_ep, xch.ep->rank(), D);
      }
      ORIGAMI_CHECK(p.handle.send_rows_per_ep == bare->handle().send_rows_per_ep &&
                        p.handle.recv_rows_per_ep == bare->handle().recv_rows_per_ep,
                    "bench: the dispatch counts changed between repeats");
      if (!bare_first) bare_pass();
      wrong += count_different(p.y_TD, b->y_TD) + count_different(p.dx_TD, b->dx_TD);
      if (i >= a.warmup) bare_splits.push_back(b->split);
    }
    if (i < a.warmup) continue;
    layer_t.push_back(layer_s);
    splits.push_back(p.split);
  }

  // Each rank's medians, then the slowest rank's: [layer, router, permute,
  // experts, 4 steps, 4 bare steps].
  auto med = [](const std::vector<Split>& v, auto&& field) {
    std::vector<double> x;
    for (const Split& s : v) x.push_back(field(s));
    return x.empty() ? 0.0 : median(x);
  };
  std::vector<double> r = {median(layer_t), med(splits, [](const Split& s) { return s.router; }),
                           med(splits, [](const Split& s) { return s.permute; }),
                           med(splits, [](const Split& s) { return s.experts; })};
  for (int k = 0; k < kNumSteps; ++k) r.push_back(med(splits, [k](const Split& s) { return s.exchange[k]; }));
  for (int k = 0; k < kNumSteps; ++k) r.push_back(med(bare_splits, [k](const Split& s) { return s.exchange[k]; }));
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, r.data(), static_cast<int>(r.size()), MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD));
  const double layer_s = r[0], router_s = r[1], permute_s = r[2], experts_s = r[3];
  const double* step_s = &r[4];
  const double* bare_s = &r[4 + kNumSteps];
  // Bytes per rank and exchange, the mean over ranks (bandwidth = it / the slowest rank's time).
  std::array<int64_t, 3> sums = {bytes_fwd, bytes_rev, wrong};
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, sums.data(), 3, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD));
  const double mean_fwd = static_cast<double>(sums[0]) / world, mean_rev = static_cast<double>(sums[1]) / world;
  wrong = sums[2];

  const double exchange_s = step_s[kDispatch] + step_s[kCombine] + step_s[kCombineBackward] +
                            step_s[kDispatchBackward];
  const double rest_s = std::max(0.0, layer_s - router_s - permute_s - experts_s - exchange_s);
  const double tokens_per_s = static_cast<double>(T) / layer_s;
  const double routing_fraction = (router_s + permute_s) / layer_s;
  if (rank == 0) {
    struct Row {
      const char *name, *key;
      double time_s, bare_s, bytes;
    };
    const Row rows[] = {
        {"dispatch", "dispatch", step_s[kDispatch], bare_s[kDispatch], mean_fwd},
        {"combine", "combine", step_s[kCombine], bare_s[kCombine], mean_rev},
        {"combine backward", "combine_backward", step_s[kCombineBackward], bare_s[kCombineBackward], mean_fwd},
        {"dispatch backward", "dispatch_backward", step_s[kDispatchBackward], bare_s[kDispatchBackward], mean_rev},
        {"dispatch + combine", "dispatch_combine", step_s[kDispatch] + step_s[kCombine],
         bare_s[kDispatch] + bare_s[kCombine], mean_fwd + mean_rev}};
    auto gbs = [](double bytes, double t) { return t > 0 ? bytes / t / 1e9 : 0.0; };
    if (a.json) {
      nlohmann::ordered_json j = {{"config", a.config},
                                  {"ranks", world},
                                  {"ep", par.ep},
                                  {"etp", par.etp},
                                  {"edp", layout->edp()},
                                  {"threads", ctx.threads()},
                                  {"tokens", T},
                                  {"experts", E},
                                  {"top_k", m.router.top_k},
                                  {"layer_time_s", layer_s},
                                  {"tokens_per_s", tokens_per_s},
                                  {"tokens_per_s_all_ranks", tokens_per_s * world},
                                  {"router_s", router_s},
                                  {"permute_s", permute_s},
                                  {"experts_s", experts_s},
                                  {"exchange_s", exchange_s},
                                  {"rest_s", rest_s},
                                  {"parts_over_layer", (router_s + permute_s + experts_s + exchange_s) / layer_s},
                                  {"router_permute_fraction", routing_fraction},
                                  {"repeats", a.steps}};
      if (ep_run) {
        j["ep_sent_bytes_dispatch"] = mean_fwd;
        j["ep_sent_bytes_combine"] = mean_rev;
        for (const Row& row : rows) {
          const std::string k = row.key;
          j[k + "_s"] = row.time_s;
          j[k + "_gbs"] = gbs(row.bytes, row.time_s);
          j[k + "_bare_s"] = row.bare_s;
          j[k + "_bare_gbs"] = gbs(row.bytes, row.bare_s);
          j[k + "_ratio"] = row.bare_s / row.time_s;
        }
        j["wrong"] = wrong;
      }
      std::printf("%s\n", j.dump().c_str());
    } else {
      std::printf(
          "bench moe-layer: %s, %lld tokens x %lld, %lld experts top-%lld (ffn %lld), %d thread(s), median of %d\n",
          a.config.c_str(), static_cast<long long>(T), static_cast<long long>(D), static_cast<long long>(E),
          static_cast<long long>(m.router.top_k), static_cast<long long>(F), ctx.threads(), a.steps);
      if (world > 1)
        std::printf("  %d ranks: ep %lld, etp %lld, edp %lld; per rank %lld tokens, %lld experts x ffn %lld; "
                    "slowest rank's median\n",
                    world, static_cast<long long>(par.ep), static_cast<long long>(par.etp),
                    static_cast<long long>(layout->edp()), static_cast<long long>(T), static_cast<long long>(El),
                    static_cast<long long>(Fl));
      std::printf("  layer fwd+bwd    %10.4f s   %10.0f tokens/s", layer_s, tokens_per_s);
      if (world > 1) std::printf(" per rank, %.0f all ranks", tokens_per_s * world);
      std::printf("\n");
      auto line = [&](const char* what, double t) {
        std::printf("  %-16s %10.4f s   %5.1f%%\n", what, t, 100.0 * t / layer_s);
      };
      line("router", router_s);
      line("permute/unperm.", permute_s);
      line("expert GEMMs", experts_s);
      if (ep_run) line("dispatch/combine", exchange_s);
      line("rest", rest_s);
      // The parts come from their own timed passes: on a busy machine their
      // medians can outgrow the whole layer's, which is no split at all.
      if (const double parts_s = router_s + permute_s + experts_s + exchange_s; parts_s > 1.05 * layer_s)
        std::printf("  note: the parts, timed in passes of their own, sum to %.0f%% of the layer's time: the machine "
                    "was busy during the run (the split is not meaningful; rerun on a quiet one)\n",
                    100.0 * parts_s / layer_s);
      std::printf("  router + permute/un-permute: %.1f%% of the layer\n", 100.0 * routing_fraction);
      if (ep_run) {
        std::printf("  exchange (bytes sent over ep per rank: %.0f dispatch direction, %.0f combine direction;\n"
                    "  bare: the same collectives and counts in the same place, no counts exchange):\n",
                    mean_fwd, mean_rev);
        // EP 1 (ETP alone): nothing crosses ep, so no bandwidth to state;
        // the exchange is ETP's gather and scatter, timed all the same.
        if (par.ep == 1)
          std::printf("  (ep = 1: no bytes cross ep; the rows time etp's gather and scatter of the tokens, whose "
                      "bandwidth is not counted: GB/s shows -)\n");
        auto rate = [&](double bytes, double s) {
          char buf[32];
          if (bytes > 0) std::snprintf(buf, sizeof buf, "%9.3f", gbs(bytes, s));
          else std::snprintf(buf, sizeof buf, "%9s", "-");
          return std::string(buf);
        };
        std::printf("    %-19s %10s %9s %10s %9s %7s\n", "step", "time(ms)", "GB/s", "bare(ms)", "GB/s", "ratio");
        for (const Row& row : rows)
          std::printf("    %-19s %10.3f %s %10.3f %s %7.2f\n", row.name, row.time_s * 1e3,
                      rate(row.bytes, row.time_s).c_str(), row.bare_s * 1e3, rate(row.bytes, row.bare_s).c_str(),
                      row.bare_s / row.time_s);
        std::printf("  data check (dispatcher vs bare layer outputs): %s\n",
                    wrong == 0 ? "bitwise equal" : "DIFFERENT");
      }
    }
  }
  if (wrong != 0)
    throw CLI::RuntimeError("bench moe-layer: " + std::to_string(wrong) + " output element(s) differ between the "
                            "dispatcher and the bare exchange", 1);
}

}  // namespace

void add_bench_moe_layer_command(CLI::App& bench) {
  auto args = std::make_shared<MoeBenchArgs>();
  CLI::App* cmd = bench.add_subcommand("moe-layer", "One MoE layer forward+backward, with the split of its time");
  cmd->add_option("--config", args->config, "TOML config with MoE layers")->required();
  add_set_option(cmd, args->overrides);
  cmd->add_option("--ep", args->ep, "Expert parallel size (overrides parallel.ep)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--etp", args->etp, "Expert tensor parallel size (overrides parallel.etp)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--steps", args->steps, "Timed repeats (median reported)")->check(CLI::Range(1, 1000))
      ->capture_default_str();
  cmd->add_option("--warmup", args->warmup, "Untimed warm-up repeats")->check(CLI::Range(0, 1000))
      ->capture_default_str();
  cmd->add_flag("--json", args->json, "Print one JSON object");
  cmd->callback([args] { run_bench_moe_layer(*args); });
}

}  // namespace origami::tools

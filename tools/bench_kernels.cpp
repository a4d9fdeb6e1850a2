// `origami bench kernels [--device cpu|cuda] [--shapes tiny|small|model]
// [--dtype f32|bf16] [--samples N] [--warmup W] [--only K,..] [--skip K,..]
// [--json]`: every op of the kernels API at the model's shapes, through the
// public ops (kernels/*.h) on one context, against two ceilings measured in
// the same run:
//   compute:   an n×n×n GEMM through the same gemm op, in the run's dtype
//              (CUDA 8192³ bf16; CPU an fp32 one of ~0.05-0.1 s);
//   bandwidth: Tensor::copy_from of one large buffer on the device (CUDA
//              2 GiB device to device; CPU 256 MiB host memmove, one thread,
//              so multi-threaded CPU ops may pass 100% of it), counted as
//              bytes read + written like every bandwidth-bound op.
// Each line: the median over samples of R back-to-back calls between fences
// (ctx.synchronize(), see fence()), after a warm-up; R makes a sample last
// >= 2 ms (CPU) / 10 ms (CUDA). Then the rate (TFLOP/s, or GB/s of bytes read
// + written; the formulas are in tools/bench_kernels_ops.cpp) and its
// fraction of the matching ceiling, beside the target.
//
// Shapes (--shapes model, CUDA's default): batch 1 × seq 4096, hidden 4096,
// 32 q / 8 kv heads of 128 (Llama-3-8B's attention; its MLP width 14336 for
// the dense GEMMs), 64 experts top-8 of width 1536 (32768 routed rows, 512
// per expert), vocab 32768, AdamW over 1e8 parameters. Data is bf16 on CUDA
// (kernels/cuda/common.cuh's dtype rule: statistics f32, router logits f32 as
// Megatron keeps its router in fp32, AdamW on the f32 master shard) and f32
// on the CPU, an fp32 backend, whose default is the scaled-down "small" set
// ("tiny" is the smoke test's).
//
// The routing line is the MoE layer's path from router logits to expert rows
// and back, as moe/permutation.cpp runs it: top-k, capacity mask (capacity T:
// nothing drops), the routed and kept histograms, rows per expert, the
// per-expert counts to the host (the dispatcher's one device-to-host sync),
// the row maps, permute and un-permute. Beside its bandwidth it is reported
// as a fraction of the layer's forward expert GEMMs (gate, up, down:
// 2 · grouped_gemm/gate_up.fwd + grouped_gemm/down.fwd); the target is <= 10%.
//
// Data is checked by default (nccl-tests style): outputs start as NaN (the
// accumulated ones at 0), and each must come back finite and not all zero;
// the routing line checks its row count. A wrong line makes the command fail
// after the report (CLI::RuntimeError: exit status 2, as bench moe-layer).
// An op that fails an internal check ends the process (kernels/check.h): the
// text table prints each line as it is measured, and --skip leaves such an
// op out of a rerun.
//
// JSON (--json, one object on stdout; the table then goes to stderr): the
// device, the ceilings, and per line: key (unique;
// tools/bench_kernels_torch.py reports its counterparts
// under the same keys: gemm/q.fwd, grouped_gemm/gate_up.fwd,
// attention_forward, attention_backward), op (the kernels API entry point),
// shape, dtype, ms, repeats, flops + tflops or bytes + gbps,
// fraction_of_ceiling, and where the issue sets one target {of, min|max} and
// meets_target. GEMM shapes read MxNxK; grouped ones Gx(MxNxK) per group.
#include "tools/bench_kernels.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>

#include "kernels/elementwise.h"
#include "kernels/init.h"
#include "kernels/threads.h"
#include "tools/commands.h"
#if ORIGAMI_WITH_CUDA
#include "kernels/cuda/check.h"
#endif

namespace origami::tools {

namespace kernel_bench {

namespace {

using Clock = std::chrono::steady_clock;

constexpr ShapeSet kShapeSets[] = {
    {"model", 1, 4096, 4096, 32, 8, 128, 14336, 64, 8, 1536, 32768, 100'000'000, 8192, int64_t{2} << 30},
    {"small", 1, 256, 512, 8, 2, 64, 1536, 16, 4, 256, 4096, int64_t{1} << 22, 1024, int64_t{256} << 20},
    {"tiny", 1, 32, 64, 4, 2, 16, 128, 8, 2, 32, 256, int64_t{1} << 16, 256, int64_t{8} << 20},
};

// The targets the CUDA issue sets, as fractions of the compute ceiling.
std::optional<double> ceiling_target(const std::string& op) {
  if (op == "gemm") return 0.70;
  if (op == "grouped_gemm" || op == "grouped_gemm_wgrad") return 0.60;
  if (op == "attention_forward") return 0.50;
  if (op == "attention_backward") return 0.40;
  return std::nullopt;
}
constexpr double kRoutingTarget = 0.10;  // routing+permute <= 10% of the forward expert GEMMs

// Host integers on the device, fenced: the upload runs on the legacy stream.
Tensor upload_i32(const ExecContext& ctx, const std::vector<int32_t>& v) {
  Tensor host = Tensor::empty({static_cast<int64_t>(v.size())}, DType::i32, MemCategory::workspace);
  std::copy(v.begin(), v.end(), host.i32());
  Tensor t = host.to(ctx.device());
  fence(ctx);
  return t;
}

// True when t (f32 or bf16) is finite everywhere and not all zeros.
bool finite_nonzero(const ExecContext& ctx, const Tensor& t) {
  Tensor f = t;
  if (t.dtype() != DType::f32) {
    f = empty(ctx, t.shape(), DType::f32);
    cast(ctx, t, f);
  }
  const double ss = sum_squares(ctx, f);
  return std::isfinite(ss) && ss > 0;
}

std::string device_name(const ExecContext& ctx) {
#if ORIGAMI_WITH_CUDA
  if (!ctx.device().is_host()) {
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, ctx.device().index));
    return prop.name;
  }
#endif
  return "cpu, " + std::to_string(ctx.threads()) + " thread(s)";
}

}  // namespace

const ShapeSet& shape_set(const std::string& name) {
  for (const ShapeSet& s : kShapeSets)
    if (name == s.name) return s;
  ORIGAMI_USER_ERROR("bench kernels: unknown shape set '", shorten(name), "' (tiny, small, model)");
}

void fence(const ExecContext& ctx) { ctx.synchronize(); }

Tensor empty(const ExecContext& ctx, Shape shape, DType dt) {
  return Tensor::empty(std::move(shape), dt, MemCategory::workspace, ctx.device());
}
Tensor random(const ExecContext& ctx, Shape shape, DType dt, const std::string& name, float std) {
  Tensor t = empty(ctx, std::move(shape), DType::f32);
  init_normal(ctx, t, 1234, name, 0, std);
  return as_dtype(ctx, t, dt);
}
Tensor filled(const ExecContext& ctx, Shape shape, DType dt, float value) {
  Tensor t = empty(ctx, std::move(shape), DType::f32);
  init_constant(ctx, t, value);
  return as_dtype(ctx, t, dt);
}
Tensor output(const ExecContext& ctx, Shape shape, DType dt) {
  return filled(ctx, std::move(shape), dt, std::numeric_limits<float>::quiet_NaN());
}
Tensor random_ids(const ExecContext& ctx, int64_t n, int64_t below, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(below - 1));
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int32_t& x : v) x = id(rng);
  return upload_i32(ctx, v);
}
Tensor positions(const ExecContext& ctx, int64_t S) {
  std::vector<int32_t> v(static_cast<size_t>(S));
  for (int64_t i = 0; i < S; ++i) v[i] = static_cast<int32_t>(i);
  return upload_i32(ctx, v);
}
std::string dims(std::initializer_list<int64_t> d) {
  std::string s;
  for (int64_t x : d) s += (s.empty() ? "" : "x") + std::to_string(x);
  return s;
}

Runner::Runner(const ExecContext& ctx, const BenchOptions& o)
    // A sample lasts at least this long, so launch and clock overheads stay small.
    : ctx_(ctx), o_(o), min_sample_s_(ctx.device().is_host() ? 2e-3 : 10e-3) {}

double Runner::seconds_per_call(const std::function<void()>& run, int* repeats) const {
  for (int i = 0; i < o_.warmup; ++i) run();
  fence(ctx_);
  auto t0 = Clock::now();
  run();
  fence(ctx_);
  const double probe = std::chrono::duration<double>(Clock::now() - t0).count();
  *repeats = static_cast<int>(std::clamp(std::ceil(min_sample_s_ / std::max(probe, 1e-9)), 1.0, 1000.0));
  std::vector<double> samples;
  for (int s = 0; s < o_.samples; ++s) {
    fence(ctx_);
    t0 = Clock::now();
    for (int r = 0; r < *repeats; ++r) run();
    fence(ctx_);
    samples.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / *repeats);
  }
  return median(samples);
}

bool Runner::wanted(const BenchOptions& o, const std::string& key) {
  auto any_prefix = [&](const std::vector<std::string>& list) {
    return std::any_of(list.begin(), list.end(), [&](const std::string& p) { return key.starts_with(p); });
  };
  return (o.only.empty() || any_prefix(o.only)) && !any_prefix(o.skip);
}

void Runner::bench(const std::string& key, const std::function<Case()>& make) {
  keys.push_back(key);
  if (listing || !wanted(o_, key)) return;
  Result r;
  {
    Case c = make();
    fence(ctx_);
    r.key = key;
    r.op = c.op;
    r.shape = c.shape;
    r.dtype = c.dtype;
    r.compute = c.flops > 0;
    r.work = r.compute ? c.flops : c.bytes;
    const double s = seconds_per_call(c.run, &r.repeats);
    r.ms = s * 1e3;
    r.rate = r.work / s / (r.compute ? 1e12 : 1e9);
    r.fraction = r.rate / (r.compute ? ceiling_tflops : ceiling_gbps);
    if (r.compute) r.target = ceiling_target(r.op);
    for (const Tensor& t : c.outputs)
      if (!finite_nonzero(ctx_, t)) r.wrong = "an output is not finite or is all zeros";
    if (c.verify && r.wrong.empty()) r.wrong = c.verify();
    fence(ctx_);
  }
  // Cases differ in their sizes: give this one's blocks back, so the cache
  // does not hold every case's buffers at once.
  TrackedAllocator::of(ctx_.device()).release_cached();
  results.push_back(std::move(r));
  if (on_result) on_result(results.back());
}

const Result* Runner::find(const std::string& key) const {
  for (const Result& r : results)
    if (r.key == key) return &r;
  return nullptr;
}

}  // namespace kernel_bench

namespace {

using namespace kernel_bench;

// Compute ceiling: an n×n×n GEMM through the gemm op in the run's dtype.
// Bandwidth ceiling: Tensor::copy_from of one buffer, 2 · its bytes moved.
void measure_ceilings(const ExecContext& ctx, Runner& r, const ShapeSet& s, DType dt) {
  int repeats = 0;
  {
    const int64_t n = s.ceiling_n;
    Case c = gemm_case(ctx, dt, n, n, n, Trans::no, Trans::no, 0.0f);
    fence(ctx);
    if (!ctx.device().is_host()) {
      // A GPU idles at a low clock and ramps up under load over tens of
      // milliseconds: timed cold, the ceiling would read low and every
      // line's %ceil high. A quarter second of this GEMM first.
      const auto t0 = Clock::now();
      do {
        c.run();
        fence(ctx);
      } while (std::chrono::duration<double>(Clock::now() - t0).count() < 0.25);
    }
    const double t = r.seconds_per_call(c.run, &repeats);
    r.ceiling_gemm_ms = t * 1e3;
    r.ceiling_tflops = c.flops / t / 1e12;
  }
  {
    Tensor src = empty(ctx, {s.copy_bytes}, DType::u8), dst = empty(ctx, {s.copy_bytes}, DType::u8);
    const double t = r.seconds_per_call([&] { dst.copy_from(src); }, &repeats);
    r.ceiling_copy_ms = t * 1e3;
    r.ceiling_gbps = 2.0 * static_cast<double>(s.copy_bytes) / t / 1e9;
  }
  TrackedAllocator::of(ctx.device()).release_cached();
}

// ---- report

// The routing line's time over the forward expert GEMMs' (gate and up have
// one shape), once the three are measured.
struct RoutingShare {
  double expert_ms = 0, fraction = 0;
};
std::optional<RoutingShare> routing_share(const Runner& r, const Result& x) {
  const Result* gate_up = r.find("grouped_gemm/gate_up.fwd");
  const Result* down = r.find("grouped_gemm/down.fwd");
  if (x.key != "moe_routing_permute" || !gate_up || !down) return std::nullopt;
  const double expert_ms = 2 * gate_up->ms + down->ms;
  return RoutingShare{expert_ms, x.ms / expert_ms};
}

nlohmann::ordered_json to_json(const Result& x, const Runner& r) {
  nlohmann::ordered_json j = {{"key", x.key},     {"op", x.op}, {"shape", x.shape},
                              {"dtype", x.dtype}, {"ms", x.ms}, {"repeats", x.repeats}};
  j[x.compute ? "flops" : "bytes"] = x.work;
  j[x.compute ? "tflops" : "gbps"] = x.rate;
  j["fraction_of_ceiling"] = x.fraction;
  if (x.target) {
    j["target"] = {{"of", "ceiling"}, {"min", *x.target}};
    j["meets_target"] = x.fraction >= *x.target;
  }
  if (const auto share = routing_share(r, x)) {
    j["expert_gemm_fwd_ms"] = share->expert_ms;
    j["fraction_of_expert_gemm"] = share->fraction;
    j["target"] = {{"of", "expert_gemm"}, {"max", kRoutingTarget}};
    j["meets_target"] = share->fraction <= kRoutingTarget;
  }
  if (!x.wrong.empty()) j["wrong"] = x.wrong;
  return j;
}

// One table row, printed as soon as the op is measured (an op that aborts
// the run leaves the rows before it on the screen).
void print_row(std::FILE* out, const Result& x, const Runner& r) {
  char target[96] = "";
  if (x.target)
    std::snprintf(target, sizeof target, ">= %.0f%% %s", 100 * *x.target, x.fraction >= *x.target ? "ok" : "MISS");
  if (const auto share = routing_share(r, x))
    std::snprintf(target, sizeof target, "%.1f%% of expert GEMM fwd, <= %.0f%% %s", 100 * share->fraction,
                  100 * kRoutingTarget, share->fraction <= kRoutingTarget ? "ok" : "MISS");
  std::fprintf(out, "  %-27s %-27s %10.4f %9.3f %s %7.1f%%  %s%s%s\n", x.key.c_str(), x.shape.c_str(), x.ms, x.rate,
               x.compute ? "TFLOP/s" : "GB/s   ", 100 * x.fraction, target,
               x.wrong.empty() ? "" : "  WRONG: ", x.wrong.c_str());
  std::fflush(out);
}

// A prefix that names no op is a typo, not an empty selection; a selection
// that leaves nothing is a mistake too.
void check_selection(const std::vector<std::string>& keys, const BenchOptions& o) {
  for (const std::vector<std::string>* list : {&o.only, &o.skip})
    for (const std::string& p : *list)
      if (std::none_of(keys.begin(), keys.end(), [&](const std::string& k) { return k.starts_with(p); })) {
        std::string families;
        for (const std::string& k : keys)
          if (const std::string f = k.substr(0, k.find('.')); families.find(" " + f + ",") == std::string::npos)
            families += " " + f + ",";
        ORIGAMI_USER_ERROR("bench kernels ", list == &o.only ? "--only " : "--skip ", shorten(p),
                           ": no op's key starts with it (keys start with:", families.substr(0, families.size() - 1),
                           "; the table lists every key)");
      }
  if (std::none_of(keys.begin(), keys.end(), [&](const std::string& k) { return Runner::wanted(o, k); }))
    ORIGAMI_USER_ERROR("bench kernels: --skip leaves out every op --only selects (nothing would be measured)");
}

void run_bench_kernels(BenchOptions o) {
  const bool on_cuda = o.device == "cuda";
  if (o.shapes.empty()) o.shapes = on_cuda ? "model" : "small";
  if (o.dtype.empty()) o.dtype = on_cuda ? "bf16" : "f32";
  const ShapeSet& s = shape_set(o.shapes);
  const DType dt = o.dtype == "bf16" ? DType::bf16 : DType::f32;
  if (!on_cuda && dt == DType::bf16)
    ORIGAMI_USER_ERROR(
        "bench kernels --device cpu --dtype bf16: the CPU backend is fp32 (use --dtype f32, or "
        "--device cuda)");
  std::optional<ExecContext> made;
  if (on_cuda) {
    try {
      made.emplace(ExecContext::cuda(0));
    } catch (const UserError& e) {
      ORIGAMI_USER_ERROR("bench kernels --device cuda: ", e.what());
    }
  } else {
    const int threads = default_threads_per_rank();
    set_num_threads(threads);
    made.emplace(ExecContext::cpu(threads));
  }
  const ExecContext& ctx = *made;
  const std::string name = device_name(ctx), ceiling_gemm = dims({s.ceiling_n, s.ceiling_n, s.ceiling_n});

  Runner r(ctx, o);
  auto every_op = [&](Runner& runner) {
    bench_gemms(ctx, runner, s, dt);
    bench_grouped(ctx, runner, s, dt);
    bench_attention(ctx, runner, s, dt);
    bench_dense(ctx, runner, s, dt);
    bench_loss_optimizer(ctx, runner, s, dt);
    bench_routing(ctx, runner, s, dt);
  };
  // The selection is checked before anything is measured: a typo in --only
  // should not cost a whole table's run first.
  r.listing = true;
  every_op(r);
  r.listing = false;
  check_selection(r.keys, o);
  r.keys.clear();
  measure_ceilings(ctx, r, s, dt);
  {
    // The table, a row as each op is measured; under --json on stderr, so a
    // run cut short (tools/gpu_check.sh's deadline) still leaves its rows.
    std::FILE* out = o.json ? stderr : stdout;
    std::fprintf(out, "bench kernels: %s (%s), %s shapes, %s, median of %d samples\n", to_string(ctx.device()).c_str(),
                 name.c_str(), s.name, o.dtype.c_str(), o.samples);
    std::fprintf(out, "  compute ceiling    gemm %s %s: %.3f ms, %.2f TFLOP/s\n", ceiling_gemm.c_str(),
                 o.dtype.c_str(), r.ceiling_gemm_ms, r.ceiling_tflops);
    std::fprintf(out, "  bandwidth ceiling  copy of %.0f MiB: %.3f ms, %.1f GB/s (bytes read + written)\n",
                 static_cast<double>(s.copy_bytes) / (1 << 20), r.ceiling_copy_ms, r.ceiling_gbps);
    std::fprintf(out, "  %-27s %-27s %10s %17s %8s  %s\n", "key", "shape", "ms", "rate", "%ceil", "target");
    r.on_result = [&r, out](const Result& x) { print_row(out, x, r); };
  }
  every_op(r);

  int64_t wrong = 0;
  for (const Result& x : r.results) wrong += !x.wrong.empty();
  if (o.json) {
    nlohmann::ordered_json ops = nlohmann::ordered_json::array();
    for (const Result& x : r.results) ops.push_back(to_json(x, r));
    nlohmann::ordered_json j = {{"bench", "kernels"},
                                {"device", to_string(ctx.device())},
                                {"device_name", name},
                                {"threads", ctx.threads()},
                                {"shapes", s.name},
                                {"dtype", o.dtype},
                                {"samples", o.samples},
                                {"ceilings",
                                 {{"gemm_shape", ceiling_gemm},
                                  {"gemm_dtype", o.dtype},
                                  {"gemm_ms", r.ceiling_gemm_ms},
                                  {"gemm_tflops", r.ceiling_tflops},
                                  {"copy_bytes", s.copy_bytes},
                                  {"copy_ms", r.ceiling_copy_ms},
                                  {"copy_gbps", r.ceiling_gbps}}},
                                {"ops", std::move(ops)},
                                {"wrong", wrong}};
    std::printf("%s\n", j.dump().c_str());
  }
  if (wrong != 0) throw CLI::RuntimeError("bench kernels: " + std::to_string(wrong) + " op(s) produced wrong data", 1);
}

}  // namespace

void add_bench_kernels_command(CLI::App& bench) {
  auto o = std::make_shared<BenchOptions>();
  CLI::App* cmd = bench.add_subcommand("kernels", "Every kernel op at model shapes vs GEMM and copy ceilings");
  cmd->add_option("--device", o->device, "cpu or cuda (device 0)")->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--shapes", o->shapes, "tiny, small or model (default: model on cuda, small on cpu)")
      ->check(CLI::IsMember({"tiny", "small", "model"}));
  cmd->add_option("--dtype", o->dtype, "Data dtype: f32 or bf16 (default: bf16 on cuda, f32 on cpu)")
      ->check(CLI::IsMember({"f32", "bf16"}));
  cmd->add_option("--samples", o->samples, "Timed samples per op (median reported)")->check(CLI::Range(1, 1000));
  cmd->add_option("--warmup", o->warmup, "Untimed calls per op first")->check(CLI::Range(0, 1000))
      ->capture_default_str();
  auto only = std::make_shared<std::vector<std::string>>(), skip = std::make_shared<std::vector<std::string>>();
  cmd->add_option("--only", *only, "Only the ops whose key starts with one of these (comma-separated)");
  cmd->add_option("--skip", *skip, "Leave out the ops whose key starts with one of these (comma-separated)");
  cmd->add_flag("--json", o->json, "Print one JSON object");
  cmd->callback([o, only, skip] {
    o->only = comma_items(*only, "--only");
    o->skip = comma_items(*skip, "--skip");
    require_one_process("bench kernels");
    run_bench_kernels(*o);
  });
}

}  // namespace origami::tools

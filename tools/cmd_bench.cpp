// `origami bench step --config C [--steps N] [--warmup W] [--json]`: times a
// full training step (forward, backward, AdamW) of the configured model on
// random tokens, and, in the same run, oneDNN sgemm at exactly the GEMM shapes
// that step performs (forward Y = X·Wᵀ, backward dX = dY·W and dW += dYᵀ·X for
// every linear). Reports medians and the ratio of the step's achieved FLOP
// rate (6·N·tokens + causal attention FLOPs, per second) to that sgemm rate.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>

#include "engine/config.h"
#include "engine/model.h"
#include "engine/optimizer.h"
#include "kernels/gemm.h"
#include "kernels/threads.h"
#include "tools/commands.h"

namespace origami::tools {

namespace {

using Clock = std::chrono::steady_clock;

// Cheap non-zero, non-denormal operands: GEMM speed does not depend on the values.
void fill_pattern(Tensor& t) {
  float* p = t.f32();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = static_cast<float>((i * 2654435761u) % 1999u) / 1999.0f - 0.5f;
}

struct GemmCase {
  int64_t M, N, K;
  Trans ta, tb;
};

// The GEMMs of one micro-batch's forward and backward: every 2-D parameter but
// the embedding table is a linear [out, in] applied to T tokens, except
// routed experts, which see T·k/E rows each on average.
std::vector<GemmCase> step_gemms(const Model& model, int64_t T) {
  const MoeConfig& moe = model.moe_config();
  const int64_t E = moe.router.num_experts;
  const int64_t expert_rows = E > 0 ? std::max<int64_t>(1, T * moe.router.top_k / E) : T;
  std::vector<GemmCase> cases;
  for (const ParamUnit& u : model.params().units())
    for (const ParamInfo& p : u.params) {
      if (p.shape.size() != 2 || p.name == "model.embed_tokens.weight") continue;
      const int64_t out = p.shape[0], in = p.shape[1];
      const int64_t rows = p.name.find(".experts.") != std::string::npos ? expert_rows : T;
      cases.push_back({rows, out, in, Trans::no, Trans::yes});   // Y = X·Wᵀ
      cases.push_back({rows, in, out, Trans::no, Trans::no});    // dX = dY·W
      cases.push_back({out, in, rows, Trans::yes, Trans::no});   // dW += dYᵀ·X
    }
  return cases;
}

// Seconds for one pass over all cases (median of `repeats`), after warm-up.
double time_gemms(const ExecContext& ctx, const std::vector<GemmCase>& cases, int repeats, double* flops) {
  struct Buffers {
    Tensor a, b, c;
  };
  std::vector<Buffers> bufs;
  *flops = 0;
  for (const GemmCase& g : cases) {
    Buffers b;
    b.a = g.ta == Trans::no ? Tensor::empty({g.M, g.K}, DType::f32, MemCategory::workspace)
                            : Tensor::empty({g.K, g.M}, DType::f32, MemCategory::workspace);
    b.b = g.tb == Trans::no ? Tensor::empty({g.K, g.N}, DType::f32, MemCategory::workspace)
                            : Tensor::empty({g.N, g.K}, DType::f32, MemCategory::workspace);
    b.c = Tensor::empty({g.M, g.N}, DType::f32, MemCategory::workspace);
    fill_pattern(b.a);
    fill_pattern(b.b);
    bufs.push_back(b);
    *flops += 2.0 * static_cast<double>(g.M) * static_cast<double>(g.N) * static_cast<double>(g.K);
  }
  std::vector<double> times;
  for (int r = 0; r < repeats + 2; ++r) {
    const auto t0 = Clock::now();
    for (size_t i = 0; i < cases.size(); ++i) gemm(ctx, bufs[i].a, cases[i].ta, bufs[i].b, cases[i].tb, bufs[i].c);
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    if (r >= 2) times.push_back(dt);  // the first two passes warm caches and oneDNN's kernel selection
  }
  return median(times);
}

void run_bench_step(const std::string& config_path, const std::vector<std::string>& overrides, int steps,
                    int warmup, bool json) {
  Config cfg = load_config(config_path, overrides);
  require_host_engine(cfg, "bench step");
  cfg.training.steps = std::max(cfg.training.steps, static_cast<int64_t>(steps + warmup));
  {
    // One rank's whole model: a layout of several ranks would be timed as
    // another one's, so it is refused rather than ignored.
    const ParallelConfig& p = cfg.parallel;
    if (p.tp > 1 || p.cp > 1 || p.pp > 1 || p.ep > 1 || p.etp > 1)
      ORIGAMI_USER_ERROR(cfg.sources(), ": parallel.tp = ", p.tp, ", cp = ", p.cp, ", pp = ", p.pp, ", ep = ", p.ep,
                         ", etp = ", p.etp, ": bench step times one rank's whole model (rule: all 1; a layout's "
                         "throughput is `mpirun ... origami train`'s step line, expert parallelism's `bench "
                         "moe-layer`)");
    // The one-rank rules, and memory as `origami train` holds it to.
    Config one = cfg;
    one.parallel = ParallelConfig{};
    validate_for_world(one, 1);
    validate_for_machine(one, 1, ranks_on_this_node());
  }
  const int threads = cfg.runtime.threads > 0 ? static_cast<int>(cfg.runtime.threads) : default_threads_per_rank();
  set_num_threads(threads);
  const ExecContext ctx = ExecContext::cpu(threads);
  const TrainingConfig& tc = cfg.training;
  Model model(ctx, cfg.model, tc.seed, cfg.moe);
  AdamW optimizer(cfg.optimizer, cfg.lr_schedule, cfg.training.steps);
  const int64_t accum = tc.global_batch / tc.micro_batch;
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(cfg.model.vocab_size - 1));
  Tensor tokens = Tensor::empty({tc.micro_batch, tc.seq_len + 1}, DType::i32, MemCategory::activation);

  std::vector<double> step_times;
  for (int s = 0; s < warmup + steps; ++s) {
    for (int64_t i = 0; i < tokens.numel(); ++i) tokens.i32()[i] = tok(rng);
    const auto t0 = Clock::now();
    model.params().zero_grads(ctx);
    for (int64_t a = 0; a < accum; ++a) {
      ModelSaved saved;
      model.forward(tokens, saved);
      model.backward(saved, 1.0f / static_cast<float>(tc.global_batch * tc.seq_len));
    }
    optimizer.step(ctx, model.params());
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    if (s >= warmup) step_times.push_back(dt);
  }
  const double step_s = median(step_times);
  const StepFlops flops = model.training_flops(tc.global_batch, tc.seq_len);
  const double step_gflops = flops.total() / step_s / 1e9;
  const double tokens_per_s = static_cast<double>(tc.global_batch * tc.seq_len) / step_s;

  double gemm_flops = 0;
  const double gemm_s =
      time_gemms(ctx, step_gemms(model, tc.micro_batch * tc.seq_len), std::max(steps, 3), &gemm_flops);
  const double sgemm_gflops = gemm_flops / gemm_s / 1e9;
  const double ratio = step_gflops / sgemm_gflops;

  if (json) {
    nlohmann::ordered_json j = {{"config", config_path},
                                {"threads", ctx.threads()},
                                {"params", model.params().total_params()},
                                {"tokens_per_step", tc.global_batch * tc.seq_len},
                                {"step_time_s", step_s},
                                {"tokens_per_s", tokens_per_s},
                                {"step_gflops", step_gflops},
                                {"matmul_flops_per_step", flops.matmul},
                                {"attention_flops_per_step", flops.attention},
                                {"sgemm_gflops", sgemm_gflops},
                                {"ratio_to_sgemm", ratio},
                                {"repeats", steps}};
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("bench step: %s, %lld params, %d thread(s), %lld tokens/step, median of %d steps\n",
                config_path.c_str(), static_cast<long long>(model.params().total_params()), ctx.threads(),
                static_cast<long long>(tc.global_batch * tc.seq_len), steps);
    std::printf("  step time        %10.4f s\n", step_s);
    std::printf("  tokens/s         %10.0f\n", tokens_per_s);
    std::printf("  step GFLOP/s     %10.1f  (6·N·tokens + causal attention)\n", step_gflops);
    std::printf("  sgemm GFLOP/s    %10.1f  (oneDNN at this step's GEMM shapes, same run)\n", sgemm_gflops);
    std::printf("  ratio            %10.3f\n", ratio);
  }
}

}  // namespace

void add_bench_command(CLI::App& app) {
  CLI::App* bench = app.add_subcommand("bench", "Throughput benchmarks (median of repeats, with a baseline)");
  bench->require_subcommand(1);
  add_bench_comm_command(*bench);
  struct Args {
    std::string config;
    std::vector<std::string> overrides;
    int steps = 5, warmup = 2;
    bool json = false;
  };
  auto args = std::make_shared<Args>();
  CLI::App* step = bench->add_subcommand("step", "Full training step vs oneDNN sgemm at the step's shapes");
  step->add_option("--config", args->config, "TOML config")->required();
  add_set_option(step, args->overrides);
  step->add_option("--steps", args->steps, "Timed steps (median reported)")->check(CLI::Range(1, 1000))
      ->capture_default_str();
  step->add_option("--warmup", args->warmup, "Untimed warm-up steps")->check(CLI::Range(0, 1000))
      ->capture_default_str();
  step->add_flag("--json", args->json, "Print one JSON object");
  step->callback([args] {
    require_one_process("bench step");
    run_bench_step(args->config, args->overrides, args->steps, args->warmup, args->json);
  });
  add_bench_moe_layer_command(*bench);
  add_bench_checkpoint_command(*bench);
  add_bench_imbalance_command(*bench);
  add_bench_kernels_command(*bench);
}

}  // namespace origami::tools

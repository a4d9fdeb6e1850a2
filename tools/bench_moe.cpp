// `origami bench moe-layer --config C [--steps N] [--warmup W] [--json]`: one
// MoE layer (the config's router, capacity and experts, on micro_batch ·
// seq_len tokens of width hidden_size), forward + backward. Reports the
// median layer time and tokens/s, and the split of the time: router (forward
// and backward), permute/un-permute (capacity, permutation, gathers and their
// backward), expert GEMMs (grouped SwiGLU forward and backward), and the rest
// (the whole layer's median minus those three, measured in the same run).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "engine/config.h"
#include "kernels/init.h"
#include "kernels/threads.h"
#include "moe/moe_layer.h"
#include "tools/commands.h"

namespace origami::tools {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

Tensor random_param(Shape shape, const std::string& name, float std) {
  Tensor t = Tensor::empty(std::move(shape), DType::f32, MemCategory::param);
  init_normal(t, 7, name, 0, std);
  return t;
}

moe::ExpertWeights random_experts(int64_t E, int64_t F, int64_t D, const std::string& name, float std) {
  return {random_param({E, F, D}, name + ".w1", std), random_param({E, F, D}, name + ".w3", std),
          random_param({E, D, F}, name + ".w2", std)};
}

moe::ExpertWeights zero_like(const moe::ExpertWeights& w) {
  return {Tensor::zeros(w.w1_EFD.shape(), DType::f32, MemCategory::grad),
          Tensor::zeros(w.w3_EFD.shape(), DType::f32, MemCategory::grad),
          Tensor::zeros(w.w2_EDF.shape(), DType::f32, MemCategory::grad)};
}

struct Split {
  double router = 0, permute = 0, experts = 0;
};

// The layer's steps one by one, in the layer's order, timed per category.
Split time_components(const moe::MoeLayerOptions& opt, const moe::MoeLayerWeights& w, moe::MoeLayerWeights& g,
                      const Tensor& x_TD, int64_t seq_len, const Tensor& dy_TD) {
  Split s;
  const int64_t T = x_TD.rows(), E = opt.router.num_experts;
  auto t0 = Clock::now();
  moe::RouterSaved rs;
  moe::RouterLosses losses;
  moe::Routing routing = moe::router_forward(opt.router, x_TD, w.gate_ED, w.bias_E, seq_len, rs, losses);
  s.router += seconds_since(t0);

  t0 = Clock::now();
  const int64_t C = moe::expert_capacity(opt.capacity, T, opt.router.top_k, E);
  Tensor kept = moe::apply_capacity(opt.capacity, routing.expert_TK, routing.weight_TK, E, C);
  moe::Permutation perm = moe::make_permutation(routing.expert_TK, kept, E, C, opt.capacity.pad_to_capacity);
  Tensor x_ND = moe::permute_rows(x_TD, perm);
  s.permute += seconds_since(t0);

  t0 = Clock::now();
  moe::ExpertsSaved es;
  Tensor y_ND = moe::experts_forward(w.experts, x_ND, perm.rows_per_expert, es);
  s.experts += seconds_since(t0);

  t0 = Clock::now();
  Tensor y_TD = moe::unpermute_rows(y_ND, perm, routing.weight_TK, T);
  Tensor dy_ND = Tensor::empty(y_ND.shape(), DType::f32, MemCategory::activation);
  Tensor dweight = Tensor::empty(routing.weight_TK.shape(), DType::f32, MemCategory::activation);
  moe::unpermute_rows_backward(dy_TD, y_ND, perm, routing.weight_TK, dy_ND, dweight);
  s.permute += seconds_since(t0);

  t0 = Clock::now();
  Tensor dx_ND = moe::experts_backward(w.experts, es, dy_ND, g.experts);
  s.experts += seconds_since(t0);

  t0 = Clock::now();
  Tensor dx_TD = Tensor::zeros(x_TD.shape(), DType::f32, MemCategory::activation);
  moe::permute_rows_backward(dx_ND, perm, dx_TD);
  s.permute += seconds_since(t0);

  t0 = Clock::now();
  moe::router_backward(opt.router, rs, w.gate_ED, dweight, 1.0f, g.gate_ED);
  s.router += seconds_since(t0);
  return s;
}

void run_bench_moe_layer(const std::string& config_path, const std::vector<std::string>& overrides, int steps,
                         int warmup, bool json) {
  Config cfg = load_config(config_path, overrides);
  const MoeConfig& m = cfg.moe;
  if (m.num_experts == 0) ORIGAMI_USER_ERROR(config_path, ": moe.num_experts = 0: bench moe-layer needs MoE layers");
  set_num_threads(cfg.runtime.threads > 0 ? static_cast<int>(cfg.runtime.threads) : default_threads_per_rank());
  const int64_t D = cfg.model.hidden_size, E = m.num_experts, F = m.expert_ffn(cfg.model.ffn_hidden_size);
  const int64_t S = cfg.training.seq_len, T = cfg.training.micro_batch * S;
  const float std = static_cast<float>(cfg.model.init_std);

  moe::MoeLayerOptions opt;
  opt.router = {E, m.top_k, m.score_function, m.normalize_topk, static_cast<float>(m.topk_scaling), m.num_groups,
                m.group_topk, m.load_balancing, static_cast<float>(m.aux_loss_coeff),
                static_cast<float>(m.z_loss_coeff)};
  opt.capacity = {m.capacity_factor, m.drop_policy, m.pad_to_capacity};
  moe::MoeLayerWeights w;
  w.gate_ED = random_param({E, D}, "bench.gate", std);
  if (m.expert_bias) w.bias_E = Tensor::zeros({E}, DType::f32, MemCategory::param);
  w.experts = random_experts(E, F, D, "bench.experts", std);
  if (m.shared_expert_hidden_size > 0) w.shared = random_experts(1, m.shared_expert_hidden_size, D, "bench.shared", std);
  moe::MoeLayerWeights g;
  g.gate_ED = Tensor::zeros({E, D}, DType::f32, MemCategory::grad);
  g.experts = zero_like(w.experts);
  if (w.has_shared()) g.shared = zero_like(w.shared);

  Tensor x = random_param({T, D}, "bench.x", 1.0f), dy = random_param({T, D}, "bench.dy", 1.0f);
  std::vector<double> layer_times, router_t, permute_t, expert_t;
  for (int i = 0; i < warmup + steps; ++i) {
    auto t0 = Clock::now();
    moe::MoeLayerSaved saved;
    moe::MoeLayerStats stats;
    moe::moe_layer_forward(opt, w, x, S, saved, stats);
    moe::moe_layer_backward(opt, w, saved, dy, 1.0f, g);
    const double layer_s = seconds_since(t0);
    Split s = time_components(opt, w, g, x, S, dy);
    if (i < warmup) continue;
    layer_times.push_back(layer_s);
    router_t.push_back(s.router);
    permute_t.push_back(s.permute);
    expert_t.push_back(s.experts);
  }
  const double layer_s = median(layer_times), router_s = median(router_t), permute_s = median(permute_t),
               experts_s = median(expert_t);
  const double rest_s = std::max(0.0, layer_s - router_s - permute_s - experts_s);
  const double tokens_per_s = static_cast<double>(T) / layer_s;
  const double routing_fraction = (router_s + permute_s) / layer_s;
  if (json) {
    nlohmann::ordered_json j = {{"config", config_path},       {"threads", num_threads()},
                                {"tokens", T},                 {"experts", E},
                                {"top_k", m.top_k},            {"layer_time_s", layer_s},
                                {"tokens_per_s", tokens_per_s}, {"router_s", router_s},
                                {"permute_s", permute_s},      {"experts_s", experts_s},
                                {"rest_s", rest_s},            {"router_permute_fraction", routing_fraction},
                                {"repeats", steps}};
    std::printf("%s\n", j.dump().c_str());
    return;
  }
  std::printf("bench moe-layer: %s, %lld tokens x %lld, %lld experts top-%lld (ffn %lld), %d thread(s), median of %d\n",
              config_path.c_str(), static_cast<long long>(T), static_cast<long long>(D), static_cast<long long>(E),
              static_cast<long long>(m.top_k), static_cast<long long>(F), num_threads(), steps);
  std::printf("  layer fwd+bwd    %10.4f s   %10.0f tokens/s\n", layer_s, tokens_per_s);
  auto line = [&](const char* what, double t) {
    std::printf("  %-16s %10.4f s   %5.1f%%\n", what, t, 100.0 * t / layer_s);
  };
  line("router", router_s);
  line("permute/unperm.", permute_s);
  line("expert GEMMs", experts_s);
  line("rest", rest_s);
  std::printf("  router + permute/un-permute: %.1f%% of the layer\n", 100.0 * routing_fraction);
}

}  // namespace

void add_bench_moe_layer_command(CLI::App& bench) {
  struct Args {
    std::string config;
    std::vector<std::string> overrides;
    int steps = 5, warmup = 2;
    bool json = false;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = bench.add_subcommand("moe-layer", "One MoE layer forward+backward, with the split of its time");
  cmd->add_option("--config", args->config, "TOML config with MoE layers")->required();
  cmd->add_option("--set", args->overrides, "Override a config value: section.key=value");
  cmd->add_option("--steps", args->steps, "Timed repeats (median reported)")->check(CLI::Range(1, 1000));
  cmd->add_option("--warmup", args->warmup, "Untimed warm-up repeats")->check(CLI::Range(0, 1000));
  cmd->add_flag("--json", args->json, "Print one JSON object");
  cmd->callback([args] { run_bench_moe_layer(args->config, args->overrides, args->steps, args->warmup, args->json); });
}

}  // namespace origami::tools

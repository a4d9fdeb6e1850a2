// Config rules (see config.h): ranges and limits of single keys, rules tying
// keys together, and the checks that need the world size or the machine.
// Every failure is a UserError naming where the value came from, the key and
// the rule; size limits name what they protect (i32 kernel indices, 32-bit
// GEMM dimensions, 64-bit byte counts, this node's memory).
#include <unistd.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <sstream>
#include <thread>

#include "comm/layout.h"
#include "engine/config_rules.h"
#include "engine/plan.h"
#include "kernels/attention.h"
#include "kernels/check.h"
#include "kernels/moe_ops.h"
#include "kernels/threads.h"

namespace origami {

using config_detail::fmt;
using config_detail::Origins;
using detail::concat;

namespace {

class Rules {
 public:
  explicit Rules(const Origins& o) : o_(o) {}

  template <class T>
  void need(bool ok, std::string_view key, T value, std::string_view rule) const {
    if (!ok) ORIGAMI_USER_ERROR(o_.of(key), ": ", key, " = ", shorten(fmt(value)), ": ", rule);
  }
  void at_least(std::string_view key, int64_t v, int64_t lo) const { need(v >= lo, key, v, concat("must be >= ", lo)); }
  void between(std::string_view key, int64_t v, int64_t lo, int64_t hi) const {
    need(v >= lo && v <= hi, key, v, concat("must be in ", lo, "..", hi));
  }
  void finite(std::string_view key, double v) const { need(std::isfinite(v), key, v, "must be a finite number"); }
  void positive(std::string_view key, double v) const {
    finite(key, v);
    need(v > 0, key, v, "must be > 0");
  }
  void non_negative(std::string_view key, double v) const {
    finite(key, v);
    need(v >= 0, key, v, "must be >= 0");
  }
  void unit_interval(std::string_view key, double v) const {
    finite(key, v);
    need(v >= 0 && v < 1, key, v, "must be in [0, 1)");
  }
  void at_most(std::string_view key, int64_t v, int64_t hi, std::string_view why) const {
    need(v <= hi, key, v, concat("must be <= ", hi, " (", why, ")"));
  }
  // Values the kernels use as fp32: a double that passes "> 0" may still be
  // 0 or inf as a float (1e-300, 1e300).
  void positive_fp32(std::string_view key, double v) const {
    positive(key, v);
    fp32(key, v, Zero::refused);
  }
  void non_negative_fp32(std::string_view key, double v) const {
    non_negative(key, v);
    fp32(key, v, Zero::allowed);
  }
  // A rule tying several keys together: message names them all and the rule.
  void need_all(bool ok, std::initializer_list<std::string_view> keys, const std::string& what) const {
    if (!ok) ORIGAMI_USER_ERROR(o_.of(keys), ": ", what);
  }

 private:
  enum class Zero { allowed, refused };
  void fp32(std::string_view key, double v, Zero zero) const {
    const double a = std::fabs(v);
    need((zero == Zero::allowed && v == 0) || (a >= FLT_MIN && a <= FLT_MAX), key, v,
         concat("must be representable in fp32, where the kernels use it: ", zero == Zero::allowed ? "0 or " : "",
                "magnitude in [", fmt(double{FLT_MIN}), ", ", fmt(double{FLT_MAX}), "]"));
  }
  const Origins& o_;
};

// parallel.order: the five axes, each once, joined by '-'.
void check_order(const Rules& r, const std::string& order) {
  static constexpr std::string_view kAxes[] = {"tp", "cp", "ep", "dp", "pp"};
  std::vector<std::string> parts;
  std::string part;
  std::istringstream is(order);
  while (std::getline(is, part, '-')) parts.push_back(part);
  if (!order.empty() && order.back() == '-') parts.push_back("");
  std::string problem;
  for (const std::string& p : parts) {
    if (std::find(std::begin(kAxes), std::end(kAxes), p) == std::end(kAxes)) {
      problem = concat("unknown axis '", p, "'");
      break;
    }
    if (std::count(parts.begin(), parts.end(), p) > 1) {
      problem = concat("axis '", p, "' appears twice");
      break;
    }
  }
  if (problem.empty())
    for (std::string_view a : kAxes)
      if (std::find(parts.begin(), parts.end(), a) == parts.end()) {
        problem = concat("axis '", a, "' is missing");
        break;
      }
  r.need(problem.empty(), "parallel.order", order,
         concat("must be a permutation of tp, cp, ep, dp, pp joined by '-' (e.g. \"tp-cp-ep-dp-pp\"): ", problem));
}

// Pipeline stages: an explicit parallel.pp_layers lists pp counts in
// 0..num_layers summing to model.num_layers; the even split
// (plan::stage_layers) needs num_layers >= pp so that no stage is left
// without a layer. "" when the stages are fine.
std::string stage_problem(const ModelConfig& m, const ParallelConfig& p) {
  const std::vector<int64_t>& layers = p.pp_layers;
  const int64_t v = std::max<int64_t>(p.virtual_stages, 1), chunks = p.pp * v;
  const std::string count = v > 1 ? concat("parallel.pp · virtual_stages = ", chunks) : concat("parallel.pp = ", p.pp);
  if (layers.empty()) {
    if (m.num_layers >= chunks) return {};
    return concat("model.num_layers = ", m.num_layers, " must be >= ", count,
                  " (the even split gives every ", v > 1 ? "virtual " : "",
                  "pipeline stage a layer; parallel.pp_layers sets the split explicitly)");
  }
  const auto stages = static_cast<int64_t>(layers.size());
  if (stages != chunks)
    return concat("parallel.pp_layers = ", fmt(layers), " lists ", stages, " stages: must list one layer count per ",
                  v > 1 ? "virtual " : "", "pipeline stage, ", count);
  if (!std::all_of(layers.begin(), layers.end(), [&](int64_t n) { return n >= 0 && n <= m.num_layers; }))
    return concat("parallel.pp_layers = ", fmt(layers), ": layer counts must be in 0..model.num_layers = ",
                  m.num_layers);
  const int64_t sum = std::accumulate(layers.begin(), layers.end(), int64_t{0});
  if (sum != m.num_layers)
    return concat("parallel.pp_layers = ", fmt(layers), " sums to ", sum, ": must sum to model.num_layers = ",
                  m.num_layers);
  return {};
}

// i32 is what the kernels index with: token ids, positions, expert ids,
// routing slots and permuted rows; and a GEMM dimension (cuBLAS takes int).
constexpr int64_t kMaxI32 = std::numeric_limits<int32_t>::max();
constexpr const char* kI32Why = "the kernels index it with i32";
constexpr const char* kGemmWhy = "a GEMM dimension, which BLAS libraries take as a 32-bit int";

// Layers l >= first_dense_layers with (l - first) % layer_freq == 0
// (MoeConfig::is_moe_layer), counted without visiting each layer.
int64_t moe_layer_count(const ModelConfig& m, const MoeConfig& e) {
  const int64_t after = m.num_layers - e.first_dense_layers;
  return e.router.num_experts > 0 && after > 0 ? (after - 1) / e.layer_freq + 1 : 0;
}

// Whole-model parameters, exactly (the §4 shapes at tp = ep = etp = 1), in
// 128 bits so no configured size can wrap it.
struct ModelSize {
  unsigned __int128 dense = 0, expert = 0;  // expert: the routed experts of every MoE layer
  unsigned __int128 total() const { return dense + expert; }
};
ModelSize model_size(const ModelConfig& m, const MoeConfig& e) {
  using U = unsigned __int128;
  const U H = static_cast<U>(m.hidden_size), L = static_cast<U>(m.num_layers), V = static_cast<U>(m.vocab_size);
  const U hd = static_cast<U>(m.head_dim());
  const U attention = H * hd * static_cast<U>(2 * m.num_heads + 2 * m.num_kv_heads) + 2 * H;  // q, o, k, v + norms
  ModelSize s;
  s.dense = 2 * V * H + H;  // embedding, head, final norm
  const U moe_layers = static_cast<U>(moe_layer_count(m, e));
  const U dense_layers = L - moe_layers;
  s.dense += L * attention + dense_layers * 3 * H * static_cast<U>(m.ffn_hidden_size);
  if (moe_layers > 0) {
    const U E = static_cast<U>(e.router.num_experts), Fe = static_cast<U>(e.expert_ffn(m.ffn_hidden_size));
    s.dense += moe_layers * (E * H + 3 * H * static_cast<U>(e.shared_expert_hidden_size));
    s.expert = moe_layers * E * 3 * H * Fe;
  }
  return s;
}

std::string fmt_count(long double n) {  // 2.02e+13
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3Lg", n);
  return buf;
}

std::string fmt_bytes(long double b) {  // 3.2e+14 bytes (320.0 TB)
  char buf[64];
  const char* unit[] = {"B", "KB", "MB", "GB", "TB", "PB", "EB"};
  int u = 0;
  long double v = b;
  while (v >= 1000 && u < 6) v /= 1000, ++u;
  std::snprintf(buf, sizeof buf, "%.3Lg bytes (%.1Lf %s)", b, v, unit[u]);
  return buf;
}

// With pad_to_capacity every expert gets Megatron's capacity,
// ceil(T·k/E · cf) (moe::expert_capacity), rows of the permuted buffer,
// whose i32 row indices must address E of them. "" when they do.
std::string capacity_problem(const MoeConfig& e, int64_t tokens_per_rank) {
  const moe::RouterOptions& ro = e.router;
  const moe::CapacityOptions& cap = e.capacity;
  if (ro.num_experts == 0 || !cap.capacity_factor || !cap.pad_to_capacity) return {};
  const long double per_expert = static_cast<long double>(tokens_per_rank) * static_cast<long double>(ro.top_k) /
                                 static_cast<long double>(ro.num_experts) *
                                 static_cast<long double>(*cap.capacity_factor);
  const long double rows = std::ceil(per_expert) * static_cast<long double>(ro.num_experts);
  if (rows <= static_cast<long double>(kMaxI32)) return {};
  return concat("moe.capacity_factor = ", fmt(*cap.capacity_factor), " with moe.pad_to_capacity pads each of the ",
                ro.num_experts, " experts to ", fmt_count(std::ceil(per_expert)), " rows for ", tokens_per_rank,
                " tokens per rank: ", fmt_count(rows), " permuted rows, more than the ", kMaxI32,
                " that i32 row indices address; lower the capacity factor");
}

}  // namespace

namespace config_detail {

void validate(const Config& c, const Origins& o) {
  const Rules r(o);
  const ModelConfig& m = c.model;
  r.at_least("model.vocab_size", m.vocab_size, 2);
  r.at_most("model.vocab_size", m.vocab_size, kMaxI32, "token ids are i32");
  r.at_least("model.hidden_size", m.hidden_size, 1);
  r.at_most("model.hidden_size", m.hidden_size, kMaxI32, kGemmWhy);
  r.at_least("model.num_layers", m.num_layers, 1);
  r.at_most("model.num_layers", m.num_layers, kMaxI32, kI32Why);
  r.at_least("model.num_heads", m.num_heads, 1);
  r.at_most("model.num_heads", m.num_heads, kMaxI32, kI32Why);
  r.at_least("model.num_kv_heads", m.num_kv_heads, 1);
  r.at_most("model.num_kv_heads", m.num_kv_heads, kMaxI32, kI32Why);
  r.at_least("model.ffn_hidden_size", m.ffn_hidden_size, 1);
  r.at_most("model.ffn_hidden_size", m.ffn_hidden_size, kMaxI32, kGemmWhy);
  r.positive_fp32("model.rope_theta", m.rope_theta);
  r.positive_fp32("model.norm_eps", m.norm_eps);
  r.positive_fp32("model.init_std", m.init_std);

  const MoeConfig& e = c.moe;
  const moe::RouterOptions& ro = e.router;  // the [moe] keys of the router and capacity
  const moe::CapacityOptions& cap = e.capacity;
  r.at_least("moe.num_experts", ro.num_experts, 0);
  r.at_most("moe.num_experts", ro.num_experts, kMaxI32, "expert ids are i32");
  if (ro.num_experts > 0) r.between("moe.top_k", ro.top_k, 1, ro.num_experts);
  r.at_least("moe.ffn_hidden_size", e.ffn_hidden_size, 0);
  r.at_most("moe.ffn_hidden_size", e.ffn_hidden_size, kMaxI32, kGemmWhy);
  r.at_least("moe.first_dense_layers", e.first_dense_layers, 0);
  r.at_least("moe.layer_freq", e.layer_freq, 1);
  r.at_least("moe.shared_expert_hidden_size", e.shared_expert_hidden_size, 0);
  r.at_most("moe.shared_expert_hidden_size", e.shared_expert_hidden_size, kMaxI32, kGemmWhy);
  r.positive_fp32("moe.topk_scaling", ro.topk_scaling);
  r.at_least("moe.num_groups", ro.num_groups, 1);
  r.between("moe.group_topk", ro.group_topk, 1, ro.num_groups);
  r.non_negative_fp32("moe.aux_loss_coeff", ro.aux_loss_coeff);
  r.non_negative_fp32("moe.z_loss_coeff", ro.z_loss_coeff);
  r.non_negative_fp32("moe.bias_update_rate", e.bias_update_rate);
  if (cap.capacity_factor) {
    r.positive_fp32("moe.capacity_factor", *cap.capacity_factor);
    if (ro.num_experts > 0)
      r.need(*cap.capacity_factor <= static_cast<double>(ro.num_experts), "moe.capacity_factor", *cap.capacity_factor,
             concat("must be <= moe.num_experts = ", ro.num_experts,
                    " (from num_experts / top_k up, every expert can already take every token; more only pads)"));
  }

  const ParallelConfig& p = c.parallel;
  r.at_least("parallel.tp", p.tp, 1);
  r.at_least("parallel.cp", p.cp, 1);
  r.at_least("parallel.pp", p.pp, 1);
  r.at_least("parallel.ep", p.ep, 1);
  r.at_least("parallel.etp", p.etp, 1);
  r.at_least("parallel.virtual_stages", p.virtual_stages, 1);
  if (p.pp_schedule == PipeSchedule::interleaved)
    r.need_all(p.virtual_stages >= 2 && p.pp >= 2, {"parallel.pp_schedule", "parallel.virtual_stages", "parallel.pp"},
               concat("parallel.pp_schedule = \"interleaved\" needs parallel.pp >= 2 and parallel.virtual_stages >= 2 "
                      "(got pp = ", p.pp, ", virtual_stages = ", p.virtual_stages,
                      "); with one chunk per rank use \"1f1b\""));
  else
    r.need_all(p.virtual_stages == 1, {"parallel.virtual_stages", "parallel.pp_schedule"},
               concat("parallel.virtual_stages = ", p.virtual_stages,
                      " needs parallel.pp_schedule = \"interleaved\" (1f1b and zb-h1 run one model chunk per rank)"));
  r.between("parallel.zero_stage", p.zero_stage, 0, 3);
  check_order(r, p.order);

  const TrainingConfig& t = c.training;
  r.at_least("training.steps", t.steps, 0);
  r.at_least("training.seq_len", t.seq_len, 1);
  r.at_most("training.seq_len", t.seq_len, kMaxI32 - 1, "a sample is seq_len + 1 tokens at i32 positions");
  r.at_least("training.global_batch", t.global_batch, 1);
  r.at_least("training.micro_batch", t.micro_batch, 1);
  {
    // Tokens of a micro-batch are GEMM rows, and with top_k its routing
    // slots are i32 rows; a step's tokens and the run's samples are int64.
    int64_t tokens = 0, slots = 0, step_tokens = 0, samples = 0;
    const int64_t k = ro.num_experts > 0 ? ro.top_k : 1;
    r.need_all(checked_mul(t.micro_batch, t.seq_len, &tokens) && tokens <= kMaxI32 &&
                   checked_mul(tokens, k, &slots) && slots <= kMaxI32,
               {"training.micro_batch", "training.seq_len", "moe.top_k"},
               concat("training.micro_batch · seq_len", ro.num_experts > 0 ? " · moe.top_k" : "", " = ",
                      t.micro_batch, " · ", t.seq_len, ro.num_experts > 0 ? concat(" · ", k) : "", " must be <= ",
                      kMaxI32,
                      " (a micro-batch's tokens and routing slots are i32 rows of the kernels)"));
    r.need_all(checked_mul(t.global_batch, t.seq_len, &step_tokens) && checked_mul(t.steps, t.global_batch, &samples),
               {"training.global_batch", "training.seq_len", "training.steps"},
               concat("training.global_batch = ", t.global_batch, " with seq_len = ", t.seq_len, " and steps = ",
                      t.steps, ": the tokens of a step and the samples of the run must fit in 64-bit counts"));
  }

  const OptimizerConfig& op = c.optimizer;
  r.positive_fp32("optimizer.lr", op.lr);
  r.unit_interval("optimizer.beta1", op.beta1);
  r.unit_interval("optimizer.beta2", op.beta2);
  r.positive_fp32("optimizer.eps", op.eps);
  r.non_negative_fp32("optimizer.weight_decay", op.weight_decay);
  r.non_negative_fp32("optimizer.clip_grad", op.clip_grad);

  const LrScheduleConfig& s = c.lr_schedule;
  r.at_least("lr_schedule.warmup_steps", s.warmup_steps, 0);
  r.at_least("lr_schedule.decay_steps", s.decay_steps, 0);
  r.non_negative_fp32("lr_schedule.min_lr", s.min_lr);

  r.at_least("checkpoint.interval", c.checkpoint.interval, 0);
  r.at_least("checkpoint.keep", c.checkpoint.keep, 0);
  r.at_least("logging.interval", c.logging.interval, 1);
  r.at_least("runtime.threads", c.runtime.threads, 0);
  r.positive("runtime.collective_timeout_s", c.runtime.collective_timeout_s);
  r.need(c.runtime.collective_timeout_s <= 1e6, "runtime.collective_timeout_s", c.runtime.collective_timeout_s,
         "must be <= 1e6 s (a wait of 11 days is a hang)");
  r.positive("runtime.io_timeout_s", c.runtime.io_timeout_s);
  r.need(c.runtime.io_timeout_s <= 1e6, "runtime.io_timeout_s", c.runtime.io_timeout_s,
         "must be <= 1e6 s (a wait of 11 days is a hang)");

  // Parameters of the whole model: every one takes 16 bytes of fp32 training
  // state (param, grad, two AdamW moments), which must be countable in
  // 64-bit sizes (validate_for_machine then asks whether it fits here).
  const unsigned __int128 params = model_size(m, e).total();
  r.need_all(params <= static_cast<unsigned __int128>(INT64_MAX / 16),
             {"model.vocab_size", "model.hidden_size", "model.num_layers", "model.ffn_hidden_size", "moe.num_experts",
              "moe.ffn_hidden_size"},
             concat("the model has ", fmt_count(static_cast<long double>(params)), " parameters: their training state (16 bytes each) does not fit in 64-bit sizes; check "
                    "model.vocab_size, hidden_size, num_layers, ffn_hidden_size and moe.num_experts"));

  // Consistency between keys.
  r.need_all(m.hidden_size % m.num_heads == 0, {"model.hidden_size", "model.num_heads"},
             concat("model.hidden_size = ", m.hidden_size, " must be divisible by model.num_heads = ", m.num_heads));
  r.need_all(m.num_heads % m.num_kv_heads == 0, {"model.num_heads", "model.num_kv_heads"},
             concat("model.num_heads = ", m.num_heads, " must be divisible by model.num_kv_heads = ", m.num_kv_heads,
                    " (each kv head serves num_heads / num_kv_heads query heads)"));
  r.need_all(m.head_dim() % 2 == 0, {"model.hidden_size", "model.num_heads"},
             concat("head_dim = model.hidden_size / model.num_heads = ", m.hidden_size, " / ", m.num_heads, " = ",
                    m.head_dim(), " must be even (RoPE rotates channel pairs)"));
  r.need_all(t.global_batch % t.micro_batch == 0, {"training.global_batch", "training.micro_batch"},
             concat("training.global_batch = ", t.global_batch, " must be a multiple of training.micro_batch = ",
                    t.micro_batch));
  if (ro.num_experts > 0) {
    r.need_all(ro.num_experts % ro.num_groups == 0, {"moe.num_experts", "moe.num_groups"},
               concat("moe.num_experts = ", ro.num_experts, " must be divisible by moe.num_groups = ", ro.num_groups,
                      " (experts split into equal contiguous groups)"));
    if (ro.num_groups > 1) {
      r.need_all(ro.top_k % ro.group_topk == 0, {"moe.top_k", "moe.group_topk"},
                 concat("moe.top_k = ", ro.top_k, " must be divisible by moe.group_topk = ", ro.group_topk,
                        " (a group's score sums its top top_k / group_topk experts)"));
      const int64_t reachable = ro.group_topk * (ro.num_experts / ro.num_groups);
      r.need_all(ro.top_k <= reachable, {"moe.top_k", "moe.group_topk", "moe.num_groups", "moe.num_experts"},
                 concat("moe.top_k = ", ro.top_k, " must be <= moe.group_topk · (moe.num_experts / moe.num_groups) = ",
                        ro.group_topk, " · (", ro.num_experts, " / ", ro.num_groups, ") = ", reachable,
                        " (the experts in the kept groups)"));
    }
  }
  if (const std::string stages = stage_problem(m, c.parallel); !stages.empty())
    r.need_all(false, {"parallel.pp_layers", "parallel.pp", "model.num_layers"}, stages);
  r.need_all(!cap.pad_to_capacity || cap.capacity_factor.has_value(), {"moe.pad_to_capacity", "moe.capacity_factor"},
             "moe.pad_to_capacity = true requires moe.capacity_factor (dropless routing has no capacity to pad to)");
  r.need_all(s.min_lr <= op.lr, {"lr_schedule.min_lr", "optimizer.lr"},
             concat("lr_schedule.min_lr = ", fmt(s.min_lr), " must be <= optimizer.lr = ", fmt(op.lr)));

  r.need_all(c.checkpoint.interval == 0 || !c.checkpoint.dir.empty(), {"checkpoint.interval", "checkpoint.dir"},
             concat("checkpoint.interval = ", c.checkpoint.interval,
                    " saves checkpoints, so checkpoint.dir must name where"));
  r.need_all(c.checkpoint.load != "latest" || !c.checkpoint.dir.empty(), {"checkpoint.load", "checkpoint.dir"},
             "checkpoint.load = \"latest\" reads <checkpoint.dir>/latest, so checkpoint.dir must be set");
}

}  // namespace config_detail

void validate_for_training(const Config& cfg) {
  Origins o(cfg.source);
  for (const auto& [key, origin] : cfg.set_by) o.set(key, origin);
  // Rules of a run's own settings, not of a config read back from a
  // checkpoint (whose saving run was held to the rules of its day).
  // Megatron's (warmup < decay); decay_steps = 0 (training.steps) is left
  // free, so a short run of a long config still runs.
  const LrScheduleConfig& s = cfg.lr_schedule;
  if (s.decay_steps != 0 && s.decay_steps <= s.warmup_steps)
    ORIGAMI_USER_ERROR(o.of({"lr_schedule.decay_steps", "lr_schedule.warmup_steps"}), ": lr_schedule.decay_steps = ",
                       s.decay_steps, " must be > lr_schedule.warmup_steps = ", s.warmup_steps,
                       " (the cosine runs from the warmup's end to decay_steps; 0: training.steps)");
  if (cfg.training.steps == 0 || !cfg.data.path.empty()) return;
  ORIGAMI_USER_ERROR(o.of({"data.path", "training.steps"}), ": data.path is required to train (training.steps = ",
                     cfg.training.steps, "); set data.path, or training.steps = 0");
}

RunPlacement resolve_placement(const Config& cfg, int local_rank, int ranks_per_node) {
  const RuntimeConfig& rt = cfg.runtime;
  const int devices = cuda_device_count();
  RunPlacement out;
  const bool cuda = rt.device == RuntimeDevice::cuda || (rt.device == RuntimeDevice::auto_ && devices > 0);
  if (cuda) {
    const std::string& at = cfg.origin("runtime.device");
    if (!built_with_cuda())
      ORIGAMI_USER_ERROR(at, ": runtime.device = \"cuda\", but this origami was built without the CUDA backend "
                         "(configure with -DORIGAMI_CUDA=ON on a machine with the CUDA toolkit)");
    if (devices == 0)
      ORIGAMI_USER_ERROR(at, ": runtime.device = \"cuda\", but this process sees no CUDA device (no driver, no GPU, "
                         "or CUDA_VISIBLE_DEVICES hides them; ", cuda_unavailable_reason(), ")");
    // Local rank mod the visible devices: cuda:(local rank) when every rank
    // sees the node's GPUs, cuda:0 when a launcher gives each rank its own
    // (CUDA_VISIBLE_DEVICES per rank). Two ranks on one GPU are refused
    // where the ranks can compare their GPUs (check_one_rank_per_gpu).
    ORIGAMI_CHECK(local_rank >= 0 && local_rank < ranks_per_node, "local rank ", local_rank, " of ", ranks_per_node);
    out.device = Device::cuda(local_rank % devices);
  }
  // auto: the device's recipe, bf16 on CUDA and fp32 on the CPU (whose
  // kernels are f32: bf16 there is emulated, for checking the recipe).
  switch (rt.precision) {
    case Precision::auto_: out.precision = cuda ? Precision::bf16 : Precision::fp32; break;
    case Precision::fp32: out.precision = Precision::fp32; break;
    case Precision::bf16: out.precision = Precision::bf16; break;
  }
  return out;
}

void check_fits_host_memory(const std::string& source, std::span<const MemoryNeed> parts, const std::string& advice,
                            int ranks_per_node) {
  long double need = 0;
  std::string what;
  for (const MemoryNeed& p : parts) {
    need += p.bytes;
    what += concat(what.empty() ? "" : "; ", p.what, ": ", fmt_bytes(p.bytes));
  }
  const long double pages = static_cast<long double>(::sysconf(_SC_PHYS_PAGES));
  const long double memory = pages * static_cast<long double>(::sysconf(_SC_PAGE_SIZE));
  const int sharing = std::max(1, ranks_per_node);
  if (pages > 0 && memory > 0 && need * sharing > memory)
    ORIGAMI_USER_ERROR(source, ": needs at least ", fmt_bytes(need), " per rank (", what, "), and ", sharing,
                       " rank(s) share this machine's ", fmt_bytes(memory), " of memory; ", advice);
}

void validate_threads(const Config& cfg) {
  const int cpus = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (cfg.runtime.threads > cpus)
    ORIGAMI_USER_ERROR(cfg.origin("runtime.threads"), ": runtime.threads = ", cfg.runtime.threads, ": must be <= ",
                       cpus, ", the logical CPUs of this machine (more threads only time-slice; 0 picks max(1, ",
                       "cores / ranks on the node))");
}

void validate_for_machine(const Config& cfg, int world_size, int ranks_per_node, bool trains) {
  validate_threads(cfg);
  // The host's memory, shared by the node's ranks; or one rank's own GPU.
  const RunPlacement placement = resolve_placement(cfg, local_rank_on_this_node(), ranks_per_node);
  const bool on_gpu = !placement.device.is_host();
  const moe::RouterOptions& ro = cfg.moe.router;
  if (on_gpu && ro.num_experts > 0 && !moe_router_fits_cuda(ro.num_experts, ro.num_groups, ro.top_k))
    ORIGAMI_USER_ERROR(cfg.origin("moe.num_experts"), ": moe.num_experts = ", ro.num_experts, " (num_groups ",
                       ro.num_groups, ", top_k ", ro.top_k, ") on ", to_string(placement.device),
                       ": the CUDA router keeps a token's scores in shared memory, which holds 2·num_experts + "
                       "2·num_groups + top_k <= ", kMoeCudaRouterWords,
                       " values (about 6,000 experts); use fewer experts, or runtime.device = \"cpu\"");
  const bool bf16 = placement.precision == Precision::bf16;
  // The SIMT attention's fp32 tiles (kernels/attention.h); eval runs only the forward.
  const int64_t hd = cfg.model.head_dim();
  if (const size_t smem = on_gpu ? cuda_device_shared_memory_per_block(placement.device.index) : 0;
      smem > 0 && !attention_cuda_on_tensor_cores(bf16, hd) && attention_cuda_smem(hd, trains) > smem)
    ORIGAMI_USER_ERROR(cfg.origin_of({"model.hidden_size", "model.num_heads"}), ": head_dim = model.hidden_size / "
                       "model.num_heads = ", cfg.model.hidden_size, " / ", cfg.model.num_heads, " = ", hd, " on ",
                       to_string(placement.device), ": the CUDA attention keeps fp32 tiles of that width in shared ",
                       "memory, and a block there may use ", smem, " bytes: head_dim <= ",
                       attention_cuda_max_head_dim(smem, trains), trains ? " to train" : " for the forward",
                       " (bf16 at 64 or 128 runs on tensor cores; use more heads, or runtime.device = \"cpu\")");
  // A lower bound of the worst rank's persistent state (§6, no padding, the
  // layout's splits and shards perfectly even): dense parameters split over
  // tp·pp and sharded over dp·cp, experts split over ep·etp·pp and sharded
  // over edp, at the recipe's bytes per parameter by ZeRO stage (fp32 4+4+8;
  // bf16 2+2 with the 4-byte master sharded beside the 8 of the moments).
  const ParallelConfig& p = cfg.parallel;
  const long double W = world_size, tp = p.tp, cp = p.cp, pp = p.pp, ep = p.ep, etp = p.etp;
  const long double dp = W / (tp * cp * pp), edp = W / (etp * ep * pp);
  auto per_param = [&](long double N) -> long double {
    switch (p.zero_stage) {
      case 0: return 16;
      case 1: return bf16 ? 4 + 12 / N : 8 + 8 / N;
      case 2: return bf16 ? 2 + 14 / N : 4 + 12 / N;
      default: return 16 / N;
    }
  };
  const ModelSize size = model_size(cfg.model, cfg.moe);
  const long double dense = static_cast<long double>(size.dense), expert = static_cast<long double>(size.expert);
  const long double state = dense / (tp * pp) * per_param(dp * cp) + expert / (ep * etp * pp) * per_param(edp);
  // Activations of one micro-batch, also a lower bound: every layer of the
  // stage keeps at least its input and its normed input ([T, H] each, in the
  // data dtype), the head its fp32 logits' vocab slice ([T, V/tp]); T = the
  // rank's tokens.
  const TrainingConfig& t = cfg.training;
  const long double tokens = static_cast<long double>(t.micro_batch) * static_cast<long double>(t.seq_len) / (cp * tp);
  const long double activations =
      tokens * ((bf16 ? 2 : 4) * 2 * static_cast<long double>(cfg.model.hidden_size) *
                    static_cast<long double>(cfg.model.num_layers) / pp +
                4 * static_cast<long double>(cfg.model.vocab_size) / tp);
  const long double pages = on_gpu ? 1 : static_cast<long double>(::sysconf(_SC_PHYS_PAGES));
  const long double memory = on_gpu ? static_cast<long double>(cuda_device_memory(placement.device.index))
                                    : pages * static_cast<long double>(::sysconf(_SC_PAGE_SIZE));
  const int sharing = on_gpu ? 1 : std::max(1, ranks_per_node);
  if (pages > 0 && memory > 0 && (state + activations) * sharing > memory)
    ORIGAMI_USER_ERROR(cfg.sources(), ": the model (", fmt_count(dense + expert), " parameters) needs at least ",
                       fmt_bytes(state + activations), " per rank (training state at ZeRO stage ", p.zero_stage, ": ",
                       fmt_bytes(state), "; activations of one micro-batch: ", fmt_bytes(activations), ") on ",
                       world_size, " rank(s) (tp ", p.tp, ", cp ", p.cp, ", pp ", p.pp, ", ep ", p.ep, ", etp ", p.etp,
                       "), and ", on_gpu ? concat("its ", to_string(placement.device), " has ") : concat(sharing, " rank(s) share this machine's "), fmt_bytes(memory),
                       " of memory; check model.num_layers, hidden_size, ffn_hidden_size, vocab_size, moe.num_experts ",
                       "and training.micro_batch, seq_len, or spread the model over more ranks");
  if (!trains || pages <= 0 || memory <= 0) return;
  // The bound above passed, so the model is of a size this machine could
  // build: the plan (what the trainer itself allocates, unit by unit) is
  // affordable now. Its stage with the most memory: training state and the
  // most live at once of ZeRO working buffers, held activations, pipeline
  // buffers and a backward's transients (with recompute "full", the layer
  // it rebuilds).
  plan::PlanInput in = plan::plan_input(cfg);
  in.recipe = bf16 ? plan::Recipe::bf16 : plan::Recipe::fp32;
  const comm::Layout layout(world_size, comm::LayoutOptions{p.tp, p.cp, p.pp, p.ep, p.etp, p.order, ro.num_experts});
  const plan::LayoutPlan lp = plan::plan_layout(in, layout, plan::Machine{});
  const plan::StageMemory* worst = nullptr;
  for (const plan::StageMemory& st : lp.stages)
    if (!worst || st.total() > worst->total()) worst = &st;
  if (!worst) return;
  const long double need = static_cast<long double>(worst->total());
  auto bytes = [](int64_t b) { return fmt_bytes(static_cast<long double>(b)); };
  if (need * sharing > memory)
    ORIGAMI_USER_ERROR(cfg.sources(), ": training needs ", fmt_bytes(need), " per rank (pipeline stage ", worst->stage,
                       ": training state ", bytes(worst->state.total()), ", then ", bytes(worst->live),
                       " at the step's busiest moment: activations held for backward (up to ",
                       bytes(worst->activations), " between ops), ZeRO working buffers (up to ",
                       bytes(worst->zero.total), ")",
                       worst->rebuild > 0 ? concat(", one layer rebuilt in backward (", bytes(worst->rebuild), ")") : "",
                       " and a backward's transient buffers, as `origami plan` counts them) on ", world_size,
                       " rank(s), and ",
                       on_gpu ? concat("its ", to_string(placement.device), " has ")
                              : concat(sharing, " rank(s) share this machine's "),
                       fmt_bytes(memory), " of memory; lower training.micro_batch or seq_len",
                       t.recompute == Recompute::full ? "" : ", set training.recompute = \"full\" (activations rebuilt in backward)",
                       ", or spread the model over more ranks");
}

std::string layout_problem(const ModelConfig& m, const MoeConfig& e, const TrainingConfig& t,
                           const ParallelConfig& p, int64_t world_size) {
  // comm::Layout's rules (ARCHITECTURE.md §3) first, so a bad layout is
  // reported as such, with its numbers.
  int64_t dp = 1;
  try {
    const comm::LayoutOptions lo{p.tp, p.cp, p.pp, p.ep, p.etp, p.order, e.router.num_experts};
    dp = comm::Layout(world_size, lo).dp();
  } catch (const UserError& err) {
    // comm::Layout names the axes, as `origami groups`' flags do.
    return concat(err.what(), " (TP, CP, PP, EP, ETP: parallel.tp, cp, pp, ep, etp; num_experts: moe.num_experts)");
  }
  // Megatron's too: expert parallelism spreads experts, which a dense model has none of.
  if (p.ep > 1 && e.router.num_experts == 0)
    return concat("parallel.ep = ", p.ep, " needs moe.num_experts > 0 (a dense model has no experts to spread)");
  if (p.pp_schedule == PipeSchedule::interleaved && (p.pp < 2 || p.virtual_stages < 2))
    return concat("parallel.pp_schedule = \"interleaved\" needs parallel.pp >= 2 and parallel.virtual_stages >= 2 "
                  "(got pp = ", p.pp, ", virtual_stages = ", p.virtual_stages, ")");
  if (p.pp_schedule != PipeSchedule::interleaved && p.virtual_stages != 1)
    return concat("parallel.virtual_stages = ", p.virtual_stages, " needs parallel.pp_schedule = \"interleaved\"");
  if (std::string stages = stage_problem(m, p); !stages.empty()) return stages;
  const int64_t moe_layers = moe_layer_count(m, e);
  const bool any_moe = moe_layers > 0, any_dense = moe_layers < m.num_layers;
  if (p.ep > 1 && !any_moe)
    return concat("parallel.ep = ", p.ep, " needs a MoE layer, but moe.first_dense_layers = ", e.first_dense_layers,
                  " (with moe.layer_freq = ", e.layer_freq, ") leaves all ", m.num_layers,
                  " layers dense (a model without MoE layers has no experts to spread)");
  if (m.num_heads % p.tp != 0 || m.num_kv_heads % p.tp != 0)
    return concat("parallel.tp = ", p.tp, " must divide model.num_heads = ", m.num_heads,
                  " and model.num_kv_heads = ", m.num_kv_heads, " (heads split over tp)");
  if (any_dense && m.ffn_hidden_size % p.tp != 0)
    return concat("parallel.tp = ", p.tp, " must divide model.ffn_hidden_size = ", m.ffn_hidden_size,
                  " (the dense MLP's columns split over tp)");
  if (t.seq_len % (2 * p.cp) != 0)
    return concat("training.seq_len = ", t.seq_len, " must be a multiple of 2·parallel.cp = ", 2 * p.cp,
                  " (context parallelism cuts each sample into 2·cp chunks)");
  const int64_t cp_tokens = t.micro_batch * t.seq_len / p.cp;
  if (cp_tokens % p.tp != 0)
    return concat("training.micro_batch · seq_len / cp = ", cp_tokens, " tokens must split evenly over parallel.tp = ",
                  p.tp, " (sequence parallelism)");
  if (any_moe && p.tp * p.cp > 1 && e.router.load_balancing == moe::LoadBalancing::seq_aux_loss)
    return concat("moe.load_balancing = \"seq_aux_loss\" needs whole sequences per rank; with parallel.tp·cp = ",
                  p.tp * p.cp, " use aux_loss or global_aux_loss");
  if (any_moe && e.expert_ffn(m.ffn_hidden_size) % p.etp != 0)
    return concat("parallel.etp = ", p.etp, " must divide the expert ffn size ", e.expert_ffn(m.ffn_hidden_size),
                  " (each expert's w1/w3 rows and w2 columns split over etp)");
  if (t.global_batch % (t.micro_batch * dp) != 0)
    return concat("training.global_batch = ", t.global_batch, " must be a multiple of training.micro_batch · DP = ",
                  t.micro_batch, " · ", dp, " = ", t.micro_batch * dp, " (DP = world size / (tp·cp·pp))");
  if (const int64_t micro_batches = t.global_batch / (t.micro_batch * dp);
      p.pp_schedule == PipeSchedule::interleaved && micro_batches % p.pp != 0)
    return concat("parallel.pp_schedule = \"interleaved\": the micro-batches per step, training.global_batch / "
                  "(training.micro_batch · DP) = ", t.global_batch, " / (", t.micro_batch, " · ", dp, ") = ",
                  micro_batches, ", must be a multiple of parallel.pp = ", p.pp,
                  " (micro-batches advance through the chunks in groups of pp)");
  if (any_moe) return capacity_problem(e, cp_tokens / p.tp);
  return {};
}

std::string layout_problem(const Config& cfg, int64_t world_size) {
  return layout_problem(cfg.model, cfg.moe, cfg.training, cfg.parallel, world_size);
}

void validate_for_world(const Config& cfg, int world_size) {
  if (std::string p = layout_problem(cfg, world_size); !p.empty())
    ORIGAMI_USER_ERROR(cfg.sources(), ": on ", world_size, " rank(s): ", p);
}

}  // namespace origami

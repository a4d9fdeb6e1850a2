// Model assembly (see model.h).
#include "engine/model.h"

#include <algorithm>

#include "dense/embedding.h"
#include "kernels/elementwise.h"

namespace origami {

void ForwardStats::accumulate(const std::vector<MoeLayerRecord>& other) {
  // By layer: the chunks of an interleaved stage report different layers.
  for (const MoeLayerRecord& o : other) {
    auto it = std::lower_bound(moe.begin(), moe.end(), o.layer,
                               [](const MoeLayerRecord& r, int64_t l) { return r.layer < l; });
    if (it == moe.end() || it->layer != o.layer) {
      moe.insert(it, o);
      continue;
    }
    MoeLayerRecord& r = *it;
    ORIGAMI_CHECK(r.routed_per_expert.size() == o.routed_per_expert.size() &&
                      r.tokens_per_ep_rank.size() == o.tokens_per_ep_rank.size(),
                  "MoE statistics of layer ", o.layer, " from different models");
    for (size_t e = 0; e < r.routed_per_expert.size(); ++e) {
      r.routed_per_expert[e] += o.routed_per_expert[e];
      r.kept_per_expert[e] += o.kept_per_expert[e];
    }
    for (size_t k = 0; k < r.tokens_per_ep_rank.size(); ++k) r.tokens_per_ep_rank[k] += o.tokens_per_ep_rank[k];
    r.aux_loss += o.aux_loss;
    r.z_loss += o.z_loss;
  }
}

double ForwardStats::aux_loss() const {
  double s = 0;
  for (const MoeLayerRecord& r : moe) s += r.aux_loss;
  return s;
}

double ForwardStats::z_loss() const {
  double s = 0;
  for (const MoeLayerRecord& r : moe) s += r.z_loss;
  return s;
}

Model::Model(const ExecContext& ctx, const ModelConfig& cfg, uint64_t seed, const MoeConfig& moe_cfg,
             const ModelPlacement& placement)
    : ctx_(&ctx), cfg_(cfg), moe_cfg_(moe_cfg), units_(cfg, moe_cfg) {
  const comm::Groups* groups = placement.groups;
  const int64_t E = moe_cfg.router.num_experts;
  attn_opt_ = dense::AttentionOptions{cfg.num_heads, cfg.num_kv_heads, cfg.head_dim(),
                                      static_cast<float>(cfg.rope_theta)};
  moe_opt_.router = moe_cfg.router;  // the structs the config parsed, whole (moe/options.h)
  moe_opt_.capacity = moe_cfg.capacity;

  // Expert ownership and the MoE layers' groups (size-1 groups are left out:
  // no communication on one rank).
  auto group = [&](comm::GroupKind k) { return comm::multi_rank(groups, k); };
  if (E > 0) {
    local_experts_ = E / comm::group_size(group(comm::GroupKind::ep));
    const bool global = moe_cfg.router.load_balancing == moe::LoadBalancing::global_aux_loss;
    if (comm::Communicator* c = group(global ? comm::GroupKind::tp_dp_cp : comm::GroupKind::tp_cp))
      reduce_stats_ = [c](const Tensor& stats_N) { c->all_reduce(stats_N); };
  }
  // Tensor and context parallel groups; this rank's heads (dense/tensor_parallel.h).
  tp_ = group(comm::GroupKind::tp);
  cp_ = group(comm::GroupKind::cp);
  local_attn_opt_ = dense::tp_attention_shard(attn_opt_, tp_).local;
  stage_ = pipeline_stage(cfg.num_layers, groups ? groups->layout().pp() : 1, groups ? groups->coords().pp : 0,
                          placement.pp_layers, placement.virtual_stages);
  // A dispatcher per MoE layer of the stage, with the layer's placement for
  // this layout's EP size (the unit table below places the experts' weights
  // by the same rule: ExpertPlacements::find).
  dispatchers_.resize(cfg.num_layers);
  for (int64_t l = 0; l < cfg.num_layers; ++l)
    if (stage_.owns_layer(l) && moe_cfg.is_moe_layer(l)) {
      comm::Communicator* ep = group(comm::GroupKind::ep);
      dispatchers_[l] = std::make_unique<moe::AllToAllDispatcher>(
          ctx, E, ep, group(comm::GroupKind::etp), moe_cfg.expert_placement.of_layer(l, E, comm::group_size(ep)));
    }

  // This rank's part of every unit of its stage, as the unit table cuts it.
  const comm::Layout one_rank = single_rank_layout(moe_cfg);
  params_.add_units(units_, groups ? groups->layout() : one_rank, groups ? groups->coords() : comm::RankCoords{},
                    stage_);
  params_.allocate(ctx.device(), ctx.data_dtype(), zero_shard_plan(placement.zero_stage, groups));
  params_.initialize(ctx, seed, static_cast<float>(cfg.init_std), cfg.num_layers);
  layer_unit_.assign(cfg.num_layers, 0);
  expert_unit_.assign(cfg.num_layers, 0);
  for (size_t i = 0; i < params_.units().size(); ++i) {
    const std::string& n = params_.units()[i].name;
    if (n == "embedding") embedding_unit_ = i;
    if (n == "final") final_unit_ = i;
    if (n.rfind("layers.", 0) == 0) {
      const int64_t l = std::stoll(n.substr(7));
      (params_.units()[i].expert ? expert_unit_ : layer_unit_)[l] = i;
    }
  }

  if (stage_.first()) embedding_ = params_.ref("model.embed_tokens.weight");
  if (stage_.last()) final_norm_ = params_.ref("model.norm.weight"), head_ = params_.ref("lm_head.weight");
  layer_refs_.resize(cfg.num_layers);
  for (int64_t l = 0; l < cfg.num_layers; ++l)
    if (stage_.owns_layer(l)) layer_refs_[l] = resolve_layer(l);

  expert_bias_.resize(cfg.num_layers);
  if (moe_cfg.expert_bias)
    for (int64_t l = 0; l < cfg.num_layers; ++l)
      if (stage_.owns_layer(l) && moe_cfg.is_moe_layer(l)) expert_bias_[l] = ctx.zeros({E}, DType::f32, MemCategory::param);
}

Model::LayerRefs Model::resolve_layer(int64_t l) const {
  auto ref = [&](const char* n) { return params_.ref(layer_param_name(l, n)); };
  LayerRefs r;
  r.attn_norm = ref("input_layernorm.weight");
  r.q = ref("self_attn.q_proj.weight");
  r.k = ref("self_attn.k_proj.weight");
  r.v = ref("self_attn.v_proj.weight");
  r.o = ref("self_attn.o_proj.weight");
  r.mlp_norm = ref("post_attention_layernorm.weight");
  if (!moe_cfg_.is_moe_layer(l)) {
    r.gate = ref("mlp.gate_proj.weight");
    r.up = ref("mlp.up_proj.weight");
    r.down = ref("mlp.down_proj.weight");
    return r;
  }
  r.router = ref("block_sparse_moe.gate.weight");
  r.dispatcher = dispatchers_[l].get();
  // The layer's experts are one [El, ...] block per weight from the first
  // one's offset (units.h: held experts in ascending id, the dispatcher's
  // local order), whichever experts the placement gave this rank.
  const std::vector<int64_t> mine = r.dispatcher->local_experts();
  ORIGAMI_CHECK(static_cast<int64_t>(mine.size()) == local_experts_, "layer ", l, ": ", mine.size(),
                " local experts, expected ", local_experts_);
  for (const char* w : {"w1", "w3", "w2"}) {
    const ParamRef first = params_.ref(expert_param_name(l, mine.front(), w));
    const int64_t offset = params_.units()[first.unit].params[first.index].offset;
    for (size_t j = 0; j < mine.size(); ++j) {
      const ParamRef p = params_.ref(expert_param_name(l, mine[j], w));
      const ParamInfo& info = params_.units()[p.unit].params[p.index];
      ORIGAMI_CHECK(p.unit == first.unit && info.offset == offset + static_cast<int64_t>(j) * info.numel(), "layer ", l,
                    ": expert ", mine[j], " ", w, " is not local expert ", j, " of the unit's block");
    }
  }
  r.w1 = params_.ref(expert_param_name(l, mine.front(), "w1"));
  r.w3 = params_.ref(expert_param_name(l, mine.front(), "w3"));
  r.w2 = params_.ref(expert_param_name(l, mine.front(), "w2"));
  if (moe_cfg_.shared_expert_hidden_size > 0) {
    r.shared_gate = ref("block_sparse_moe.shared_expert.gate_proj.weight");
    r.shared_up = ref("block_sparse_moe.shared_expert.up_proj.weight");
    r.shared_down = ref("block_sparse_moe.shared_expert.down_proj.weight");
  }
  return r;
}

Model::LayerWeights Model::layer_views(int64_t l, bool grads) const {
  ORIGAMI_CHECK(stage_.owns_layer(l), "layer ", l, " is not on this pipeline rank");
  const LayerRefs& r = layer_refs_[l];
  auto get = [&](ParamRef p) { return grads ? params_.grad(p) : params_.param(p); };
  LayerWeights w;
  w.attn_norm = get(r.attn_norm);
  w.attn = {get(r.q), get(r.k), get(r.v), get(r.o)};
  w.mlp_norm = get(r.mlp_norm);
  if (!moe_cfg_.is_moe_layer(l)) {
    w.mlp = {get(r.gate), get(r.up), get(r.down)};
    return w;
  }
  const int64_t El = local_experts_, D = cfg_.hidden_size;
  const int64_t Fl = moe_cfg_.expert_ffn(cfg_.ffn_hidden_size) / r.dispatcher->etp_size();
  w.moe.gate_ED = get(r.router);
  if (!grads) w.moe.bias_E = expert_bias_[l];
  // The local experts' tensors of one kind sit back to back in the unit: one
  // [El, ...] view from the first one's offset.
  auto block = [&](ParamRef p, Shape shape) {
    const ParamUnit& unit = params_.units()[p.unit];
    const int64_t n = shape_numel(shape);
    return (grads ? unit.grad : unit.param).flat_view(unit.params[p.index].offset, n, std::move(shape));
  };
  w.moe.experts = {block(r.w1, {El, Fl, D}), block(r.w3, {El, Fl, D}), block(r.w2, {El, D, Fl})};
  if (const int64_t Fs = moe_cfg_.shared_expert_hidden_size; Fs > 0)
    w.moe.shared = {get(r.shared_gate).view({1, Fs, D}), get(r.shared_up).view({1, Fs, D}),
                    get(r.shared_down).view({1, D, Fs})};
  return w;
}

std::vector<int64_t> Model::local_experts(int64_t l) const {
  ORIGAMI_CHECK(stage_.owns_layer(l) && dispatchers_[l], "layer ", l, " is not a MoE layer of this stage");
  return dispatchers_[l]->local_experts();
}

int64_t Model::active_matmul_params() const { return units_.counts().matmul_active; }

StepFlops Model::training_flops(int64_t batch, int64_t seq_len) const {
  StepFlops f;
  const double tokens = static_cast<double>(batch) * static_cast<double>(seq_len);
  f.matmul = 6.0 * static_cast<double>(active_matmul_params()) * tokens;
  const double pairs = static_cast<double>(seq_len) * static_cast<double>(seq_len + 1) / 2.0;
  f.attention = 3.0 * 4.0 * static_cast<double>(batch * cfg_.num_heads * cfg_.head_dim()) * pairs *
                static_cast<double>(cfg_.num_layers);
  return f;
}

void Model::update_expert_bias(const std::vector<MoeLayerRecord>& loads) {
  if (!moe_cfg_.expert_bias) return;
  for (const MoeLayerRecord& r : loads)
    if (stage_.owns_layer(r.layer))
      moe::update_expert_bias(*ctx_, expert_bias_[r.layer], r.routed_per_expert,
                              static_cast<float>(moe_cfg_.bias_update_rate));
}

namespace {
// Hook calls that are no-ops without hooks.
struct Hooks {
  UnitHooks* h;
  void before_forward(size_t u) const { if (h) h->before_forward(u); }
  void after_forward(size_t u) const { if (h) h->after_forward(u); }
  void before_backward(size_t u, WeightGrads g) const { if (h) h->before_backward(u, g); }
  void after_backward(size_t u, WeightGrads g) const { if (h) h->after_backward(u, g); }
  void before_weight(size_t u) const { if (h) h->before_weight(u); }
  void after_weight(size_t u) const { if (h) h->after_weight(u); }
};
}  // namespace

Tensor Model::layer_forward(int64_t l, const Tensor& h_in, int64_t B, int64_t S, const dense::CpPositions& pos_S,
                            LayerSaved& ls, MoeLayerRecord* record) const {
  const ExecContext& ctx = *ctx_;
  const float eps = static_cast<float>(cfg_.norm_eps);
  LayerWeights w = layer_views(l, /*grads=*/false);
  Tensor a = dense::rmsnorm_module_forward(ctx, h_in, w.attn_norm, eps, ls.attn_norm);
  // Sequence parallel: gather the tp shards, attend over the local heads
  // (K/V gathered or passed around the cp ring inside), sum the head partials back onto shards.
  const Tensor a_all = dense::tp_all_gather_tokens(a, tp_);  // (T, D)
  Tensor h = dense::tp_reduce_scatter_tokens(
      dense::cp_attention_forward(ctx, local_attn_opt_, w.attn, a_all, B, pos_S, cp_, cp_comm_, ls.attn),
      tp_);  // (T/tp, D)
  add_inplace(ctx, h, h_in);  // residual: h is fresh, h_in stays saved by the norm
  Tensor m = dense::rmsnorm_module_forward(ctx, h, w.mlp_norm, eps, ls.mlp_norm);
  Tensor z;
  if (moe_cfg_.is_moe_layer(l)) {
    moe::MoeLayerStats st;
    z = moe::moe_layer_forward(ctx, moe_opt_, w.moe, m, S, ls.moe, st, reduce_stats_, dispatchers_[l].get());
    if (record)
      *record = {l, st.routed_per_expert, st.kept_per_expert, st.tokens_per_ep_rank, st.losses.aux_loss,
                 st.losses.z_loss};
  } else {
    z = dense::tp_mlp_forward(ctx, w.mlp, m, tp_, ls.mlp);
  }
  add_inplace(ctx, z, h);
  return z;  // the views in w die here, before the caller may free the units
}

namespace {
// dh += dx. Deferred, the sum goes into dx's buffer instead (the same bits:
// the one addition commutes), since pending weight-gradient calls may keep dh.
void add_residual(const ExecContext& ctx, Tensor& dh, Tensor dx, bool deferred) {
  if (!deferred) return add_inplace(ctx, dh, dx);
  add_inplace(ctx, dx, dh);
  dh = std::move(dx);
}
}  // namespace

void Model::layer_backward(int64_t l, Tensor& dh, LayerSaved& ls, LayerWeights& g, WeightGradQueue* q,
                           float aux_scale, bool deferred) const {
  const ExecContext& ctx = *ctx_;
  LayerWeights w = layer_views(l, /*grads=*/false);
  Tensor dm = moe_cfg_.is_moe_layer(l)
                  ? moe::moe_layer_backward(ctx, moe_opt_, w.moe, ls.moe, dh, aux_scale, g.moe, dispatchers_[l].get(), q)
                  : dense::tp_mlp_backward(ctx, w.mlp, ls.mlp, dh, tp_, g.mlp, q);
  add_residual(ctx, dh, dense::rmsnorm_module_backward(ctx, dm, w.mlp_norm, ls.mlp_norm, g.mlp_norm, q), deferred);
  Tensor da = dense::tp_reduce_scatter_tokens(
      dense::cp_attention_backward(ctx, local_attn_opt_, w.attn, ls.attn, dense::tp_all_gather_tokens(dh, tp_), cp_,
                                   g.attn, q),
      tp_);
  add_residual(ctx, dh, dense::rmsnorm_module_backward(ctx, da, w.attn_norm, ls.attn_norm, g.attn_norm, q), deferred);
}  // the views in w die here, before the caller may free the units

Shape Model::boundary_shape(int64_t batch, int64_t seq_len) const {
  const int64_t cp = comm::group_size(cp_), tp = comm::group_size(tp_);
  return {batch * seq_len / cp / tp, cfg_.hidden_size};
}

void Model::forward(StageIO& io, ModelSaved& saved) const {
  const ExecContext& ctx = *ctx_;
  const Hooks hooks{io.hooks};
  const Tensor& tokens_BS1 = io.tokens_BS1;
  ORIGAMI_CHECK(tokens_BS1.defined() && tokens_BS1.dim() == 2, "forward: tokens must be [B, S+1]");
  const int64_t B = tokens_BS1.size(0), S = tokens_BS1.size(1) - 1, V = cfg_.vocab_size;
  const float eps = static_cast<float>(cfg_.norm_eps);
  // This cp rank's tokens of each window (all of them when cp = 1): inputs,
  // shifted targets and their global positions. Replicated over tp; the
  // residual stream below is the tp rank's shard of these rows.
  dense::CpTokens own = dense::cp_shard_tokens(ctx, tokens_BS1, comm::group_size(cp_), comm::group_rank(cp_));
  saved.pos_S = own.pos_S;
  saved.batch = B;
  saved.seq_len = S;
  ORIGAMI_CHECK(io.chunk >= 0 && io.chunk < stage_.virtual_stages(), "forward of chunk ", io.chunk, " of ",
                stage_.virtual_stages());
  saved.chunk = io.chunk;
  // The ids only where the embedding's backward reads them again (the plan
  // counts them there alone): another chunk's forward drops them here.
  if (stage_.first_chunk(io.chunk)) saved.ids_T = own.ids_T;
  const LayerRange layers = stage_.chunks[static_cast<size_t>(io.chunk)];

  Tensor h;  // (T/tp, D)
  if (stage_.first_chunk(io.chunk)) {
    hooks.before_forward(embedding_unit_);
    h = dense::tp_embedding_forward(ctx, own.ids_T, params_.param(embedding_), V, tp_);
    hooks.after_forward(embedding_unit_);
  } else {
    ORIGAMI_CHECK(io.h_in.defined() && io.h_in.shape() == boundary_shape(B, S), "stage ", stage_.index,
                  ": input of shape ", io.h_in.defined() ? shape_string(io.h_in.shape()) : "(none)", ", expected ",
                  shape_string(boundary_shape(B, S)));
    h = io.h_in;
  }
  std::vector<MoeLayerRecord> records;
  saved.layers.assign(layers.end_layer - layers.first_layer, LayerSaved{});
  for (int64_t l = layers.first_layer; l < layers.end_layer; ++l) {
    const bool is_moe = moe_cfg_.is_moe_layer(l);
    hooks.before_forward(layer_unit_[l]);
    if (is_moe) hooks.before_forward(expert_unit_[l]);
    LayerSaved& ls = saved.layers[l - layers.first_layer];
    MoeLayerRecord record;
    if (recompute_ == Recompute::full) {
      LayerSaved discarded;  // rebuilt by the layer's backward
      ls.input = h;
      h = layer_forward(l, h, B, S, saved.pos_S, discarded, &record);
    } else {
      h = layer_forward(l, h, B, S, saved.pos_S, ls, &record);
    }
    if (is_moe) records.push_back(std::move(record));
    hooks.after_forward(layer_unit_[l]);
    if (is_moe) hooks.after_forward(expert_unit_[l]);
  }
  if (io.stats) io.stats->accumulate(records);
  if (!stage_.last_chunk(io.chunk)) {
    io.h_out = h;
    return;
  }
  hooks.before_forward(final_unit_);
  Tensor y = dense::rmsnorm_module_forward(ctx, h, params_.param(final_norm_), eps, saved.final_norm);
  const Tensor losses_T = dense::tp_lm_head_losses(ctx, params_.param(head_), V, y, own.targets_T, tp_, saved.head);
  if (!io.loss_sum.defined()) io.loss_sum = ctx.zeros({1}, DType::f64, MemCategory::workspace);
  sum_add(ctx, losses_T, io.loss_sum);
  hooks.after_forward(final_unit_);
}

double Model::forward(const Tensor& tokens_BS1, ModelSaved& saved, ForwardStats* stats) const {
  ORIGAMI_CHECK(stage_.count == 1 && stage_.virtual_stages() == 1, "forward(tokens, saved) runs the whole model; stage ",
                stage_.index, " of ", stage_.count, " needs forward(StageIO&)");
  StageIO io;
  io.tokens_BS1 = tokens_BS1;
  io.stats = stats;
  forward(io, saved);
  return ctx_->read_later(io.loss_sum).scalar_f64();
}



void Model::backward(StageGradIO& io, ModelSaved& saved) {
  const ExecContext& ctx = *ctx_;
  const Hooks hooks{io.hooks};
  const float aux_scale = io.aux_scale;
  // Deferred: each unit's weight-gradient calls go to a step of the pass, into
  // the step's views, unbound until weight_backward (kernels/deferred.h).
  WeightPass* const pass = io.defer;
  ORIGAMI_CHECK(!pass || pass->empty(), "backward: the WeightPass given still holds another micro-batch's work");
  const WeightGrads when = pass ? WeightGrads::deferred : WeightGrads::fused;
  Tensor dh;
  const int64_t chunk = saved.chunk;
  const LayerRange layers = stage_.chunks[static_cast<size_t>(chunk)];
  if (stage_.last_chunk(chunk)) {
    hooks.before_backward(final_unit_, when);
    WeightPass::Step* st = pass ? &pass->add(WeightPass::Kind::final, -1, {final_unit_}) : nullptr;
    Tensor fused_norm, fused_head;
    if (!st) fused_norm = params_.grad(final_norm_), fused_head = params_.grad(head_);
    Tensor& dnorm_w = st ? st->norm : fused_norm;
    Tensor& dhead_w = st ? st->matrix : fused_head;
    WeightGradQueue* q = st ? &st->queue : nullptr;
    Tensor dy =
        dense::tp_lm_head_backward(ctx, params_.param(head_), saved.head, io.lm_grad_scale, tp_, dhead_w, q);
    dh = dense::rmsnorm_module_backward(ctx, dy, params_.param(final_norm_), saved.final_norm, dnorm_w, q);
    hooks.after_backward(final_unit_, when);
  } else {
    ORIGAMI_CHECK(io.dh_out.defined() && io.dh_out.shape() == boundary_shape(saved.batch, saved.seq_len), "stage ",
                  stage_.index, ": output gradient of the wrong shape");
    dh = std::move(io.dh_out);  // accumulated into below: the caller hands it over
  }
  for (int64_t l = layers.end_layer - 1; l >= layers.first_layer; --l) {
    const bool is_moe = moe_cfg_.is_moe_layer(l);
    if (is_moe) hooks.before_backward(expert_unit_[l], when);
    hooks.before_backward(layer_unit_[l], when);
    LayerSaved& ls = saved.layers[l - layers.first_layer];
    if (recompute_ == Recompute::full) {  // rebuild this layer's activations from its input
      const Tensor input = ls.input;
      ls = LayerSaved{};
      layer_forward(l, input, saved.batch, saved.seq_len, saved.pos_S, ls, nullptr);
    }
    WeightPass::Step* st = nullptr;
    if (pass) {  // the step opens the units in the order the hooks opened them here
      std::vector<size_t> units{layer_unit_[l]};
      if (is_moe) units.insert(units.begin(), expert_unit_[l]);
      st = &pass->add(WeightPass::Kind::layer, l, std::move(units));
    }
    LayerWeights fused_grads;
    if (!st) fused_grads = layer_views(l, /*grads=*/true);
    layer_backward(l, dh, ls, st ? st->layer_grads : fused_grads, st ? &st->queue : nullptr, aux_scale,
                   pass != nullptr);
    ls = LayerSaved{};  // free this layer's activations as soon as they are consumed
    fused_grads = LayerWeights{};
    if (is_moe) hooks.after_backward(expert_unit_[l], when);
    hooks.after_backward(layer_unit_[l], when);
  }
  if (stage_.first_chunk(chunk)) {
    hooks.before_backward(embedding_unit_, when);
    WeightPass::Step* st = pass ? &pass->add(WeightPass::Kind::embedding, -1, {embedding_unit_}) : nullptr;
    Tensor fused_emb;
    if (!st) fused_emb = params_.grad(embedding_);
    Tensor& demb = st ? st->matrix : fused_emb;
    dense::tp_embedding_backward(ctx, saved.ids_T, dh, cfg_.vocab_size, tp_, demb, st ? &st->queue : nullptr);
    hooks.after_backward(embedding_unit_, when);
    dh = Tensor();
  }
  saved = ModelSaved{};
  io.dh_in = std::move(dh);
}

WeightPass::Step& WeightPass::add(Kind kind, int64_t layer, std::vector<size_t> units) {
  steps_.push_back(std::make_unique<Step>());
  Step& s = *steps_.back();
  s.kind = kind;
  s.layer = layer;
  s.units = std::move(units);
  return s;
}

std::vector<size_t> WeightPass::units() const {
  std::vector<size_t> out;
  for (const std::unique_ptr<Step>& s : steps_) out.insert(out.end(), s->units.begin(), s->units.end());
  return out;
}

void Model::weight_backward(WeightPass& pass, UnitHooks* hooks_in) {
  const Hooks hooks{hooks_in};
  for (std::unique_ptr<WeightPass::Step>& st : pass.steps_) {
    for (size_t u : st->units) hooks.before_weight(u);
    // The destinations exist now (ZeRO 2-3: before_weight allocated them): bind them.
    switch (st->kind) {
      case WeightPass::Kind::final:
        st->norm = params_.grad(final_norm_);
        st->matrix = params_.grad(head_);
        break;
      case WeightPass::Kind::layer: st->layer_grads = layer_views(st->layer, /*grads=*/true); break;
      case WeightPass::Kind::embedding: st->matrix = params_.grad(embedding_); break;
    }
    st->queue.run(*ctx_);
    const std::vector<size_t> units = std::move(st->units);
    st.reset();  // the views die before the units close (the operands went with the calls)
    for (size_t u : units) hooks.after_weight(u);
  }
  pass.steps_.clear();
}

void Model::backward(ModelSaved& saved, float lm_grad_scale, float aux_scale) {
  ORIGAMI_CHECK(stage_.count == 1 && stage_.virtual_stages() == 1, "backward(saved, ...) runs the whole model; stage ",
                stage_.index, " of ", stage_.count, " needs backward(StageGradIO&)");
  StageGradIO io;
  io.lm_grad_scale = lm_grad_scale;
  io.aux_scale = aux_scale;
  backward(io, saved);
}

}  // namespace origami

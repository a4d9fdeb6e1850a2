// The table of parameter units (see units.h).
#include "engine/units.h"

#include <algorithm>

#include "dense/tensor_parallel.h"
#include "kernels/check.h"

namespace origami {

std::string layer_param_name(int64_t layer, std::string_view suffix) {
  return "model.layers." + std::to_string(layer) + "." + std::string(suffix);
}

std::string expert_param_name(int64_t layer, int64_t expert, std::string_view w) {
  return layer_param_name(layer, "block_sparse_moe.experts." + std::to_string(expert) + "." + std::string(w) +
                                     ".weight");
}

std::string expert_bias_name(int64_t layer) { return layer_param_name(layer, "block_sparse_moe.expert_bias"); }

comm::Layout single_rank_layout(const MoeConfig& moe) {
  return comm::Layout(1, comm::LayoutOptions{1, 1, 1, 1, 1, "tp-cp-ep-dp-pp", moe.router.num_experts});
}

int64_t UnitSpec::zero_group_size(const comm::Layout& layout) const {
  return expert ? layout.edp() : layout.dp() * layout.cp();
}

bool UnitSpec::on_stage(const PipelineStage& stage) const {
  switch (place) {
    case UnitPlace::first_stage: return stage.first();
    case UnitPlace::last_stage: return stage.last();
    case UnitPlace::layer: return stage.owns_layer(layer);
  }
  return false;
}

int64_t UnitSpec::stage(const std::vector<int64_t>& stage_layers, int64_t pp) const {
  ORIGAMI_CHECK(!stage_layers.empty() && pp >= 1 && static_cast<int64_t>(stage_layers.size()) % pp == 0, "unit ", name,
                ": ", stage_layers.size(), " virtual stages on ", pp, " pipeline ranks");
  const auto last = static_cast<int64_t>(stage_layers.size()) - 1;
  if (place != UnitPlace::layer) return place == UnitPlace::first_stage ? 0 : last % pp;
  int64_t end = 0;
  for (int64_t s = 0; s <= last; ++s)
    if (layer < (end += stage_layers[static_cast<size_t>(s)])) return s % pp;
  ORIGAMI_CHECK(false, "unit ", name, ": layer ", layer, " beyond the stages' ", end, " layers");
  return last;
}

namespace {

// Tensor constructors by shard rule.
TensorSpec whole(std::string name, Shape shape, InitKind init, bool matmul) {
  return {std::move(name), std::move(shape), init, ShardRule::whole, -1, 1, -1, matmul};
}
TensorSpec tp_split(std::string name, Shape shape, InitKind init, int dim, int64_t block) {
  return {std::move(name), std::move(shape), init, ShardRule::tp_even, dim, block, -1, true};
}

}  // namespace

UnitTable::UnitTable(const ModelConfig& m, const MoeConfig& e)
    : num_experts_(e.router.num_experts), top_k_(e.router.top_k), placements_(e.expert_placement) {
  const int64_t D = m.hidden_size, V = m.vocab_size, F = m.ffn_hidden_size, hd = m.head_dim();
  const int64_t Hq = m.num_heads, Hkv = m.num_kv_heads;
  const int64_t E = e.router.num_experts, Fe = e.expert_ffn(F), Fs = e.shared_expert_hidden_size;
  using enum InitKind;

  // Vocab-parallel embedding: a lookup, not a matmul.
  units_.push_back({"embedding", false, UnitPlace::first_stage, -1,
                    {{"model.embed_tokens.weight", {V, D}, normal, ShardRule::tp_vocab, 0, 1, -1, false}}});
  for (int64_t l = 0; l < m.num_layers; ++l) {
    auto name = [l](std::string_view suffix) { return layer_param_name(l, suffix); };
    UnitSpec u{"layers." + std::to_string(l), false, UnitPlace::layer, l, {}};
    // Norms replicated over tp; q/k/v split by heads (rows), o by heads (columns).
    u.tensors = {whole(name("input_layernorm.weight"), {D}, ones, false),
                 tp_split(name("self_attn.q_proj.weight"), {Hq * hd, D}, normal, 0, hd),
                 tp_split(name("self_attn.k_proj.weight"), {Hkv * hd, D}, normal, 0, hd),
                 tp_split(name("self_attn.v_proj.weight"), {Hkv * hd, D}, normal, 0, hd),
                 tp_split(name("self_attn.o_proj.weight"), {D, Hq * hd}, normal_scaled_output, 1, hd),
                 whole(name("post_attention_layernorm.weight"), {D}, ones, false)};
    if (!e.is_moe_layer(l)) {
      // Dense SwiGLU: gate/up column-parallel (rows of F), down row-parallel (columns).
      u.tensors.push_back(tp_split(name("mlp.gate_proj.weight"), {F, D}, normal, 0, 1));
      u.tensors.push_back(tp_split(name("mlp.up_proj.weight"), {F, D}, normal, 0, 1));
      u.tensors.push_back(tp_split(name("mlp.down_proj.weight"), {D, F}, normal_scaled_output, 1, 1));
      units_.push_back(std::move(u));
      continue;
    }
    // The router and the shared expert run whole on each tp rank's own tokens.
    u.tensors.push_back(whole(name("block_sparse_moe.gate.weight"), {E, D}, normal, true));
    if (Fs > 0) {
      u.tensors.push_back(whole(name("block_sparse_moe.shared_expert.gate_proj.weight"), {Fs, D}, normal, true));
      u.tensors.push_back(whole(name("block_sparse_moe.shared_expert.up_proj.weight"), {Fs, D}, normal, true));
      u.tensors.push_back(
          whole(name("block_sparse_moe.shared_expert.down_proj.weight"), {D, Fs}, normal_scaled_output, true));
    }
    units_.push_back(std::move(u));
    // Routed experts: their own unit (reduced and sharded over edp). All w1,
    // then all w3, then all w2, each in expert order, so a rank's local
    // experts of each weight (its held ones, ascending under any placement)
    // form one [E/EP, ...] block of its buffer; F split over etp (w1/w3
    // rows, w2 columns).
    UnitSpec x{"layers." + std::to_string(l) + ".experts", true, UnitPlace::layer, l, {}};
    x.tensors.reserve(static_cast<size_t>(3 * E));
    for (int64_t j = 0; j < E; ++j)
      x.tensors.push_back({expert_param_name(l, j, "w1"), {Fe, D}, normal, ShardRule::etp_even, 0, 1, j, true, l});
    for (int64_t j = 0; j < E; ++j)
      x.tensors.push_back({expert_param_name(l, j, "w3"), {Fe, D}, normal, ShardRule::etp_even, 0, 1, j, true, l});
    for (int64_t j = 0; j < E; ++j)
      x.tensors.push_back(
          {expert_param_name(l, j, "w2"), {D, Fe}, normal_scaled_output, ShardRule::etp_even, 1, 1, j, true, l});
    units_.push_back(std::move(x));
  }
  // Final norm replicated; vocab-parallel head.
  units_.push_back({"final", false, UnitPlace::last_stage, -1,
                    {whole("model.norm.weight", {D}, ones, false),
                     {"lm_head.weight", {V, D}, normal, ShardRule::tp_vocab, 0, 1, -1, true}}});

  for (size_t u = 0; u < units_.size(); ++u)
    for (size_t i = 0; i < units_[u].tensors.size(); ++i) {
      units_[u].numel += units_[u].tensors[i].numel();
      const bool fresh = index_.emplace(units_[u].tensors[i].name, std::make_pair(u, i)).second;
      ORIGAMI_CHECK(fresh, "parameter ", units_[u].tensors[i].name, " listed twice");
    }
}

std::pair<size_t, size_t> UnitTable::find(const std::string& name) const {
  auto it = index_.find(name);
  ORIGAMI_CHECK(it != index_.end(), "no parameter named ", name);
  return it->second;
}

const TensorSpec& UnitTable::tensor(const std::string& name) const {
  auto [u, i] = find(name);
  return units_[u].tensors[i];
}

ParamCounts UnitTable::counts() const {
  ParamCounts c;
  for (const UnitSpec& u : units_) {
    const int64_t n = u.numel;
    c.total += n;
    if (u.expert) {
      // E experts of equal size per weight: a token multiplies top_k of them.
      const int64_t active = n / num_experts_ * top_k_;
      c.expert += n;
      c.active += active;
      c.matmul_active += active;
      continue;
    }
    c.active += n;
    for (const TensorSpec& t : u.tensors)
      if (t.matmul) c.matmul_active += t.numel();
  }
  return c;
}

bool UnitTable::holds(const TensorSpec& t, const comm::Layout& layout, const comm::RankCoords& coords) const {
  if (t.expert < 0) return true;
  ORIGAMI_CHECK(num_experts_ % layout.ep() == 0, "moe.num_experts = ", num_experts_, " does not split over ep ",
                layout.ep());
  if (const moe::ExpertPlacement* p = placements_.find(t.layer, layout.ep())) return p->owner(t.expert) == coords.ep;
  return moe::ExpertPlacement::contiguous(num_experts_, layout.ep()).owner(t.expert) == coords.ep;
}

UnitTable::Cut UnitTable::cut(const TensorSpec& t, const comm::Layout& layout,
                              const comm::RankCoords& coords) const {
  Cut c;
  if (!holds(t, layout, coords)) return c;
  c.held = true;
  int64_t parts = 1, index = 0;
  switch (t.rule) {
    case ShardRule::whole: return c;
    case ShardRule::tp_even:
    case ShardRule::tp_vocab: parts = layout.tp(), index = coords.tp; break;
    case ShardRule::etp_even: parts = layout.etp(), index = coords.etp; break;
  }
  if (parts == 1) return c;
  ORIGAMI_CHECK(t.dim >= 0 && t.dim < static_cast<int>(t.global_shape.size()) && index >= 0 && index < parts,
                "parameter ", t.name, ": split dim ", t.dim, ", part ", index, " of ", parts);
  const int64_t n = t.global_shape[static_cast<size_t>(t.dim)];
  c.dim = t.dim;
  if (t.rule == ShardRule::tp_vocab) {
    const dense::TpRange r = dense::tp_vocab_range(n, static_cast<int>(index), static_cast<int>(parts));
    c.start = r.start, c.count = r.count;
  } else {
    ORIGAMI_CHECK(n % t.block == 0 && (n / t.block) % parts == 0, "parameter ", t.name, ": dim ", t.dim, " of ", n,
                  " (", n / t.block, " blocks of ", t.block, ") does not split over ", parts, " ranks");
    c.count = n / parts;
    c.start = index * c.count;
  }
  return c;
}

TensorSlice UnitTable::local_slice(const TensorSpec& t, const comm::Layout& layout,
                                   const comm::RankCoords& coords) const {
  const Cut c = cut(t, layout, coords);
  TensorSlice s;
  if (!c.held) return s;
  s.held = true;
  s.shape = t.global_shape;
  if (c.dim < 0) return s;
  s.shape[static_cast<size_t>(c.dim)] = c.count;
  s.shard = ShardSpec{c.dim, c.start, t.global_shape};
  return s;
}

LocalUnit UnitTable::local_unit(const UnitSpec& u, const comm::Layout& layout, const comm::RankCoords& coords) const {
  LocalUnit lu;
  for (size_t i = 0; i < u.tensors.size(); ++i) {
    if (!holds(u.tensors[i], layout, coords)) continue;
    TensorSlice s = local_slice(u.tensors[i], layout, coords);
    lu.numel += s.numel();
    if (u.tp_replicated(u.tensors[i])) lu.tp_replicated += s.numel();
    lu.tensors.push_back(i);
    lu.slices.push_back(std::move(s));
  }
  return lu;
}

std::pair<int64_t, int64_t> UnitTable::local_numel(const UnitSpec& u, const comm::Layout& layout,
                                                   const comm::RankCoords& coords) const {
  int64_t numel = 0, replicated = 0;
  for (const TensorSpec& t : u.tensors) {
    if (!holds(t, layout, coords)) continue;
    const Cut c = cut(t, layout, coords);
    const int64_t n = c.dim < 0 ? t.numel() : t.numel() / t.global_shape[static_cast<size_t>(c.dim)] * c.count;
    numel += n;
    if (u.tp_replicated(t)) replicated += n;
  }
  return {numel, replicated};
}

void place_slice(const TensorSlice& slice, const float* local, float* whole_f32) {
  ORIGAMI_CHECK(slice.held, "place_slice: the rank holds no slice");
  const int64_t n = shape_numel(slice.shape);
  if (slice.shard.dim < 0) return static_cast<void>(std::copy_n(local, n, whole_f32));
  const Shape& g = slice.shard.global_shape;
  const int64_t inner = shape_numel(g) / g[0];  // elements per global row
  if (slice.shard.dim == 0) return static_cast<void>(std::copy_n(local, n, whole_f32 + slice.shard.start * inner));
  ORIGAMI_CHECK(slice.shard.dim == 1 && g.size() == 2, "place_slice: only dims 0 and 1 of a matrix split");
  const int64_t cols = slice.shape[1];
  for (int64_t r = 0; r < slice.shape[0]; ++r)
    std::copy_n(local + r * cols, cols, whole_f32 + r * g[1] + slice.shard.start);
}

}  // namespace origami

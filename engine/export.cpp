// Hugging Face export and import (see export.h).
#include "engine/export.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "engine/files.h"
#include "engine/json_file.h"
#include "engine/safetensors.h"

namespace origami {

namespace {
std::string bias_name(int64_t l) { return expert_bias_name(l); }

const char* score_name(moe::ScoreFunction f) { return f == moe::ScoreFunction::softmax ? "softmax" : "sigmoid"; }
// A tp-sliced dense tensor made whole on world rank 0 (undefined elsewhere):
// the slices of rank 0's tp group are gathered in rank order and each put in
// its place, as the unit table cuts the tensor for that member.
Tensor gather_tp_slices(const UnitTable& table, const ParamInfo& p, const Tensor& local, const comm::Groups& groups,
                        comm::Communicator& tp, bool root) {
  const int n = tp.size();
  int64_t mine = local.numel();
  std::vector<int64_t> counts(n);
  tp.all_gather(std::span<const int64_t>(&mine, 1), std::span<int64_t>(counts));
  const Shape& g = p.global_shape();
  Tensor all = Tensor::empty(g, DType::f32, MemCategory::comm);
  tp.all_gather_v(std::span<const float>(local.f32(), mine), std::span<float>(all.f32(), all.numel()), counts);
  if (!root) return Tensor();
  const TensorSpec& spec = table.tensor(p.name);
  Tensor whole = Tensor::empty(g, DType::f32, MemCategory::comm);
  int64_t off = 0;
  for (int r = 0; r < n; ++r) {
    const TensorSlice s = table.local_slice(spec, groups.layout(), groups.layout().coords(tp.members()[r]));
    ORIGAMI_CHECK(s.numel() == counts[r], "export: tp rank ", r, " sent ", counts[r], " elements of ", p.name,
                  ", the unit table gives it ", s.numel());
    place_slice(s, all.f32() + off, whole.f32());
    off += counts[r];
  }
  return whole;
}

// Every expert weight of the model's stage, whole, by HF name — on the
// stage's first rank (every coordinate 0 but pp); empty elsewhere.
// Collective over that rank's tp-ep group (which holds each expert slice
// once); the other ranks return at once. Member m's unit holds the tensors
// the unit table gives its coordinates, in table order.
std::map<std::string, Tensor> gather_experts(const Model& model, const comm::Groups& groups) {
  std::map<std::string, Tensor> full;  // every slice lands in its whole tensor
  comm::Communicator& shards = groups.get(comm::GroupKind::tp_ep);
  const int stage_root = stage_root_rank(groups);
  if (shards.members().front() != stage_root) return full;  // another replica of the experts
  const UnitTable& table = model.units();
  for (const UnitSpec& spec : table.units()) {
    if (!spec.expert || !spec.on_stage(model.stage())) continue;
    const std::vector<ParamUnit>& held = model.params().units();
    const auto it = std::find_if(held.begin(), held.end(), [&](const ParamUnit& p) { return p.name == spec.name; });
    ORIGAMI_CHECK(it != held.end(), "export: unit ", spec.name, " is not on this stage");
    const ParamUnit& u = *it;
    const int64_t n = shards.size();
    Tensor all = Tensor::empty({n * u.numel}, DType::f32, MemCategory::comm);
    const Tensor mine = u.param.on_host_f32();
    shards.all_gather(std::span<const float>(mine.f32(), u.numel), std::span<float>(all.f32(), n * u.numel));
    if (groups.world_rank() != stage_root) continue;
    for (int64_t m = 0; m < n; ++m) {
      const LocalUnit local = table.local_unit(spec, groups.layout(), groups.layout().coords(shards.members()[m]));
      ORIGAMI_CHECK(local.numel == u.numel, "export: unit ", spec.name, " of ", u.numel, " elements, the table gives ",
                    "tp-ep member ", m, " ", local.numel);
      const float* base = all.f32() + m * u.numel;
      for (size_t k = 0; k < local.tensors.size(); ++k) {
        const TensorSpec& t = spec.tensors[local.tensors[k]];
        Tensor& whole = full[t.name];
        if (!whole.defined()) whole = Tensor::empty(t.global_shape, DType::f32, MemCategory::comm);
        place_slice(local.slices[k], base, whole.f32());
        base += local.slices[k].numel();
      }
    }
  }
  return full;
}

// Pipeline stages hand their consolidated tensors to stage 0 over the pp
// group of world rank 0 (the stage roots): sizes, then a header of
// (name length, rank, dims...) per tensor, the names' characters, the data.
void send_stage_tensors(comm::Communicator& roots, const std::vector<NamedTensor>& tensors) {
  std::vector<int64_t> header;
  std::vector<int32_t> names;
  std::vector<float> data;
  for (const NamedTensor& t : tensors) {
    header.push_back(static_cast<int64_t>(t.name.size()));
    header.push_back(static_cast<int64_t>(t.tensor.shape().size()));
    header.insert(header.end(), t.tensor.shape().begin(), t.tensor.shape().end());
    names.insert(names.end(), t.name.begin(), t.name.end());
    data.insert(data.end(), t.tensor.f32(), t.tensor.f32() + t.tensor.numel());
  }
  int64_t sizes[4] = {static_cast<int64_t>(tensors.size()), static_cast<int64_t>(header.size()),
                      static_cast<int64_t>(names.size()), static_cast<int64_t>(data.size())};
  roots.send(std::span<const int64_t>(sizes, 4), 0);
  roots.send(std::span<const int64_t>(header), 0);
  roots.send(std::span<const int32_t>(names), 0);
  roots.send(std::span<const float>(data), 0);
}

void receive_stage_tensors(comm::Communicator& roots, int stage, std::vector<NamedTensor>& out) {
  int64_t sizes[4];
  roots.recv(std::span<int64_t>(sizes, 4), stage);
  std::vector<int64_t> header(static_cast<size_t>(sizes[1]));
  std::vector<int32_t> names(static_cast<size_t>(sizes[2]));
  std::vector<float> data(static_cast<size_t>(sizes[3]));
  roots.recv(std::span<int64_t>(header), stage);
  roots.recv(std::span<int32_t>(names), stage);
  roots.recv(std::span<float>(data), stage);
  size_t h = 0, c = 0, d = 0;
  for (int64_t i = 0; i < sizes[0]; ++i) {
    const auto name_len = static_cast<size_t>(header[h++]);
    const auto rank = static_cast<size_t>(header[h++]);
    Shape shape(header.begin() + static_cast<std::ptrdiff_t>(h), header.begin() + static_cast<std::ptrdiff_t>(h + rank));
    h += rank;
    std::string name(names.begin() + static_cast<std::ptrdiff_t>(c), names.begin() + static_cast<std::ptrdiff_t>(c + name_len));
    c += name_len;
    Tensor t = Tensor::empty(shape, DType::f32, MemCategory::comm);
    std::copy_n(data.data() + d, t.numel(), t.f32());
    d += static_cast<size_t>(t.numel());
    out.push_back({std::move(name), std::move(t)});
  }
  ORIGAMI_CHECK(h == header.size() && c == names.size() && d == data.size(), "export: stage ", stage,
                " sent a malformed tensor list");
}

// Weights that are NaN or infinite would evaluate (or train) to a NaN loss
// that looks like a number was computed.
void check_finite(const std::string& path, const std::string& name, const Tensor& t) {
  const float* v = t.f32();
  for (int64_t i = 0; i < t.numel(); ++i)
    if (!std::isfinite(v[i]))
      ORIGAMI_USER_ERROR(path, ": tensor '", name, "' element ", i, " of ", t.numel(), " is ", v[i],
                         " (rule: weights are finite numbers)");
}

}  // namespace

void export_hf(const Model& model, const std::string& dir, const comm::Groups* groups) {
  const bool spread = comm::multi_rank(groups, comm::GroupKind::tp_ep) != nullptr;
  std::vector<NamedTensor> tensors;
  if (spread)
    for (auto& [name, t] : gather_experts(model, *groups)) tensors.push_back({name, t});
  // Tensor-parallel slices of the dense weights: rank 0's tp group gathers them.
  comm::Communicator* tp = comm::multi_rank(groups, comm::GroupKind::tp);
  // Each pipeline stage's first rank consolidates its stage's tensors.
  const int stage_root = groups ? stage_root_rank(*groups) : 0;
  const bool root = !groups || groups->world_rank() == stage_root;
  if (tp && tp->members().front() == stage_root) {
    for (const ParamUnit& u : model.params().units())
      for (size_t i = 0; i < u.params.size(); ++i)
        if (!u.expert && u.params[i].shard.dim >= 0)
          if (Tensor t = gather_tp_slices(model.units(), u.params[i], u.param_view(i).on_host_f32(), *groups, *tp, root); root)
            tensors.push_back({u.params[i].name, t});
  }
  if (!root) return;
  for (const ParamUnit& u : model.params().units())
    if (!(spread && u.expert))
      for (size_t i = 0; i < u.params.size(); ++i)
        if (!(tp && !u.expert && u.params[i].shard.dim >= 0))
          tensors.push_back({u.params[i].name, u.param_view(i).on_host_f32()});
  for (size_t l = 0; l < model.expert_bias().size(); ++l)
    if (model.expert_bias()[l].defined())
      tensors.push_back({bias_name(static_cast<int64_t>(l)), model.expert_bias()[l].on_host()});
  if (groups && groups->layout().pp() > 1) {
    comm::Communicator& roots = groups->get(comm::GroupKind::pp);  // stage roots: world rank 0's pp group
    if (roots.rank() != 0) return send_stage_tensors(roots, tensors);
    for (int s = 1; s < roots.size(); ++s) receive_stage_tensors(roots, s, tensors);
  }
  std::map<std::string, size_t> position;
  for (const std::string& name : export_tensor_order(model.units(), model.config(), model.moe_config()))
    position.emplace(name, position.size());
  std::sort(tensors.begin(), tensors.end(), [&](const NamedTensor& a, const NamedTensor& b) {
    return position.at(a.name) < position.at(b.name);
  });
  // A failed export (a full disk) leaves the previous one whole (files.h).
  std::filesystem::create_directories(dir);
  // Left from earlier: `origami export --optimizer`'s moments, and an HF
  // index whose shards this file replaces.
  ReplacedFiles files({dir + "/model.safetensors", dir + "/config.json"},
                      {dir + "/optimizer.safetensors", dir + "/model.safetensors.index.json"});
  write_safetensors(files.tmp(0), tensors);
  OutputFile out(files.tmp(1), OutputFile::Mode::truncate);
  out.write(hf_config(model.config(), model.moe_config()).dump(2) + "\n");
  out.sync();
  out.close();
  files.commit();
}

std::vector<std::string> export_tensor_order(const UnitTable& table, const ModelConfig& model, const MoeConfig& moe) {
  std::vector<std::string> names;
  for (const UnitSpec& u : table.units())
    for (const TensorSpec& t : u.tensors) names.push_back(t.name);
  if (moe.expert_bias)
    for (int64_t l = 0; l < model.num_layers; ++l)
      if (moe.is_moe_layer(l)) names.push_back(bias_name(l));
  return names;
}

nlohmann::ordered_json hf_config(const ModelConfig& c, const MoeConfig& m) {
  const bool is_moe = m.router.num_experts > 0;
  nlohmann::ordered_json cfg = {
      {"architectures", {is_moe ? "MixtralForCausalLM" : "LlamaForCausalLM"}},
      {"model_type", is_moe ? "mixtral" : "llama"},
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.ffn_hidden_size},
      {"num_hidden_layers", c.num_layers},
      {"num_attention_heads", c.num_heads},
      {"num_key_value_heads", c.num_kv_heads},
      {"head_dim", c.head_dim()},
      {"hidden_act", "silu"},
      {"rms_norm_eps", c.norm_eps},
      {"rope_theta", c.rope_theta},
      {"max_position_embeddings", 4096},
      {"tie_word_embeddings", false},
      {"attention_bias", false},
      {"mlp_bias", false},
      {"initializer_range", c.init_std},
      {"torch_dtype", "float32"},
  };
  if (is_moe) {
    // Mixtral's names, then DeepSeek's where Mixtral has none, so the forward
    // pass is fully determined by this file.
    cfg["num_local_experts"] = m.router.num_experts;
    cfg["num_experts_per_tok"] = m.router.top_k;
    cfg["moe_intermediate_size"] = m.expert_ffn(c.ffn_hidden_size);
    cfg["router_aux_loss_coef"] = m.router.aux_loss_coeff;
    cfg["output_router_logits"] = false;
    cfg["scoring_func"] = score_name(m.router.score_function);
    cfg["norm_topk_prob"] = m.router.normalize_topk;
    cfg["routed_scaling_factor"] = m.router.topk_scaling;
    cfg["first_k_dense_replace"] = m.first_dense_layers;
    cfg["moe_layer_freq"] = m.layer_freq;
    cfg["n_group"] = m.router.num_groups;
    cfg["topk_group"] = m.router.group_topk;
    cfg["shared_expert_intermediate_size"] = m.shared_expert_hidden_size;
    cfg["expert_bias"] = m.expert_bias;
    if (m.capacity.capacity_factor) {
      cfg["capacity_factor"] = *m.capacity.capacity_factor;
      cfg["drop_policy"] = m.capacity.drop_policy == moe::DropPolicy::probs ? "probs" : "position";
    }
  }
  return cfg;
}

std::vector<std::string> config_differences(const Config& cfg, const std::string& dir, bool present_only) {
  const std::string path = dir + "/config.json";
  const nlohmann::json got = read_json_file(path, "Hugging Face config.json", int64_t{1} << 20);
  if (!got.is_object()) ORIGAMI_USER_ERROR(path, ": must be a JSON object (an exported config.json)");
  std::vector<std::string> differences;
  const nlohmann::ordered_json expected = hf_config(cfg.model, cfg.moe);
  // The keys that change the forward pass, and the config key behind each.
  static constexpr std::pair<const char*, const char*> kForward[] = {
      {"model_type", "moe.num_experts"},
      {"vocab_size", "model.vocab_size"},
      {"hidden_size", "model.hidden_size"},
      {"intermediate_size", "model.ffn_hidden_size"},
      {"num_hidden_layers", "model.num_layers"},
      {"num_attention_heads", "model.num_heads"},
      {"num_key_value_heads", "model.num_kv_heads"},
      {"rms_norm_eps", "model.norm_eps"},
      {"rope_theta", "model.rope_theta"},
      {"num_local_experts", "moe.num_experts"},
      {"num_experts_per_tok", "moe.top_k"},
      {"moe_intermediate_size", "moe.ffn_hidden_size"},
      {"scoring_func", "moe.score_function"},
      {"norm_topk_prob", "moe.normalize_topk"},
      {"routed_scaling_factor", "moe.topk_scaling"},
      {"first_k_dense_replace", "moe.first_dense_layers"},
      {"moe_layer_freq", "moe.layer_freq"},
      {"n_group", "moe.num_groups"},
      {"topk_group", "moe.group_topk"},
      {"shared_expert_intermediate_size", "moe.shared_expert_hidden_size"},
      {"expert_bias", "moe.expert_bias"},
      {"capacity_factor", "moe.capacity_factor"},
      {"drop_policy", "moe.drop_policy"},
  };
  for (const auto& [json_key, config_key] : kForward) {
    const nlohmann::json want = expected.contains(json_key) ? nlohmann::json(expected[json_key]) : nlohmann::json();
    const nlohmann::json have = got.contains(json_key) ? got[json_key] : nlohmann::json();
    if (want == have || (present_only && have.is_null())) continue;
    differences.push_back(detail::concat(cfg.origin(config_key), ": ", config_key, " gives \"", json_key, "\": ",
                                         want.is_null() ? "(absent)" : shorten(want.dump(), 60), ", but ", path,
                                         " has ", have.is_null() ? "none" : shorten(have.dump(), 60)));
  }
  return differences;
}

void check_config_matches_export(const Config& cfg, const std::string& dir) {
  const std::vector<std::string> differences = config_differences(cfg, dir, /*present_only=*/false);
  if (!differences.empty())
    ORIGAMI_USER_ERROR(differences.front(), " (rule: evaluation uses the model the weights were trained as; drop the "
                       "contradicting setting or use the matching weights)");
}

void load_hf_weights(Model& model, const std::string& dir) {
  const HfFiles hf = open_hf_dir(dir);
  std::set<std::string> loaded;
  // One tensor in memory at a time, from whichever file holds it.
  auto take = [&](const std::string& name, const Shape& shape) {
    const auto it = hf.by_tensor.find(name);
    if (it == hf.by_tensor.end())
      ORIGAMI_USER_ERROR(dir, ": missing tensor '", name, "' (no file of the directory holds it)");
    const SafetensorsFile& file = *it->second;
    const SafetensorsFile::Entry& e = file.entry(name);
    if (e.shape != shape)
      ORIGAMI_USER_ERROR(file.path(), ": tensor '", name, "' has shape ", shape_string(e.shape), ", the config needs ",
                         shape_string(shape));
    Tensor t = file.read(e, MemCategory::workspace);
    check_finite(file.path(), name, t);
    loaded.insert(name);
    return t;
  };
  for (ParamUnit& u : model.params().units()) {
    for (size_t i = 0; i < u.params.size(); ++i) {
      const ParamInfo& p = u.params[i];
      const Tensor t = take(p.name, p.shape);
      u.param_view(i).assign_f32(t);  // rounded into a bf16 working copy
      if (u.master.defined()) {
        ORIGAMI_CHECK(!u.shard.optim, "load_hf_weights: unit ", u.name, " is ZeRO-sharded");
        u.view_of(u.master, i).assign_f32(t);
      }
    }
  }
  for (size_t l = 0; l < model.expert_bias().size(); ++l) {
    Tensor bias = model.expert_bias()[l];
    if (bias.defined()) bias.copy_from(take(bias_name(static_cast<int64_t>(l)), bias.shape()));
  }
  for (const auto& [name, file] : hf.by_tensor)
    if (!loaded.count(name)) ORIGAMI_USER_ERROR(file->path(), ": unexpected tensor '", name, "' for this model config");
}

}  // namespace origami

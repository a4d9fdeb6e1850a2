// Model assembly (see model.h).
#include "engine/model.h"

#include "dense/embedding.h"
#include "kernels/elementwise.h"

namespace origami {

namespace {
std::string layer_prefix(int64_t l) { return "model.layers." + std::to_string(l) + "."; }
}  // namespace

Model::Model(const ModelConfig& cfg, uint64_t seed) : cfg_(cfg) {
  const int64_t D = cfg.hidden_size, V = cfg.vocab_size, F = cfg.ffn_hidden_size, hd = cfg.head_dim();
  const int64_t Hq = cfg.num_heads, Hkv = cfg.num_kv_heads;
  attn_opt_ = dense::AttentionOptions{Hq, Hkv, hd, static_cast<float>(cfg.rope_theta)};

  ParamUnit& emb = params_.add_unit("embedding");
  params_.add_param(emb, "model.embed_tokens.weight", {V, D}, InitKind::normal);
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    const std::string p = layer_prefix(l);
    ParamUnit& u = params_.add_unit("layers." + std::to_string(l));
    params_.add_param(u, p + "input_layernorm.weight", {D}, InitKind::ones);
    params_.add_param(u, p + "self_attn.q_proj.weight", {Hq * hd, D}, InitKind::normal);
    params_.add_param(u, p + "self_attn.k_proj.weight", {Hkv * hd, D}, InitKind::normal);
    params_.add_param(u, p + "self_attn.v_proj.weight", {Hkv * hd, D}, InitKind::normal);
    params_.add_param(u, p + "self_attn.o_proj.weight", {D, Hq * hd}, InitKind::normal_scaled_output);
    params_.add_param(u, p + "post_attention_layernorm.weight", {D}, InitKind::ones);
    params_.add_param(u, p + "mlp.gate_proj.weight", {F, D}, InitKind::normal);
    params_.add_param(u, p + "mlp.up_proj.weight", {F, D}, InitKind::normal);
    params_.add_param(u, p + "mlp.down_proj.weight", {D, F}, InitKind::normal_scaled_output);
  }
  ParamUnit& fin = params_.add_unit("final");
  params_.add_param(fin, "model.norm.weight", {D}, InitKind::ones);
  params_.add_param(fin, "lm_head.weight", {V, D}, InitKind::normal);
  params_.allocate();
  params_.initialize(seed, static_cast<float>(cfg.init_std), cfg.num_layers);
}

Model::LayerWeights Model::layer_views(int64_t l, bool grads) const {
  const std::string p = layer_prefix(l);
  auto get = [&](const std::string& n) { return grads ? params_.grad(p + n) : params_.param(p + n); };
  LayerWeights w;
  w.attn_norm = get("input_layernorm.weight");
  w.attn = {get("self_attn.q_proj.weight"), get("self_attn.k_proj.weight"), get("self_attn.v_proj.weight"),
            get("self_attn.o_proj.weight")};
  w.mlp_norm = get("post_attention_layernorm.weight");
  w.mlp = {get("mlp.gate_proj.weight"), get("mlp.up_proj.weight"), get("mlp.down_proj.weight")};
  return w;
}

int64_t Model::matmul_params() const {
  const int64_t D = cfg_.hidden_size, hd = cfg_.head_dim();
  const int64_t per_layer = D * hd * (2 * cfg_.num_heads + 2 * cfg_.num_kv_heads) + 3 * D * cfg_.ffn_hidden_size;
  return cfg_.num_layers * per_layer + cfg_.vocab_size * D;
}

StepFlops Model::training_flops(int64_t batch, int64_t seq_len) const {
  StepFlops f;
  const double tokens = static_cast<double>(batch) * static_cast<double>(seq_len);
  f.matmul = 6.0 * static_cast<double>(matmul_params()) * tokens;
  const double pairs = static_cast<double>(seq_len) * static_cast<double>(seq_len + 1) / 2.0;
  f.attention = 3.0 * 4.0 * static_cast<double>(batch * cfg_.num_heads * cfg_.head_dim()) * pairs *
                static_cast<double>(cfg_.num_layers);
  return f;
}

double Model::forward(const Tensor& tokens_BS1, ModelSaved& saved, Tensor* loss_T) const {
  const int64_t B = tokens_BS1.size(0), S = tokens_BS1.size(1) - 1, T = B * S;
  const float eps = static_cast<float>(cfg_.norm_eps);
  // Split each window into inputs [0, S) and targets [1, S].
  saved.ids_T = Tensor::empty({T}, DType::i32, MemCategory::activation);
  Tensor targets = Tensor::empty({T}, DType::i32, MemCategory::activation);
  const int32_t* tok = tokens_BS1.i32();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s) {
      saved.ids_T.i32()[b * S + s] = tok[b * (S + 1) + s];
      targets.i32()[b * S + s] = tok[b * (S + 1) + s + 1];
    }
  saved.pos_S = Tensor::empty({S}, DType::i32, MemCategory::activation);
  for (int64_t s = 0; s < S; ++s) saved.pos_S.i32()[s] = static_cast<int32_t>(s);

  Tensor h = dense::embedding_module_forward(saved.ids_T, params_.param("model.embed_tokens.weight"));  // (T, D)
  saved.layers.assign(cfg_.num_layers, LayerSaved{});
  for (int64_t l = 0; l < cfg_.num_layers; ++l) {
    LayerWeights w = layer_views(l, /*grads=*/false);
    LayerSaved& ls = saved.layers[l];
    Tensor a = dense::rmsnorm_module_forward(h, w.attn_norm, eps, ls.attn_norm);
    Tensor y = dense::attention_module_forward(attn_opt_, w.attn, a, B, saved.pos_S, ls.attn);
    add_inplace(y, h);  // residual: y is fresh, h stays saved by the norm
    h = y;
    Tensor m = dense::rmsnorm_module_forward(h, w.mlp_norm, eps, ls.mlp_norm);
    Tensor z = dense::mlp_module_forward(w.mlp, m, ls.mlp);
    add_inplace(z, h);
    h = z;
  }
  Tensor y = dense::rmsnorm_module_forward(h, params_.param("model.norm.weight"), eps, saved.final_norm);
  return dense::lm_head_forward(params_.param("lm_head.weight"), y, targets, saved.head, loss_T);
}

void Model::backward(ModelSaved& saved, float grad_scale) {
  Tensor dnorm_w = params_.grad("model.norm.weight"), dhead_w = params_.grad("lm_head.weight");
  Tensor dy = dense::lm_head_backward(params_.param("lm_head.weight"), saved.head, grad_scale, dhead_w);
  Tensor dh = dense::rmsnorm_module_backward(dy, params_.param("model.norm.weight"), saved.final_norm, dnorm_w);
  for (int64_t l = cfg_.num_layers - 1; l >= 0; --l) {
    LayerWeights w = layer_views(l, /*grads=*/false), g = layer_views(l, /*grads=*/true);
    LayerSaved& ls = saved.layers[l];
    Tensor dm = dense::mlp_module_backward(w.mlp, ls.mlp, dh, g.mlp);
    add_inplace(dh, dense::rmsnorm_module_backward(dm, w.mlp_norm, ls.mlp_norm, g.mlp_norm));
    Tensor da = dense::attention_module_backward(attn_opt_, w.attn, ls.attn, dh, g.attn);
    add_inplace(dh, dense::rmsnorm_module_backward(da, w.attn_norm, ls.attn_norm, g.attn_norm));
    ls = LayerSaved{};  // free this layer's activations as soon as they are consumed
  }
  Tensor demb = params_.grad("model.embed_tokens.weight");
  dense::embedding_module_backward(saved.ids_T, dh, demb);
  saved = ModelSaved{};
}

}  // namespace origami

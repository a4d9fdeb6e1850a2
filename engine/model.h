// Model assembly (ARCHITECTURE.md §4): embedding → L pre-norm decoder layers
// (attention + dense SwiGLU; MoE layers join with the MoE issue) → final norm
// → LM head → token cross-entropy. Owns the parameter store and the
// per-micro-batch saved activations; forward and backward are adjacent.
#pragma once
#include <vector>

#include "dense/attention.h"
#include "dense/lm_head.h"
#include "dense/mlp.h"
#include "dense/norm.h"
#include "engine/config.h"
#include "engine/params.h"

namespace origami {

struct LayerSaved {
  dense::RmsNormSaved attn_norm;
  dense::AttentionSaved attn;
  dense::RmsNormSaved mlp_norm;
  dense::MlpSaved mlp;
};

struct ModelSaved {
  Tensor ids_T, pos_S;
  std::vector<LayerSaved> layers;
  dense::RmsNormSaved final_norm;
  dense::LmHeadSaved head;
};

// FLOPs of one training step's matmuls and attention, for throughput figures:
// 6·N_matmul·tokens (forward 2, backward 4) plus causal attention
// 3 · (2 products · 2 FLOP/MAC) · B·Hq·hd·S(S+1)/2 per layer.
struct StepFlops {
  double matmul = 0, attention = 0;
  double total() const { return matmul + attention; }
};

class Model {
 public:
  Model(const ModelConfig& cfg, uint64_t seed);

  ParamStore& params() { return params_; }
  const ParamStore& params() const { return params_; }
  const ModelConfig& config() const { return cfg_; }
  // Parameters that multiply activations (everything but the embedding and norms).
  int64_t matmul_params() const;
  StepFlops training_flops(int64_t batch, int64_t seq_len) const;

  // tokens: i32 [B, S+1] windows. Returns Σ token loss; fills saved for backward.
  double forward(const Tensor& tokens_BS1, ModelSaved& saved, Tensor* loss_T = nullptr) const;
  // Accumulates d(grad_scale · Σ loss)/dθ into the grad buffers; consumes saved.
  void backward(ModelSaved& saved, float grad_scale);

 private:
  struct LayerWeights {
    Tensor attn_norm;
    dense::AttentionWeights attn;
    Tensor mlp_norm;
    dense::MlpWeights mlp;
  };
  LayerWeights layer_views(int64_t l, bool grads) const;

  ModelConfig cfg_;
  dense::AttentionOptions attn_opt_;
  ParamStore params_;
};

}  // namespace origami

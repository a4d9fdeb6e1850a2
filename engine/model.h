// Model assembly (ARCHITECTURE.md §4): embedding → L pre-norm decoder layers
// (attention + dense SwiGLU or MoE, by the moe layer pattern) → final norm →
// LM head → token cross-entropy. Owns the unit table (engine/units.h), the
// parameter store holding this rank's part of it, the expert-bias state and
// the per-micro-batch saved activations; forward and backward are adjacent.
#pragma once
#include <memory>
#include <vector>

#include "comm/groups.h"
#include "dense/attention.h"
#include "dense/attention_cp.h"
#include "dense/tensor_parallel.h"
#include "dense/lm_head.h"
#include "dense/mlp.h"
#include "dense/norm.h"
#include "engine/config.h"
#include "engine/params.h"
#include "engine/pipeline.h"
#include "engine/units.h"
#include "engine/zero.h"
#include "kernels/deferred.h"
#include "moe/moe_layer.h"

namespace origami {

struct LayerSaved {
  Tensor input;  // the layer's input, kept alone under training.recompute = "full"
  dense::RmsNormSaved attn_norm;
  dense::CpAttentionSaved attn;
  dense::RmsNormSaved mlp_norm;
  dense::MlpSaved mlp;       // dense layers
  moe::MoeLayerSaved moe;    // MoE layers
};

struct ModelSaved {
  int64_t chunk = 0;  // the model chunk (virtual stage) forward ran
  Tensor ids_T;
  dense::CpPositions pos_S;  // this cp rank's zigzag shard of the windows
  int64_t batch = 0, seq_len = 0;  // of the micro-batch's windows
  std::vector<LayerSaved> layers;
  dense::RmsNormSaved final_norm;
  dense::TpLmHeadSaved head;
};

// Routing statistics of one MoE layer, summed over the micro-batches seen
// (this rank's tokens until the trainer sums them over ranks).
struct MoeLayerRecord {
  int64_t layer = 0;
  std::vector<int64_t> routed_per_expert, kept_per_expert;
  std::vector<int64_t> tokens_per_ep_rank;  // [EP] kept tokens sent to each EP rank's experts
  double aux_loss = 0, z_loss = 0;  // summed over micro-batches
};

// What a forward pass reports besides the LM loss.
struct ForwardStats {
  std::vector<MoeLayerRecord> moe;  // one per MoE layer, in layer order
  void accumulate(const std::vector<MoeLayerRecord>& other);
  double aux_loss() const;  // Σ over layers
  double z_loss() const;
};

// What one micro-batch's forward reads and hands back on this stage. (Every
// member has an initializer, so aggregate initializers may stop early.)
struct StageIO {
  Tensor tokens_BS1{};            // in: i32 [B, S+1] windows
  Tensor h_in{};                  // in: the previous virtual stage's output (all but the first)
  ForwardStats* stats = nullptr;  // in/out: this stage's MoE layers' statistics accumulate here
  UnitHooks* hooks = nullptr;     // ZeRO gathers and frees around each unit
  // in/out, f64 [1] on the context's device: the last stage adds its Σ token
  // LM loss here on the device, without a host wait (the trainer reads the
  // step's total once); the other stages leave it. Undefined on the last
  // stage: the forward makes one from zero.
  Tensor loss_sum{};
  Tensor h_out{};                 // out: this chunk's output (all virtual stages but the last)
  int64_t chunk = 0;              // in: which of this rank's model chunks runs (interleaved pipelines)
};

class WeightPass;

// What one micro-batch's backward reads and hands back on this stage (every
// member initialized, as StageIO's).
struct StageGradIO {
  float lm_grad_scale = 1.0f;  // weight of Σ token loss in the objective
  float aux_scale = 1.0f;      // weight of each layer's aux and z losses
  UnitHooks* hooks = nullptr;
  Tensor dh_out{};  // in: gradient of this stage's output (stages before the last; consumed)
  Tensor dh_in{};   // out: gradient of its input (stages after the first)
  // Null: the fused backward (input and weight gradients). Non-null, an empty
  // pass: backward runs only the input gradients (B) and records the weight
  // gradients' work here, for Model::weight_backward (W) to run later. The
  // pass may keep dh_out: do not reuse its buffer meanwhile.
  WeightPass* defer = nullptr;
};

// A decoder layer's parameter views, or (the same shapes) its gradient views.
struct LayerWeights {
  Tensor attn_norm;
  dense::AttentionWeights attn;
  Tensor mlp_norm;
  dense::MlpWeights mlp;       // dense layers
  moe::MoeLayerWeights moe;    // MoE layers
};

// The deferred weight-gradient (W) work of one micro-batch on this stage: what
// a backward given StageGradIO::defer recorded instead of accumulating weight
// gradients (the zero-bubble split, kernels/deferred.h). Grouped per
// parameter unit in backward order, one step per unit as the fused backward
// opens them: the final unit; per layer, top-down, its dense unit — and for a
// MoE layer its expert unit with it, since one MoE backward gives the
// experts', router's and shared expert's gradients together (the fused
// backward opens both units around it too); the embedding.
// Model::weight_backward runs the steps in that order and empties the pass.
//
// It holds the operands its calls read — activations and output gradients,
// ledger category activation, plan::ActivationBytes::weight_pending_* per
// layer and stage — never a parameter and no gradient buffer: each step's
// destinations are bound only while it runs (ZeRO 2-3 allocate a unit's
// whole gradient just then). Move-only; destroying a pass drops its work.
class WeightPass {
 public:
  WeightPass() = default;
  WeightPass(WeightPass&&) = default;
  WeightPass& operator=(WeightPass&&) = default;
  bool empty() const { return steps_.empty(); }
  // The units W writes, in the order weight_backward opens them.
  std::vector<size_t> units() const;

 private:
  friend class Model;
  enum class Kind { final, layer, embedding };
  // One step: the units it opens (before_weight, then after_weight, in this
  // order), the views its calls land in (bound while it runs) and the calls.
  // Held by pointer: the calls hold the addresses of the views.
  struct Step {
    Kind kind = Kind::layer;
    int64_t layer = -1;              // Kind::layer
    std::vector<size_t> units;
    LayerWeights layer_grads;        // Kind::layer
    Tensor norm, matrix;             // Kind::final: final norm, LM head; Kind::embedding: matrix = the table
    WeightGradQueue queue;
  };
  Step& add(Kind kind, int64_t layer, std::vector<size_t> units);
  std::vector<std::unique_ptr<Step>> steps_;
};

// FLOPs of one training step's matmuls and attention, for throughput figures:
// 6·N_active·tokens (forward 2, backward 4; N_active = parameters a token
// multiplies: every linear, the router, top_k experts and the shared expert,
// the LM head) plus causal attention 3 · (2 products · 2 FLOP/MAC) ·
// B·Hq·hd·S(S+1)/2 per layer.
struct StepFlops {
  double matmul = 0, attention = 0;
  double total() const { return matmul + attention; }
};

// Where a model's parameters live across the ranks. The default is one rank
// holding everything.
struct ModelPlacement {
  const comm::Groups* groups = nullptr;  // must outlive the model
  // How ParamStore shards the units over their groups (§6; engine/zero.h
  // runs the gathers and reductions).
  int zero_stage = 0;
  // Layers per virtual pipeline stage (empty: even split); the stage is this
  // rank's pp coordinate, holding virtual_stages model chunks
  // (engine/pipeline.h: chunk c is virtual stage c·pp + stage).
  std::vector<int64_t> pp_layers = {};
  int64_t virtual_stages = 1;
};

// Under tensor parallelism (tp > 1) each rank holds its slice of every
// matmul weight (heads of q/k/v/o, F of the dense MLP, vocab rows of the
// embedding and head; dense/tensor_parallel.h), the residual stream is the
// rank's sequence-parallel shard of the micro-batch's tokens, and norms,
// router and shared expert are replicated. Under context parallelism
// (cp > 1) the rank's tokens are its zigzag chunks of each sample
// (dense/attention_cp.h). The returned loss is the sum over this rank's cp
// shard (the same on every tp rank).
// Under pipeline parallelism (pp > 1) the model holds only its stage's
// layers (engine/pipeline.h; the embedding on the first stage, final norm and
// head on the last): forward takes the previous stage's output and hands its
// own to the next, backward the reverse; parameter and layer names stay
// global, so every stage initializes exactly its part of the one-rank model.
// Under expert parallelism (groups given, EP·ETP > 1) the model holds only
// this rank's experts — E/EP of them per layer, where the layer's placement
// puts them (moe.expert_placement), each its F/ETP slice — and its MoE
// layers exchange tokens over the `ep` and `etp` groups; routing statistics
// reduce over `tp-cp` (aux_loss, seq_aux_loss) or `tp-dp-cp`
// (global_aux_loss). Every rank of a group must run the same forward and
// backward calls in the same order. Without groups: one rank, all experts.
class Model {
 public:
  // ctx: where the model's ops run; it must outlive the model.
  Model(const ExecContext& ctx, const ModelConfig& cfg, uint64_t seed, const MoeConfig& moe = {},
        const ModelPlacement& placement = {});

  ParamStore& params() { return params_; }
  const ParamStore& params() const { return params_; }
  const ModelConfig& config() const { return cfg_; }
  const MoeConfig& moe_config() const { return moe_cfg_; }
  const ExecContext& context() const { return *ctx_; }
  // training.recompute (engine/config.h): what backward recomputes.
  void set_recompute(Recompute r) {
    recompute_ = r;
    moe_opt_.recompute_experts = r == Recompute::moe;
  }
  // parallel.cp_comm (dense/cp_comm.h): how attention moves K, V over cp.
  void set_cp_comm(dense::CpComm c) { cp_comm_ = c; }
  const PipelineStage& stage() const { return stage_; }
  // The shape of a stage boundary tensor (this rank's residual stream of one
  // micro-batch): [batch·seq_len / (cp·tp), hidden].
  Shape boundary_shape(int64_t batch, int64_t seq_len) const;
  // This rank's experts of MoE layer l (of its stage): num_local_experts()
  // of them, ascending, where the layer's placement puts them
  // (moe.expert_placement, else the contiguous block); each its F-slice
  // [etp_rank · F/ETP, + F/ETP).
  std::vector<int64_t> local_experts(int64_t l) const;
  int64_t num_local_experts() const { return local_experts_; }

  // Every parameter of the whole model: global shapes and shard rules.
  const UnitTable& units() const { return units_; }
  int64_t active_matmul_params() const;  // units().counts().matmul_active
  StepFlops training_flops(int64_t batch, int64_t seq_len) const;

  // Expert bias per layer (undefined for dense layers, other stages' layers
  // or when disabled).
  // State, not a parameter: no gradient, no optimizer, updated by
  // update_expert_bias from a global batch's routed loads.
  const std::vector<Tensor>& expert_bias() const { return expert_bias_; }
  void update_expert_bias(const std::vector<MoeLayerRecord>& global_batch_loads);

  // One micro-batch through this rank's stage. Every stage reads the tokens
  // (the first embeds the ids, the last scores the targets, all use the
  // positions). Fills saved for backward; hooks (ZeRO) are told before and
  // after each unit's use.
  void forward(StageIO& io, ModelSaved& saved) const;
  // Accumulates d(lm_grad_scale · Σ loss + aux_scale · Σ_layers (aux + z))/dθ
  // into the grad buffers; consumes saved. With io.defer: only the input
  // gradients now — every collective of the fused backward, in its order;
  // hooks told WeightGrads::deferred — and the weight gradients recorded
  // into *io.defer (the same for every recompute mode: recompute rebuilds
  // activations here, the pass keeps what its calls read).
  void backward(StageGradIO& io, ModelSaved& saved);
  // Runs a pass that backward(io with defer = &pass) recorded, step by step
  // (hooks: before_weight / after_weight around each of its units; no
  // parameter is read), and empties it. Its gradients are bitwise those the
  // fused backward would have accumulated. Every rank of a shard group runs
  // its passes in the same order; a stage's passes run in micro-batch order
  // when gradients accumulate across micro-batches (ZeRO 0-1).
  void weight_backward(WeightPass& pass, UnitHooks* hooks);
  // The whole model on one stage, no hooks: Σ token LM loss; and its backward.
  double forward(const Tensor& tokens_BS1, ModelSaved& saved, ForwardStats* stats = nullptr) const;
  void backward(ModelSaved& saved, float lm_grad_scale, float aux_scale = 1.0f);

 private:
  using LayerWeights = origami::LayerWeights;
  // A layer's parameters, resolved once at construction (names built and
  // looked up here only); layer_views takes this micro-batch's views.
  struct LayerRefs {
    ParamRef attn_norm, q, k, v, o, mlp_norm;
    ParamRef gate, up, down;                       // dense MLP
    ParamRef router, w1, w3, w2;                   // MoE: w1/w3/w2 of the first local expert (blocks are contiguous)
    const moe::AllToAllDispatcher* dispatcher = nullptr;  // MoE: the layer's (its placement's)
    ParamRef shared_gate, shared_up, shared_down;  // MoE with a shared expert
  };
  LayerRefs resolve_layer(int64_t l) const;
  LayerWeights layer_views(int64_t l, bool grads) const;
  // One decoder layer: h_in [T/tp, D] → output; fills ls and, for MoE layers, *record.
  Tensor layer_forward(int64_t l, const Tensor& h_in, int64_t batch, int64_t seq_len, const dense::CpPositions& pos_S,
                       LayerSaved& ls, MoeLayerRecord* record) const;
  // Its backward: dh, the gradient at the layer's output, becomes the one at
  // its input; weight gradients go into g, or onto q when deferred (then the
  // residual sums go to fresh buffers: pending calls may keep dh).
  void layer_backward(int64_t l, Tensor& dh, LayerSaved& ls, LayerWeights& g, WeightGradQueue* q, float aux_scale,
                      bool deferred) const;

  const ExecContext* ctx_;
  ModelConfig cfg_;
  MoeConfig moe_cfg_;
  UnitTable units_;                         // built once; params_ holds this rank's part
  dense::AttentionOptions attn_opt_;        // global head counts
  dense::AttentionOptions local_attn_opt_;  // this tp rank's heads
  comm::Communicator* tp_ = nullptr;        // null when tp = 1
  comm::Communicator* cp_ = nullptr;        // null when cp = 1
  moe::MoeLayerOptions moe_opt_;
  ParamStore params_;
  std::vector<Tensor> expert_bias_;
  Recompute recompute_ = Recompute::none;
  dense::CpComm cp_comm_ = dense::CpComm::all_gather;
  PipelineStage stage_;
  int64_t local_experts_ = 0;  // E/EP on every MoE layer
  size_t embedding_unit_ = 0, final_unit_ = 0;    // first / last stage only
  ParamRef embedding_, final_norm_, head_;         // first / last stage only
  std::vector<LayerRefs> layer_refs_;              // by layer (filled for this rank's layers)
  std::vector<size_t> layer_unit_, expert_unit_;  // per layer of this stage (expert_unit_: MoE layers only)
  // One per MoE layer of this stage (by layer; null for the others):
  // placements differ by layer.
  std::vector<std::unique_ptr<moe::AllToAllDispatcher>> dispatchers_;
  moe::StatsReducer reduce_stats_;                        // null when the group is one rank
};

}  // namespace origami

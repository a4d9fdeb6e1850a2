// Parameter store: the model's state in units (ARCHITECTURE.md §6). A unit is
// one flat buffer each for params, grads and the two AdamW moments; named
// tensors are views into it at fixed offsets. Units are the grain ZeRO shards
// and gathers; on one rank every unit is whole.
// Invariant: tensors of a unit are laid out in registration order, contiguous.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kernels/tensor.h"

namespace origami {

enum class InitKind { normal, normal_scaled_output, ones };

struct ParamInfo {
  std::string name;  // Hugging Face name, e.g. model.layers.0.self_attn.q_proj.weight
  Shape shape;
  int64_t offset = 0;  // elements into the unit's flat buffer
  InitKind init = InitKind::normal;
  bool weight_decay() const { return shape.size() >= 2; }
  int64_t numel() const { return shape_numel(shape); }
};

struct ParamUnit {
  std::string name;  // "embedding", "layers.3", "final"
  std::vector<ParamInfo> params;
  int64_t numel = 0;
  Tensor param, grad, exp_avg, exp_avg_sq;  // flat [numel] each

  Tensor param_view(size_t i) const { return view_of(param, i); }
  Tensor grad_view(size_t i) const { return view_of(grad, i); }
  Tensor view_of(const Tensor& flat, size_t i) const {
    return flat.flat_view(params[i].offset, params[i].numel(), params[i].shape);
  }
};

class ParamStore {
 public:
  // Registration phase: declare units and their tensors, then allocate().
  ParamUnit& add_unit(const std::string& name);
  void add_param(ParamUnit& unit, const std::string& name, Shape shape, InitKind init);
  void allocate();  // param/grad/moments buffers, moments and grads zeroed
  // Layout-independent init (§4): element i of tensor `name` from (seed, name, i).
  void initialize(uint64_t seed, float init_std, int64_t num_layers);

  std::vector<ParamUnit>& units() { return units_; }
  const std::vector<ParamUnit>& units() const { return units_; }
  int64_t total_params() const;
  // Lookup by HF name: (unit index, param index).
  std::pair<size_t, size_t> find(const std::string& name) const;
  Tensor param(const std::string& name) const;
  Tensor grad(const std::string& name) const;
  void zero_grads();

 private:
  std::vector<ParamUnit> units_;
  std::map<std::string, std::pair<size_t, size_t>> index_;
};

}  // namespace origami

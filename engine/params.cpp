// Parameter store (see params.h).
#include "engine/params.h"

#include <cmath>

#include "kernels/init.h"

namespace origami {

ParamUnit& ParamStore::add_unit(const std::string& name) {
  ORIGAMI_CHECK(units_.empty() || !units_.back().param.defined(), "add_unit after allocate()");
  units_.push_back(ParamUnit{});
  units_.back().name = name;
  return units_.back();
}

void ParamStore::add_param(ParamUnit& unit, const std::string& name, Shape shape, InitKind init) {
  ORIGAMI_CHECK(!index_.count(name), "parameter ", name, " registered twice");
  ParamInfo info{name, std::move(shape), unit.numel, init};
  unit.numel += info.numel();
  index_[name] = {static_cast<size_t>(&unit - units_.data()), unit.params.size()};
  unit.params.push_back(std::move(info));
}

void ParamStore::allocate() {
  for (ParamUnit& u : units_) {
    u.param = Tensor::empty({u.numel}, DType::f32, MemCategory::param);
    u.grad = Tensor::zeros({u.numel}, DType::f32, MemCategory::grad);
    u.exp_avg = Tensor::zeros({u.numel}, DType::f32, MemCategory::optim);
    u.exp_avg_sq = Tensor::zeros({u.numel}, DType::f32, MemCategory::optim);
  }
}

void ParamStore::initialize(uint64_t seed, float init_std, int64_t num_layers) {
  // Output projections feed the residual stream once per sub-block; scaling
  // them by 1/sqrt(2L) keeps the residual variance flat in depth.
  const float out_std = init_std / std::sqrt(2.0f * static_cast<float>(num_layers));
  for (ParamUnit& u : units_) {
    for (size_t i = 0; i < u.params.size(); ++i) {
      Tensor t = u.param_view(i);
      const ParamInfo& p = u.params[i];
      switch (p.init) {
        case InitKind::normal: init_normal(t, seed, p.name, 0, init_std); break;
        case InitKind::normal_scaled_output: init_normal(t, seed, p.name, 0, out_std); break;
        case InitKind::ones: init_constant(t, 1.0f); break;
      }
    }
  }
}

int64_t ParamStore::total_params() const {
  int64_t n = 0;
  for (const ParamUnit& u : units_) n += u.numel;
  return n;
}

std::pair<size_t, size_t> ParamStore::find(const std::string& name) const {
  auto it = index_.find(name);
  ORIGAMI_CHECK(it != index_.end(), "no parameter named ", name);
  return it->second;
}

Tensor ParamStore::param(const std::string& name) const {
  auto [u, i] = find(name);
  return units_[u].param_view(i);
}

Tensor ParamStore::grad(const std::string& name) const {
  auto [u, i] = find(name);
  return units_[u].grad_view(i);
}

void ParamStore::zero_grads() {
  for (ParamUnit& u : units_) u.grad.fill_zero();
}

}  // namespace origami

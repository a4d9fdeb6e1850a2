// The harness's input generators and helpers (backend_ops/harness.h).
#include "backend_ops/harness.h"

#include <algorithm>
#include <cstring>

#include "kernels/elementwise.h"

namespace origami::testing::backend_ops {

Problem& Problem::out(std::string name, Shape shape, DType dt, Tol tol, Where where) {
  return add({std::move(name), empty(std::move(shape), dt), Role::out, tol, where});
}

Problem bf16_variant(const Problem& p, std::initializer_list<std::string_view> keep_f32, Tol tol,
                     const std::map<std::string, Tol, std::less<>>& tols) {
  static const ExecContext host = ExecContext::cpu(1);
  Problem q = p;
  q.label += ", bf16";
  q.bf16 = true;
  for (Arg& a : q.args) {
    const bool keep = std::find(keep_f32.begin(), keep_f32.end(), a.name) != keep_f32.end();
    if (a.value.dtype() == DType::f32 && !keep && a.where == Where::device) {
      Tensor rounded = empty(a.value.shape(), DType::bf16);
      if (a.role != Role::out) cast(host, a.value, rounded);
      a.value = rounded;
    }
    if (a.role != Role::in) {
      const auto it = tols.find(a.name);
      a.tol = it != tols.end() ? it->second : tol;
    }
  }
  return q;
}

Tensor empty(Shape s, DType dt) { return Tensor::empty(std::move(s), dt, MemCategory::activation); }

Tensor randn(Shape s, std::mt19937& g, float sd) {
  Tensor t = empty(std::move(s));
  std::normal_distribution<float> nd(0.0f, sd);
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = nd(g);
  return t;
}

Tensor randint(Shape s, std::mt19937& g, int lo, int hi) {
  Tensor t = empty(std::move(s));
  const bool skip_zero = lo < 0 && hi > 0;
  std::uniform_int_distribution<int> d(lo, skip_zero ? hi - 1 : hi);
  for (int64_t i = 0; i < t.numel(); ++i) {
    const int v = d(g);
    t.f32()[i] = static_cast<float>(skip_zero && v >= 0 ? v + 1 : v);
  }
  return t;
}

Tensor i32s(const std::vector<int32_t>& v, Shape s) {
  if (s.empty()) s = {static_cast<int64_t>(v.size())};
  Tensor t = empty(std::move(s), DType::i32);
  if (!v.empty()) std::memcpy(t.raw(), v.data(), v.size() * sizeof(int32_t));
  return t;
}

Tensor i64s(const std::vector<int64_t>& v) {
  Tensor t = empty({static_cast<int64_t>(v.size())}, DType::i64);
  if (!v.empty()) std::memcpy(t.raw(), v.data(), v.size() * sizeof(int64_t));
  return t;
}

Tensor from_doubles(const std::vector<double>& v, Shape s) {
  Tensor t = empty(std::move(s));
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = static_cast<float>(v[i]);
  return t;
}

std::vector<double> values(const Tensor& t) {
  const int64_t n = t.numel();
  std::vector<double> v(n);
  for (int64_t i = 0; i < n; ++i) {
    switch (t.dtype()) {
      case DType::f32: v[i] = t.f32()[i]; break;
      case DType::f64: v[i] = t.data<double>()[i]; break;
      case DType::i32: v[i] = t.i32()[i]; break;
      case DType::i64: v[i] = static_cast<double>(t.data<int64_t>()[i]); break;
      case DType::u8: v[i] = t.data<uint8_t>()[i]; break;
      case DType::bf16: {
        uint16_t b;
        std::memcpy(&b, static_cast<const char*>(t.raw()) + 2 * i, 2);
        const uint32_t bits = static_cast<uint32_t>(b) << 16;
        float f;
        std::memcpy(&f, &bits, 4);
        v[i] = f;
        break;
      }
    }
  }
  return v;
}

Tensor poisoned_workspace(const ExecContext& ctx, size_t bytes) {
  Tensor ws = ctx.workspace(bytes);
  Tensor host = empty({static_cast<int64_t>(bytes)}, DType::u8);
  if (bytes) std::memset(host.raw(), 0xFF, bytes);
  ws.copy_from(host);
  return ws;
}

}  // namespace origami::testing::backend_ops

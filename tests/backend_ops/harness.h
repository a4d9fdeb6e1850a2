// The op × backend harness (ARCHITECTURE.md §9, ggml's test-backend-ops):
// the table's types — an op entry is a name and a generator of problems; a
// problem is one call of the op on fresh random inputs with its naive fp64
// reference and a stated tolerance per output. tests/test_kernels_backend_ops.cpp
// runs every problem of every entry on every backend: CPU against the
// reference, CUDA against the CPU result. Every argument sits between
// sentinel regions; overwritten outputs start poisoned (NaN for floats), so
// an element the op never writes shows; inputs must come back unchanged.
// The table is split by concern: ops_gemm.cpp, ops_elementwise.cpp, ops_dense.cpp,
// ops_update_init.cpp, ops_loss.cpp, ops_attention.cpp, ops_moe.cpp, ops_moe_stats.cpp,
// ops_context_parallel.cpp.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kernels/context.h"
#include "kernels/tensor.h"

namespace origami::testing::backend_ops {

// How the op treats an argument.
enum class Role {
  in,     // read only: must come back bitwise unchanged
  out,    // overwritten: starts poisoned, every element must be written
  inout,  // accumulated into or updated in place: starts from its value
};

// Where the argument lives during the call: on the context's device, or on
// the host whatever the context (an op writing through a host pointer).
enum class Where { device, host };

// |got − want| <= rel · scale + abs, where scale is the reference's
// per-element scale when it gives one, else max |want| over the tensor.
// Integer outputs use {0, 0}: exact.
struct Tol {
  double rel = 0.0, abs = 0.0;
  const char* why = "exact";
};

// A reference value and, optionally, the per-element scale its rounding
// error is measured against (e.g. Σ |terms| of a sum with cancellation).
struct Ref {
  std::vector<double> value, scale;
  bool may_be_zero = false;  // legitimately all zeros (else the comparison would be vacuous: a failure)
};

struct Arg {
  std::string name;
  Tensor value;  // host: the input, an inout's starting value, an out's shape and dtype
  Role role = Role::in;
  Tol tol;
  Where where = Where::device;
};

// Tensors by argument name: the call sees them on the context's device (or
// the host, Where::host); the reference sees the host inputs.
using Bound = std::map<std::string, Tensor, std::less<>>;
using Refs = std::map<std::string, Ref, std::less<>>;

struct Problem {
  std::string label;  // the shape and settings, for messages
  std::vector<Arg> args;
  std::function<void(const ExecContext& ctx, Bound& t)> call;
  // Fills want[name] for every out and inout argument.
  std::function<void(const Bound& in, Refs& want)> reference;

  // bf16 problems (bf16_variant): every backend against the fp64 reference
  // on the rounded inputs (the CPU kernels are f32: the CPU backend runs
  // them on bf16 by widening and rounding, kernels/dispatch_detail.h).
  bool bf16 = false;

  explicit Problem(std::string l) : label(std::move(l)) {}
  Problem& in(std::string name, Tensor value) { return add({std::move(name), std::move(value), Role::in, {}}); }
  Problem& inout(std::string name, Tensor value, Tol tol) {
    return add({std::move(name), std::move(value), Role::inout, tol});
  }
  Problem& out(std::string name, Shape shape, DType dt, Tol tol, Where where = Where::device);

 private:
  Problem& add(Arg a) {
    args.push_back(std::move(a));
    return *this;
  }
};

struct OpEntry {
  std::string name;  // the backend entry point (kernels/backend_ops.inc)
  std::function<std::vector<Problem>(std::mt19937& rng)> problems;
};

// The table, by part (each in kernels/backend_ops.inc order).
std::vector<OpEntry> gemm_ops();              // ops_gemm.cpp
std::vector<OpEntry> elementwise_ops();       // ops_elementwise.cpp
std::vector<OpEntry> dense_ops();             // ops_dense.cpp
std::vector<OpEntry> update_init_ops();       // ops_update_init.cpp
std::vector<OpEntry> loss_ops();              // ops_loss.cpp
std::vector<OpEntry> attention_ops();         // ops_attention.cpp
std::vector<OpEntry> moe_ops();               // ops_moe.cpp
std::vector<OpEntry> moe_stats_ops();         // ops_moe_stats.cpp
std::vector<OpEntry> context_parallel_ops();  // ops_context_parallel.cpp

// A bf16 copy of `p` for the CUDA backend (kernels/cuda/common.cuh's dtype
// rule): every f32 argument not named in `keep_f32` (the op's statistics:
// rstd, lse, router scores, ...) becomes bf16. Inputs are rounded to nearest
// even first, so the reference sees exactly the values the op reads; outputs
// and inouts get `tol` unless `tols` names them. The call and reference are
// p's own (they must not assume f32 for the converted arguments). The label
// gains ", bf16".
Problem bf16_variant(const Problem& p, std::initializer_list<std::string_view> keep_f32, Tol tol,
                     const std::map<std::string, Tol, std::less<>>& tols = {});

// ---- input generators (host tensors; fresh values from the entry's rng)

Tensor empty(Shape s, DType dt = DType::f32);
Tensor randn(Shape s, std::mt19937& g, float sd = 1.0f);
// Small integers in [lo, hi] as f32: products and sums stay exact, so
// references are too. Zero is left out of a range that spans it: a fresh
// draw of a one-element problem could otherwise be all zeros.
Tensor randint(Shape s, std::mt19937& g, int lo, int hi);
Tensor i32s(const std::vector<int32_t>& v, Shape s = {});
Tensor i64s(const std::vector<int64_t>& v);
Tensor from_doubles(const std::vector<double>& v, Shape s);  // rounded to f32

// Any dtype's elements as doubles.
std::vector<double> values(const Tensor& t);

// A workspace of `bytes` on the context's device, every byte 0xFF (NaN as
// f32), so an op that reads scratch it never wrote shows.
Tensor poisoned_workspace(const ExecContext& ctx, size_t bytes);

}  // namespace origami::testing::backend_ops

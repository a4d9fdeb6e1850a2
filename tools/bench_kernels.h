// The driver of `origami bench kernels` (tools/bench_kernels.cpp), shared
// with its per-op cases (tools/bench_kernels_ops.cpp), nccl-tests style: the
// shape sets, input makers on the context's device, one table line (Case:
// the call, its work, the outputs to check) and the Runner that times it.
#pragma once
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include "kernels/context.h"
#include "kernels/gemm.h"
#include "kernels/tensor.h"

namespace origami::tools::kernel_bench {

struct ShapeSet {
  const char* name;
  int64_t B, S, D, Hq, Hkv, hd, F;  // attention and the dense MLP (Hq·hd = D)
  int64_t E, K, Fe;                 // experts, top-k, expert width
  int64_t V, adamw_params;          // vocabulary; one AdamW shard
  int64_t ceiling_n, copy_bytes;    // the ceilings' GEMM edge and copy size
  int64_t T() const { return B * S; }
  int64_t N() const { return T() * K; }  // routed rows
};
// "model", "small" or "tiny"; a UserError for anything else.
const ShapeSet& shape_set(const std::string& name);

// Waits for every op of ctx (Tensor::copy_from and to() synchronize the
// whole device themselves: kernels/cuda/memory.cpp).
void fence(const ExecContext& ctx);

// ---- inputs, on the context's device, made by the context's own ops
Tensor empty(const ExecContext& ctx, Shape shape, DType dt);
// N(0, std²) elements drawn in f32 (init_normal), rounded once to dt (cast).
Tensor random(const ExecContext& ctx, Shape shape, DType dt, const std::string& name, float std = 1.0f);
Tensor filled(const ExecContext& ctx, Shape shape, DType dt, float value);
// An output the op overwrites: NaN until it does, so a skipped element shows.
Tensor output(const ExecContext& ctx, Shape shape, DType dt);
// i32 [n] uniform in [0, below), and 0..S-1; uploaded and fenced.
Tensor random_ids(const ExecContext& ctx, int64_t n, int64_t below, uint32_t seed);
Tensor positions(const ExecContext& ctx, int64_t S);
// "4096x1536x4096".
std::string dims(std::initializer_list<int64_t> d);

// One line of the table.
struct Case {
  Case(std::string op_name, std::string shape_text, std::string dtype_name)
      : op(std::move(op_name)), shape(std::move(shape_text)), dtype(std::move(dtype_name)) {}
  std::string op, shape, dtype;         // op: the kernels API entry point timed
  double flops = 0;                     // per call, compute-bound ops ...
  double bytes = 0;                     // ... or bytes read + written, bandwidth-bound ones
  std::function<void()> run;            // one call
  std::vector<Tensor> outputs;          // must be finite and not all zeros after timing
  std::function<std::string()> verify;  // an extra data check: "" when right
};

struct Result {
  std::string key, op, shape, dtype, wrong;         // wrong: "" when the data checked out
  double ms = 0, work = 0, rate = 0, fraction = 0;  // rate: TFLOP/s (compute) or GB/s
  bool compute = false;
  int repeats = 0;               // calls per sample
  std::optional<double> target;  // the minimum fraction of the ceiling
};

struct BenchOptions {
  std::string device = "cpu", shapes, dtype;  // shapes, dtype: "" for the device's default
  int samples = 5, warmup = 1;
  std::vector<std::string> only, skip;  // key prefixes
  bool json = false;
};

class Runner {
 public:
  Runner(const ExecContext& ctx, const BenchOptions& o);
  // Median seconds per call of `run`: warm-up, one probe call that sizes R
  // (a sample lasts at least a few ms), then samples of R back-to-back calls
  // between fences.
  double seconds_per_call(const std::function<void()>& run, int* repeats) const;
  // Builds the case when --only / --skip want `key`, times it, checks its
  // data, frees it, records the Result and hands it to on_result.
  void bench(const std::string& key, const std::function<Case()>& make);
  const Result* find(const std::string& key) const;
  // Whether --only / --skip select the op of this key.
  static bool wanted(const BenchOptions& o, const std::string& key);

  std::vector<Result> results;
  std::vector<std::string> keys;  // every op's key, wanted or not: what --only and --skip can name
  bool listing = false;           // bench() only records keys (no case is built or timed)
  std::function<void(const Result&)> on_result;
  double ceiling_tflops = 0, ceiling_gbps = 0, ceiling_gemm_ms = 0, ceiling_copy_ms = 0;

 private:
  const ExecContext& ctx_;
  const BenchOptions& o_;
  double min_sample_s_ = 0;
};

// C[M, N] = op(A)·op(B) + beta·C through the gemm op (also the compute ceiling).
Case gemm_case(const ExecContext& ctx, DType dt, int64_t M, int64_t N, int64_t K, Trans ta, Trans tb, float beta);

// The cases, in table order (tools/bench_kernels_ops.cpp).
void bench_gemms(const ExecContext& ctx, Runner& r, const ShapeSet& s, DType dt);
void bench_grouped(const ExecContext& ctx, Runner& r, const ShapeSet& s, DType dt);
void bench_attention(const ExecContext& ctx, Runner& r, const ShapeSet& s, DType dt);
void bench_dense(const ExecContext& ctx, Runner& r, const ShapeSet& s, DType dt);
void bench_loss_optimizer(const ExecContext& ctx, Runner& r, const ShapeSet& s, DType dt);
void bench_routing(const ExecContext& ctx, Runner& r, const ShapeSet& s, DType dt);

}  // namespace origami::tools::kernel_bench

// CUDA grouped GEMM (kernels/grouped_gemm.h): the MoE experts' three
// products. A problem whose output alone gives every multiprocessor a
// 128x128 tile, over an inner dimension of 512 or more, runs as its own
// cuBLASLt matmul; the others of a call go together in one
// cublasGemmGroupedBatchedEx (the schedule `automatic`).
// Why both: cuBLAS's grouped kernels use warp-level MMA only (NVIDIA's
// cuBLAS 12.5 notes), not Hopper's warpgroup MMA that its single GEMMs
// use, so a grouped call runs a large product at a fraction of the GEMM
// rate (one published H100 measurement on MoE shapes: 85 TFLOP/s grouped,
// 130 for a loop of single GEMMs). Where a product fills the GPU by itself,
// its own launch loses nothing; where products are small (fine-grained
// experts: DeepSeek's 1408-wide experts on a few hundred rows each), one
// launch for all of them is what fills the GPU. Mixtral-sized experts
// (14336 x 4096, ~1000 rows each) run alone in every product on an H200
// (132 SMs; from ~530 rows up). The choice depends on shapes alone, so a
// run stays bitwise reproducible.
//
// Mapping (row-major to cuBLAS's column-major, as kernels/cuda/gemm.cu):
//   rows    Y_s = X_s·op(W_g):  m = M, n = rows_s, k = K; cuBLAS A = W_g (op = trans_w), B = X_s, C = Y_s
//   wgrad   dW_g += dY_sᵀ·X_s:  m = K, n = M, k = rows_s; cuBLAS A = X_s, B = dY_s (op T), C = dW_g
// One problem per non-empty segment; problems with equal row counts form one
// cuBLAS group (their m, n, k, leading dimensions, alpha and beta agree).
//
// The weight gradient sums a group's segments in segment order, as the CPU
// does: problems of one grouped call must write disjoint matrices, so the
// call runs in rounds, round r holding every group's r-th non-empty segment,
// with beta in round 0 and 1 after. A group no segment feeds is only scaled
// by beta (a small kernel: zeros for beta = 0, untouched for beta = 1). One
// call when no group repeats (the usual one-segment-per-expert layout);
// as many as the most segments one group has otherwise (expert parallelism:
// one per source rank).
//
// The device arrays of pointers: the context owns one buffer of
// kMaxGroupedProblems A, B and C pointers (kernels/cuda/blas.h). A tiny
// kernel writes them from the problems' row offsets and groups, passed by
// value as its launch parameters, so there is no host staging buffer whose
// reuse could race an asynchronous copy: the launch captures the parameters
// when it is enqueued. The buffer's reuse is stream ordered: the next fill
// kernel (this call's next chunk or round, or the next call) runs on the
// same stream after the grouped GEMM that read the pointers has finished.
// Host arrays (sizes, leading dimensions, alpha, beta) are read by cuBLAS
// during the call.
//
// Fallback to one cublasLtMatmul per problem (kernels/cuda/gemm.cu's cached
// plans) where cublasGemmGroupedBatchedEx cannot run the case: a bf16
// problem whose pointers are not 16-byte aligned (its documented requirement
// for 16-bit types; odd K or M give such row offsets, model shapes do not),
// a dimension past INT_MAX, or cuBLAS refusing the types. Its documented
// combinations have A, B and C of one type (f32, or bf16 with fp32 compute);
// bf16 A/B with an f32 C (the fp32 master gradient) is tried once per
// context and, when refused, runs per problem from then on.
//
// Precision and determinism: CUBLAS_COMPUTE_32F for both dtypes (no TF32),
// cuBLAS's atomics mode left off (its default), the context's own workspace
// (kernels/cuda/blas.h): bitwise reproducible run to run. Not bitwise the
// CPU (cuBLAS's own summation order within a product).
#include <algorithm>
#include <climits>
#include <vector>

#include "kernels/cuda/blas.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/op_shapes.h"

namespace origami::cuda {

namespace {

// `rows` rows of the stacked operand from row `row`, times group `group`'s matrix.
struct Problem {
  int64_t row = 0, rows = 0, group = 0;
};

// Where problem p's matrix of one operand starts: base + p.row·row_bytes + p.group·group_bytes.
struct Operand {
  const char* base = nullptr;
  int64_t row_bytes = 0, group_bytes = 0, ld = 0;
  const char* at(const Problem& p) const { return base + p.row * row_bytes + p.group * group_bytes; }
};

// One grouped product in cuBLAS terms; a problem's rows are its n or its k.
struct GroupedCall {
  cublasOperation_t op_a = CUBLAS_OP_N, op_b = CUBLAS_OP_N;
  int64_t m = 0, n = 0, k = 0;  // the one that is the rows is set per problem
  bool rows_are_k = false;
  DType ab = DType::f32, c_type = DType::f32;
  Operand a, b, c;
  float beta = 0.0f;
};

LtMatmul lt_problem(const GroupedCall& call, const Problem& p) {
  LtMatmul mm;
  mm.op_a = call.op_a;
  mm.op_b = call.op_b;
  mm.m = call.m;
  mm.n = call.rows_are_k ? call.n : p.rows;
  mm.k = call.rows_are_k ? p.rows : call.k;
  mm.ab = call.ab;
  mm.c_type = call.c_type;
  mm.a = call.a.at(p);
  mm.lda = call.a.ld;
  mm.b = call.b.at(p);
  mm.ldb = call.b.ld;
  mm.c = const_cast<char*>(call.c.at(p));
  mm.ldc = call.c.ld;
  mm.beta = call.beta;
  return mm;
}

// ---------------------------------------------------------------- the pointer arrays

// By value (24.6 KB of launch parameters; CUDA 12.1+ takes up to 32 KB).
struct FillArgs {
  const char* base[3];
  int64_t row_bytes[3], group_bytes[3];
  int64_t row[kMaxGroupedProblems];
  int32_t group[kMaxGroupedProblems];
};

// out[x·kMaxGroupedProblems + i] = operand x's pointer for problem i (x = A, B, C).
__global__ void fill_pointers(const __grid_constant__ FillArgs f, int count, void** out) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= count) return;
  for (int x = 0; x < 3; ++x)
    out[x * kMaxGroupedProblems + i] =
        const_cast<char*>(f.base[x] + f.row[i] * f.row_bytes[x] + f.group[i] * f.group_bytes[x]);
}

bool fits_int(int64_t v) { return v >= 0 && v <= INT_MAX; }

// Whether cublasGemmGroupedBatchedEx may run every problem of `call`
// (the types are cuBLAS's to judge: see run_grouped).
bool grouped_supported(const GroupedCall& call, std::span<const Problem> problems) {
  if (!fits_int(call.m) || !fits_int(call.n) || !fits_int(call.k) || !fits_int(call.a.ld) || !fits_int(call.b.ld) ||
      !fits_int(call.c.ld))
    return false;
  for (const Problem& p : problems) {
    if (!fits_int(p.rows) || p.group > INT32_MAX) return false;
    if (call.ab == DType::bf16) {
      for (const Operand* o : {&call.a, &call.b, &call.c})
        if (reinterpret_cast<uintptr_t>(o->at(p)) % 16 != 0) return false;
    }
  }
  return true;
}

void per_problem(ExecContext::CudaState& s, const GroupedCall& call, std::span<const Problem> problems) {
  for (const Problem& p : problems) lt_matmul(s, lt_problem(call, p));
}

// Whether problem p fills the device alone: its output (m x n in cuBLAS
// terms) holds at least one 128x128 tile per multiprocessor, a full wave,
// and its inner dimension is at least 512, so each tile's work (~6 us per
// wave on an H200) outweighs a launch and a cuBLASLt plan of its own (the
// plan cache keys on the rows, which change every step). DeepSeek's expert
// weight gradients (1408 x 2048 over ~384 rows) stay grouped by the second
// rule; Mixtral's (14336 x 4096 over ~1000) run alone.
bool fills_device(const ExecContext::CudaState& s, const GroupedCall& call, const Problem& p) {
  constexpr int64_t kTile = 128, kMinInner = 512;
  const int64_t n = call.rows_are_k ? call.n : p.rows, inner = call.rows_are_k ? p.rows : call.k;
  return (call.m + kTile - 1) / kTile * ((n + kTile - 1) / kTile) >= s.multiprocessors && inner >= kMinInner;
}

// Problems ordered by row count, <= kMaxGroupedProblems: fill the pointer
// arrays, then one grouped call. False when cuBLAS refuses the case before
// launching anything: NOT_SUPPORTED, or for mixed types also INVALID_VALUE.
bool grouped_chunk(ExecContext::CudaState& s, const GroupedCall& call, std::span<const Problem> chunk) {
  const int count = static_cast<int>(chunk.size());
  FillArgs f{};
  const Operand* ops[3] = {&call.a, &call.b, &call.c};
  for (int x = 0; x < 3; ++x) {
    f.base[x] = ops[x]->base;
    f.row_bytes[x] = ops[x]->row_bytes;
    f.group_bytes[x] = ops[x]->group_bytes;
  }
  for (int i = 0; i < count; ++i) {
    f.row[i] = chunk[i].row;
    f.group[i] = static_cast<int32_t>(chunk[i].group);
  }
  constexpr int kThreads = 256;
  fill_pointers<<<(count + kThreads - 1) / kThreads, kThreads, 0, s.stream>>>(f, count, s.grouped_pointers);
  CUDA_CHECK_LAUNCH();

  // A cuBLAS group per run of equal row counts.
  std::vector<cublasOperation_t> op_a, op_b;
  std::vector<int> m, n, k, lda, ldb, ldc, size;
  std::vector<float> alpha, beta;
  for (int i = 0; i < count; ++i) {
    if (i > 0 && chunk[i].rows == chunk[i - 1].rows) {
      ++size.back();
      continue;
    }
    const int rows = static_cast<int>(chunk[i].rows);
    op_a.push_back(call.op_a);
    op_b.push_back(call.op_b);
    m.push_back(static_cast<int>(call.m));
    n.push_back(call.rows_are_k ? static_cast<int>(call.n) : rows);
    k.push_back(call.rows_are_k ? rows : static_cast<int>(call.k));
    lda.push_back(static_cast<int>(call.a.ld));
    ldb.push_back(static_cast<int>(call.b.ld));
    ldc.push_back(static_cast<int>(call.c.ld));
    alpha.push_back(1.0f);
    beta.push_back(call.beta);
    size.push_back(1);
  }
  auto type = [](DType dt) { return dt == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F; };
  const cudaDataType_t ab = type(call.ab), c = type(call.c_type);
  void** ptrs = s.grouped_pointers;
  const cublasStatus_t st = cublas().gemm_grouped_batched_ex(
      s.blas, op_a.data(), op_b.data(), m.data(), n.data(), k.data(), alpha.data(), ptrs, ab, lda.data(),
      ptrs + kMaxGroupedProblems, ab, ldb.data(), beta.data(), ptrs + 2 * kMaxGroupedProblems, c, ldc.data(),
      static_cast<int>(size.size()), size.data(), CUBLAS_COMPUTE_32F);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || (call.ab != call.c_type && st == CUBLAS_STATUS_INVALID_VALUE))
    return false;
  CUBLAS_CHECK(st);
  return true;
}

// Every problem of `call` (they write disjoint matrices, so the order of
// the single matmuls and the grouped call does not matter).
void run_grouped(ExecContext::CudaState& s, const GroupedCall& call, std::vector<Problem> problems,
                 GroupedGemmSchedule schedule) {
  if (schedule == GroupedGemmSchedule::single) return per_problem(s, call, problems);
  if (schedule == GroupedGemmSchedule::automatic) {
    const auto alone = std::stable_partition(problems.begin(), problems.end(),
                                             [&](const Problem& p) { return !fills_device(s, call, p); });
    per_problem(s, call, {alone, problems.end()});
    problems.erase(alone, problems.end());
  }
  if (problems.empty()) return;
  if (!grouped_supported(call, problems)) return per_problem(s, call, problems);
  // Equal row counts side by side (stable: a deterministic order for a given segment list).
  std::stable_sort(problems.begin(), problems.end(),
                   [](const Problem& x, const Problem& y) { return x.rows < y.rows; });
  const bool mixed = call.ab != call.c_type;
  std::lock_guard lock(s.grouped_mu);
  for (size_t first = 0; first < problems.size(); first += kMaxGroupedProblems) {
    const std::span<const Problem> chunk(problems.data() + first,
                                         std::min<size_t>(kMaxGroupedProblems, problems.size() - first));
    if (!(mixed && s.grouped_mixed_unsupported) && grouped_chunk(s, call, chunk)) continue;
    if (mixed) s.grouped_mixed_unsupported = true;  // asked once per context
    per_problem(s, call, chunk);
  }
}

// ---------------------------------------------------------------- checks (as the CPU twin's)

void check_operands(const char* op, const Tensor& a, const char* a_name, const Tensor& b, const char* b_name,
                    const Tensor& out, const char* out_name) {
  ORIGAMI_CHECK(a.defined() && b.defined() && out.defined(), op, " on an undefined tensor");
  check_data_dtype(op, a, a_name);
  check_same_dtype(op, a, a_name, b, b_name);
  ORIGAMI_CHECK(out.dtype() == a.dtype() || (a.dtype() == DType::bf16 && out.dtype() == DType::f32), op, ": ",
                out_name, " is ", to_string(out.dtype()), " for ", to_string(a.dtype()), " ", a_name, " and ", b_name,
                " (", out_name, " is ", to_string(a.dtype()), a.dtype() == DType::bf16 ? " or f32)" : ")");
}

const char* bytes_of(const Tensor& t) { return static_cast<const char*>(t.address()); }

}  // namespace

void grouped_gemm(const ExecContext& ctx, const Tensor& X_NK, const Tensor& W, Trans trans_w,
                  std::span<const GemmSegment> segments, Tensor& Y_NM, float beta, GroupedGemmSchedule schedule) {
  constexpr const char* op = "grouped_gemm";
  check_operands(op, X_NK, "X", W, "W", Y_NM, "Y");
  const auto [G, M, K, N] = grouped_gemm_shapes(X_NK, W, trans_w, segments, Y_NM);
  if (N == 0 || M == 0) return;
  if (K == 0) {  // every product empty: Y = beta · Y (the segments tile all of Y's rows)
    const int64_t whole = 0;
    if (beta != 1.0f) scale_matrices(stream_of(ctx), Y_NM.dtype(), Y_NM.address(), N * M, {&whole, 1}, beta);
    return;
  }

  std::vector<Problem> problems;
  int64_t off = 0;
  for (const GemmSegment& s : segments) {
    if (s.rows > 0) problems.push_back({off, s.rows, s.group});
    off += s.rows;
  }
  const auto ab = static_cast<int64_t>(dtype_size(X_NK.dtype()));
  const auto c = static_cast<int64_t>(dtype_size(Y_NM.dtype()));
  GroupedCall call;
  call.op_a = trans_w == Trans::yes ? CUBLAS_OP_T : CUBLAS_OP_N;
  call.op_b = CUBLAS_OP_N;
  call.m = M;
  call.k = K;
  call.rows_are_k = false;
  call.ab = X_NK.dtype();
  call.c_type = Y_NM.dtype();
  call.a = {bytes_of(W), 0, M * K * ab, W.size(2)};
  call.b = {bytes_of(X_NK), K * ab, 0, K};
  call.c = {bytes_of(Y_NM), M * c, 0, M};
  call.beta = beta;
  run_grouped(state_of(ctx), call, std::move(problems), schedule);
}

void grouped_gemm_wgrad(const ExecContext& ctx, const Tensor& dY_NM, const Tensor& X_NK,
                        std::span<const GemmSegment> segments, Tensor& dW_GMK, float beta,
                        GroupedGemmSchedule schedule) {
  constexpr const char* op = "grouped_gemm_wgrad";
  check_operands(op, dY_NM, "dY", X_NK, "X", dW_GMK, "dW");
  const auto [G, M, K, N] = grouped_gemm_wgrad_shapes(dY_NM, X_NK, segments, dW_GMK);
  if (G == 0 || M == 0 || K == 0) return;

  // Each group's non-empty segments, in segment order.
  std::vector<std::vector<Problem>> runs(G);
  int64_t off = 0;
  size_t rounds = 0;
  for (const GemmSegment& s : segments) {
    if (s.rows > 0) {
      runs[s.group].push_back({off, s.rows, s.group});
      rounds = std::max(rounds, runs[s.group].size());
    }
    off += s.rows;
  }
  // Groups no segment feeds: dW[g] = beta · dW[g].
  if (beta != 1.0f) {
    std::vector<int64_t> unused;
    for (int64_t g = 0; g < G; ++g)
      if (runs[g].empty()) unused.push_back(g * M * K);
    if (!unused.empty()) scale_matrices(stream_of(ctx), dW_GMK.dtype(), dW_GMK.address(), M * K, unused, beta);
  }
  if (rounds == 0) return;

  const auto ab = static_cast<int64_t>(dtype_size(X_NK.dtype()));
  const auto c = static_cast<int64_t>(dtype_size(dW_GMK.dtype()));
  GroupedCall call;
  call.op_a = CUBLAS_OP_N;
  call.op_b = CUBLAS_OP_T;
  call.m = K;
  call.n = M;
  call.rows_are_k = true;
  call.ab = X_NK.dtype();
  call.c_type = dW_GMK.dtype();
  call.a = {bytes_of(X_NK), K * ab, 0, K};
  call.b = {bytes_of(dY_NM), M * ab, 0, M};
  call.c = {bytes_of(dW_GMK), 0, M * K * c, K};
  ExecContext::CudaState& s = state_of(ctx);
  for (size_t r = 0; r < rounds; ++r) {
    std::vector<Problem> problems;
    for (int64_t g = 0; g < G; ++g)
      if (runs[g].size() > r) problems.push_back(runs[g][r]);
    call.beta = r == 0 ? beta : 1.0f;  // later rounds accumulate onto the earlier ones
    run_grouped(s, call, std::move(problems), schedule);
  }
}

}  // namespace origami::cuda

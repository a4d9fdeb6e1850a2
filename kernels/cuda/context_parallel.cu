// CUDA context-parallel layout ops (kernels/context_parallel.h): the zigzag
// index map, the token gather and the K/V copies between the
// wire [cp, 2, B, S/cp, E] and saved [B, S, E] layouts. Nothing is computed
// on the data: every result is bitwise the CPU's (kernels/cpu/context_parallel.cpp).
//
// The zigzag map is one thread per local row.
//
// pack / unpack move runs of C·E elements (C = S/(2·cp)) that are contiguous
// on both sides: run j of the wire is [r][part][b][half], half 0 being chunk
// r of the saved part and half 1 chunk 2·cp−1−r. Every run offset is a
// multiple of the run's bytes on both sides, so the copy moves the widest
// word (16, 8, 4, 2 or 1 bytes) that divides the run's bytes and all three
// base addresses, whatever the dtype (the CPU copies any dtype too). Grid:
// x strides over a run's words, y over the runs.
//
// The token gather checks positions on the device (no host sync): a bad
// position prints the CPU's message and traps, and the job's next CUDA call
// fails at its CUDA_CHECK.
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/op_shapes.h"

namespace origami::cuda {

namespace {

// Global position of local row i (0 <= i < 2·C) of cp rank `rank`.
__device__ __forceinline__ int64_t zigzag_position(int64_t cp, int64_t rank, int64_t C, int64_t i) {
  return i < C ? rank * C + i : (2 * cp - 1 - rank) * C + (i - C);
}

// The CPU's checks: pos_S is i32 [S/cp] with S/cp even and positive, rank in
// [0, cp); returns C = S/(2·cp).
int64_t check_zigzag(const char* op, const Tensor& pos_S, int64_t cp, int64_t rank) {
  ORIGAMI_CHECK(cp >= 1 && rank >= 0 && rank < cp, op, ": rank ", rank, " of cp ", cp);
  ORIGAMI_CHECK(pos_S.defined() && pos_S.dtype() == DType::i32 && pos_S.dim() == 1, op,
                ": positions must be i32 [S/cp], got ", pos_S.defined() ? shape_string(pos_S.shape()) : "(none)");
  ORIGAMI_CHECK(pos_S.numel() > 0 && pos_S.numel() % 2 == 0, op, ": ", pos_S.numel(),
                " positions per rank; S/cp must be even and positive (S % (2·cp) == 0)");
  return pos_S.numel() / 2;
}

__global__ void zigzag_positions(int64_t cp, int64_t rank, int64_t C, int32_t* __restrict__ pos) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < 2 * C;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    pos[i] = static_cast<int32_t>(zigzag_position(cp, rank, C, i));
}

// Threads over the local rows, each writing its row's token for every b
// (coalesced over i for each b).
__global__ void gather_tokens(const int32_t* __restrict__ tok, const int32_t* __restrict__ pos, int64_t B, int64_t S1,
                              int64_t Sl, int32_t* __restrict__ ids, int32_t* __restrict__ targets) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < Sl;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t p = pos[i];
    if (p < 0 || p >= S1 - 1) {
      printf("cp_gather_tokens: position %lld at row %lld outside [0, %lld)\n", static_cast<long long>(p),
             static_cast<long long>(i), static_cast<long long>(S1 - 1));
      __trap();
    }
    for (int64_t b = 0; b < B; ++b) {
      ids[b * Sl + i] = tok[b * S1 + p];
      targets[b * Sl + i] = tok[b * S1 + p + 1];
    }
  }
}

enum class Copy { to_wire, from_wire };

// Copies every run, in words of type W: run j (of n_runs = cp·2·B·2) is
// wire words [j·run, (j + 1)·run) and saved words starting at
// (b·2·cp + chunk)·run of part `part`.
template <class W> __global__ void copy_runs(W* wire, W* k, W* v, int64_t cp, int64_t B, int64_t run, Copy dir) {
  const int64_t n_runs = cp * 4 * B;
  for (int64_t j = blockIdx.y; j < n_runs; j += gridDim.y) {
    const int64_t half = j % 2, b = j / 2 % B, part = j / (2 * B) % 2, r = j / (4 * B);
    const int64_t chunk = half == 0 ? r : 2 * cp - 1 - r;
    W* w = wire + j * run;
    W* s = (part == 0 ? k : v) + (b * 2 * cp + chunk) * run;
    const W* src = dir == Copy::to_wire ? s : w;
    W* dst = dir == Copy::to_wire ? w : s;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < run;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x)
      dst[i] = src[i];
  }
}

template <class W>
void launch_copy(cudaStream_t stream, void* wire, void* k, void* v, const CpKvLayout& l, size_t run_bytes, Copy dir) {
  const int64_t run = static_cast<int64_t>(run_bytes / sizeof(W)), n_runs = l.cp * 4 * l.B;
  constexpr int kThreads = 256;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((run + kThreads - 1) / kThreads, 1024)),
                  static_cast<unsigned>(std::min<int64_t>(n_runs, 65535)));
  copy_runs<W><<<grid, kThreads, 0, stream>>>(static_cast<W*>(wire), static_cast<W*>(k), static_cast<W*>(v), l.cp, l.B,
                                              run, dir);
  CUDA_CHECK_LAUNCH();
}

// Both directions: wire ↔ the saved k and v.
void copy_kv(const ExecContext& ctx, const CpKvLayout& l, void* wire, void* k, void* v, Copy dir) {
  const size_t run_bytes = static_cast<size_t>(l.C * l.E) * l.elem_bytes;
  if (l.B == 0 || run_bytes == 0) return;
  size_t width = 16;
  const auto fits = [&](size_t w) {
    return run_bytes % w == 0 && reinterpret_cast<uintptr_t>(wire) % w == 0 &&
           reinterpret_cast<uintptr_t>(k) % w == 0 && reinterpret_cast<uintptr_t>(v) % w == 0;
  };
  while (width > 1 && !fits(width)) width /= 2;
  const cudaStream_t stream = stream_of(ctx);
  switch (width) {
    case 16: return launch_copy<uint4>(stream, wire, k, v, l, run_bytes, dir);
    case 8: return launch_copy<uint2>(stream, wire, k, v, l, run_bytes, dir);
    case 4: return launch_copy<uint32_t>(stream, wire, k, v, l, run_bytes, dir);
    case 2: return launch_copy<uint16_t>(stream, wire, k, v, l, run_bytes, dir);
    default: return launch_copy<uint8_t>(stream, wire, k, v, l, run_bytes, dir);
  }
}

}  // namespace

void cp_zigzag_positions(const ExecContext& ctx, int64_t cp, int64_t rank, Tensor& pos_S) {
  const int64_t C = check_zigzag("cp_zigzag_positions", pos_S, cp, rank);
  zigzag_positions<<<grid_for(2 * C, 256), 256, 0, stream_of(ctx)>>>(cp, rank, C, dev<int32_t>(pos_S, "pos_S"));
  CUDA_CHECK_LAUNCH();
}

void cp_gather_tokens(const ExecContext& ctx, const Tensor& tokens_BS1, const Tensor& pos_S, Tensor& ids_T,
                      Tensor& targets_T) {
  ORIGAMI_CHECK(
      tokens_BS1.defined() && tokens_BS1.dtype() == DType::i32 && tokens_BS1.dim() == 2 && tokens_BS1.size(1) >= 2,
      "cp_gather_tokens: windows must be i32 [B, S+1] with S >= 1, got ",
      tokens_BS1.defined() ? shape_string(tokens_BS1.shape()) : "(none)");
  ORIGAMI_CHECK(pos_S.defined() && pos_S.dtype() == DType::i32 && pos_S.dim() == 1,
                "cp_gather_tokens: positions must be i32 [Sl]");
  const int64_t B = tokens_BS1.size(0), S1 = tokens_BS1.size(1), Sl = pos_S.numel();
  ORIGAMI_CHECK(
      ids_T.defined() && ids_T.dtype() == DType::i32 && targets_T.defined() && targets_T.dtype() == DType::i32,
      "cp_gather_tokens: ids and targets must be i32");
  check_shape(ids_T, {B * Sl}, "cp_gather_tokens: ids_T");
  check_shape(targets_T, {B * Sl}, "cp_gather_tokens: targets_T");
  if (Sl == 0) return;
  // B == 0 still checks the positions, as the CPU does.
  gather_tokens<<<grid_for(Sl, 256), 256, 0, stream_of(ctx)>>>(
      dev<const int32_t>(tokens_BS1, "tokens_BS1"), dev<const int32_t>(pos_S, "pos_S"), B, S1, Sl,
      dev<int32_t>(ids_T, "ids_T"), dev<int32_t>(targets_T, "targets_T"));
  CUDA_CHECK_LAUNCH();
}

void cp_pack_kv(const ExecContext& ctx, const Tensor& k_BSHd, const Tensor& v_BSHd, Tensor& wire) {
  const CpKvLayout l = cp_kv_shapes("cp_pack_kv", wire, k_BSHd, v_BSHd);
  copy_kv(ctx, l, wire.address(), k_BSHd.address(), v_BSHd.address(), Copy::to_wire);
}

void cp_unpack_kv(const ExecContext& ctx, const Tensor& wire, Tensor& k_BSHd, Tensor& v_BSHd) {
  const CpKvLayout l = cp_kv_shapes("cp_unpack_kv", wire, k_BSHd, v_BSHd);
  copy_kv(ctx, l, wire.address(), k_BSHd.address(), v_BSHd.address(), Copy::from_wire);
}

}  // namespace origami::cuda

// CPU context-parallel layout ops (kernels/context_parallel.h): the zigzag
// index map and contiguous copies between the K/V wire and saved layouts.
// Nothing is computed on the data, so every result is bitwise the input's
// elements, independent of the thread count.
#include <cstring>
#include <string>

#include "kernels/cpu/ops.h"
#include "kernels/op_shapes.h"

namespace origami::cpu {

namespace {

// Global position of local row i (0 <= i < 2·C) of cp rank `rank`.
int64_t zigzag_position(int64_t cp, int64_t rank, int64_t C, int64_t i) {
  return i < C ? rank * C + i : (2 * cp - 1 - rank) * C + (i - C);
}

// Checks pos_S is i32 [S/cp] with S/cp even and positive, rank in [0, cp);
// returns C = S/(2·cp).
int64_t check_zigzag(const char* op, const Tensor& pos_S, int64_t cp, int64_t rank) {
  ORIGAMI_CHECK(cp >= 1 && rank >= 0 && rank < cp, op, ": rank ", rank, " of cp ", cp);
  ORIGAMI_CHECK(pos_S.defined() && pos_S.dtype() == DType::i32 && pos_S.dim() == 1, op,
                ": positions must be i32 [S/cp], got ", pos_S.defined() ? shape_string(pos_S.shape()) : "(none)");
  ORIGAMI_CHECK(pos_S.numel() > 0 && pos_S.numel() % 2 == 0, op, ": ", pos_S.numel(),
                " positions per rank; S/cp must be even and positive (S % (2·cp) == 0)");
  return pos_S.numel() / 2;
}

// Calls f(wire offset, part, offset in the part's saved buffer), in elements,
// for every run of C·E elements the two layouts share. Run j of the wire is
// [r][part][b][half] = j in row-major order, so wire runs are consecutive;
// half 0 is chunk r, half 1 chunk 2·cp−1−r. Runs are disjoint on both sides,
// so threads may take any of them.
template <class F>
void for_each_run(const CpKvLayout& l, F&& f) {
  const int64_t n_runs = l.cp * 2 * l.B * 2, run = l.C * l.E;
  const bool big = static_cast<size_t>(n_runs * run) * l.elem_bytes >= (size_t{1} << 20);
#pragma omp parallel for schedule(static) if (big)
  for (int64_t j = 0; j < n_runs; ++j) {
    const int64_t half = j % 2, b = j / 2 % l.B, part = j / (2 * l.B) % 2, r = j / (4 * l.B);
    const int64_t chunk = half == 0 ? r : 2 * l.cp - 1 - r;
    f(j * run, part, (b * l.S + chunk * l.C) * l.E);
  }
}

}  // namespace

void cp_zigzag_positions(const ExecContext& ctx, int64_t cp, int64_t rank, Tensor& pos_S) {
  const int64_t C = check_zigzag("cp_zigzag_positions", pos_S, cp, rank);
  int32_t* pos = pos_S.i32();
  for (int64_t i = 0; i < 2 * C; ++i) pos[i] = static_cast<int32_t>(zigzag_position(cp, rank, C, i));
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
  const int32_t* tok = tokens_BS1.i32();
  const int32_t* pos = pos_S.i32();
  int32_t* ids = ids_T.i32();
  int32_t* targets = targets_T.i32();
  for (int64_t i = 0; i < Sl; ++i)
    ORIGAMI_CHECK(pos[i] >= 0 && pos[i] < S1 - 1, "cp_gather_tokens: position ", pos[i], " at row ", i, " outside [0, ",
                  S1 - 1, ")");
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < Sl; ++i) {
      ids[b * Sl + i] = tok[b * S1 + pos[i]];
      targets[b * Sl + i] = tok[b * S1 + pos[i] + 1];
    }
}

void cp_pack_kv(const ExecContext& ctx, const Tensor& k_BSHd, const Tensor& v_BSHd, Tensor& wire) {
  const CpKvLayout l = cp_kv_shapes("cp_pack_kv", wire, k_BSHd, v_BSHd);
  const char* part[2] = {static_cast<const char*>(k_BSHd.raw()), static_cast<const char*>(v_BSHd.raw())};
  char* out = static_cast<char*>(wire.raw());
  const size_t run_bytes = static_cast<size_t>(l.C * l.E) * l.elem_bytes;
  for_each_run(l, [&](int64_t wire_off, int64_t p, int64_t saved_off) {
    std::memcpy(out + wire_off * l.elem_bytes, part[p] + saved_off * l.elem_bytes, run_bytes);
  });
}

void cp_unpack_kv(const ExecContext& ctx, const Tensor& wire, Tensor& k_BSHd, Tensor& v_BSHd) {
  const CpKvLayout l = cp_kv_shapes("cp_unpack_kv", wire, k_BSHd, v_BSHd);
  char* part[2] = {static_cast<char*>(k_BSHd.raw()), static_cast<char*>(v_BSHd.raw())};
  const char* in = static_cast<const char*>(wire.raw());
  const size_t run_bytes = static_cast<size_t>(l.C * l.E) * l.elem_bytes;
  for_each_run(l, [&](int64_t wire_off, int64_t p, int64_t saved_off) {
    std::memcpy(part[p] + saved_off * l.elem_bytes, in + wire_off * l.elem_bytes, run_bytes);
  });
}

}  // namespace origami::cpu

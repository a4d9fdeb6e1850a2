// Context-parallel layout ops: the zigzag positions of a cp rank's tokens,
// its share of a micro-batch's token windows, and the K/V wire layout around
// the all_gather (forward) and reduce_scatter (backward). dense/attention_cp.h
// owns the design; these are the index arithmetic and copies behind it, so a
// device backend can run them where the tensors live. All are pure copies or
// index maps: results are exact, whatever the thread count or device.
//
// Zigzag. S tokens are cut into 2·cp chunks of C = S/(2·cp); cp rank r owns
// chunks r and 2·cp−1−r, in that order: local row i < C is global position
// r·C + i, local row C + i is (2·cp−1−r)·C + i. cp = 1 is the iota 0..S−1.
//
// Wire layout of K and V (and of dK, dV), E = Hkv·hd:
//   [cp rank r][part: 0 = K, 1 = V][b][local row i][E]
// — one all_gather block per rank, one reduce_scatter block per owner. The
// saved layout is [b][global position][Hkv][hd] per part, so the two share
// runs of C whole rows (C·E contiguous elements on both sides).
#pragma once
#include <cstdint>

#include "kernels/context.h"
#include "kernels/tensor.h"

namespace origami {

// pos_S: i32 [S/cp] (overwritten) ← the global positions of cp rank `rank`'s
// rows. S/cp must be even and positive (S % (2·cp) == 0); 0 <= rank < cp.
// cp = 1, rank = 0 gives 0..S−1, the positions of gathered keys.
void cp_zigzag_positions(const ExecContext& ctx, int64_t cp, int64_t rank, Tensor& pos_S);

// tokens_BS1: i32 [B, S+1] windows (inputs at [0, S), next tokens at [1, S]);
// pos_S: i32 [Sl], every entry in [0, S) (checked). ids_T, targets_T: i32
// [B·Sl] (overwritten), batch-major:
//   ids_T[b·Sl + i] = tokens[b][pos_S[i]],  targets_T[b·Sl + i] = tokens[b][pos_S[i] + 1].
void cp_gather_tokens(const ExecContext& ctx, const Tensor& tokens_BS1, const Tensor& pos_S, Tensor& ids_T,
                      Tensor& targets_T);

// Saved layout → wire: k_BSHd, v_BSHd [B, S, Hkv, hd] (global position
// order) into wire [cp, 2, B, S/cp, Hkv·hd] (overwritten; S % (2·cp) == 0).
// Any dtype, the same for all three. Used for dK, dV before the
// reduce_scatter, each rank's block holding its keys' rows.
void cp_pack_kv(const ExecContext& ctx, const Tensor& k_BSHd, const Tensor& v_BSHd, Tensor& wire);
// Wire → saved layout, the inverse of cp_pack_kv (same shapes and rules):
// after the all_gather, K and V in global position order. Every element of
// k_BSHd and v_BSHd is written.
void cp_unpack_kv(const ExecContext& ctx, const Tensor& wire, Tensor& k_BSHd, Tensor& v_BSHd);

}  // namespace origami

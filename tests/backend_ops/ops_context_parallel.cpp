// The harness's table, context-parallel part (kernels/context_parallel.h):
// the zigzag positions and their check, the token gather, and K/V packing
// between the saved [B, S, Hkv, hd] and wire [cp, 2, B, S/cp, Hkv·hd]
// layouts. These ops only copy or map indices, so every tolerance is exact;
// the references are written element by element from the layout's definition
// in the header. pack and unpack copy any dtype: f32 on every shape, bf16,
// i32 and f64 on some, and one problem large enough for the CPU copies to go
// parallel. What a comparison of values cannot show (bytes such as NaN
// payloads, u8, round trips, thread counts, bad-input messages) stays in
// tests/test_kernels_context_parallel.cpp.
#include <cmath>
#include <cstring>
#include <set>

#include "backend_ops/harness.h"
#include "kernels/context_parallel.h"

namespace origami::testing::backend_ops {
namespace {

const Tol kExact{0, 0, "positions, tokens or elements copied: exact"};

// Straight from the definition: chunk `rank`, then chunk 2·cp−1−rank, each
// C = S/(2·cp) consecutive positions.
std::vector<int32_t> naive_zigzag(int64_t S, int64_t cp, int64_t rank) {
  const int64_t C = S / (2 * cp);
  std::vector<int32_t> pos;
  for (int64_t chunk : {rank, 2 * cp - 1 - rank})
    for (int64_t i = 0; i < C; ++i) pos.push_back(static_cast<int32_t>(chunk * C + i));
  return pos;
}

// The ranks a problem set visits for one cp: the first, the last and one
// drawn from the rng (the middle ones differ from both ends in both chunks).
std::set<int64_t> some_ranks(int64_t cp, std::mt19937& g) {
  return {0, cp - 1, std::uniform_int_distribution<int64_t>(0, cp - 1)(g)};
}

std::string where(int64_t cp, int64_t rank, int64_t S) {
  return "cp " + std::to_string(cp) + ", rank " + std::to_string(rank) + ", S " + std::to_string(S);
}

// cp and C = S/(2·cp) for the position ops: one-row chunks, odd ones, long
// ones; cp = 3 off the powers of two.
struct ZigzagDims {
  int64_t cp, C;
};
const ZigzagDims kZigzagDims[] = {{1, 1},  {1, 3}, {1, 20}, {2, 1},  {2, 3}, {2, 20}, {3, 1},  {3, 3},
                                  {3, 20}, {4, 1}, {4, 3},  {4, 20}, {8, 1}, {8, 3},  {8, 20}, {2, 257}};

// ---------------------------------------------------------------- positions

OpEntry zigzag_positions_entry() {
  return {"cp_zigzag_positions", [](std::mt19937& g) {
            std::vector<Problem> ps;
            for (const ZigzagDims d : kZigzagDims)
              for (int64_t r : some_ranks(d.cp, g)) {
                const int64_t S = 2 * d.cp * d.C;
                Problem p(where(d.cp, r, S));
                p.out("pos_S", {S / d.cp}, DType::i32, kExact);
                p.call = [cp = d.cp, r](const ExecContext& ctx, Bound& t) {
                  cp_zigzag_positions(ctx, cp, r, t.at("pos_S"));
                };
                p.reference = [S, cp = d.cp, r](const Bound&, Refs& want) {
                  for (int32_t x : naive_zigzag(S, cp, r)) want["pos_S"].value.push_back(x);
                };
                ps.push_back(std::move(p));
              }
            return ps;
          }};
}

// ---------------------------------------------------------------- token gather

// ids_T[b·Sl + i] = tokens[b][pos[i]], targets_T[b·Sl + i] = tokens[b][pos[i] + 1].
Problem gather_problem(const std::string& label, int64_t B, int64_t S, const std::vector<int32_t>& pos,
                       std::mt19937& g) {
  const int64_t Sl = static_cast<int64_t>(pos.size());
  Tensor tokens = empty({B, S + 1}, DType::i32);
  std::uniform_int_distribution<int32_t> token(1, 50000);
  for (int64_t i = 0; i < tokens.numel(); ++i) tokens.i32()[i] = token(g);
  Problem p(label + ", B " + std::to_string(B));
  p.in("tokens_BS1", tokens).in("pos_S", i32s(pos));
  p.out("ids_T", {B * Sl}, DType::i32, kExact).out("targets_T", {B * Sl}, DType::i32, kExact);
  p.call = [](const ExecContext& ctx, Bound& t) {
    cp_gather_tokens(ctx, t.at("tokens_BS1"), t.at("pos_S"), t.at("ids_T"), t.at("targets_T"));
  };
  p.reference = [B, S, Sl](const Bound& in, Refs& want) {
    const std::vector<double> tok = values(in.at("tokens_BS1")), at = values(in.at("pos_S"));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < Sl; ++i) {
        const int64_t s = static_cast<int64_t>(at[i]);
        want["ids_T"].value.push_back(tok[b * (S + 1) + s]);
        want["targets_T"].value.push_back(tok[b * (S + 1) + s + 1]);
      }
  };
  return p;
}

OpEntry gather_tokens_entry() {
  return {"cp_gather_tokens", [](std::mt19937& g) {
            std::vector<Problem> ps;
            struct Dims {
              int64_t cp, B, S;
            };
            for (const Dims d : {Dims{1, 1, 2}, Dims{1, 3, 16}, Dims{2, 2, 8}, Dims{3, 4, 18}, Dims{4, 1, 64},
                                 Dims{8, 2, 32}, Dims{4, 3, 1000}})
              for (int64_t r : some_ranks(d.cp, g))
                ps.push_back(gather_problem(where(d.cp, r, d.S), d.B, d.S, naive_zigzag(d.S, d.cp, r), g));
            // Any positions, not only zigzag ones: repeats, any order, the last input position.
            for (auto [S, Sl] : {std::pair<int64_t, int64_t>{5, 7}, {40, 11}, {1, 3}}) {
              std::uniform_int_distribution<int32_t> any(0, static_cast<int32_t>(S - 1));
              std::vector<int32_t> pos(Sl);
              for (int32_t& x : pos) x = any(g);
              pos[Sl / 2] = static_cast<int32_t>(S - 1);
              ps.push_back(gather_problem("S " + std::to_string(S) + ", " + std::to_string(Sl) + " random positions", 2,
                                          S, pos, g));
            }
            return ps;
          }};
}

// ---------------------------------------------------------------- K/V packing

struct KvDims {
  int64_t cp, B, S, Hkv, hd;
  DType dt;
  std::string label() const {
    return "cp " + std::to_string(cp) + ", B " + std::to_string(B) + ", S " + std::to_string(S) + ", Hkv·hd " +
           std::to_string(Hkv) + "·" + std::to_string(hd) + ", " + std::string(to_string(dt));
  }
  Shape kv() const { return {B, S, Hkv, hd}; }
  Shape wire() const { return {cp, 2, B, S / cp, Hkv * hd}; }
};

// f32 over the shapes (one-row chunks, odd row widths, cp = 3), then the
// other element sizes, then 2·B·S·E·4 = 1 MiB: the size at which the CPU
// copies go parallel. bf16, the recipe's K/V dtype, also on runs of 2 bytes
// (one element), 28 bytes (C·E = 14) and a large one: a device copy moving
// the widest word that divides a run takes 2-, 4- and 16-byte words there.
const KvDims kKvDims[] = {
    {1, 1, 2, 1, 1, DType::f32},    {1, 2, 8, 2, 4, DType::f32},    {2, 1, 4, 1, 3, DType::f32},
    {2, 3, 8, 2, 5, DType::f32},    {3, 2, 12, 1, 7, DType::f32},   {4, 2, 16, 2, 8, DType::f32},
    {4, 1, 64, 3, 2, DType::f32},   {8, 2, 32, 2, 16, DType::f32},  {2, 3, 8, 2, 5, DType::bf16},
    {8, 2, 32, 2, 16, DType::bf16}, {1, 1, 2, 1, 1, DType::bf16},   {3, 2, 12, 1, 7, DType::bf16},
    {4, 2, 256, 4, 64, DType::bf16}, {3, 2, 12, 2, 3, DType::i32},  {4, 2, 16, 2, 8, DType::i32},
    {3, 2, 12, 2, 3, DType::f64},   {4, 2, 256, 4, 64, DType::f32},
};

// Fresh random elements of dt: normals (bf16: a normal float's upper half),
// i32 away from the harness's 0xA5A5A5A5 poison.
Tensor random_elements(Shape s, DType dt, std::mt19937& g) {
  Tensor t = empty(std::move(s), dt);
  std::normal_distribution<double> normal;
  std::uniform_int_distribution<int32_t> any_i32(-1000000000, 1000000000);
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (dt == DType::f32) {
      t.f32()[i] = static_cast<float>(normal(g));
    } else if (dt == DType::f64) {
      t.data<double>()[i] = normal(g);
    } else if (dt == DType::i32) {
      t.i32()[i] = any_i32(g);
    } else {  // bf16
      const float f = static_cast<float>(normal(g));
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      const uint16_t upper = static_cast<uint16_t>(bits >> 16);
      std::memcpy(static_cast<char*>(t.raw()) + 2 * i, &upper, 2);
    }
  }
  return t;
}

// The wire's definition, element by element: wire[r][part][b][i][e] is
// saved[part][b][zigzag(r)[i]][e]. Calls f(wire index, part, saved index)
// for every wire element.
template <class F>
void for_each_wire_element(const KvDims& d, F&& f) {
  const int64_t E = d.Hkv * d.hd, Sl = d.S / d.cp;
  for (int64_t r = 0; r < d.cp; ++r) {
    const std::vector<int32_t> pos = naive_zigzag(d.S, d.cp, r);
    for (int64_t part = 0; part < 2; ++part)
      for (int64_t b = 0; b < d.B; ++b)
        for (int64_t i = 0; i < Sl; ++i)
          for (int64_t e = 0; e < E; ++e)
            f((((r * 2 + part) * d.B + b) * Sl + i) * E + e, part, (b * d.S + pos[i]) * E + e);
  }
}

OpEntry pack_kv_entry() {
  return {"cp_pack_kv", [](std::mt19937& g) {
            std::vector<Problem> ps;
            for (const KvDims& d : kKvDims) {
              Problem p(d.label());
              p.in("k_BSHd", random_elements(d.kv(), d.dt, g)).in("v_BSHd", random_elements(d.kv(), d.dt, g));
              p.out("wire", d.wire(), d.dt, kExact);
              p.call = [](const ExecContext& ctx, Bound& t) {
                cp_pack_kv(ctx, t.at("k_BSHd"), t.at("v_BSHd"), t.at("wire"));
              };
              p.reference = [d](const Bound& in, Refs& want) {
                const std::vector<double> part[2] = {values(in.at("k_BSHd")), values(in.at("v_BSHd"))};
                std::vector<double>& wire = want["wire"].value;
                wire.assign(2 * part[0].size(), NAN);  // a wire element the definition misses fails
                for_each_wire_element(d, [&](int64_t w, int64_t p, int64_t s) { wire[w] = part[p][s]; });
              };
              ps.push_back(std::move(p));
            }
            return ps;
          }};
}

OpEntry unpack_kv_entry() {
  return {"cp_unpack_kv", [](std::mt19937& g) {
            std::vector<Problem> ps;
            for (const KvDims& d : kKvDims) {
              Problem p(d.label());
              p.in("wire", random_elements(d.wire(), d.dt, g));
              p.out("k_BSHd", d.kv(), d.dt, kExact).out("v_BSHd", d.kv(), d.dt, kExact);
              p.call = [](const ExecContext& ctx, Bound& t) {
                cp_unpack_kv(ctx, t.at("wire"), t.at("k_BSHd"), t.at("v_BSHd"));
              };
              p.reference = [d](const Bound& in, Refs& want) {
                const std::vector<double> wire = values(in.at("wire"));
                std::vector<double>* part[2] = {&want["k_BSHd"].value, &want["v_BSHd"].value};
                for (std::vector<double>* v : part) v->assign(wire.size() / 2, NAN);
                for_each_wire_element(d, [&](int64_t w, int64_t p, int64_t s) { (*part[p])[s] = wire[w]; });
              };
              ps.push_back(std::move(p));
            }
            return ps;
          }};
}

}  // namespace

std::vector<OpEntry> context_parallel_ops() {
  return {zigzag_positions_entry(), gather_tokens_entry(), pack_kv_entry(), unpack_kv_entry()};
}

}  // namespace origami::testing::backend_ops

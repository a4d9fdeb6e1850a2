// Context-parallel layout ops (kernels/context_parallel.h) against naive
// references written from the layout's definition, element by element: the
// zigzag positions, the position check, the token gather, and K/V packing
// between the saved [B, S, Hkv, hd] and wire [cp, 2, B, S/cp, Hkv·hd]
// layouts. These ops only copy, so every comparison is bitwise; inputs are
// fresh random values (never zeros), outputs start as sentinels so an element
// left unwritten shows, and guard regions catch writes outside. Also
// pack∘unpack and unpack∘pack are identities, results do not depend on the
// thread count, and bad shapes stop with a message naming the op.
// tests/test_dense_mpi_context_parallel.cpp covers the layout through the
// attention module over a real cp group.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/context_parallel.h"
#include "test_context.h"

namespace origami {
namespace {

const ExecContext& ctx = testing::test_context();

constexpr uint8_t kSentinelByte = 0xA5;  // f32 0xA5A5A5A5 ≈ −2.9e−16, i32 −1515870811: no input has it
constexpr int64_t kGuardBytes = 64;

// An output view with kGuardBytes of sentinel bytes on each side; the view
// itself starts as sentinels too, so an unwritten element is seen.
struct Guarded {
  Tensor storage, view;
  Guarded(Shape s, DType dt) {
    const int64_t n = shape_numel(s), esz = static_cast<int64_t>(dtype_size(dt));
    const int64_t guard = kGuardBytes / esz;
    storage = Tensor::empty({n + 2 * guard}, dt, MemCategory::activation);
    std::memset(storage.raw(), kSentinelByte, storage.nbytes());
    view = storage.flat_view(guard, n, std::move(s));
  }
  void expect_intact(const std::string& what) const {
    const auto* all = static_cast<const uint8_t*>(storage.raw());
    const size_t body = view.nbytes();
    for (int64_t i = 0; i < kGuardBytes; ++i) {
      EXPECT_EQ(all[i], kSentinelByte) << what << ": write before the output";
      EXPECT_EQ(all[kGuardBytes + body + i], kSentinelByte) << what << ": write past the output";
    }
  }
};

// Random elements of any dtype: random bytes, with no element equal to the
// sentinel pattern (so "still a sentinel" means "never written").
Tensor random_tensor(Shape s, DType dt, std::mt19937& g) {
  Tensor t = Tensor::empty(std::move(s), dt, MemCategory::activation);
  auto* bytes = static_cast<uint8_t*>(t.raw());
  std::uniform_int_distribution<int> byte(0, 255);
  for (size_t i = 0; i < t.nbytes(); ++i) {
    bytes[i] = static_cast<uint8_t>(byte(g));
    if (bytes[i] == kSentinelByte) bytes[i] = 0x5A;
  }
  return t;
}

bool bytes_equal(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

// Straight from the definition: chunk `rank`, then chunk 2·cp−1−rank, each C
// consecutive positions.
std::vector<int32_t> naive_zigzag(int64_t S, int64_t cp, int64_t rank) {
  const int64_t C = S / (2 * cp);
  std::vector<int32_t> pos;
  for (int64_t chunk : {rank, 2 * cp - 1 - rank})
    for (int64_t i = 0; i < C; ++i) pos.push_back(static_cast<int32_t>(chunk * C + i));
  return pos;
}

Tensor i32_tensor(const std::vector<int32_t>& v) {
  Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::i32, MemCategory::activation);
  std::memcpy(t.raw(), v.data(), v.size() * sizeof(int32_t));
  return t;
}

// ------------------------------------------------------------ positions

TEST(CpKernels, ZigzagPositionsMatchTheDefinition) {
  for (int64_t cp : {1, 2, 3, 4, 8})
    for (int64_t S : {2 * cp, 6 * cp, 40 * cp})
      for (int64_t r = 0; r < cp; ++r) {
        const std::string at = "cp " + std::to_string(cp) + " S " + std::to_string(S) + " rank " + std::to_string(r);
        Guarded pos({S / cp}, DType::i32);
        cp_zigzag_positions(ctx, cp, r, pos.view);
        const std::vector<int32_t> want = naive_zigzag(S, cp, r);
        for (int64_t i = 0; i < S / cp; ++i) ASSERT_EQ(pos.view.i32()[i], want[i]) << at << " row " << i;
        pos.expect_intact(at);
        EXPECT_TRUE(cp_zigzag_positions_match(ctx, pos.view, cp, r)) << at;
      }
}

TEST(CpKernels, OneRanksZigzagIsTheIota) {
  for (int64_t S : {2, 8, 130}) {
    Tensor pos = Tensor::empty({S}, DType::i32, MemCategory::activation);
    cp_zigzag_positions(ctx, 1, 0, pos);
    for (int64_t s = 0; s < S; ++s) ASSERT_EQ(pos.i32()[s], s) << "S " << S;
  }
}

TEST(CpKernels, PositionsMatchRejectsAnyOtherShard) {
  std::mt19937 g(7);
  for (int64_t cp : {1, 2, 4}) {
    const int64_t S = 12 * cp;
    for (int64_t r = 0; r < cp; ++r) {
      // Another rank's shard.
      for (int64_t other = 0; other < cp; ++other)
        EXPECT_EQ(cp_zigzag_positions_match(ctx, i32_tensor(naive_zigzag(S, cp, other)), cp, r), other == r)
            << "cp " << cp << " rank " << r << " given rank " << other << "'s positions";
      // One entry off by one, anywhere; two entries swapped.
      std::vector<int32_t> want = naive_zigzag(S, cp, r);
      std::uniform_int_distribution<size_t> at(0, want.size() - 1);
      for (int trial = 0; trial < 8; ++trial) {
        std::vector<int32_t> bad = want;
        bad[at(g)] += (trial % 2 == 0) ? 1 : -1;
        EXPECT_FALSE(cp_zigzag_positions_match(ctx, i32_tensor(bad), cp, r)) << "cp " << cp << " rank " << r;
        bad = want;
        const size_t a = at(g), b = (a + 1 + at(g) % (want.size() - 1)) % want.size();
        std::swap(bad[a], bad[b]);
        EXPECT_FALSE(cp_zigzag_positions_match(ctx, i32_tensor(bad), cp, r)) << "cp " << cp << " swap " << a << b;
      }
    }
  }
}

// ------------------------------------------------------------ token gather

TEST(CpKernels, GatherTokensReadsInputsAndNextTokensAtThePositions) {
  std::mt19937 g(11);
  std::uniform_int_distribution<int32_t> token(1, 50000);
  struct Dims {
    int64_t cp, B, S;
  };
  for (const Dims d : {Dims{1, 1, 2}, Dims{1, 3, 16}, Dims{2, 2, 8}, Dims{3, 4, 18}, Dims{4, 1, 64}, Dims{8, 2, 32}}) {
    Tensor tok = Tensor::empty({d.B, d.S + 1}, DType::i32, MemCategory::activation);
    for (int64_t i = 0; i < tok.numel(); ++i) tok.i32()[i] = token(g);
    for (int64_t r = 0; r < d.cp; ++r) {
      const std::string at = "cp " + std::to_string(d.cp) + " B " + std::to_string(d.B) + " S " + std::to_string(d.S) +
                             " rank " + std::to_string(r);
      const std::vector<int32_t> pos = naive_zigzag(d.S, d.cp, r);
      const int64_t Sl = static_cast<int64_t>(pos.size());
      Guarded ids({d.B * Sl}, DType::i32), targets({d.B * Sl}, DType::i32);
      cp_gather_tokens(ctx, tok, i32_tensor(pos), ids.view, targets.view);
      for (int64_t b = 0; b < d.B; ++b)
        for (int64_t i = 0; i < Sl; ++i) {
          ASSERT_EQ(ids.view.i32()[b * Sl + i], tok.i32()[b * (d.S + 1) + pos[i]]) << at << " b " << b << " i " << i;
          ASSERT_EQ(targets.view.i32()[b * Sl + i], tok.i32()[b * (d.S + 1) + pos[i] + 1]) << at << " b " << b;
        }
      ids.expect_intact(at + " ids");
      targets.expect_intact(at + " targets");
    }
  }
  // Any positions, not only zigzag ones: the last input position included.
  Tensor tok = Tensor::empty({2, 6}, DType::i32, MemCategory::activation);
  for (int64_t i = 0; i < 12; ++i) tok.i32()[i] = static_cast<int32_t>(100 + i);
  Tensor ids = Tensor::empty({6}, DType::i32, MemCategory::activation);
  Tensor targets = Tensor::empty({6}, DType::i32, MemCategory::activation);
  cp_gather_tokens(ctx, tok, i32_tensor({4, 0, 2}), ids, targets);
  const std::vector<int32_t> want_ids = {104, 100, 102, 110, 106, 108}, want_targets = {105, 101, 103, 111, 107, 109};
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(ids.i32()[i], want_ids[i]) << i;
    EXPECT_EQ(targets.i32()[i], want_targets[i]) << i;
  }
}

// ------------------------------------------------------------ K/V packing

struct KvDims {
  int64_t cp, B, S, Hkv, hd;
  std::string name() const {
    return "cp " + std::to_string(cp) + " B " + std::to_string(B) + " S " + std::to_string(S) + " Hkv·hd " +
           std::to_string(Hkv) + "·" + std::to_string(hd);
  }
};

const KvDims kKvShapes[] = {
    {1, 1, 2, 1, 1},  {1, 2, 8, 2, 4},  {2, 1, 4, 1, 3},  {2, 3, 8, 2, 5},
    {3, 2, 12, 1, 7}, {4, 2, 16, 2, 8}, {4, 1, 64, 3, 2}, {8, 2, 32, 2, 16},
};

// Naive wire element address: wire[r][part][b][i][e] is saved[part][b][zigzag(r)[i]][e].
// Calls f(wire element index, part, saved element index) for every element.
template <class F>
void for_each_element(const KvDims& d, F&& f) {
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

// Element i of t as its bytes (any dtype).
std::vector<uint8_t> element(const Tensor& t, int64_t i) {
  const size_t esz = dtype_size(t.dtype());
  const auto* p = static_cast<const uint8_t*>(t.raw()) + i * esz;
  return {p, p + esz};
}

void check_pack(const KvDims& d, DType dt, uint32_t seed) {
  SCOPED_TRACE(d.name() + " " + std::string(to_string(dt)));
  std::mt19937 g(seed);
  const Shape kv{d.B, d.S, d.Hkv, d.hd}, wire_shape{d.cp, 2, d.B, d.S / d.cp, d.Hkv * d.hd};
  const Tensor k = random_tensor(kv, dt, g), v = random_tensor(kv, dt, g);
  Guarded wire(wire_shape, dt);
  cp_pack_kv(ctx, k, v, wire.view);
  wire.expect_intact("pack");
  const Tensor* part[2] = {&k, &v};
  int64_t visited = 0;
  for_each_element(d, [&](int64_t w, int64_t p, int64_t s) {
    ++visited;
    if (element(wire.view, w) != element(*part[p], s)) ADD_FAILURE() << "wire element " << w << " (part " << p << ")";
  });
  EXPECT_EQ(visited, wire.view.numel()) << "the reference covers the wire";

  // unpack(pack(k, v)) = (k, v), into sentinel-filled outputs: every element written.
  Guarded k2(kv, dt), v2(kv, dt);
  cp_unpack_kv(ctx, wire.view, k2.view, v2.view);
  EXPECT_TRUE(bytes_equal(k2.view, k)) << "unpack∘pack is not the identity on K";
  EXPECT_TRUE(bytes_equal(v2.view, v)) << "unpack∘pack is not the identity on V";
  k2.expect_intact("unpack K");
  v2.expect_intact("unpack V");
}

void check_unpack(const KvDims& d, DType dt, uint32_t seed) {
  SCOPED_TRACE(d.name() + " " + std::string(to_string(dt)));
  std::mt19937 g(seed);
  const Shape kv{d.B, d.S, d.Hkv, d.hd}, wire_shape{d.cp, 2, d.B, d.S / d.cp, d.Hkv * d.hd};
  const Tensor wire = random_tensor(wire_shape, dt, g);
  Guarded k(kv, dt), v(kv, dt);
  cp_unpack_kv(ctx, wire, k.view, v.view);
  k.expect_intact("unpack K");
  v.expect_intact("unpack V");
  const Tensor* part[2] = {&k.view, &v.view};
  for_each_element(d, [&](int64_t w, int64_t p, int64_t s) {
    if (element(*part[p], s) != element(wire, w)) ADD_FAILURE() << "part " << p << " element " << s;
  });

  // pack(unpack(wire)) = wire.
  Guarded wire2(wire_shape, dt);
  cp_pack_kv(ctx, k.view, v.view, wire2.view);
  EXPECT_TRUE(bytes_equal(wire2.view, wire)) << "pack∘unpack is not the identity";
  wire2.expect_intact("pack");
}

TEST(CpKernels, PackKvMatchesTheNaiveLayoutAndUnpackInvertsIt) {
  uint32_t seed = 100;
  for (const KvDims& d : kKvShapes) check_pack(d, DType::f32, ++seed);
}

TEST(CpKernels, UnpackKvMatchesTheNaiveLayoutAndPackInvertsIt) {
  uint32_t seed = 200;
  for (const KvDims& d : kKvShapes) check_unpack(d, DType::f32, ++seed);
}

TEST(CpKernels, PackingIsByteExactForEveryElementSize) {
  const KvDims d{3, 2, 12, 2, 3};
  uint32_t seed = 300;
  for (DType dt : {DType::bf16, DType::i32, DType::u8, DType::f64}) {
    check_pack(d, dt, ++seed);
    check_unpack(d, dt, ++seed);
  }
}

TEST(CpKernels, PackingIsIndependentOfTheThreadCount) {
  // 2·B·S·E·4 = 2 MiB, above the size at which the copies go parallel.
  const KvDims d{4, 2, 256, 4, 128};
  std::mt19937 g(400);
  const Shape kv{d.B, d.S, d.Hkv, d.hd}, wire_shape{d.cp, 2, d.B, d.S / d.cp, d.Hkv * d.hd};
  const Tensor k = random_tensor(kv, DType::f32, g), v = random_tensor(kv, DType::f32, g);
  Tensor wire1 = Tensor::empty(wire_shape, DType::f32, MemCategory::comm);
  Tensor wire3 = Tensor::empty(wire_shape, DType::f32, MemCategory::comm);
  cp_pack_kv(ExecContext::cpu(1), k, v, wire1);
  cp_pack_kv(ExecContext::cpu(3), k, v, wire3);
  EXPECT_TRUE(bytes_equal(wire1, wire3));
  Tensor k3 = Tensor::empty(kv, DType::f32, MemCategory::activation);
  Tensor v3 = Tensor::empty(kv, DType::f32, MemCategory::activation);
  cp_unpack_kv(ExecContext::cpu(3), wire1, k3, v3);
  EXPECT_TRUE(bytes_equal(k3, k));
  EXPECT_TRUE(bytes_equal(v3, v));
  check_pack(d, DType::f32, 401);  // and the naive layout at this size
}

// ------------------------------------------------------------ bad shapes

TEST(CpKernelsDeathTest, BadShapesStopNamingTheOp) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto i32 = [](Shape s) { return Tensor::empty(std::move(s), DType::i32, MemCategory::activation); };
  auto f32 = [](Shape s) { return Tensor::empty(std::move(s), DType::f32, MemCategory::activation); };

  Tensor pos6 = i32({6}), pos5 = i32({5});
  EXPECT_DEATH(cp_zigzag_positions(ctx, 2, 2, pos6), "cp_zigzag_positions: rank 2 of cp 2");
  EXPECT_DEATH(cp_zigzag_positions(ctx, 0, 0, pos6), "cp_zigzag_positions: rank 0 of cp 0");
  EXPECT_DEATH(cp_zigzag_positions(ctx, 2, 0, pos5), "cp_zigzag_positions: 5 positions per rank");
  Tensor pos_f32 = f32({6});
  EXPECT_DEATH(cp_zigzag_positions(ctx, 2, 0, pos_f32), "cp_zigzag_positions: positions must be i32");
  EXPECT_DEATH(cp_zigzag_positions_match(ctx, pos5, 1, 0), "cp_zigzag_positions_match: 5 positions");

  const Tensor tok = i32({2, 9}), pos = i32_tensor({0, 7, 3, 8});
  Tensor ids = i32({8}), targets = i32({8}), short_ids = i32({7});
  EXPECT_DEATH(cp_gather_tokens(ctx, tok, pos, ids, targets),
               "cp_gather_tokens: position 8 at row 3 outside \\[0, 8\\)");
  const Tensor ok_pos = i32_tensor({0, 7, 3, 1});
  EXPECT_DEATH(cp_gather_tokens(ctx, tok, ok_pos, short_ids, targets),
               "cp_gather_tokens: ids_T has shape \\[7\\], expected \\[8\\]");
  EXPECT_DEATH(cp_gather_tokens(ctx, f32({2, 9}), ok_pos, ids, targets), "cp_gather_tokens: windows must be i32");
  EXPECT_DEATH(cp_gather_tokens(ctx, i32({2, 1}), ok_pos, ids, targets), "cp_gather_tokens: windows must be i32");

  const Tensor k = f32({2, 8, 2, 3}), v = f32({2, 8, 2, 3});
  Tensor wire = f32({2, 2, 2, 4, 6});
  Tensor k_out = f32({2, 8, 2, 3}), v_out = f32({2, 8, 2, 3});
  Tensor wire_bad_rows = f32({2, 2, 2, 3, 6}), wire_4d = f32({2, 2, 8, 6}), wire_i32 = i32({2, 2, 2, 4, 6});
  Tensor wire_cp3 = f32({3, 2, 2, 8, 6});  // S = 8 is not a multiple of 2·3
  EXPECT_DEATH(cp_pack_kv(ctx, k, v, wire_bad_rows),
               "cp_pack_kv: wire has shape \\[2, 2, 2, 3, 6\\], expected \\[2, 2, 2, 4, 6\\]");
  EXPECT_DEATH(cp_pack_kv(ctx, k, v, wire_4d), "cp_pack_kv: wire must be \\[cp, 2, B, S/cp, Hkv·hd\\]");
  EXPECT_DEATH(cp_pack_kv(ctx, k, v, wire_i32), "cp_pack_kv: dtypes differ");
  EXPECT_DEATH(cp_pack_kv(ctx, k, v, wire_cp3), "cp_pack_kv: S = 8 is not a positive multiple of 2·cp = 6");
  EXPECT_DEATH(cp_pack_kv(ctx, k, f32({2, 8, 3, 2}), wire), "cp_pack_kv: v \\[2, 8, 3, 2\\] differs from k");
  EXPECT_DEATH(cp_pack_kv(ctx, f32({2, 8, 6}), f32({2, 8, 6}), wire), "cp_pack_kv: k must be \\[B, S, Hkv, hd\\]");
  EXPECT_DEATH(cp_unpack_kv(ctx, wire_bad_rows, k_out, v_out), "cp_unpack_kv: wire has shape");
  Tensor v_short = f32({2, 4, 2, 3});
  EXPECT_DEATH(cp_unpack_kv(ctx, wire, k_out, v_short), "cp_unpack_kv: v \\[2, 4, 2, 3\\] differs from k");
}

}  // namespace
}  // namespace origami

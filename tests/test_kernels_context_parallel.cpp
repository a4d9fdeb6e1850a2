// Context-parallel layout ops (kernels/context_parallel.h): what the op ×
// backend harness does not check. The harness (tests/backend_ops/
// ops_context_parallel.cpp) compares every op against a naive reference from
// the layout's definition, on every backend; this file keeps the byte-level
// round trips — pack∘unpack and unpack∘pack are the identity on random bytes
// of every element size (NaN payloads and u8 included, which a comparison of
// values cannot see), every element written, nothing outside — that the
// packing's result does not depend on the thread count, and that bad shapes
// stop with a message naming the op. tests/test_dense_mpi_context_parallel.cpp
// covers the layout through the attention module over a real cp group.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/context_parallel.h"
#include "test_context.h"
#include "test_seed.h"

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

Tensor i32_tensor(const std::vector<int32_t>& v) {
  Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::i32, MemCategory::activation);
  std::memcpy(t.raw(), v.data(), v.size() * sizeof(int32_t));
  return t;
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

// unpack(pack(k, v)) = (k, v) and pack(unpack(wire)) = wire, bytewise, each
// into sentinel-filled outputs (the inputs never hold a sentinel byte, so an
// element left unwritten differs), with the guards around them intact.
void check_round_trips(const KvDims& d, DType dt, uint32_t seed, const ExecContext& on = ctx) {
  SCOPED_TRACE(d.name() + " " + std::string(to_string(dt)));
  std::mt19937 g(testing::test_seed(seed));
  const Shape kv{d.B, d.S, d.Hkv, d.hd}, wire_shape{d.cp, 2, d.B, d.S / d.cp, d.Hkv * d.hd};
  const Tensor k = random_tensor(kv, dt, g), v = random_tensor(kv, dt, g);
  Guarded wire(wire_shape, dt);
  cp_pack_kv(on, k, v, wire.view);
  wire.expect_intact("pack");
  Guarded k2(kv, dt), v2(kv, dt);
  cp_unpack_kv(on, wire.view, k2.view, v2.view);
  EXPECT_TRUE(bytes_equal(k2.view, k)) << "unpack∘pack is not the identity on K";
  EXPECT_TRUE(bytes_equal(v2.view, v)) << "unpack∘pack is not the identity on V";
  k2.expect_intact("unpack K");
  v2.expect_intact("unpack V");

  const Tensor w = random_tensor(wire_shape, dt, g);
  Guarded k3(kv, dt), v3(kv, dt);
  cp_unpack_kv(on, w, k3.view, v3.view);
  k3.expect_intact("unpack K");
  v3.expect_intact("unpack V");
  Guarded wire2(wire_shape, dt);
  cp_pack_kv(on, k3.view, v3.view, wire2.view);
  EXPECT_TRUE(bytes_equal(wire2.view, w)) << "pack∘unpack is not the identity";
  wire2.expect_intact("pack");
}

TEST(CpKernels, PackAndUnpackInvertEachOther) {
  uint32_t seed = 100;
  for (const KvDims& d : kKvShapes) check_round_trips(d, DType::f32, ++seed);
}

TEST(CpKernels, RoundTripsAreByteExactForEveryElementSize) {
  const KvDims d{3, 2, 12, 2, 3};
  uint32_t seed = 300;
  for (DType dt : {DType::bf16, DType::i32, DType::u8, DType::f64}) check_round_trips(d, dt, ++seed);
}

TEST(CpKernels, PackingIsIndependentOfTheThreadCount) {
  // 2·B·S·E·4 = 2 MiB, above the size at which the copies go parallel.
  const KvDims d{4, 2, 256, 4, 128};
  std::mt19937 g(testing::test_seed(400));
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
  check_round_trips(d, DType::f32, 401, ExecContext::cpu(3));  // and the guards at this size, on 3 threads
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

// Multi-rank tests of Communicator's Tensor overloads over MPI, run by CTest
// under `mpirun -np N` for N = 1, 2, 3, 4, 8. Every op on every group of a
// folded layout, every communicable dtype (f32, i32, i64; bf16 for the ops
// that only move data, and its sums and maxima through MPI user ops), rank-tagged data (a value names the world rank and
// index it came from, never zero); each Tensor call counts exactly the bytes
// and sequence numbers of the span call over the same elements; host tensors
// on Groups go over MPI and count as host memory. The refusal rules
// (memory_refusal) are checked here too; that a refused call aborts with its
// message is tests/test_comm_tensor_checks.cpp.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "comm/groups.h"
#include "comm/tensor_memory.h"
#include "kernels/bf16.h"
#include "mpi_test_main.h"

namespace origami::comm {
namespace {

using testing::world_rank;
using testing::world_size;

constexpr CommOptions kOptions{30.0};

LayoutOptions folded_layout(int w) {
  LayoutOptions o;
  if (w % 4 == 0) {  // dense tp = 2, expert ep = 2 (and pp = 2 at 8): groups differ between the views
    o.tp = 2;
    o.ep = 2;
    o.pp = w >= 8 ? 2 : 1;
  } else {
    o.ep = w;
  }
  o.num_experts = 12 * o.ep;
  return o;
}

template <class F>
void for_each_group(F&& body) {
  Groups g = Groups::create(Layout(world_size(), folded_layout(world_size())), MPI_COMM_WORLD, GroupsOptions{
                                                                                                   .comm = kOptions});
  body(g.world());
  for (GroupKind k : kAllGroupKinds)
    if (g.has(k)) body(g[k]);
}

// Value i from world rank r: exact in f32, i32, i64 and as 16-bit bf16 words (r < 64, i < 1000).
int64_t tag(int r, int64_t i) { return 1000 * (r + 1) + i; }

// Tensor element access by dtype: bf16 as its 16-bit word (moves are bitwise).
void put(const Tensor& t, int64_t i, int64_t v) {
  switch (t.dtype()) {
    case DType::f32: t.data<float>()[i] = static_cast<float>(v); return;
    case DType::i32: t.data<int32_t>()[i] = static_cast<int32_t>(v); return;
    case DType::i64: t.data<int64_t>()[i] = v; return;
    case DType::bf16: static_cast<uint16_t*>(t.raw())[i] = static_cast<uint16_t>(v); return;
    default: FAIL() << "dtype " << to_string(t.dtype());
  }
}
int64_t get(const Tensor& t, int64_t i) {
  switch (t.dtype()) {
    case DType::f32: return static_cast<int64_t>(t.data<float>()[i]);
    case DType::i32: return t.data<int32_t>()[i];
    case DType::i64: return t.data<int64_t>()[i];
    case DType::bf16: return static_cast<uint16_t*>(t.raw())[i];
    default: ADD_FAILURE() << "dtype " << to_string(t.dtype()); return 0;
  }
}
Tensor filled(Shape s, DType dt, int64_t v) {
  Tensor t = Tensor::empty(std::move(s), dt, MemCategory::comm);
  for (int64_t i = 0; i < t.numel(); ++i) put(t, i, v);
  return t;
}
std::string where(int64_t v) {
  return "value " + std::to_string(v) + " (rank " + std::to_string(v / 1000 - 1) + " index " +
         std::to_string(v % 1000) + ")";
}

// Bytes and sequence numbers the call adds, checked against what `span_call`
// (the same op over a span of the same elements) adds.
template <class F, class G>
void expect_counts_match(Communicator& c, CommOp op, F&& tensor_call, G&& span_call) {
  const int64_t b0 = c.stats(op).bytes, s0 = c.next_seq();
  tensor_call();
  const int64_t tensor_bytes = c.stats(op).bytes - b0;
  EXPECT_EQ(c.next_seq(), s0 + 1) << c.name() << " " << op_name(op) << ": one sequence number per call";
  const int64_t b1 = c.stats(op).bytes;
  span_call();
  EXPECT_EQ(tensor_bytes, c.stats(op).bytes - b1) << c.name() << " " << op_name(op) << ": Tensor vs span bytes";
  EXPECT_EQ(c.stats(op).device_calls, 0) << c.name() << ": host tensors are host memory";
}

const DType kReducible[] = {DType::f32, DType::i32, DType::i64};
const DType kMovable[] = {DType::f32, DType::i32, DType::i64, DType::bf16};

TEST(CommMpiTensors, AllReduceSumAndMax) {
  for_each_group([](Communicator& c) {
    for (DType dt : kReducible) {
      Tensor sum = filled({3, 5}, dt, 0), mx = filled({15}, dt, 0);
      for (int64_t i = 0; i < 15; ++i) {
        put(sum, i, tag(world_rank(), i));
        put(mx, i, tag(world_rank(), i));
      }
      c.all_reduce(sum);
      c.all_reduce(mx, ReduceOp::max);
      for (int64_t i = 0; i < 15; ++i) {
        int64_t e = 0;
        for (int m : c.members()) e += tag(m, i);
        ASSERT_EQ(get(sum, i), e) << c.name() << " " << to_string(dt) << " element " << i;
        ASSERT_EQ(get(mx, i), tag(c.members().back(), i)) << c.name() << " " << where(get(mx, i));
      }
    }
    std::vector<float> v(15, 1.0f);
    expect_counts_match(
        c, CommOp::all_reduce, [&] { c.all_reduce(filled({15}, DType::f32, 1)); }, [&] { c.all_reduce(std::span(v)); });
  });
}

TEST(CommMpiTensors, AllGatherEveryMovableDtype) {
  for_each_group([](Communicator& c) {
    const int64_t block = 4, n = c.size();
    for (DType dt : kMovable) {
      Tensor send = filled({block}, dt, 0), recv = filled({n, block}, dt, 7);
      for (int64_t i = 0; i < block; ++i) put(send, i, tag(world_rank(), i));
      c.all_gather(send, recv);
      for (int p = 0; p < n; ++p)
        for (int64_t i = 0; i < block; ++i)
          ASSERT_EQ(get(recv, p * block + i), tag(c.members()[p], i))
              << c.name() << " " << to_string(dt) << " block " << p << ": " << where(get(recv, p * block + i));
    }
    std::vector<int32_t> s(block, 1), r(static_cast<size_t>(n * block));
    expect_counts_match(
        c, CommOp::all_gather, [&] { c.all_gather(filled({block}, DType::i32, 1), filled({n * block}, DType::i32, 0)); },
        [&] { c.all_gather(std::span<const int32_t>(s), std::span(r)); });
    // bf16 counts 2 bytes an element.
    const int64_t b0 = c.stats(CommOp::all_gather).bytes;
    c.all_gather(filled({block}, DType::bf16, 1), filled({n * block}, DType::bf16, 0));
    EXPECT_EQ(c.stats(CommOp::all_gather).bytes - b0, (n - 1) * block * 2);
  });
}

TEST(CommMpiTensors, ReduceScatter) {
  for_each_group([](Communicator& c) {
    const int64_t block = 3, n = c.size();
    for (DType dt : kReducible) {
      Tensor send = filled({n, block}, dt, 0), recv = filled({block}, dt, 0);
      for (int64_t b = 0; b < n; ++b)
        for (int64_t j = 0; j < block; ++j) put(send, b * block + j, tag(world_rank(), 10 * b + j));
      c.reduce_scatter(send, recv);
      for (int64_t j = 0; j < block; ++j) {
        int64_t e = 0;
        for (int m : c.members()) e += tag(m, 10 * c.rank() + j);
        ASSERT_EQ(get(recv, j), e) << c.name() << " " << to_string(dt) << " element " << j;
      }
    }
    std::vector<float> s(static_cast<size_t>(n * block), 1.0f), r(block);
    expect_counts_match(
        c, CommOp::reduce_scatter,
        [&] { c.reduce_scatter(filled({n * block}, DType::f32, 1), filled({block}, DType::f32, 0)); },
        [&] { c.reduce_scatter(std::span<const float>(s), std::span(r)); });
  });
}

int64_t v_count(int p) { return (p + 2) % 3; }  // zero for some ranks

TEST(CommMpiTensors, AllGatherVAndReduceScatterV) {
  for_each_group([](Communicator& c) {
    const int n = c.size();
    std::vector<int64_t> counts(n);
    for (int p = 0; p < n; ++p) counts[p] = v_count(p);
    const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0}), own = counts[c.rank()];
    for (DType dt : kMovable) {
      Tensor mine = filled({own}, dt, 0), all = filled({total}, dt, 7);
      for (int64_t j = 0; j < own; ++j) put(mine, j, tag(world_rank(), j));
      c.all_gather_v(mine, all, counts);
      int64_t off = 0;
      for (int p = 0; p < n; ++p)
        for (int64_t j = 0; j < counts[p]; ++j, ++off)
          ASSERT_EQ(get(all, off), tag(c.members()[p], j)) << c.name() << " " << to_string(dt) << ": " << where(get(all, off));
    }
    for (DType dt : kReducible) {
      Tensor send = filled({total}, dt, 0), recv = filled({own}, dt, 0);
      int64_t off = 0;
      for (int p = 0; p < n; ++p)
        for (int64_t j = 0; j < counts[p]; ++j, ++off) put(send, off, tag(world_rank(), 10 * p + j));
      c.reduce_scatter_v(send, recv, counts);
      for (int64_t j = 0; j < own; ++j) {
        int64_t e = 0;
        for (int m : c.members()) e += tag(m, 10 * c.rank() + j);
        ASSERT_EQ(get(recv, j), e) << c.name() << " " << to_string(dt);
      }
    }
    std::vector<int64_t> s(static_cast<size_t>(own), 1), a(static_cast<size_t>(total));
    expect_counts_match(
        c, CommOp::all_gather, [&] { c.all_gather_v(filled({own}, DType::i64, 1), filled({total}, DType::i64, 0), counts); },
        [&] { c.all_gather_v(std::span<const int64_t>(s), std::span(a), counts); });
    std::vector<float> rs(static_cast<size_t>(total), 1.0f), ro(static_cast<size_t>(own));
    expect_counts_match(
        c, CommOp::reduce_scatter,
        [&] { c.reduce_scatter_v(filled({total}, DType::f32, 1), filled({own}, DType::f32, 0), counts); },
        [&] { c.reduce_scatter_v(std::span<const float>(rs), std::span(ro), counts); });
  });
}

int64_t a2a_count(int s, int d) { return (s + 2 * d) % 3 * 2; }

TEST(CommMpiTensors, AllToAllVEveryMovableDtype) {
  for_each_group([](Communicator& c) {
    const int n = c.size(), me = world_rank();
    std::vector<int64_t> sc(n), rc(n);
    for (int p = 0; p < n; ++p) {
      sc[p] = a2a_count(me, c.members()[p]);
      rc[p] = a2a_count(c.members()[p], me);
    }
    const int64_t st = std::accumulate(sc.begin(), sc.end(), int64_t{0});
    const int64_t rt = std::accumulate(rc.begin(), rc.end(), int64_t{0});
    for (DType dt : kMovable) {
      Tensor send = filled({st}, dt, 0), recv = filled({rt}, dt, 7);
      int64_t off = 0;
      for (int p = 0; p < n; ++p)
        for (int64_t j = 0; j < sc[p]; ++j) put(send, off++, tag(me, 10 * p + j));
      c.all_to_all_v(send, sc, recv, rc);
      off = 0;
      for (int p = 0; p < n; ++p)
        for (int64_t j = 0; j < rc[p]; ++j, ++off)
          ASSERT_EQ(get(recv, off), tag(c.members()[p], 10 * c.rank() + j))
              << c.name() << " " << to_string(dt) << " from rank " << p << ": " << where(get(recv, off));
    }
    std::vector<int32_t> s(static_cast<size_t>(st), 1), r(static_cast<size_t>(rt));
    expect_counts_match(
        c, CommOp::all_to_all_v, [&] { c.all_to_all_v(filled({st}, DType::i32, 1), sc, filled({rt}, DType::i32, 0), rc); },
        [&] { c.all_to_all_v(std::span<const int32_t>(s), sc, std::span(r), rc); });
  });
}

TEST(CommMpiTensors, SendRecvAndBroadcastEveryMovableDtype) {
  for_each_group([](Communicator& c) {
    const int n = c.size(), next = (c.rank() + 1) % n, prev = (c.rank() + n - 1) % n;
    for (DType dt : kMovable) {
      Tensor out = filled({2, 3}, dt, 0), in = filled({6}, dt, 7);
      for (int64_t i = 0; i < 6; ++i) put(out, i, tag(world_rank(), i));
      Request r = c.recv_async(in, prev, 3);
      c.send(out, next, 3);
      r.wait();
      for (int64_t i = 0; i < 6; ++i)
        ASSERT_EQ(get(in, i), tag(c.members()[prev], i)) << c.name() << " " << to_string(dt) << ": " << where(get(in, i));
      for (int root = 0; root < n; ++root) {
        Tensor data = filled({5}, dt, 7);
        if (c.rank() == root)
          for (int64_t i = 0; i < 5; ++i) put(data, i, tag(world_rank(), i));
        c.broadcast_async(data, root).wait_on(nullptr);  // host memory: a host wait
        for (int64_t i = 0; i < 5; ++i)
          ASSERT_EQ(get(data, i), tag(c.members()[root], i)) << c.name() << " root " << root << ": " << where(get(data, i));
      }
    }
    // send counts its elements, recv nothing: the same for both forms.
    std::vector<double> so(6, 1.0), si(6);
    const Tensor to = filled({6}, DType::i64, 1), from = filled({6}, DType::i64, 0);
    const int64_t s0 = c.next_seq(), sb0 = c.stats(CommOp::send).bytes;
    {
      Request r = c.recv_async(from, prev, 4);
      c.send(to, next, 4);
    }
    const int64_t tensor_bytes = c.stats(CommOp::send).bytes - sb0;
    {
      Request r = c.recv_async(std::span(si), prev, 4);
      c.send(std::span<const double>(so), next, 4);
    }
    EXPECT_EQ(c.next_seq(), s0 + 4);
    EXPECT_EQ(tensor_bytes, 6 * 8);
    EXPECT_EQ(c.stats(CommOp::send).bytes - sb0, 2 * 6 * 8);
    EXPECT_EQ(c.stats(CommOp::recv).bytes, 0);
    std::vector<float> b(5, 1.0f);
    expect_counts_match(
        c, CommOp::broadcast, [&] { c.broadcast(filled({5}, DType::f32, 1), 0); }, [&] { c.broadcast(std::span(b), 0); });
  });
}

TEST(CommMpiTensors, GroupsSendHostTensorsOverMpi) {
  Groups g = Groups::create(Layout(world_size(), folded_layout(world_size())), MPI_COMM_WORLD, GroupsOptions{
                                                                                                   .comm = kOptions});
  EXPECT_EQ(g.compute_device(), Device::cpu());
  EXPECT_EQ(g.backend(), Backend::mpi);
  for (GroupKind k : kAllGroupKinds) {
    if (!g.has(k)) continue;
    Communicator& c = g[k];
    EXPECT_EQ(c.backend(), Backend::mpi) << c.name();
    Tensor t = filled({4}, DType::f32, tag(world_rank(), 1));
    c.all_reduce(t);
    EXPECT_EQ(get(t, 0), [&] {
      int64_t e = 0;
      for (int m : c.members()) e += tag(m, 1);
      return e;
    }()) << c.name();
    EXPECT_EQ(c.stats(CommOp::all_reduce).calls, 1) << c.name();
    EXPECT_EQ(c.stats(CommOp::all_reduce).device_calls, 0) << c.name();
    EXPECT_EQ(c.stats(CommOp::all_reduce).device_bytes, 0) << c.name();
  }
}

TEST(CommMpiTensors, MemoryOfATensorView) {
  Tensor t = filled({4, 3}, DType::i32, 0);
  const Tensor rows = t.slice(1, 2);
  const TensorMemory m = memory_of(rows);
  EXPECT_EQ(m.data, static_cast<void*>(t.data<int32_t>() + 3));
  EXPECT_EQ(m.count, 6);
  EXPECT_EQ(m.type, ElemType::i32);
  EXPECT_EQ(m.device, Device::cpu());
  EXPECT_EQ(comm_elem_type(DType::bf16), ElemType::bf16);
  EXPECT_EQ(comm_elem_type(DType::f64), ElemType::f64);
  EXPECT_EQ(comm_elem_type(DType::u8), std::nullopt);
  EXPECT_EQ(elem_size(ElemType::bf16), 2u);
}

// bf16 sums and maxima over MPI (the CPU ranks of the bf16 recipe reduce
// bf16 gradients): each rank contributes values of a random scale, so the
// sum of bf16 words is wrong by far if the op adds bits. Every combine rounds
// to bf16 (unit roundoff 2^-8), so the result is within n − 1 roundings of
// partial sums bounded by Σ|x| of the fp64 sum of the bf16 inputs:
// |err| <= (n − 1)·2^-8·Σ|x|, doubled for slack; the maximum is exact, and
// every rank of the group holds the same bits.
TEST(CommMpiTensors, Bf16ReductionsRoundEachCombine) {
  for_each_group([](Communicator& c) {
    SCOPED_TRACE(c.name());
    const int n = c.size();
    const int64_t per = 37, N = per * n;
    std::mt19937 rng(testing::test_seed(static_cast<uint32_t>(1234 + 17 * c.members()[static_cast<size_t>(c.rank())])));
    std::normal_distribution<float> nd(0.0f, 1.0f);
    Tensor x = Tensor::empty({N}, DType::bf16, MemCategory::comm);
    auto* w = static_cast<uint16_t*>(x.raw());
    for (int64_t i = 0; i < N; ++i) w[i] = bf16_bits(nd(rng) * std::ldexp(1.0f, static_cast<int>(i % 9) - 4));
    // The fp64 sums, maxima and Σ|x| of everyone's rounded inputs.
    Tensor wide = Tensor::empty({N}, DType::f64, MemCategory::comm), abs = Tensor::empty({N}, DType::f64,
                                                                                         MemCategory::comm);
    for (int64_t i = 0; i < N; ++i) {
      wide.data<double>()[i] = bf16_value(w[i]);
      abs.data<double>()[i] = std::fabs(bf16_value(w[i]));
    }
    Tensor mx = Tensor::empty({N}, DType::f64, MemCategory::comm);
    std::memcpy(mx.raw(), wide.raw(), static_cast<size_t>(N) * 8);
    c.all_reduce(wide);
    c.all_reduce(abs);
    c.all_reduce(mx, ReduceOp::max);

    Tensor sum = Tensor::empty({N}, DType::bf16, MemCategory::comm), top = Tensor::empty({N}, DType::bf16,
                                                                                          MemCategory::comm);
    std::memcpy(sum.raw(), x.raw(), static_cast<size_t>(N) * 2);
    std::memcpy(top.raw(), x.raw(), static_cast<size_t>(N) * 2);
    c.all_reduce(sum);
    c.all_reduce(top, ReduceOp::max);
    Tensor mine = Tensor::empty({per}, DType::bf16, MemCategory::comm);
    c.reduce_scatter(x, mine);
    const auto* s = static_cast<const uint16_t*>(sum.raw());
    const auto* t = static_cast<const uint16_t*>(top.raw());
    const auto* m = static_cast<const uint16_t*>(mine.raw());
    for (int64_t i = 0; i < N; ++i) {
      const double bound = 2.0 * (n - 1) * std::ldexp(1.0, -8) * abs.data<double>()[i];
      ASSERT_LE(std::fabs(bf16_value(s[i]) - wide.data<double>()[i]), bound) << "all_reduce element " << i;
      ASSERT_EQ(bf16_value(t[i]), mx.data<double>()[i]) << "max element " << i;
    }
    for (int64_t i = 0; i < per; ++i) {
      const int64_t g = c.rank() * per + i;
      const double bound = 2.0 * (n - 1) * std::ldexp(1.0, -8) * abs.data<double>()[g];
      ASSERT_LE(std::fabs(bf16_value(m[i]) - wide.data<double>()[g]), bound) << "reduce_scatter element " << g;
    }
    // The same bits on every rank: rank 0's sum, broadcast, equals each one's.
    Tensor first = Tensor::empty({N}, DType::bf16, MemCategory::comm);
    std::memcpy(first.raw(), sum.raw(), static_cast<size_t>(N) * 2);
    c.broadcast(first, 0);
    EXPECT_EQ(std::memcmp(first.raw(), sum.raw(), static_cast<size_t>(N) * 2), 0);
  });
}

TEST(CommMpiTensors, RefusalRules) {
  const Device gpu{DeviceKind::cuda, 1};
  // MPI: host memory only (not assumed CUDA-aware).
  EXPECT_NE(memory_refusal(Backend::mpi, gpu, ElemType::f32, CommOp::all_gather).find("memory on cuda:1, but the MPI "
                                                                                      "backend moves host memory only"),
            std::string::npos);
  // MPI: bf16 moves and reductions (through a bf16 user op: BF16ReductionsRoundEachCombine).
  for (CommOp op : {CommOp::all_gather, CommOp::all_to_all_v, CommOp::send, CommOp::recv, CommOp::broadcast,
                    CommOp::all_reduce, CommOp::reduce_scatter})
    EXPECT_EQ(memory_refusal(Backend::mpi, Device::cpu(), ElemType::bf16, op), "") << op_name(op);
  // NCCL: device memory only; bf16 reductions are fine there.
  EXPECT_NE(memory_refusal(Backend::nccl, Device::cpu(), ElemType::f32, CommOp::all_reduce).find("host memory, but the "
                                                                                                "NCCL backend"),
            std::string::npos);
  EXPECT_EQ(memory_refusal(Backend::nccl, gpu, ElemType::bf16, CommOp::all_reduce), "");
  EXPECT_EQ(memory_refusal(Backend::nccl, Device::cpu(), ElemType::f32, CommOp::barrier), "");
  EXPECT_EQ(to_string(gpu), "cuda:1");
}

}  // namespace
}  // namespace origami::comm

int main(int argc, char** argv) { return origami::testing::run_mpi_tests(argc, argv); }

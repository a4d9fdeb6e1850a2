// Multi-rank tests of the MPI Communicator, run by CTest under
// `mpirun -np N` for N = 1, 2, 3, 4, 8 (tests/CMakeLists.txt). Every op runs
// on every group kind of a folded layout for this world size, with
// rank-tagged data: a value encodes the world rank that produced it and its
// index, so a misroute reports where the data came from. Also: zero counts in
// all_to_all_v, overlapping async ops, and measured bytes against the ring
// formulas worked out independently here.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <numeric>
#include <thread>

#include "comm/agreement.h"
#include "comm/groups.h"
#include "comm/mpi_communicator.h"
#include "kernels/threads.h"
#include "mpi_test_main.h"

namespace origami::comm {
namespace {

using testing::world_rank;
using testing::world_size;

// Folded layouts per world size: dense and expert groups differ wherever the
// sizes allow. W = 8 is the tp=2, cp=1, pp=2, ep=2, etp=1, plus one
// with CP and ETP > 1; W = 4 likewise.
std::vector<LayoutOptions> layouts_for(int w) {
  auto mk = [](int64_t tp, int64_t cp, int64_t pp, int64_t ep, int64_t etp) {
    LayoutOptions o;
    o.tp = tp;
    o.cp = cp;
    o.pp = pp;
    o.ep = ep;
    o.etp = etp;
    o.num_experts = 12 * ep;
    return o;
  };
  switch (w) {
    case 1: return {mk(1, 1, 1, 1, 1)};
    case 2: return {mk(2, 1, 1, 2, 1)};
    case 3: return {mk(1, 1, 1, 3, 1)};
    case 4: return {mk(2, 1, 2, 2, 1), mk(1, 2, 1, 2, 2)};
    case 8: return {mk(2, 1, 2, 2, 1), mk(1, 2, 2, 2, 2)};
    default: return {mk(1, 1, 1, w, 1)};
  }
}

constexpr CommOptions kOptions{30.0};  // generous: 8 ranks share 2 cores in CI

// Value i sent by world rank r: exact in every element type for r < 64, i < 1000.
template <class T>
T tag(int r, int64_t i) {
  return static_cast<T>(1000 * (r + 1) + i);
}
// "rank R index I" for a tagged value, to say where misrouted data came from.
template <class T>
std::string untag(T v) {
  const int64_t x = static_cast<int64_t>(v);
  return "value " + std::to_string(x) + " (rank " + std::to_string(x / 1000 - 1) + " index " +
         std::to_string(x % 1000) + ")";
}

// Runs `body(kind name, communicator)` on every group this rank holds, for
// every layout of this world size, plus the world communicator; once as
// training runs them and once by NCCL's rules as the host stand-in runs them
// (CommOptions::check_in_flight and p2p_by_order), whose private copies must
// give the same results for every op, in place or not, with zero counts or not.
template <class F>
void for_each_group(F&& body) {
  for (bool check : {false, true}) {
    SCOPED_TRACE(check ? "in-flight check on" : "in-flight check off");
    CommOptions options = kOptions;
    options.check_in_flight = options.p2p_by_order = check;
    for (const LayoutOptions& o : layouts_for(world_size())) {
      Groups g = Groups::create(Layout(world_size(), o), MPI_COMM_WORLD, Backend::mpi, options);
      body(g.world());
      for (GroupKind k : kAllGroupKinds)
        if (g.has(k)) body(g[k]);
    }
  }
}

TEST(CommMpi, GroupsMatchTheLayout) {
  for (const LayoutOptions& o : layouts_for(world_size())) {
    const Layout l(world_size(), o);
    Groups g = Groups::create(l, MPI_COMM_WORLD, Backend::mpi, kOptions);
    for (GroupKind k : kAllGroupKinds) {
      const RankGroup expected = l.group_of(k, world_rank());
      ASSERT_EQ(g.has(k), !expected.empty()) << group_name(k);
      if (!g.has(k)) continue;
      Communicator& c = g[k];
      EXPECT_EQ(c.members(), expected) << group_name(k);
      EXPECT_EQ(c.name(), group_name(k));
      // The MPI communicator really holds those ranks, in that order.
      std::vector<int32_t> me{world_rank()}, all(static_cast<size_t>(c.size()));
      c.all_gather(std::span(me), std::span(all));
      EXPECT_EQ(std::vector<int>(all.begin(), all.end()), expected) << group_name(k);
      EXPECT_EQ(expected[static_cast<size_t>(c.rank())], world_rank());
    }
  }
}

template <class T>
void check_all_reduce(Communicator& c) {
  for (int64_t count : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{64}}) {
    std::vector<T> sum(static_cast<size_t>(count)), mx(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) {
      sum[i] = tag<T>(world_rank(), i);
      mx[i] = tag<T>(world_rank(), i);
    }
    c.all_reduce(std::span(sum));
    c.all_reduce(std::span(mx), ReduceOp::max);
    const int top = c.members().back();
    for (int64_t i = 0; i < count; ++i) {
      T expect = 0;
      for (int m : c.members()) expect += tag<T>(m, i);
      ASSERT_EQ(sum[i], expect) << c.name() << " sum, element " << i;
      ASSERT_EQ(mx[i], tag<T>(top, i)) << c.name() << " max, element " << i << ": " << untag(mx[i]);
    }
  }
}

TEST(CommMpi, AllReduceSumAndMaxOnEveryGroup) {
  for_each_group([](Communicator& c) {
    check_all_reduce<float>(c);
    check_all_reduce<double>(c);
    check_all_reduce<int32_t>(c);
    check_all_reduce<int64_t>(c);
  });
}

template <class T>
void check_all_gather(Communicator& c) {
  const int64_t block = 5;
  std::vector<T> send(block), recv(static_cast<size_t>(block * c.size()));
  for (int64_t i = 0; i < block; ++i) send[i] = tag<T>(world_rank(), i);
  c.all_gather(std::span<const T>(send), std::span(recv));
  for (int p = 0; p < c.size(); ++p)
    for (int64_t i = 0; i < block; ++i)
      ASSERT_EQ(recv[p * block + i], tag<T>(c.members()[p], i))
          << c.name() << ": block " << p << " holds " << untag(recv[p * block + i]);
  // In place: this rank's block already sits in its slot.
  std::vector<T> inplace(static_cast<size_t>(block * c.size()), T(-1));
  for (int64_t i = 0; i < block; ++i) inplace[c.rank() * block + i] = tag<T>(world_rank(), i);
  c.all_gather(std::span<const T>(inplace.data() + c.rank() * block, block), std::span(inplace));
  ASSERT_EQ(inplace, recv) << c.name() << " in place";
}

TEST(CommMpi, AllGatherOnEveryGroup) {
  for_each_group([](Communicator& c) {
    check_all_gather<float>(c);
    check_all_gather<int64_t>(c);
  });
}

TEST(CommMpi, ReduceScatterOnEveryGroup) {
  for_each_group([](Communicator& c) {
    // Block b of rank m's input: 1000·(m+1) + 10·b + j. Rank b receives the
    // sum over members, so the block index shows in every element.
    const int64_t block = 3, n = c.size();
    std::vector<float> send(static_cast<size_t>(block * n)), recv(block);
    std::vector<float> mx(static_cast<size_t>(block * n)), recv_mx(block);
    for (int64_t b = 0; b < n; ++b)
      for (int64_t j = 0; j < block; ++j)
        send[b * block + j] = mx[b * block + j] = tag<float>(world_rank(), 10 * b + j);
    c.reduce_scatter(std::span<const float>(send), std::span(recv));
    c.reduce_scatter(std::span<const float>(mx), std::span(recv_mx), ReduceOp::max);
    for (int64_t j = 0; j < block; ++j) {
      float expect = 0;
      for (int m : c.members()) expect += tag<float>(m, 10 * c.rank() + j);
      ASSERT_EQ(recv[j], expect) << c.name() << " element " << j;
      ASSERT_EQ(recv_mx[j], tag<float>(c.members().back(), 10 * c.rank() + j)) << c.name() << ": " << untag(recv_mx[j]);
    }
  });
}

// Elements world rank s sends to world rank d: uneven, and zero for a third of the pairs.
int64_t a2a_count(int s, int d) { return (s + 2 * d) % 3 * 2; }

TEST(CommMpi, AllToAllVWithUnevenAndZeroCounts) {
  for_each_group([](Communicator& c) {
    const int n = c.size(), me = world_rank();
    std::vector<int64_t> sc(n), rc(n);
    for (int p = 0; p < n; ++p) {
      sc[p] = a2a_count(me, c.members()[p]);
      rc[p] = a2a_count(c.members()[p], me);
    }
    std::vector<int32_t> send, recv(static_cast<size_t>(std::accumulate(rc.begin(), rc.end(), int64_t{0})), -1);
    // The index carries the destination's group rank, so a block sent to the
    // wrong peer shows both ends.
    for (int p = 0; p < n; ++p)
      for (int64_t j = 0; j < sc[p]; ++j) send.push_back(tag<int32_t>(me, 10 * p + j));
    c.all_to_all_v(std::span<const int32_t>(send), sc, std::span(recv), rc);
    size_t off = 0;
    for (int p = 0; p < n; ++p)
      for (int64_t j = 0; j < rc[p]; ++j, ++off)
        ASSERT_EQ(recv[off], tag<int32_t>(c.members()[p], 10 * c.rank() + j))
            << c.name() << ": from rank " << p << " element " << j << " got " << untag(recv[off]);
    // All counts zero: nothing moves, nothing breaks.
    std::vector<int64_t> zeros(n, 0);
    c.all_to_all_v(std::span<const int32_t>(), zeros, std::span<int32_t>(), zeros);
  });
}

// Variable blocks: group rank p owns (p + 2) % 3 elements — zero for some.
int64_t v_count(int p) { return (p + 2) % 3; }

TEST(CommMpi, AllGatherVAndReduceScatterVWithUnevenAndZeroBlocks) {
  for_each_group([](Communicator& c) {
    const int n = c.size(), me = world_rank();
    std::vector<int64_t> counts(n);
    for (int p = 0; p < n; ++p) counts[p] = v_count(p);
    const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
    std::vector<double> mine(static_cast<size_t>(counts[c.rank()]));
    for (size_t j = 0; j < mine.size(); ++j) mine[j] = tag<double>(me, static_cast<int64_t>(j));
    std::vector<double> all(static_cast<size_t>(total), -1);
    c.all_gather_v(std::span<const double>(mine), std::span(all), counts);
    size_t off = 0;
    for (int p = 0; p < n; ++p)
      for (int64_t j = 0; j < counts[p]; ++j, ++off)
        ASSERT_EQ(all[off], tag<double>(c.members()[p], j)) << c.name() << ": block " << p << " got " << untag(all[off]);

    // reduce_scatter_v: block p of every member sums onto rank p.
    std::vector<float> send(static_cast<size_t>(total)), recv(static_cast<size_t>(counts[c.rank()]), -1);
    off = 0;
    for (int p = 0; p < n; ++p)
      for (int64_t j = 0; j < counts[p]; ++j, ++off) send[off] = tag<float>(me, 10 * p + j);
    c.reduce_scatter_v(std::span<const float>(send), std::span(recv), counts);
    for (int64_t j = 0; j < counts[c.rank()]; ++j) {
      float expect = 0;
      for (int m : c.members()) expect += tag<float>(m, 10 * c.rank() + j);
      ASSERT_EQ(recv[j], expect) << c.name() << " element " << j;
    }
    // Bytes: all_gather_v counts (n − 1) · own block, reduce_scatter_v every block but ours.
    const int64_t before_ag = c.stats(CommOp::all_gather).bytes, before_rs = c.stats(CommOp::reduce_scatter).bytes;
    c.all_gather_v(std::span<const double>(mine), std::span(all), counts);
    c.reduce_scatter_v(std::span<const float>(send), std::span(recv), counts);
    EXPECT_EQ(c.stats(CommOp::all_gather).bytes - before_ag, (n - 1) * counts[c.rank()] * 8);
    EXPECT_EQ(c.stats(CommOp::reduce_scatter).bytes - before_rs, (total - counts[c.rank()]) * 4);
  });
}

TEST(CommMpi, SendRecvAroundEachGroup) {
  for_each_group([](Communicator& c) {
    const int n = c.size(), next = (c.rank() + 1) % n, prev = (c.rank() + n - 1) % n;
    std::vector<double> out(4), in(4, -1);
    for (int64_t i = 0; i < 4; ++i) out[i] = tag<double>(world_rank(), i);
    Request r = c.recv_async(std::span(in), prev, 7);
    c.send(std::span<const double>(out), next, 7);
    r.wait();
    for (int64_t i = 0; i < 4; ++i)
      ASSERT_EQ(in[i], tag<double>(c.members()[prev], i)) << c.name() << ": " << untag(in[i]);
  });
}

TEST(CommMpi, BroadcastFromEveryRoot) {
  for_each_group([](Communicator& c) {
    for (int root = 0; root < c.size(); ++root) {
      std::vector<int64_t> data(6, -1);
      if (c.rank() == root)
        for (int64_t i = 0; i < 6; ++i) data[i] = tag<int64_t>(world_rank(), i);
      c.broadcast(std::span(data), root);
      for (int64_t i = 0; i < 6; ++i)
        ASSERT_EQ(data[i], tag<int64_t>(c.members()[root], i))
            << c.name() << " root " << root << ": " << untag(data[i]);
    }
    c.barrier();
  });
}

TEST(CommMpi, AsyncCollectivesOverlap) {
  const std::vector<LayoutOptions> ls = layouts_for(world_size());
  Groups g = Groups::create(Layout(world_size(), ls.back()), MPI_COMM_WORLD, Backend::mpi, kOptions);
  Communicator& a = g[GroupKind::tp_dp_cp];
  Communicator& b = g[GroupKind::ep];
  std::vector<float> x(33), y(33), gathered(static_cast<size_t>(2 * b.size()));
  for (int i = 0; i < 33; ++i) x[i] = y[i] = tag<float>(world_rank(), i);
  std::vector<float> mine = {tag<float>(world_rank(), 0), tag<float>(world_rank(), 1)};
  // Two outstanding ops on one communicator and one on another, waited out of order.
  Request r1 = a.all_reduce_async(std::span(x));
  Request r2 = b.all_gather_async(std::span<const float>(mine), std::span(gathered));
  Request r3 = a.all_reduce_async(std::span(y), ReduceOp::max);
  r3.wait();
  r2.wait();
  r1.wait();
  EXPECT_TRUE(r1.test());
  for (int i = 0; i < 33; ++i) {
    float s = 0;
    for (int m : a.members()) s += tag<float>(m, i);
    ASSERT_EQ(x[i], s);
    ASSERT_EQ(y[i], tag<float>(a.members().back(), i));
  }
  for (int p = 0; p < b.size(); ++p)
    ASSERT_EQ(gathered[2 * p + 1], tag<float>(b.members()[p], 1)) << untag(gathered[2 * p + 1]);
}

// Under the in-flight check a buffer an op writes reads as poison until the
// op's wait (NaN for floats, a negative value for integers), whatever MPI
// has already moved, and holds the results after it; a buffer it only reads
// is the caller's to read meanwhile. That is what makes a read that comes too
// early show on the CPU as it would race on a GPU.
TEST(CommMpi, InFlightCheckShowsAReceiveOnlyAfterItsWait) {
  CommOptions options = kOptions;
  options.check_in_flight = true;
  auto world = whole_mpi(MPI_COMM_WORLD, "world", options);
  const int n = world->size(), me = world->rank(), next = (me + 1) % n, prev = (me + n - 1) % n;
  std::vector<float> sum(9), in(5, 7.0f), out(5);
  for (int i = 0; i < 9; ++i) sum[i] = tag<float>(world_rank(), i);
  for (int i = 0; i < 5; ++i) out[i] = tag<float>(world_rank(), i);
  std::vector<int64_t> gathered(static_cast<size_t>(2 * n), 3), mine = {tag<int64_t>(world_rank(), 0), 5};
  Request r_in = world->recv_async(std::span(in), prev, 3);
  Request r_out = world->send_async(std::span<const float>(out), next, 3);
  Request r_sum = world->all_reduce_async(std::span(sum));
  Request r_gather = world->all_gather_async(std::span<const int64_t>(mine), std::span(gathered));
  world->barrier();  // every op has reached every rank: MPI may well have finished them
  for (float v : in) EXPECT_TRUE(std::isnan(v));
  for (float v : sum) EXPECT_TRUE(std::isnan(v));
  for (int64_t v : gathered) EXPECT_LT(v, 0);
  EXPECT_EQ(out[0], tag<float>(world_rank(), 0));  // a send buffer may be read meanwhile
  r_gather.wait();
  r_sum.wait();
  r_out.wait();
  r_in.wait();
  for (int i = 0; i < 5; ++i) ASSERT_EQ(in[i], tag<float>(world->members()[prev], i)) << untag(in[i]);
  for (int i = 0; i < 9; ++i) {
    float s = 0;
    for (int m : world->members()) s += tag<float>(m, i);
    ASSERT_EQ(sum[i], s);
  }
  for (int p = 0; p < n; ++p) ASSERT_EQ(gathered[2 * p], tag<int64_t>(p, 0)) << untag(gathered[2 * p]);
}

// p2p_by_order pairs point-to-point messages as NCCL does, by issue order
// alone: two messages sent with tags 1 then 2, received as tag 2 then tag 1,
// arrive by tag on MPI and by order under the option (the first receive
// gets the first message), so code that relies on tags shows on the CPU.
TEST(CommMpi, P2pByOrderPairsMessagesAsNcclDoesIgnoringTags) {
  for (bool by_order : {false, true}) {
    SCOPED_TRACE(by_order ? "by order" : "by tag");
    CommOptions options = kOptions;
    options.p2p_by_order = by_order;
    auto world = whole_mpi(MPI_COMM_WORLD, "world", options);
    const int n = world->size(), next = (world->rank() + 1) % n, prev = (world->rank() + n - 1) % n;
    std::vector<int32_t> first = {tag<int32_t>(world_rank(), 1)}, second = {tag<int32_t>(world_rank(), 2)};
    std::vector<int32_t> got_a(1, -1), got_b(1, -1);
    Request ra = world->recv_async(std::span(got_a), prev, /*tag=*/2);
    Request rb = world->recv_async(std::span(got_b), prev, /*tag=*/1);
    Request s1 = world->send_async(std::span<const int32_t>(first), next, /*tag=*/1);
    Request s2 = world->send_async(std::span<const int32_t>(second), next, /*tag=*/2);
    ra.wait();
    rb.wait();
    s1.wait();
    s2.wait();
    const int32_t from_first = tag<int32_t>(prev, 1), from_second = tag<int32_t>(prev, 2);
    EXPECT_EQ(got_a[0], by_order ? from_first : from_second) << untag(got_a[0]);
    EXPECT_EQ(got_b[0], by_order ? from_second : from_first) << untag(got_b[0]);
  }
}

// Exposed communication (OpStats::exposed_s): a rank that reaches an
// all-reduce 80 ms before the last rank waits about that long, and the wait is
// counted whether it blocks in the plain call or in a later wait of the async
// form; the late rank, finding its peers there, waits far less; a request
// already complete when waited adds nothing.
TEST(CommMpi, ExposedTimeCountsTheWaitForALatePeer) {
  auto world = whole_mpi(MPI_COMM_WORLD, "world", kOptions);
  if (world->size() == 1) {
    std::vector<float> v(4, 1.0f);
    world->all_reduce(std::span(v));
    EXPECT_EQ(world->stats(CommOp::all_reduce).exposed_s, 0.0) << "one rank waits for no one";
    return;
  }
  const bool late = world->rank() == world->size() - 1;
  constexpr double kDelay = 0.08;
  for (bool async : {false, true}) {
    SCOPED_TRACE(async ? "async" : "blocking");
    world->barrier();
    world->reset_stats();
    if (late) std::this_thread::sleep_for(std::chrono::duration<double>(kDelay));
    std::vector<float> v(4, 1.0f);
    if (async) {
      Request r = world->all_reduce_async(std::span(v));
      r.wait();
    } else {
      world->all_reduce(std::span(v));
    }
    ASSERT_EQ(v[0], static_cast<float>(world->size()));
    const double exposed = world->stats(CommOp::all_reduce).exposed_s;
    // The early ranks' wait spans the late one's sleep (less 10 ms for clock
    // and wake-up slack); the late rank's is bounded by scheduling on a
    // shared machine, so only checked to be well under the delay.
    if (late) EXPECT_LT(exposed, kDelay / 2);
    else EXPECT_GE(exposed, kDelay - 0.01);
    EXPECT_LT(exposed, 5.0);
    EXPECT_EQ(world->stats(CommOp::all_gather).exposed_s, 0.0) << "no all-gather ran";
  }
  // Complete before the wait: nothing exposed.
  world->barrier();
  world->reset_stats();
  std::vector<float> v(4, 1.0f);
  Request r = world->all_reduce_async(std::span(v));
  while (!r.test()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  r.wait();
  EXPECT_EQ(world->stats(CommOp::all_reduce).exposed_s, 0.0);
}

// Ring volumes derived here from first principles (not through ring_bytes).
TEST(CommMpi, MeasuredBytesEqualRingVolume) {
  for_each_group([](Communicator& c) {
    c.reset_stats();
    const int n = c.size(), r = c.rank();
    const int64_t seq0 = c.next_seq();
    // all_reduce of 10 floats: blocks of 10/n (+1 for the first 10 % n);
    // each rank sends every block but its own, once per phase.
    std::vector<float> v(10, 1.0f);
    c.all_reduce(std::span(v));
    int64_t others = 0;
    for (int b = 0; b < n; ++b)
      if (b != r) others += 10 / n + (b < 10 % n ? 1 : 0);
    EXPECT_EQ(c.stats(CommOp::all_reduce).bytes, 2 * others * 4) << c.name();
    // all_gather of 3 doubles per rank: forwards n-1 blocks.
    std::vector<double> s(3, 1.0), g(static_cast<size_t>(3 * n));
    c.all_gather(std::span<const double>(s), std::span(g));
    EXPECT_EQ(c.stats(CommOp::all_gather).bytes, (n - 1) * 3 * 8) << c.name();
    // reduce_scatter to 2 int64 per rank.
    std::vector<int64_t> rs(static_cast<size_t>(2 * n), 1), out(2);
    c.reduce_scatter(std::span<const int64_t>(rs), std::span(out));
    EXPECT_EQ(c.stats(CommOp::reduce_scatter).bytes, (n - 1) * 2 * 8) << c.name();
    // all_to_all_v: 1 + peer elements to each peer; the self block is free.
    std::vector<int64_t> sc(n), rc(n);
    int64_t sent = 0, total = 0;
    for (int p = 0; p < n; ++p) {
      sc[p] = 1 + p;
      rc[p] = 1 + r;
      total += sc[p];
      if (p != r) sent += sc[p];
    }
    std::vector<int32_t> a2a_in(static_cast<size_t>(total)), a2a_out(static_cast<size_t>(n * (1 + r)));
    c.all_to_all_v(std::span<const int32_t>(a2a_in), sc, std::span(a2a_out), rc);
    EXPECT_EQ(c.stats(CommOp::all_to_all_v).bytes, sent * 4) << c.name();
    // broadcast of 5 floats from 0 along the ring 0 → 1 → ... → n-1.
    std::vector<float> bc(5, 2.0f);
    c.broadcast(std::span(bc), 0);
    EXPECT_EQ(c.stats(CommOp::broadcast).bytes, (n > 1 && r != n - 1) ? 5 * 4 : 0) << c.name();
    c.barrier();
    EXPECT_EQ(c.stats(CommOp::barrier).bytes, 0);
    EXPECT_EQ(c.stats(CommOp::barrier).calls, 1);
    EXPECT_EQ(c.next_seq(), seq0 + 6) << "one sequence number per call";
    EXPECT_EQ(c.total_bytes(),
              2 * others * 4 + (n - 1) * 3 * 8 + (n - 1) * 2 * 8 + sent * 4 + ((n > 1 && r != n - 1) ? 20 : 0));
  });
}

// Every rank of these tests runs on this one node: MPI's shared-memory split
// (start_mpi) counts them, with no launcher variable to read (srun and
// hydra set none of Open MPI's).
TEST(NodePlacement, RanksOfThisNodeComeFromMpiNotTheLaunchersEnvironment) {
  ::unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  ::unsetenv("OMPI_COMM_WORLD_LOCAL_RANK");
  EXPECT_EQ(ranks_on_this_node(), world_size());
  EXPECT_EQ(local_rank_on_this_node(), world_rank());
}

// run_agreed: a user's error on the last rank alone (a UserError, or a
// filesystem_error naming its path) becomes a JobError on every rank with
// that rank's message and exit status 2; nothing thrown, nothing agreed.
TEST(Agreement, AUserOrFilesystemErrorOnOneRankStopsEveryRank) {
  const auto world = whole_mpi(MPI_COMM_WORLD, "agreement", kOptions);
  const int last = world->size() - 1;
  const std::string path = "/nonexistent/origami-agreement";
  const std::vector<std::function<void()>> failures = {
      [] { ORIGAMI_USER_ERROR("checkpoint.dir: a user's error"); },
      [&] { std::filesystem::directory_iterator it(path); }};
  for (size_t i = 0; i < failures.size(); ++i) {
    SCOPED_TRACE(i == 0 ? "UserError" : "filesystem_error");
    try {
      run_agreed(*world, [&] {
        if (world->rank() == last) failures[i]();
      });
      ADD_FAILURE() << "no error reached rank " << world->rank();
    } catch (const JobError& e) {
      EXPECT_EQ(e.exit_status(), kExitUserError);
      const std::string want = i == 0 ? "checkpoint.dir: a user's error" : path;
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
      if (world->size() > 1) {
        EXPECT_NE(std::string(e.what()).find("[rank " + std::to_string(last) + "]"), std::string::npos) << e.what();
      }
    }
  }
  EXPECT_NO_THROW(run_agreed(*world, [] {}));
}

// A meeting given its own wait (runtime.io_timeout_s: rank 0 writing the
// export while the rest wait) outlasts the group's collective timeout: rank
// 0 is 3× that timeout late, and every rank leaves together, unharmed. (The
// group's timeout alone would have ended the job: test_comm_timeout.)
TEST(Agreement, AnIoMeetingWaitsItsOwnTimeoutNotTheCollectiveOne) {
  const auto world = whole_mpi(MPI_COMM_WORLD, "io-meeting", CommOptions{0.5});
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_NO_THROW(run_agreed(
      *world,
      [&] {
        if (world->rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      },
      MeetingWait{60.0, "runtime.io_timeout_s"}));
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(waited, 1.4) << "every rank waited for rank 0";
  // The group still works afterwards, at its own timeout.
  int one = 1;
  world->all_reduce(std::span<int>(&one, 1), ReduceOp::sum);
  EXPECT_EQ(one, world->size());
}

}  // namespace
}  // namespace origami::comm

int main(int argc, char** argv) { return origami::testing::run_mpi_tests(argc, argv); }

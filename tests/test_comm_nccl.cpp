// The NCCL backend against the same rank-tagged expectations as the MPI tests,
// on device buffers. Skips (with the reason) in builds without NCCL and on
// machines without a CUDA device. Runs as one rank under CTest; under
// `mpirun -np N` on N GPUs it exercises real exchanges, which it launches
// itself where a machine has two GPUs. Groups with a CUDA
// compute device route each call by its memory: host Tensors over MPI,
// device buffers over NCCL, one sequence of call numbers for both.
#include <gtest/gtest.h>
#include <mpi.h>

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <numeric>
#include <string>
#include <thread>

#include "cli_util.h"

#include "comm/groups.h"
#include "comm/mpi_communicator.h"
#include "comm/nccl_communicator.h"
#include "kernels/bf16.h"
#include "kernels/tensor.h"

#if ORIGAMI_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#endif

namespace origami::comm {
namespace {

bool g_mpi_started = false;

#if ORIGAMI_WITH_NCCL

// MPI only once a test really runs: skipped tests stay cheap.
void ensure_mpi() {
  int init = 0;
  MPI_Initialized(&init);
  if (!init) {
    origami::start_mpi(nullptr, nullptr);
    g_mpi_started = true;
  }
}

bool have_device() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// A device copy of a host vector, copied back by `host()`.
template <class T>
class DeviceVec {
 public:
  explicit DeviceVec(const std::vector<T>& h) : n_(h.size()) {
    EXPECT_EQ(cudaMalloc(&p_, std::max<size_t>(1, n_) * sizeof(T)), cudaSuccess);
    if (n_) {
      EXPECT_EQ(cudaMemcpy(p_, h.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  ~DeviceVec() { cudaFree(p_); }
  std::span<T> span() { return {p_, n_}; }
  std::vector<T> host() const {
    std::vector<T> h(n_);
    if (n_) {
      EXPECT_EQ(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return h;
  }

 private:
  T* p_ = nullptr;
  size_t n_;
};

template <class T>
T tag(int r, int64_t i) {
  return static_cast<T>(1000 * (r + 1) + i);
}

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

void exercise(Communicator& c) {
  ASSERT_EQ(c.backend(), Backend::nccl);
  const int n = c.size(), me = world_rank();
  // all_reduce sum and max, float and int64.
  std::vector<float> x(37);
  for (int64_t i = 0; i < 37; ++i) x[i] = tag<float>(me, i);
  DeviceVec<float> dx(x), dm(x);
  c.all_reduce(dx.span());
  c.all_reduce(dm.span(), ReduceOp::max);
  const std::vector<float> sum = dx.host(), mx = dm.host();
  for (int64_t i = 0; i < 37; ++i) {
    float e = 0;
    for (int m : c.members()) e += tag<float>(m, i);
    ASSERT_EQ(sum[i], e) << c.name() << " element " << i;
    ASSERT_EQ(mx[i], tag<float>(c.members().back(), i)) << c.name();
  }
  // all_gather.
  std::vector<int64_t> blk(4);
  for (int64_t i = 0; i < 4; ++i) blk[i] = tag<int64_t>(me, i);
  DeviceVec<int64_t> ds(blk), dg(std::vector<int64_t>(static_cast<size_t>(4 * n), -1));
  c.all_gather(ds.span(), dg.span());
  const std::vector<int64_t> g = dg.host();
  for (int p = 0; p < n; ++p)
    for (int64_t i = 0; i < 4; ++i) ASSERT_EQ(g[p * 4 + i], tag<int64_t>(c.members()[p], i)) << c.name();
  // reduce_scatter.
  std::vector<double> rs(static_cast<size_t>(3 * n));
  for (int64_t k = 0; k < 3 * n; ++k) rs[k] = tag<double>(me, k);
  DeviceVec<double> drs(rs), dro(std::vector<double>(3, -1));
  c.reduce_scatter(drs.span(), dro.span());
  const std::vector<double> ro = dro.host();
  for (int64_t j = 0; j < 3; ++j) {
    double e = 0;
    for (int m : c.members()) e += tag<double>(m, 3 * c.rank() + j);
    ASSERT_EQ(ro[j], e) << c.name();
  }
  // all_to_all_v with uneven counts, zero for some pairs (at two ranks and
  // more) and never all zero (a one-rank group moves its own block).
  std::vector<int64_t> sc(n), rc(n);
  std::vector<int32_t> send;
  for (int p = 0; p < n; ++p) {
    sc[p] = (me + 2 * c.members()[p] + 1) % 3 * 2;
    rc[p] = (c.members()[p] + 2 * me + 1) % 3 * 2;
    for (int64_t j = 0; j < sc[p]; ++j) send.push_back(tag<int32_t>(me, 10 * p + j));
  }
  DeviceVec<int32_t> da(send),
      db(std::vector<int32_t>(static_cast<size_t>(std::accumulate(rc.begin(), rc.end(), int64_t{0})), -1));
  c.all_to_all_v(da.span(), sc, db.span(), rc);
  const std::vector<int32_t> got = db.host();
  size_t off = 0;
  for (int p = 0; p < n; ++p)
    for (int64_t j = 0; j < rc[p]; ++j, ++off) ASSERT_EQ(got[off], tag<int32_t>(c.members()[p], 10 * c.rank() + j));
  // all_gather_v and reduce_scatter_v: member p's block holds 2 + p % 3 elements.
  std::vector<int64_t> counts(n);
  for (int p = 0; p < n; ++p) counts[p] = 2 + c.members()[p] % 3;
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  std::vector<double> mine(static_cast<size_t>(counts[c.rank()]));
  for (size_t j = 0; j < mine.size(); ++j) mine[j] = tag<double>(me, static_cast<int64_t>(j));
  DeviceVec<double> dmine(mine), dall(std::vector<double>(static_cast<size_t>(total), -1));
  c.all_gather_v(dmine.span(), dall.span(), counts);
  const std::vector<double> all = dall.host();
  off = 0;
  for (int p = 0; p < n; ++p)
    for (int64_t j = 0; j < counts[p]; ++j, ++off) ASSERT_EQ(all[off], tag<double>(c.members()[p], j)) << c.name();
  std::vector<float> blocks(static_cast<size_t>(total));
  off = 0;
  for (int p = 0; p < n; ++p)
    for (int64_t j = 0; j < counts[p]; ++j, ++off) blocks[off] = tag<float>(me, 10 * p + j);
  DeviceVec<float> dblocks(blocks), dmy(std::vector<float>(static_cast<size_t>(counts[c.rank()]), -1));
  c.reduce_scatter_v(dblocks.span(), dmy.span(), counts);
  const std::vector<float> my = dmy.host();
  for (int64_t j = 0; j < counts[c.rank()]; ++j) {
    float e = 0;
    for (int m : c.members()) e += tag<float>(m, 10 * c.rank() + j);
    ASSERT_EQ(my[j], e) << c.name() << " element " << j;
  }
  // bf16 (ncclBfloat16) through the Tensor form: small integers, exact in
  // bf16 and in their sum over the group.
  Tensor h16 = Tensor::empty({16}, DType::bf16, MemCategory::comm);
  for (int64_t i = 0; i < 16; ++i) static_cast<uint16_t*>(h16.raw())[i] = bf16_bits(static_cast<float>((me + 1) * 2 + i % 5));
  Tensor d16 = h16.to(local_cuda_device());
  c.all_reduce(d16);
  const Tensor back16 = d16.to(Device::cpu());
  for (int64_t i = 0; i < 16; ++i) {
    float e = 0;
    for (int m : c.members()) e += static_cast<float>((m + 1) * 2 + i % 5);
    ASSERT_EQ(bf16_value(static_cast<const uint16_t*>(back16.raw())[i]), e) << c.name() << " bf16 element " << i;
  }
  // bf16 out of place: all_gather and reduce_scatter write a buffer apart
  // from their input, so even in a group of one (the GPU check's) a 4-byte
  // type mapping would copy twice the bytes, past the 2-byte blocks, and a
  // wrong count half of them. The receive buffers start as a poison value
  // with a sentinel block behind them. Exact: small integers and their sums.
  const auto bf16_tensor = [](const std::vector<float>& v) {
    Tensor h = Tensor::empty({static_cast<int64_t>(v.size())}, DType::bf16, MemCategory::comm);
    for (size_t i = 0; i < v.size(); ++i) static_cast<uint16_t*>(h.raw())[i] = bf16_bits(v[i]);
    return h.to(local_cuda_device());
  };
  const auto bf16_host = [](const Tensor& d) {
    const Tensor h = d.to(Device::cpu());
    std::vector<float> v(static_cast<size_t>(h.numel()));
    for (size_t i = 0; i < v.size(); ++i) v[i] = bf16_value(static_cast<const uint16_t*>(h.raw())[i]);
    return v;
  };
  constexpr int64_t kBlk = 6, kTail = 4;
  std::vector<float> mine16(kBlk), rs16(static_cast<size_t>(kBlk * n));
  for (int64_t i = 0; i < kBlk; ++i) mine16[i] = static_cast<float>(me * 8 + i + 1);
  for (int64_t i = 0; i < kBlk * n; ++i) rs16[i] = static_cast<float>((me + 1) * (i % 7 + 1));
  const Tensor g16 = bf16_tensor(std::vector<float>(static_cast<size_t>(kBlk * n + kTail), -3.0f));
  c.all_gather(bf16_tensor(mine16), g16.slice(0, kBlk * n));
  const std::vector<float> gathered16 = bf16_host(g16);
  for (int p = 0; p < n; ++p)
    for (int64_t i = 0; i < kBlk; ++i)
      ASSERT_EQ(gathered16[p * kBlk + i], static_cast<float>(c.members()[p] * 8 + i + 1)) << c.name() << " bf16 all_gather";
  for (int64_t i = 0; i < kTail; ++i) ASSERT_EQ(gathered16[kBlk * n + i], -3.0f) << c.name() << " past the bf16 all_gather";
  const Tensor o16 = bf16_tensor(std::vector<float>(static_cast<size_t>(kBlk + kTail), -3.0f));
  c.reduce_scatter(bf16_tensor(rs16), o16.slice(0, kBlk));
  const std::vector<float> scattered16 = bf16_host(o16);
  for (int64_t j = 0; j < kBlk; ++j) {
    float e = 0;
    for (int m : c.members()) e += static_cast<float>((m + 1) * ((c.rank() * kBlk + j) % 7 + 1));
    ASSERT_EQ(scattered16[j], e) << c.name() << " bf16 reduce_scatter element " << j;
  }
  for (int64_t i = 0; i < kTail; ++i) ASSERT_EQ(scattered16[kBlk + i], -3.0f) << c.name() << " past the bf16 reduce_scatter";
  // broadcast from the last rank, async, overlapped with a barrier request on the same stream.
  std::vector<float> bc(5, -1.0f);
  if (c.rank() == n - 1)
    for (int64_t i = 0; i < 5; ++i) bc[i] = tag<float>(me, i);
  DeviceVec<float> dbc(bc);
  Request r = c.broadcast_async(dbc.span(), n - 1);
  c.barrier();
  r.wait();
  const std::vector<float> b = dbc.host();
  for (int64_t i = 0; i < 5; ++i) ASSERT_EQ(b[i], tag<float>(c.members().back(), i)) << c.name();
  // all_gather and all_gather_v: (n - 1) times the own block, 8-byte
  // elements; the bf16 all_gather's 2-byte ones.
  EXPECT_EQ(c.stats(CommOp::all_gather).bytes, (n - 1) * ((4 + counts[c.rank()]) * 8 + kBlk * 2));
  // send and recv around the group's ring, at two ranks and more (in a group
  // of one, a send to itself would wait on its own receive queued behind it
  // on the one stream). Calls on one communicator share its stream, so even
  // ranks send first and odd ones receive first: no two neighbours both wait.
  if (n > 1) {
    const int next = (c.rank() + 1) % n, prev = (c.rank() + n - 1) % n;
    std::vector<float> out(9);
    for (int64_t i = 0; i < 9; ++i) out[i] = tag<float>(me, 100 + i);
    DeviceVec<float> dout(out), din(std::vector<float>(9, -1.0f));
    const std::span<const float> send_span(dout.span());
    if (c.rank() % 2 == 0) {
      c.send(send_span, next);
      c.recv(din.span(), prev);
    } else {
      c.recv(din.span(), prev);
      c.send(send_span, next);
    }
    const std::vector<float> in = din.host();
    for (int64_t i = 0; i < 9; ++i) ASSERT_EQ(in[i], tag<float>(c.members()[prev], 100 + i)) << c.name();
    EXPECT_EQ(c.stats(CommOp::send).bytes, 9 * 4) << c.name();
  }
}

// Receives posted ahead from both ring neighbours, then the sends: the
// pipeline's pattern (a stage posts its next receives before it sends).
// On the group's one stream each receive would hold up the sends queued
// behind it, on every rank at once; the pp and cp groups' ring channels
// (CommOptions::ring_p2p) carry each direction on a stream of its own. At
// two ranks both neighbours are the one peer, whose two messages arrive in
// the order it sent them.
void receives_posted_ahead(Communicator& c) {
  const int n = c.size(), me = world_rank();
  if (n < 2) return;
  const int next = (c.rank() + 1) % n, prev = (c.rank() + n - 1) % n;
  std::vector<float> fwd(7), bwd(7);
  for (int64_t i = 0; i < 7; ++i) fwd[i] = tag<float>(me, 200 + i), bwd[i] = tag<float>(me, 300 + i);
  DeviceVec<float> dfwd(fwd), dbwd(bwd), from_prev(std::vector<float>(7, -1.0f)),
      from_next(std::vector<float>(7, -1.0f));
  Request a = c.recv_async(from_prev.span(), prev);
  Request b = c.recv_async(from_next.span(), next);
  c.send(std::span<const float>(dfwd.span()), next);
  c.send(std::span<const float>(dbwd.span()), prev);
  a.wait();
  b.wait();
  const std::vector<float> p = from_prev.host(), q = from_next.host();
  for (int64_t i = 0; i < 7; ++i) {
    ASSERT_EQ(p[i], tag<float>(c.members()[prev], 200 + i)) << c.name() << " from the previous rank";
    ASSERT_EQ(q[i], tag<float>(c.members()[next], 300 + i)) << c.name() << " from the next rank";
  }
}

// Groups over the world (every rank in one expert group) computing on this
// rank's GPU, each group routing host memory over MPI and device memory over
// NCCL; device ops order after `compute` (null: the legacy stream).
Groups routed_groups(double timeout_s, cudaStream_t compute = nullptr, double call_stall_s = 0) {
  ensure_mpi();
  int w = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &w);
  GroupsOptions go;
  go.compute_device = local_cuda_device();
  go.comm = CommOptions{timeout_s};
  go.comm.compute_stream = compute;
  go.comm.simulated_nccl_call_stall_s = call_stall_s;
  go.nccl_for_groups_of_one = true;  // one rank under CTest: every call path through NCCL all the same
  LayoutOptions o;
  o.ep = w;
  return Groups::create(Layout(w, o), MPI_COMM_WORLD, go);
}

#endif  // ORIGAMI_WITH_NCCL

TEST(CommNccl, EveryOpOnEveryGroupMatchesTheTaggedExpectation) {
#if !ORIGAMI_WITH_NCCL
  ASSERT_FALSE(nccl_available());
  GTEST_SKIP() << "this build has no NCCL backend (configured without CUDA)";
#else
  if (!have_device()) GTEST_SKIP() << "no CUDA device on this machine";
  ensure_mpi();
  int w = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &w);
  LayoutOptions o;
  o.ep = w;  // every rank in one expert group; dense dp spans the world too
  Groups g = Groups::create(Layout(w, o), MPI_COMM_WORLD, Backend::nccl, CommOptions{60});
  exercise(g.world());
  for (GroupKind k : kAllGroupKinds)
    if (g.has(k)) exercise(g[k]);
  // Under mpirun, the world as one pipeline and then as one CP ring: the
  // groups whose sends and receives run on ring channels (in a world of one
  // they are groups of one, exercised above).
  if (w > 1)
    for (const GroupKind ring : {GroupKind::pp, GroupKind::cp}) {
      LayoutOptions ro;
      (ring == GroupKind::pp ? ro.pp : ro.cp) = w;
      Groups rg = Groups::create(Layout(w, ro), MPI_COMM_WORLD, Backend::nccl, CommOptions{60});
      ASSERT_EQ(rg[ring].size(), w);
      exercise(rg[ring]);
      receives_posted_ahead(rg[ring]);
    }
#endif
}

// The multi-rank bodies of every call (a broadcast per root in
// all_gather_v, ncclReduce off-root in reduce_scatter_v, all_to_all_v's
// skipped zero counts, send and recv, the pp and cp groups' ring channels)
// need real peers: this binary's
// tagged-expectation tests again under mpirun -np 2, one GPU each. A
// one-GPU machine (the GPU check's) skips it, by design: NCCL refuses two
// ranks on one device.
TEST(CommNccl, TwoRanksOnTwoGpusMatchTheTaggedExpectations) {
#if !ORIGAMI_WITH_NCCL
  GTEST_SKIP() << "this build has no NCCL backend (configured without CUDA)";
#else
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 2)
    GTEST_SKIP() << "needs two CUDA devices (this machine has " << devices << ")";
  if (std::getenv("OMPI_COMM_WORLD_SIZE")) GTEST_SKIP() << "already under mpirun (the child run)";
  char self[4096] = {};
  ASSERT_GT(readlink("/proc/self/exe", self, sizeof(self) - 1), 0);
  const testing::CommandResult r = testing::run_command(
      std::string(ORIGAMI_MPIEXEC) + " --allow-run-as-root --oversubscribe --bind-to none -np 2 " +
      // origami's own settings (kernels/device.h): enough hardware queues that
      // the ring channels' streams and the groups' never share one.
      "-x CUDA_DEVICE_MAX_CONNECTIONS=32 -x CUDA_MODULE_LOADING=EAGER " + self +
      " --gtest_filter=CommNccl.EveryOpOnEveryGroupMatchesTheTaggedExpectation:"
      "CommNccl.GroupsRouteHostTensorsOverMpiAndDeviceMemoryOverNccl");
  EXPECT_EQ(r.status, 0) << r.output;
  size_t passed = 0;
  for (size_t at = 0; (at = r.output.find("[  PASSED  ] 2 tests", at)) != std::string::npos; ++at) ++passed;
  EXPECT_EQ(passed, 2u) << "both ranks pass both tests:\n" << r.output;
#endif
}

TEST(CommNccl, GroupsRouteHostTensorsOverMpiAndDeviceMemoryOverNccl) {
#if !ORIGAMI_WITH_NCCL
  GTEST_SKIP() << "this build has no NCCL backend (configured without CUDA)";
#else
  if (!have_device()) GTEST_SKIP() << "no CUDA device on this machine";
  Groups g = routed_groups(60);
  ASSERT_EQ(g.backend(), Backend::nccl);
  Communicator& c = g[GroupKind::ep];
  ASSERT_EQ(memory_device(nullptr), Device::cpu());
  const int me = world_rank();
  // Host metadata: a host Tensor goes over MPI and counts as host memory.
  Tensor counts = Tensor::empty({3}, DType::i64, MemCategory::comm);
  for (int64_t i = 0; i < 3; ++i) counts.data<int64_t>()[i] = tag<int64_t>(me, i);
  const int64_t seq0 = c.next_seq();
  c.all_reduce(counts);
  for (int64_t i = 0; i < 3; ++i) {
    int64_t e = 0;
    for (int m : c.members()) e += tag<int64_t>(m, i);
    ASSERT_EQ(counts.data<int64_t>()[i], e);
  }
  EXPECT_EQ(c.stats(CommOp::all_reduce).device_calls, 0);
  // Device memory (a span CUDA locates) goes over NCCL; waited on a stream.
  std::vector<float> x(9);
  for (int64_t i = 0; i < 9; ++i) x[i] = tag<float>(me, i);
  DeviceVec<float> dx(x);
  ASSERT_EQ(memory_device(dx.span().data()).kind, DeviceKind::cuda);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  c.all_reduce_async(dx.span()).wait_on(stream);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  const std::vector<float> sum = dx.host();
  for (int64_t i = 0; i < 9; ++i) {
    float e = 0;
    for (int m : c.members()) e += tag<float>(m, i);
    ASSERT_EQ(sum[i], e);
  }
  cudaStreamDestroy(stream);
  EXPECT_EQ(c.stats(CommOp::all_reduce).calls, 2);
  EXPECT_EQ(c.stats(CommOp::all_reduce).device_calls, 1);
  EXPECT_EQ(c.stats(CommOp::all_reduce).device_bytes, ring_bytes::all_reduce(9, 4, c.rank(), c.size()));
  EXPECT_EQ(c.next_seq(), seq0 + 2) << "one sequence of call numbers over both backends";
  c.barrier();  // a host synchronization over MPI
#endif
}

// A blocking collective on device Tensors completes for the compute stream,
// not the host: with that stream held 1 s by a sleeping host function (the
// op waits for it: its inputs may still be being written there), the call
// returns at once, and the sum is there once the stream has run. Before,
// the host waited the whole second. A routed group takes its compute stream
// from its NCCL communicator. The compute stream's waits on device ops are
// the exposed communication: near zero for that op, whose own time is
// microseconds, and about half a second for one held that long itself.
TEST(CommNccl, BlockingDeviceCollectivesWaitOnTheComputeStreamNotTheHost) {
#if !ORIGAMI_WITH_NCCL
  GTEST_SKIP() << "this build has no NCCL backend (configured without CUDA)";
#else
  if (!have_device()) GTEST_SKIP() << "no CUDA device on this machine";
  ensure_mpi();
  cudaStream_t compute = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking), cudaSuccess);
  Groups g = routed_groups(60, compute);
  Communicator& c = g[GroupKind::ep];
  ASSERT_EQ(c.compute_stream(), static_cast<void*>(compute));
  const int me = world_rank();
  Tensor host = Tensor::empty({9}, DType::f32, MemCategory::comm);
  for (int64_t i = 0; i < 9; ++i) host.data<float>()[i] = tag<float>(me, i);
  Tensor dx = host.to(local_cuda_device());
  ASSERT_EQ(cudaLaunchHostFunc(
                compute, [](void*) { std::this_thread::sleep_for(std::chrono::seconds(1)); }, nullptr),
            cudaSuccess);
  const auto t0 = std::chrono::steady_clock::now();
  c.all_reduce(dx);
  const double returned_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(returned_s, 0.5) << "the host waited for a device collective";
  ASSERT_EQ(cudaStreamSynchronize(compute), cudaSuccess);
  const Tensor sum = dx.to(Device::cpu());
  for (int64_t i = 0; i < 9; ++i) {
    float e = 0;
    for (int m : c.members()) e += tag<float>(m, i);
    ASSERT_EQ(sum.data<float>()[i], e);
  }
  EXPECT_EQ(c.stats(CommOp::all_reduce).device_calls, 1);
  c.settle_stream_waits();
  // The op's own time was microseconds (it started once the stream let it):
  // next to nothing exposed.
  EXPECT_GE(c.stats(CommOp::all_reduce).exposed_s, 0.0);
  EXPECT_LT(c.stats(CommOp::all_reduce).exposed_s, 0.3);
  // Now the op itself is held: the communicator's stream is a blocking one,
  // so it queues behind a host function sleeping 0.5 s on the legacy
  // stream, and the compute stream stands that long waiting for the sum:
  // exposed communication (OpStats::exposed_s, the step line's figure).
  const double before = c.stats(CommOp::all_reduce).exposed_s;
  ASSERT_EQ(cudaLaunchHostFunc(
                cudaStreamLegacy, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(500)); }, nullptr),
            cudaSuccess);
  c.all_reduce(dx);
  ASSERT_EQ(cudaStreamSynchronize(compute), cudaSuccess);
  c.settle_stream_waits();
  const double exposed = c.stats(CommOp::all_reduce).exposed_s - before;
  EXPECT_GT(exposed, 0.4) << "the compute stream's wait for a held op was not counted";
  EXPECT_LT(exposed, 2.0);
  c.barrier();
  cudaStreamDestroy(compute);
#endif
}

// A death-test child whose all-reduce on the ep group the watchdog must
// end: exit status 5 naming group, op and sequence, then `what`, well
// inside the child's 120 s stall (the 60 s bound leaves it its start-up:
// MPI, the CUDA context, one NCCL communicator per group kind).
template <class Child>
void expect_watchdog_timeout(Child child, const std::string& what, const char* too_late) {
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EXIT(child(), ::testing::ExitedWithCode(5),
              "collective timeout \\(NCCL watchdog\\): group ep op all_reduce seq [0-9]+ bytes [0-9]+ " + what);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 60.0) << too_late;
}

// The NCCL watchdog: an all-reduce handed to a stream (wait_on, no host
// wait) that cannot start, because the compute stream it waits on is held by
// a host function sleeping 120 s, aborts the job with exit status 5 about a
// second past its 1 s timeout, naming group, op and sequence. The main thread
// meanwhile stands in a stream synchronization that would otherwise last
// the whole sleep. The bound, 60 s, leaves the child its start-up (MPI, the
// CUDA context, one NCCL communicator per group kind) however slow that is
// on the machine, and is still half the sleep.
TEST(CommNcclDeathTest, TheWatchdogAbortsAnOpStuckBehindItsStream) {
#if !ORIGAMI_WITH_NCCL
  GTEST_SKIP() << "this build has no NCCL backend (configured without CUDA)";
#else
  if (!have_device()) GTEST_SKIP() << "no CUDA device on this machine";
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the child starts afresh: CUDA and MPI do not survive fork
  auto stuck = [] {
    ensure_mpi();
    cudaStream_t compute = nullptr;
    if (cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking) != cudaSuccess) std::exit(1);
    Groups g = routed_groups(1.0, compute);
    DeviceVec<float> dx(std::vector<float>(9, 1.0f));
    cudaLaunchHostFunc(
        compute, [](void*) { std::this_thread::sleep_for(std::chrono::seconds(120)); }, nullptr);
    g[GroupKind::ep].all_reduce_async(dx.span()).wait_on(compute);
    cudaStreamSynchronize(compute);
    std::exit(0);  // not reached: the watchdog aborts first
  };
  expect_watchdog_timeout(stuck, "not done", "the watchdog fired only when the stream let the op go");
#endif
}

// The host standing inside an NCCL call, as it does while NCCL connects a
// communicator to a peer that never makes its matching call (NCCL connects
// on an algorithm's or peer's first use, inside the enqueue): no event
// exists yet, so only the watchdog's timing of the call itself can end the
// job, with exit status 5 naming group, op and sequence, about a second
// past the 1 s timeout. A one-rank world has no such peer, so
// CommOptions::simulated_nccl_call_stall_s holds each call 120 s instead;
// the 60 s bound leaves the child its start-up.
TEST(CommNcclDeathTest, TheWatchdogEndsAHostStuckInsideAnNcclCall) {
#if !ORIGAMI_WITH_NCCL
  GTEST_SKIP() << "this build has no NCCL backend (configured without CUDA)";
#else
  if (!have_device()) GTEST_SKIP() << "no CUDA device on this machine";
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the child starts afresh: CUDA and MPI do not survive fork
  auto stuck = [] {
    ensure_mpi();
    Groups g = routed_groups(1.0, nullptr, 120.0);
    DeviceVec<float> dx(std::vector<float>(9, 1.0f));
    g[GroupKind::ep].all_reduce(dx.span());
    std::exit(0);  // not reached: the watchdog aborts first
  };
  expect_watchdog_timeout(stuck, "still being issued after", "the watchdog fired only when the call returned");
#endif
}

// NCCL's asynchronous error, where a failed peer or network shows first,
// ends the job with exit status 4, naming group, op, sequence and NCCL's
// error, at either of the places that poll it. A one-rank world cannot make
// NCCL report one, so CommOptions::simulated_nccl_error (ncclRemoteError)
// stands in for it; the op must still be unfinished for a poll to look (a
// done op is done), so each child holds the compute stream, which the op
// waits on, with a host function sleeping 120 s. First the watchdog's poll:
// the op handed to that stream (wait_on, no host wait), the main thread
// standing in a stream synchronization; the watchdog aborts the
// communicator and the job well inside the 60 s the timeout alone would
// take (the bound also leaves the child its start-up). Then a host wait's
// (Request::wait): it polls at once, the watchdog within 100 ms, so the
// wait's check names the error nearly always; either names the same facts.
TEST(CommNcclDeathTest, AnAsynchronousNcclErrorEndsTheJobNamingTheOp) {
#if !ORIGAMI_WITH_NCCL
  GTEST_SKIP() << "this build has no NCCL backend (configured without CUDA)";
#else
  if (!have_device()) GTEST_SKIP() << "no CUDA device on this machine";
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the child starts afresh: CUDA and MPI do not survive fork
  struct Failing {
    cudaStream_t compute = nullptr;
    std::unique_ptr<Communicator> group;  // over the world, named ep, ordered after `compute`
  };
  // MPI first (as Groups::create), then the device, the held stream and one
  // NCCL communicator that reports the error.
  const auto failing_group = [] {
    ensure_mpi();
    use_cuda_device(local_cuda_device());
    Failing f;
    if (cudaStreamCreateWithFlags(&f.compute, cudaStreamNonBlocking) != cudaSuccess) std::exit(1);
    CommOptions o{60};
    o.compute_stream = f.compute;
    o.simulated_nccl_error = ncclRemoteError;
    f.group = make_nccl_communicator(*whole_mpi(MPI_COMM_WORLD, "ep", o), o);
    cudaLaunchHostFunc(
        f.compute, [](void*) { std::this_thread::sleep_for(std::chrono::seconds(120)); }, nullptr);
    return f;
  };
  auto watchdog_sees = [&] {
    Failing f = failing_group();
    DeviceVec<float> dx(std::vector<float>(9, 1.0f));
    f.group->all_reduce_async(dx.span()).wait_on(f.compute);
    cudaStreamSynchronize(f.compute);
    std::exit(0);  // not reached
  };
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_EXIT(watchdog_sees(), ::testing::ExitedWithCode(kExitInternal),
              "NCCL error \\(watchdog\\): group ep op all_reduce seq [0-9]+ bytes [0-9]+: remote process exited or "
              "there was a network error \\(simulated");
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 60.0);
  auto host_wait_sees = [&] {
    Failing f = failing_group();
    DeviceVec<float> dx(std::vector<float>(9, 1.0f));
    f.group->all_reduce_async(dx.span()).wait();
    std::exit(0);  // not reached
  };
  t0 = std::chrono::steady_clock::now();
  EXPECT_EXIT(host_wait_sees(), ::testing::ExitedWithCode(kExitInternal),
              "(group ep all_reduce seq [0-9]+: NCCL reports|NCCL error \\(watchdog\\): group ep op all_reduce seq "
              "[0-9]+ bytes [0-9]+:) remote process exited or there was a network error \\(simulated");
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 60.0);
#endif
}

// A device op's buffers stay held on the device's allocator until the host
// sees the op complete or hands it to a stream (wait_on): a free before is
// an internal error naming the op, where on the GPU the cache would hand
// the block out again while NCCL still moves it (and, while holds last, the
// allocator keeps its cache from cudaFree: kernels/allocator.h). After
// wait_on the same free goes through.
TEST(CommNcclDeathTest, FreeingADeviceBufferUnderAnOpInFlightAbortsNamingTheOp) {
#if !ORIGAMI_WITH_NCCL
  GTEST_SKIP() << "this build has no NCCL backend (configured without CUDA)";
#else
  if (!have_device()) GTEST_SKIP() << "no CUDA device on this machine";
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the child starts afresh: CUDA and MPI do not survive fork
  const auto device_ones = [] {
    Tensor host = Tensor::empty({4096}, DType::f32, MemCategory::comm);
    for (int64_t i = 0; i < 4096; ++i) host.data<float>()[i] = 1.0f + static_cast<float>(i % 7);
    return host.to(local_cuda_device());
  };
  auto early_free = [&] {
    Groups g = routed_groups(60);
    Tensor dx = device_ones();
    Request in_flight = g[GroupKind::ep].all_reduce_async(dx);
    dx = Tensor();  // freed under the op
    std::exit(0);   // not reached
  };
  EXPECT_EXIT(early_free(), ::testing::ExitedWithCode(kExitInternal),
              "cuda:[0-9]+ buffer of 16384 bytes \\(comm\\) freed while group ep all_reduce seq [0-9]+ was in flight");
  cudaStream_t compute = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking), cudaSuccess);
  {
    Groups g = routed_groups(60, compute);
    Tensor dx = device_ones();
    g[GroupKind::ep].all_reduce_async(dx).wait_on(compute);
    dx = Tensor();  // the stream holds the dependency now
    ASSERT_EQ(cudaStreamSynchronize(compute), cudaSuccess);
    g[GroupKind::ep].barrier();
  }
  cudaStreamDestroy(compute);
#endif
}

}  // namespace
}  // namespace origami::comm

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const int rc = RUN_ALL_TESTS();
  if (origami::comm::g_mpi_started) MPI_Finalize();
  return rc;
}

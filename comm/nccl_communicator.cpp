// NCCL backend. NCCL's API is host C, so this is plain C++ against the CUDA
// toolkit's headers; without ORIGAMI_WITH_NCCL only the stubs below build.
#include "comm/nccl_communicator.h"

#include "comm/mpi_communicator.h"
#include "kernels/check.h"

#if ORIGAMI_WITH_NCCL
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "comm/nccl_check.h"
#include "comm/nccl_watchdog.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/threads.h"
#endif

namespace origami::comm {

#if !ORIGAMI_WITH_NCCL

bool nccl_available() { return false; }
std::string nccl_library_version() { return ""; }
Device local_cuda_device() { ORIGAMI_USER_ERROR("this build has no CUDA support"); }
void use_cuda_device(Device) { ORIGAMI_USER_ERROR("this build has no CUDA support"); }
Device memory_device(const void*) { return Device::cpu(); }
std::unique_ptr<Communicator> make_nccl_communicator(const MpiCommunicator&, CommOptions) {
  ORIGAMI_USER_ERROR("this build has no NCCL support (configure with CUDA)");
}

#else

using nccl::NcclCallScope;
using nccl::Watchdog;

namespace {

ncclDataType_t nccl_type(ElemType t) {
  switch (t) {
    case ElemType::f32: return ncclFloat32;
    case ElemType::f64: return ncclFloat64;
    case ElemType::i32: return ncclInt32;
    case ElemType::i64: return ncclInt64;
    case ElemType::bf16: return ncclBfloat16;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::max ? ncclMax : ncclSum; }

// A stream's wait on an NCCL op: timing events before and after it on that
// stream; their interval is how long the stream stood there.
struct StreamWait {
  cudaEvent_t before = nullptr, after = nullptr;
  double* sink = nullptr;  // the op's OpStats::exposed_s
};

class NcclPending final : public detail::PendingOp {
 public:
  // Timing events: the op's run time on the stream bounds its exposed time
  // when the host waits for it (exposed_seconds).
  NcclPending(ncclComm_t comm, ncclResult_t simulated, cudaStream_t stream, std::vector<StreamWait>* waits,
              const void* owner)
      : comm_(comm), simulated_(simulated), waits_(waits), owner_(owner) {
    CUDA_CHECK(cudaEventCreate(&started_));
    CUDA_CHECK(cudaEventCreate(&event_));
    stream_ = stream;
  }
  ~NcclPending() override {
    cudaEventDestroy(started_);
    cudaEventDestroy(event_);
  }
  // Around the op's kernels, after the stream's wait for its inputs.
  void record_start() { CUDA_CHECK(cudaEventRecord(started_, stream_)); }
  void record() { CUDA_CHECK(cudaEventRecord(event_, stream_)); }
  void launched() override {
    Watchdog::Entry e;
    CUDA_CHECK(cudaGetDevice(&e.device));
    CUDA_CHECK(cudaEventCreateWithFlags(&e.done, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(e.done, stream_));
    e.issued = std::chrono::steady_clock::now();
    e.timeout_s = timeout_s;
    e.comm = comm_;
    e.simulated = simulated_;
    e.owner = owner_;
    e.group = group;
    e.op = op;
    e.seq = seq;
    e.bytes = bytes;
    e.peer_note = peer_note;
    Watchdog::watch(std::move(e));
  }
  // The part of the host's wait the op itself took: the wait also covers
  // the compute stream's work queued before the op (the op waits for it), and
  // an op that ran mostly while the host was busy elsewhere exposed only the
  // stretch the host stood waiting.
  double exposed_seconds(double host_wait_s) override {
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, started_, event_));
    return std::min(host_wait_s, ms / 1e3);
  }
  bool test() override {
    const cudaError_t rc = cudaEventQuery(event_);
    if (rc == cudaSuccess) return true;
    ORIGAMI_CHECK(rc == cudaErrorNotReady, "group ", group, " ", op_name(op), ": ", cudaGetErrorString(rc));
    ncclResult_t async = ncclSuccess;
    NCCL_CHECK(nccl::poll_async_error(comm_, simulated_, &async));
    ORIGAMI_CHECK(!nccl::is_failure(async), "group ", group, " ", op_name(op), " seq ", seq, ": NCCL reports ",
                  ncclGetErrorString(async), simulated_ != ncclSuccess ? " (simulated: CommOptions::simulated_nccl_error)" : "");
    return false;
  }
  // Stops NCCL kernels that would otherwise spin forever on a missing peer.
  void abort_backend() override { nccl::abort_nccl_comm_bounded(comm_); }
  // The stream's later work waits on the op's event; the event may then be
  // destroyed (the wait captured it), so the request can go at once.
  bool enqueue_wait(void* stream) override {
    const auto s = static_cast<cudaStream_t>(stream);
    StreamWait w;
    w.sink = exposed_sink;
    CUDA_CHECK(cudaEventCreate(&w.before));
    CUDA_CHECK(cudaEventCreate(&w.after));
    CUDA_CHECK(cudaEventRecord(w.before, s));
    CUDA_CHECK(cudaStreamWaitEvent(s, event_, 0));
    CUDA_CHECK(cudaEventRecord(w.after, s));
    waits_->push_back(w);
    return true;
  }

 private:
  ncclComm_t comm_;
  ncclResult_t simulated_;          // CommOptions::simulated_nccl_error
  std::vector<StreamWait>* waits_;  // the communicator's, settled by settle_stream_waits
  const void* owner_;               // the communicator (the watchdog's key)
  cudaStream_t stream_ = nullptr;
  cudaEvent_t started_ = nullptr;
  cudaEvent_t event_ = nullptr;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const MpiCommunicator& boot, CommOptions options)
      : Communicator(boot.name(), boot.members(), boot.rank(), options) {
    int device = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    device_ = Device{DeviceKind::cuda, device};
    simulated_ = static_cast<ncclResult_t>(options.simulated_nccl_error);
    simulated_stall_s_ = options.simulated_nccl_call_stall_s;
    ncclUniqueId id{};
    if (boot.rank() == 0) NCCL_CHECK(ncclGetUniqueId(&id));
    MPI_CHECK(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, boot.handle()));
    CUDA_CHECK(cudaStreamCreate(&stream_));  // blocking: orders after the legacy default stream
    CUDA_CHECK(cudaMalloc(&scratch_, sizeof(int32_t)));
    CUDA_CHECK(cudaMemset(scratch_, 0, sizeof(int32_t)));  // the barrier's and channel warm-up's element
    compute_ = static_cast<cudaStream_t>(options.compute_stream);
    if (compute_) CUDA_CHECK(cudaEventCreateWithFlags(&inputs_ready_, cudaEventDisableTiming));
    NCCL_CHECK(ncclCommInitRank(&comm_, size(), id, rank()));
    if (options.ring_p2p) open_ring_channels(boot);
    Watchdog::attach();
  }
  ~NcclCommunicator() override {
    for (auto* channels : {&to_, &from_})
      for (auto& [peer, ch] : *channels) cudaStreamSynchronize(ch.stream);
    cudaStreamSynchronize(stream_);
    Watchdog::detach(this);  // before the comms its entries name go
    const NcclCallScope scope;
    // In the order they were created, which is one global order of edges: a
    // channel's two ends must destroy it in the same sequence relative to
    // their other channels (NCCL's destroy joins its peer's proxy; ends that
    // destroy 0->1, 1->0 and 1->0, 0->1 can wait on each other at exit).
    for (ncclComm_t c : channels_in_creation_order_) ncclCommDestroy(c);
    for (auto* channels : {&to_, &from_})
      for (auto& [peer, ch] : *channels) cudaStreamDestroy(ch.stream);
    ncclCommDestroy(comm_);
    cudaFree(scratch_);
    if (inputs_ready_) cudaEventDestroy(inputs_ready_);
    for (StreamWait& w : waits_) {
      cudaEventDestroy(w.before);
      cudaEventDestroy(w.after);
    }
    cudaStreamDestroy(stream_);
  }
  Backend backend() const override { return Backend::nccl; }
  void settle_stream_waits() override {
    std::vector<StreamWait> pending;
    for (StreamWait& w : waits_) {
      const cudaError_t rc = cudaEventQuery(w.after);
      if (rc == cudaErrorNotReady) {
        pending.push_back(w);
        continue;
      }
      CUDA_CHECK(rc);
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, w.before, w.after));
      if (w.sink) *w.sink += ms / 1e3;
      cudaEventDestroy(w.before);
      cudaEventDestroy(w.after);
    }
    waits_ = std::move(pending);
  }

 protected:
  Device locate(const Call&) const override { return device_; }
  std::string refusal(const Call& c) const override {
    std::string why = memory_refusal(Backend::nccl, *c.memory, c.type, c.op);
    if (why.empty() && c.op != CommOp::barrier && !(*c.memory == device_))
      why = "memory on " + to_string(*c.memory) + ", but this NCCL communicator runs on " + to_string(device_);
    return why;
  }
  std::unique_ptr<detail::PendingOp> start(const Call& c) override {
    // A send to or a receive from a ring neighbour goes on its channel.
    const Channel* ch = nullptr;
    if (c.op == CommOp::send || c.op == CommOp::recv) {
      const auto& channels = c.op == CommOp::send ? to_ : from_;
      if (const auto it = channels.find(c.peer); it != channels.end()) ch = &it->second;
    }
    // The enqueue calls below are timed as the op is (nccl_watchdog.h): the
    // first use of an algorithm or peer connects inside them and waits for
    // the peers' own calls.
    Watchdog::Entry watch;
    watch.device = device_.index;
    watch.timeout_s = timeout_s();
    watch.comm = ch ? ch->comm : comm_;
    watch.simulated = simulated_;
    watch.owner = this;
    watch.group = name();
    watch.op = c.op;
    watch.seq = c.seq;
    watch.bytes = c.bytes;
    if (c.op == CommOp::send || c.op == CommOp::recv)
      watch.peer_note = origami::detail::concat(" (", c.op == CommOp::send ? "to" : "from", " world rank ",
                                                members()[static_cast<size_t>(c.peer)], ")");
    // Before the scope: entering and leaving take the watchdog's lock, which
    // its thread holds through a failure's abort, and that abort needs the
    // scope's lock alone.
    const nccl::HostCallWatch in_call(std::move(watch));
    const NcclCallScope scope;  // the communicators may be being freed
    cudaStream_t stream = ch ? ch->stream : stream_;
    auto p = std::make_unique<NcclPending>(ch ? ch->comm : comm_, simulated_, stream, &waits_, this);
    if (simulated_stall_s_ > 0) std::this_thread::sleep_for(std::chrono::duration<double>(simulated_stall_s_));
    if (compute_) {  // the inputs were written by ops queued on the compute stream
      CUDA_CHECK(cudaEventRecord(inputs_ready_, compute_));
      CUDA_CHECK(cudaStreamWaitEvent(stream, inputs_ready_, 0));
    }
    p->record_start();
    if (ch) {  // a two-rank channel: the peer is its rank 1 - ours
      if (c.op == CommOp::send)
        NCCL_CHECK(ncclSend(c.send, c.send_count, nccl_type(c.type), 1 - ch->rank, ch->comm, stream));
      else
        NCCL_CHECK(ncclRecv(c.recv, c.recv_count, nccl_type(c.type), 1 - ch->rank, ch->comm, stream));
      p->record();
      return p;
    }
    const ncclDataType_t t = nccl_type(c.type);
    const size_t es = elem_size(c.type);
    switch (c.op) {
      case CommOp::all_reduce:
        NCCL_CHECK(ncclAllReduce(c.recv, c.recv, c.recv_count, t, nccl_op(c.reduce), comm_, stream_));
        break;
      case CommOp::all_gather:
        if (!c.recv_counts.empty()) {
          // all_gather_v: one broadcast per root into its slot, as one group call.
          NCCL_CHECK(ncclGroupStart());
          size_t off = 0;
          for (int root = 0; root < size(); ++root) {
            const size_t n = static_cast<size_t>(c.recv_counts[root]);
            char* dst = static_cast<char*>(c.recv) + off * es;
            if (n) NCCL_CHECK(ncclBroadcast(root == rank() ? c.send : dst, dst, n, t, root, comm_, stream_));
            off += n;
          }
          NCCL_CHECK(ncclGroupEnd());
          break;
        }
        NCCL_CHECK(ncclAllGather(c.send, c.recv, c.send_count, t, comm_, stream_));
        break;
      case CommOp::reduce_scatter:
        if (!c.send_counts.empty()) {
          // reduce_scatter_v: one reduce per root onto its recv, as one group call.
          NCCL_CHECK(ncclGroupStart());
          size_t off = 0;
          for (int root = 0; root < size(); ++root) {
            const size_t n = static_cast<size_t>(c.send_counts[root]);
            if (n)
              NCCL_CHECK(ncclReduce(static_cast<const char*>(c.send) + off * es, root == rank() ? c.recv : nullptr,
                                            n, t, nccl_op(c.reduce), root, comm_, stream_));
            off += n;
          }
          NCCL_CHECK(ncclGroupEnd());
          break;
        }
        NCCL_CHECK(ncclReduceScatter(c.send, c.recv, c.recv_count, t, nccl_op(c.reduce), comm_, stream_));
        break;
      case CommOp::all_to_all_v: {
        // Point-to-point pairs inside one group call; zero counts post nothing.
        NCCL_CHECK(ncclGroupStart());
        size_t so = 0, ro = 0;
        for (int peer = 0; peer < size(); ++peer) {
          const size_t sn = static_cast<size_t>(c.send_counts[peer]), rn = static_cast<size_t>(c.recv_counts[peer]);
          if (sn) NCCL_CHECK(ncclSend(static_cast<const char*>(c.send) + so * es, sn, t, peer, comm_, stream_));
          if (rn) NCCL_CHECK(ncclRecv(static_cast<char*>(c.recv) + ro * es, rn, t, peer, comm_, stream_));
          so += sn;
          ro += rn;
        }
        NCCL_CHECK(ncclGroupEnd());
        break;
      }
      case CommOp::send: NCCL_CHECK(ncclSend(c.send, c.send_count, t, c.peer, comm_, stream_)); break;
      case CommOp::recv: NCCL_CHECK(ncclRecv(c.recv, c.recv_count, t, c.peer, comm_, stream_)); break;
      case CommOp::broadcast:
        NCCL_CHECK(ncclBroadcast(c.recv, c.recv, c.recv_count, t, c.peer, comm_, stream_));
        break;
      case CommOp::barrier:
        // NCCL has no barrier; a one-element all-reduce synchronizes the group.
        NCCL_CHECK(ncclAllReduce(scratch_, scratch_, 1, ncclInt32, ncclSum, comm_, stream_));
        break;
    }
    p->record();
    return p;
  }

 private:
  // One direction between two ring neighbours: a two-rank communicator
  // (rank 0 sends, rank 1 receives) with a stream of its own.
  struct Channel {
    ncclComm_t comm = nullptr;
    cudaStream_t stream = nullptr;
    int rank = 0;
  };
  // Every ring edge {r, r + 1 mod n} once, in ascending (low, high) order on
  // every rank, each as two channels (low → high, then high → low). A rank
  // joins only its own edges' inits, and every two-rank init waits for both
  // sides: visiting the edges in one global order keeps those waits free of
  // cycles (the order locks are taken in). The unique id goes from the
  // sender to the receiver over the group's MPI communicator.
  // Each channel then carries one element, waited for, at once: NCCL
  // connects a send/recv pair on its first exchange, and that host call
  // blocks until the peer's host reaches its own first call on the pair.
  // Left to the first real transfer, that wait forms a cycle at step 1 —
  // the pipeline's first stage posts the receive for its first gradient
  // before sending its first activation, the next stage waits to receive
  // that activation; every CP ring rank sends before it receives — a hang
  // no watchdog sees, since no op has been issued yet.
  void open_ring_channels(const MpiCommunicator& boot) {
    const int n = size(), me = rank();
    std::set<std::pair<int, int>> edges;
    for (int r = 0; r < n; ++r)
      if (const int s = (r + 1) % n; s != r) edges.insert({std::min(r, s), std::max(r, s)});
    for (const auto& [low, high] : edges) {
      if (me != low && me != high) continue;
      for (const auto& [src, dst] : {std::pair{low, high}, std::pair{high, low}}) {
        ncclUniqueId id{};
        constexpr int kIdTag = 77;
        if (me == src) {
          NCCL_CHECK(ncclGetUniqueId(&id));
          MPI_CHECK(MPI_Send(&id, sizeof(id), MPI_BYTE, dst, kIdTag, boot.handle()));
        } else {
          MPI_CHECK(MPI_Recv(&id, sizeof(id), MPI_BYTE, src, kIdTag, boot.handle(), MPI_STATUS_IGNORE));
        }
        Channel ch;
        ch.rank = me == src ? 0 : 1;
        CUDA_CHECK(cudaStreamCreate(&ch.stream));
        NCCL_CHECK(ncclCommInitRank(&ch.comm, 2, id, ch.rank));
        if (me == src)
          NCCL_CHECK(ncclSend(scratch_, 1, ncclInt32, 1, ch.comm, ch.stream));
        else
          NCCL_CHECK(ncclRecv(scratch_, 1, ncclInt32, 0, ch.comm, ch.stream));
        CUDA_CHECK(cudaStreamSynchronize(ch.stream));
        (me == src ? to_ : from_)[me == src ? dst : src] = ch;
        channels_in_creation_order_.push_back(ch.comm);
      }
    }
  }

  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::map<int, Channel> to_, from_;  // by the peer's group rank: channels to and from ring neighbours
  std::vector<ncclComm_t> channels_in_creation_order_;  // to_ and from_'s comms, for the destructor
  cudaStream_t compute_ = nullptr;      // CommOptions::compute_stream
  cudaEvent_t inputs_ready_ = nullptr;  // recorded on compute_ before each op
  std::vector<StreamWait> waits_;       // stream waits not yet settled
  void* scratch_ = nullptr;
  Device device_;
  ncclResult_t simulated_ = ncclSuccess;  // CommOptions::simulated_nccl_error
  double simulated_stall_s_ = 0;          // CommOptions::simulated_nccl_call_stall_s
};

}  // namespace

bool nccl_available() { return true; }

std::string nccl_library_version() {
  int v = 0;
  NCCL_CHECK(ncclGetVersion(&v));  // major * 10000 + minor * 100 + patch since NCCL 2.9
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

int visible_devices() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
  return count;
}

Device local_cuda_device() {
  const int count = visible_devices();
  if (count == 0) ORIGAMI_USER_ERROR("the NCCL backend needs a CUDA device, and this rank sees none");
  return Device{DeviceKind::cuda, local_rank_on_this_node() % count};  // the rule of resolve_placement
}

void use_cuda_device(Device d) {
  const int count = visible_devices();
  if (d.kind != DeviceKind::cuda || d.index < 0 || d.index >= count)
    ORIGAMI_USER_ERROR("compute device ", to_string(d), " is not a CUDA device this rank sees (", count,
                       " visible)");
  CUDA_CHECK(cudaSetDevice(d.index));
}

Device memory_device(const void* p) {
  if (!p) return Device::cpu();
  cudaPointerAttributes a{};
  const cudaError_t rc = cudaPointerGetAttributes(&a, p);
  // Since CUDA 11 a plain host pointer succeeds (cudaMemoryTypeUnregistered).
  // Where no device is usable (no GPU, no driver, the driver's stub) nothing
  // can be device memory; with one, an error is a fault, not a hint that the
  // buffer is the host's.
  if (rc != cudaSuccess) {
    (void)cudaGetLastError();
    if (visible_devices() == 0) return Device::cpu();
    CUDA_CHECK(rc);
  }
  if (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged) return Device{DeviceKind::cuda, a.device};
  return Device::cpu();
}

std::unique_ptr<Communicator> make_nccl_communicator(const MpiCommunicator& bootstrap, CommOptions options) {
  return std::make_unique<NcclCommunicator>(bootstrap, options);
}

#endif

}  // namespace origami::comm

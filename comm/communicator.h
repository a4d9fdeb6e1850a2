// comm::Communicator: one rank group's collectives behind one interface, with
// an MPI backend (host memory) and an NCCL backend (device memory).
//
// Every call takes typed spans or Tensors with element counts, gets a sequence
// number, and adds to this group's per-op byte counter. Every op is
// nonblocking underneath; the `_async` form returns a Request, the plain form
// waits on it. Waits are bounded by CommOptions::timeout_s: a call that does
// not complete in time prints
//   [rank R] collective timeout: group G op OP seq N bytes B memory M after T s
// (M = cpu or cuda:N, where the op's buffers live; a send or receive's OP
// also names its peer's world rank and the bytes it moves) to stderr and aborts the
// whole job (MPI_Abort) — never a silent hang.
//
// Where the memory lives: a Tensor call carries its tensor's device; a span
// call's memory is the backend's own (host for MPI, the communicator's device
// for NCCL), except on the routed communicator of comm/routed_communicator.h,
// which asks CUDA where a span's pointer points. Each call records it (OpStats'
// device_* counters, the timeout message) and a backend refuses memory it
// cannot move (memory_refusal below): host memory to NCCL, device memory to
// MPI (MPI is not assumed CUDA-aware), bf16 reductions to MPI.
//
// Measured comm volume = bytes this rank SENDS under the ring algorithms
// (what nccl-tests' bus bandwidth assumes), for a group of n ranks:
//   all_reduce     2 · (count − own) · elem, where the count is cut into n
//                  blocks (the first count % n one element longer) and `own`
//                  is block `rank`: reduce-scatter, then all-gather, each rank
//                  sending every block but its own once per phase
//   all_gather     (n − 1) · send count · elem
//   reduce_scatter (n − 1) · recv count · elem
//   all_gather_v   (n − 1) · send count · elem  (counted under all_gather)
//   reduce_scatter_v Σ_{p ≠ rank} counts[p] · elem  (under reduce_scatter)
//   all_to_all_v   Σ_{p ≠ rank} send_counts[p] · elem (the self block stays)
//   broadcast      count · elem on every rank but the last of the ring that
//                  starts at the root (rank (root + n − 1) % n sends nothing)
//   send           count · elem;  recv, barrier: 0
// These are per-rank figures; summed over a group they give the classic
// totals: 2(n−1)·S for all_reduce, (n−1)·S for all_gather, reduce_scatter,
// broadcast and an evenly split all_to_all_v (S = the full buffer). A Tensor
// call counts exactly what the span call over the same elements counts.
// The sequence number counts every call on this communicator, so ranks that
// issue the same collectives in the same order agree on it; a timeout message
// naming seq N says which call a rank got stuck in.
//
// Requests must complete (wait, wait_on or test true) before their
// communicator is destroyed; the buffers of an op belong to it until then.
#pragma once
#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/device.h"
#include "kernels/tensor.h"

namespace origami::comm {

enum class CommOp : int { all_reduce, all_gather, reduce_scatter, all_to_all_v, send, recv, broadcast, barrier };
inline constexpr int kNumCommOps = 8;
std::string_view op_name(CommOp op);

enum class ReduceOp : int { sum, max };
// bf16 has no C++ element type here: it travels as Tensors only.
enum class ElemType : int { f32, f64, i32, i64, bf16 };
size_t elem_size(ElemType t);
std::string_view elem_name(ElemType t);

template <class T>
struct elem_type_of;
template <>
struct elem_type_of<float> {
  static constexpr ElemType value = ElemType::f32;
};
template <>
struct elem_type_of<double> {
  static constexpr ElemType value = ElemType::f64;
};
template <>
struct elem_type_of<int32_t> {
  static constexpr ElemType value = ElemType::i32;
};
template <>
struct elem_type_of<int64_t> {
  static constexpr ElemType value = ElemType::i64;
};
template <class T>
concept CommElement = requires {
  elem_type_of<std::remove_const_t<T>>::value;
};
// A send span may be const where the receive span is not.
template <class S, class T>
concept SameElement = std::is_same_v<std::remove_const_t<S>, T>;

enum class Backend : int { mpi, nccl };

// Why `backend` cannot run `op` over `type` elements in memory on `memory`, or
// empty when it can: MPI moves host memory only and has no bf16 reduction;
// NCCL moves device memory only. The single statement of those rules, read by
// both backends and by tests.
std::string memory_refusal(Backend backend, Device memory, ElemType type, CommOp op);

struct CommOptions {
  double timeout_s = 300.0;  // runtime.collective_timeout_s
  // NCCL only: the cudaStream_t that writes and reads the device tensors
  // (the compute stream, a non-blocking one). Every op then starts after the
  // work queued there so far (an event the communication stream waits on,
  // no host sync). Null: ordered only after the legacy default stream.
  void* compute_stream = nullptr;
  // NCCL only: point-to-point ops between ring neighbours (group ranks r and
  // r ± 1 mod n: the pipeline's and the CP ring's peers) run on channels of
  // their own, a two-rank communicator and stream per direction, so that a
  // receive posted ahead never holds up a send queued behind it (NCCL's
  // send/recv have no tags and run in issue order on their stream). Groups
  // sets it for pp and cp.
  bool ring_p2p = false;
  // Host-memory ops run on private copies of their buffers, the caller's
  // receive bytes poisoned and every buffer held until the op completes
  // (comm/in_flight_check.h): a test mode that shows on the CPU the missing
  // waits a GPU run would race on. The trainer sets it on the host stand-in
  // device (ORIGAMI_HOST_STAND_IN=1).
  bool check_in_flight = false;
  // Point-to-point messages match in issue order alone, tags ignored:
  // NCCL's rule (its send and recv have no tags; two ranks' messages in one
  // direction form one ordered stream, a ring channel's or the group's), on
  // the MPI backend, so that code relying on tags to pair messages posted in
  // another order fails on the CPU. Set with check_in_flight on the stand-in.
  bool p2p_by_order = false;
  // NCCL only, fault injection for tests: every op's asynchronous-error poll
  // (the watchdog's, and a host wait's) reports this ncclResult_t in place
  // of NCCL's own, as a failed peer or network would make it report: the
  // failure paths a one-rank world cannot otherwise reach (PyTorch's
  // ProcessGroupNCCL tests simulate errors the same way). 0: none.
  int simulated_nccl_error = 0;
  // NCCL only, fault injection for tests: each op's host call stands this
  // many seconds inside its enqueue, as one does while NCCL connects to a
  // peer that never makes its own call (a one-rank world has no such peer).
  double simulated_nccl_call_stall_s = 0;
};

struct OpStats {
  int64_t calls = 0;
  int64_t bytes = 0;  // sent by this rank, ring convention (header comment)
  // The part of calls and bytes whose memory was on a device (the rest was
  // host memory): what went over NCCL on a routed communicator.
  int64_t device_calls = 0;
  int64_t device_bytes = 0;
  // Wall seconds inside the blocking all_to_all_v calls, start to
  // completion (waiting for late peers included): what the imbalance tool
  // turns into an all-to-all rate. Other ops' time is their callers' to measure.
  // A host-memory exchange (the dispatcher's counts, over MPI) waits on the
  // host; a device tensor's call on a communicator with a compute stream
  // returns once queued, so its seconds are the launch's only.
  double blocking_s = 0;
  // Exposed communication: seconds this rank's work stood still waiting for
  // this op's requests — every op, blocking or async, counted when a wait
  // (Request::wait, wait_for) finds it unfinished. MPI: the host's wall time
  // in the wait. NCCL: the op's own run time on the communication stream
  // (CUDA events around it), the span the compute stream had nothing to do
  // while the host waited; an op handed to a stream (wait_on): the time that
  // stream stood at the wait (events around it), added by
  // settle_stream_waits() once the stream has passed it.
  double exposed_s = 0;
};

// Per-rank ring volumes in bytes (the convention above), for tests and plans.
namespace ring_bytes {
int64_t all_reduce(int64_t count, size_t elem, int rank, int n);
int64_t all_gather(int64_t send_count, size_t elem, int n);
int64_t reduce_scatter(int64_t recv_count, size_t elem, int n);
int64_t reduce_scatter_v(std::span<const int64_t> counts, size_t elem, int rank);
int64_t all_to_all_v(std::span<const int64_t> send_counts, size_t elem, int rank);
int64_t broadcast(int64_t count, size_t elem, int rank, int root, int n);
}  // namespace ring_bytes

namespace detail {
struct InFlightRegions;  // comm/in_flight_check.h
// One operation in flight. Backends implement test(); the diagnostics feed the
// timeout message.
class PendingOp {
 public:
  virtual ~PendingOp();  // releases hold_device_buffers' holds
  virtual bool test() = 0;         // true once complete (buffers may be reused)
  virtual void abort_backend() {}  // called before MPI_Abort on a timeout
  // Makes `stream` (a cudaStream_t) wait for this op without blocking the
  // host; false when the backend cannot (its memory is host memory, so the
  // host must wait).
  virtual bool enqueue_wait(void* /*stream*/) { return false; }
  // Once complete, after a wait that found it unfinished and took
  // `host_wait_s`: the exposed seconds to count (OpStats::exposed_s).
  virtual double exposed_seconds(double host_wait_s) { return host_wait_s; }
  // Called once launch() has filled the fields below (NCCL: hands the op to
  // its watchdog, which needs group, op, seq and timeout).
  virtual void launched() {}
  double* exposed_sink = nullptr;  // the communicator's OpStats::exposed_s of this op
  std::string group;
  CommOp op = CommOp::barrier;
  int64_t seq = 0;
  int64_t bytes = 0;
  // A send's or receive's other end: " (to world rank 3, 64 bytes)"; "" for
  // collectives. A stuck receive's line then names whom it waits for.
  std::string peer_note;
  // The group's world ranks, shared with the communicator: whom a
  // timed-out wait asks where they are (comm/census.h).
  std::shared_ptr<const std::vector<int>> members;
  Device memory;  // where the op's buffers live
  double timeout_s = 0;
  // A device op's buffers, held on that device's allocator until this op is
  // destroyed: once the host has seen it complete or handed it to a stream
  // (Request), the rule a free must follow there. A free that breaks it is
  // an internal error instead of a block the op still moves being handed out
  // again, and while holds last the allocator keeps its cache from cudaFree
  // (kernels/allocator.h).
  void hold_device_buffers(const InFlightRegions& regions, const std::string& holder);

 private:
  std::vector<int64_t> hold_ids_;  // on TrackedAllocator::of(memory)
};
}  // namespace detail

// A handle to an operation in flight. Move-only; the destructor waits, so an
// un-waited request can never outlive the buffers it reads or writes.
class Request {
 public:
  Request() = default;
  explicit Request(std::unique_ptr<detail::PendingOp> op) : op_(std::move(op)) {}
  Request(Request&&) noexcept = default;
  Request& operator=(Request&& other) noexcept {
    if (this != &other) {
      wait();
      op_ = std::move(other.op_);
    }
    return *this;
  }
  ~Request() { wait(); }

  // Blocks until complete, bounded by the group's timeout (then aborts).
  // Waits expected to be long (a pipeline stage waiting out the bubble) pass
  // sleep_when_idle: after a millisecond of polling the thread sleeps
  // between polls and leaves the core to ranks that compute.
  void wait(bool sleep_when_idle = false);
  // Orders the work queued on `cuda_stream` (a cudaStream_t; null = the
  // legacy default stream) after this op, and leaves the request empty. An
  // NCCL op makes the stream wait on its completion event (cudaStreamWaitEvent)
  // and the host goes on at once: its buffers then belong to the stream's
  // later work, and a hang shows at the next host synchronization rather than
  // as a timeout here. An MPI op waits on the host, as wait() does — host
  // memory is ready before anything later is queued.
  void wait_on(void* cuda_stream);
  // True when complete (or empty); never blocks.
  bool test();
  // Waits at most `seconds` (sleeping between polls): true when complete,
  // false when still in flight, which leaves the request as it was.
  bool wait_for(double seconds);
  // The same until `deadline`, which moves later by any time this process
  // did not run (as wait() discounts it), so that the next wait against it
  // (a meeting's phases share one) sees the same allowance.
  bool wait_until(std::chrono::steady_clock::time_point& deadline);
  // Forgets an operation that will never complete, without waiting: only on
  // the way to aborting the job (its buffers must outlive the process).
  void abandon() { (void)op_.release(); }

 private:
  void add_exposed(double host_wait_s);
  std::unique_ptr<detail::PendingOp> op_;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  const std::string& name() const { return name_; }
  int rank() const { return rank_; }  // in this group
  int size() const { return static_cast<int>(members_.size()); }
  const std::vector<int>& members() const { return members_; }  // world ranks, ascending
  // The backend device memory goes over (nccl), or mpi when there is none;
  // host memory always goes over MPI.
  virtual Backend backend() const = 0;
  // Adds to exposed_s the stalls of stream waits (Request::wait_on of NCCL
  // ops) that have completed; call after synchronizing the stream, before
  // reading the stats. Nothing on MPI.
  virtual void settle_stream_waits() {}
  double timeout_s() const { return options_.timeout_s; }
  // CommOptions::compute_stream (a cudaStream_t), null on the host.
  void* compute_stream() const { return options_.compute_stream; }
  // Completes `r` for the work that follows it: with a compute stream, that
  // stream waits for the op (Request::wait_on: no host synchronization; the
  // op's buffers then belong to the stream's later work, and the caching
  // allocator's reuse is safe because every later op, compute or
  // communication, is ordered after that stream's wait); without one, or
  // for an op on host memory, the host waits (sleep_when_idle as in wait).
  void complete(Request& r, bool sleep_when_idle = false) const {
    if (options_.compute_stream)
      r.wait_on(options_.compute_stream);
    else
      r.wait(sleep_when_idle);
  }

  // ---- spans: element type from the span, memory the backend's own --------------------------------

  // In place over `data`.
  template <CommElement T>
  Request all_reduce_async(std::span<T> data, ReduceOp op = ReduceOp::sum) {
    return start_all_reduce(buffer(data), op);
  }
  // recv holds size() blocks of send.size() elements, in group-rank order.
  template <CommElement S, CommElement T>
  requires SameElement<S, T> Request all_gather_async(std::span<S> send, std::span<T> recv) {
    return start_all_gather(buffer(send), buffer(recv), {});
  }
  // send holds size() blocks of recv.size() elements; block r reduces onto rank r.
  template <CommElement S, CommElement T>
  requires SameElement<S, T> Request reduce_scatter_async(std::span<S> send, std::span<T> recv,
                                                          ReduceOp op = ReduceOp::sum) {
    return start_reduce_scatter(buffer(send), buffer(recv), {}, op);
  }
  // Variable blocks: rank p contributes recv_counts[p] elements (its send
  // holds exactly recv_counts[rank]); recv gets them packed in rank order.
  template <CommElement S, CommElement T>
  requires SameElement<S, T> Request all_gather_v_async(std::span<S> send, std::span<T> recv,
                                                        std::span<const int64_t> recv_counts) {
    return start_all_gather(buffer(send), buffer(recv), recv_counts);
  }
  // Variable blocks: send holds counts[p] elements for each rank p, packed in
  // rank order; block p reduces onto rank p, whose recv holds counts[p].
  template <CommElement S, CommElement T>
  requires SameElement<S, T> Request reduce_scatter_v_async(std::span<S> send, std::span<T> recv,
                                                            std::span<const int64_t> counts,
                                                            ReduceOp op = ReduceOp::sum) {
    return start_reduce_scatter(buffer(send), buffer(recv), counts, op);
  }
  // Block p of send (send_counts[p] elements, packed in rank order) goes to
  // rank p; recv gets recv_counts[p] elements from rank p. Zero counts are fine.
  template <CommElement S, CommElement T>
  requires SameElement<S, T> Request all_to_all_v_async(std::span<S> send, std::span<const int64_t> send_counts,
                                                        std::span<T> recv, std::span<const int64_t> recv_counts) {
    return start_all_to_all_v(buffer(send), send_counts, buffer(recv), recv_counts);
  }
  template <CommElement S>
  Request send_async(std::span<S> data, int peer, int tag = 0) {
    return start_send(buffer(data), peer, tag);
  }
  template <CommElement T>
  Request recv_async(std::span<T> data, int peer, int tag = 0) {
    return start_recv(buffer(data), peer, tag);
  }
  template <CommElement T>
  Request broadcast_async(std::span<T> data, int root) {
    return start_broadcast(buffer(data), root);
  }
  Request barrier_async();

  template <CommElement T>
  void all_reduce(std::span<T> data, ReduceOp op = ReduceOp::sum) {
    all_reduce_async(data, op).wait();
  }
  template <CommElement S, CommElement T>
  requires SameElement<S, T>
  void all_gather(std::span<S> send, std::span<T> recv) { all_gather_async(send, recv).wait(); }
  template <CommElement S, CommElement T>
  requires SameElement<S, T>
  void reduce_scatter(std::span<S> send, std::span<T> recv, ReduceOp op = ReduceOp::sum) {
    reduce_scatter_async(send, recv, op).wait();
  }
  template <CommElement S, CommElement T>
  requires SameElement<S, T>
  void all_gather_v(std::span<S> send, std::span<T> recv, std::span<const int64_t> recv_counts) {
    all_gather_v_async(send, recv, recv_counts).wait();
  }
  template <CommElement S, CommElement T>
  requires SameElement<S, T>
  void reduce_scatter_v(std::span<S> send, std::span<T> recv, std::span<const int64_t> counts,
                        ReduceOp op = ReduceOp::sum) {
    reduce_scatter_v_async(send, recv, counts, op).wait();
  }
  template <CommElement S, CommElement T>
  requires SameElement<S, T>
  void all_to_all_v(std::span<S> send, std::span<const int64_t> send_counts, std::span<T> recv,
                    std::span<const int64_t> recv_counts) {
    const auto start = std::chrono::steady_clock::now();
    all_to_all_v_async(send, send_counts, recv, recv_counts).wait();
    add_blocking_time(CommOp::all_to_all_v, start);
  }
  template <CommElement S>
  void send(std::span<S> data, int peer, int tag = 0) {
    send_async(data, peer, tag).wait();
  }
  template <CommElement T>
  void recv(std::span<T> data, int peer, int tag = 0) {
    recv_async(data, peer, tag).wait();
  }
  template <CommElement T>
  void broadcast(std::span<T> data, int root) {
    broadcast_async(data, root).wait();
  }
  void barrier() { barrier_async().wait(); }

  // ---- Tensors: element type from the dtype (f32, f64, i32, i64, bf16), memory on the tensor's
  // device. The same contracts as the span forms, over the tensors' elements
  // (any shape: counts are numel); send and recv must agree on dtype and device.
  // Defined in comm/tensor_calls.cpp.

  Request all_reduce_async(const Tensor& data, ReduceOp op = ReduceOp::sum);
  Request all_gather_async(const Tensor& send, const Tensor& recv);
  Request reduce_scatter_async(const Tensor& send, const Tensor& recv, ReduceOp op = ReduceOp::sum);
  Request all_gather_v_async(const Tensor& send, const Tensor& recv, std::span<const int64_t> recv_counts);
  Request reduce_scatter_v_async(const Tensor& send, const Tensor& recv, std::span<const int64_t> counts,
                                 ReduceOp op = ReduceOp::sum);
  Request all_to_all_v_async(const Tensor& send, std::span<const int64_t> send_counts, const Tensor& recv,
                             std::span<const int64_t> recv_counts);
  Request send_async(const Tensor& data, int peer, int tag = 0);
  Request recv_async(const Tensor& data, int peer, int tag = 0);
  Request broadcast_async(const Tensor& data, int root);

  // The blocking forms complete their op for the work that follows
  // (complete()): on CUDA the compute stream waits on the communication
  // stream, and the host goes on queueing work.
  void all_reduce(const Tensor& data, ReduceOp op = ReduceOp::sum) { finish(all_reduce_async(data, op)); }
  void all_gather(const Tensor& send, const Tensor& recv) { finish(all_gather_async(send, recv)); }
  void reduce_scatter(const Tensor& send, const Tensor& recv, ReduceOp op = ReduceOp::sum) {
    finish(reduce_scatter_async(send, recv, op));
  }
  void all_gather_v(const Tensor& send, const Tensor& recv, std::span<const int64_t> recv_counts) {
    finish(all_gather_v_async(send, recv, recv_counts));
  }
  void reduce_scatter_v(const Tensor& send, const Tensor& recv, std::span<const int64_t> counts,
                        ReduceOp op = ReduceOp::sum) {
    finish(reduce_scatter_v_async(send, recv, counts, op));
  }
  void all_to_all_v(const Tensor& send, std::span<const int64_t> send_counts, const Tensor& recv,
                    std::span<const int64_t> recv_counts) {
    const auto start = std::chrono::steady_clock::now();
    finish(all_to_all_v_async(send, send_counts, recv, recv_counts));
    add_blocking_time(CommOp::all_to_all_v, start);
  }
  void send(const Tensor& data, int peer, int tag = 0) { finish(send_async(data, peer, tag)); }
  void recv(const Tensor& data, int peer, int tag = 0) { finish(recv_async(data, peer, tag)); }
  void broadcast(const Tensor& data, int root) { finish(broadcast_async(data, root)); }

  const OpStats& stats(CommOp op) const { return stats_[static_cast<size_t>(op)]; }
  int64_t total_bytes() const;
  int64_t next_seq() const { return seq_; }  // sequence number the next call gets
  void reset_stats() { stats_ = {}; }

 protected:
  // Everything a backend needs to start one op. Counts are in elements.
  struct Call {
    CommOp op = CommOp::barrier;
    ElemType type = ElemType::f32;
    ReduceOp reduce = ReduceOp::sum;
    const void* send = nullptr;
    void* recv = nullptr;
    int64_t send_count = 0;  // all_reduce: count; all_gather: per-rank block; reduce_scatter: total
    int64_t recv_count = 0;
    // all_to_all_v: both. all_gather with recv_counts and reduce_scatter with
    // send_counts are the variable-block (_v) forms.
    std::span<const int64_t> send_counts, recv_counts;
    int peer = 0;                                       // send/recv peer, broadcast root (group ranks)
    int tag = 0;
    // Where send and recv live. Empty for a span call until launch() asks
    // locate(); always set when a backend's refusal() or start() sees it.
    std::optional<Device> memory;
    // Set by launch() before start(), for a backend's diagnostics: the
    // call's sequence number in this group and the bytes it sends (OpStats'
    // ring convention). A routed group's backends see the group's numbers.
    int64_t seq = -1, bytes = 0;
  };

  Communicator(std::string name, std::vector<int> members, int rank, CommOptions options);
  // Where a span call's memory lives (the backend's own memory, unless the
  // backend can ask).
  virtual Device locate(const Call& call) const = 0;
  // Why this backend cannot run `call` (empty: it can); launch() checks it
  // before the call takes a sequence number.
  virtual std::string refusal(const Call& call) const = 0;
  virtual std::unique_ptr<detail::PendingOp> start(const Call& call) = 0;
  // For a communicator that hands calls to others (comm/routed_communicator.h):
  // C++ lets a derived class reach protected members of its own kind only.
  static std::string refusal_of(const Communicator& c, const Call& call) { return c.refusal(call); }
  static std::unique_ptr<detail::PendingOp> start_on(Communicator& c, const Call& call) { return c.start(call); }

 private:
  void finish(Request r) { complete(r); }
  void add_blocking_time(CommOp op, std::chrono::steady_clock::time_point start) {
    stats_[static_cast<size_t>(op)].blocking_s +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  // One side of a call: its elements and, for a Tensor, its device.
  struct Buffer {
    const void* data = nullptr;
    int64_t count = 0;
    ElemType type = ElemType::f32;
    std::optional<Device> memory;
  };
  template <CommElement T>
  static Buffer buffer(std::span<T> s) {
    return {s.data(), static_cast<int64_t>(s.size()), elem_type_of<std::remove_const_t<T>>::value, std::nullopt};
  }
  static Buffer buffer(const Tensor& t, const char* op, const char* which, const std::string& group);

  // The one path of every call, span or Tensor (comm/communicator.cpp).
  Request start_all_reduce(const Buffer& data, ReduceOp op);
  Request start_all_gather(const Buffer& send, const Buffer& recv, std::span<const int64_t> recv_counts);
  Request start_reduce_scatter(const Buffer& send, const Buffer& recv, std::span<const int64_t> counts, ReduceOp op);
  Request start_all_to_all_v(const Buffer& send, std::span<const int64_t> send_counts, const Buffer& recv,
                             std::span<const int64_t> recv_counts);
  Request start_send(const Buffer& data, int peer, int tag);
  Request start_recv(const Buffer& data, int peer, int tag);
  Request start_broadcast(const Buffer& data, int root);
  // Both sides of a two-buffer call into `c`: same element type and memory.
  void pair(Call& c, const Buffer& send, const Buffer& recv) const;

  Request launch(Call call, int64_t bytes);
  // The bytes `call` reads and writes (CommOptions::check_in_flight).
  detail::InFlightRegions in_flight_regions(const Call& call) const;
  void check_peer(int peer, const char* what) const;
  void check_block_counts(std::span<const int64_t> counts, int64_t buffer, const char* op, const char* which) const;

  std::string name_;
  std::vector<int> members_;
  std::shared_ptr<const std::vector<int>> shared_members_;  // members_ again, for the ops (PendingOp::members)
  int rank_ = 0;
  CommOptions options_;
  int64_t seq_ = 0;
  std::array<OpStats, kNumCommOps> stats_{};
};

// The one statement of "a null Communicator* is a group of one rank":
// modules take a pointer that is null when there is nothing to communicate,
// so a one-rank group costs no call at all (Groups hands such pointers out:
// multi_rank in comm/groups.h). These read them.
inline int group_size(const Communicator* c) { return c ? c->size() : 1; }
inline int group_rank(const Communicator* c) { return c ? c->rank() : 0; }

}  // namespace origami::comm

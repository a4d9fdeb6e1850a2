// Backend-independent half of Communicator: the one path every call takes
// (span or Tensor: argument checks, where the memory lives and whether the
// backend moves it, sequence numbers, byte counters in the ring convention),
// and the bounded wait that turns a hang into a named abort.
#include "comm/communicator.h"

#include <mpi.h>
#include <sched.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <thread>

#include "comm/census.h"
#include "comm/in_flight_check.h"
#include "kernels/check.h"

namespace origami::comm {

std::string_view op_name(CommOp op) {
  switch (op) {
    case CommOp::all_reduce: return "all_reduce";
    case CommOp::all_gather: return "all_gather";
    case CommOp::reduce_scatter: return "reduce_scatter";
    case CommOp::all_to_all_v: return "all_to_all_v";
    case CommOp::send: return "send";
    case CommOp::recv: return "recv";
    case CommOp::broadcast: return "broadcast";
    case CommOp::barrier: return "barrier";
  }
  return "?";
}

size_t elem_size(ElemType t) {
  switch (t) {
    case ElemType::f32: return 4;
    case ElemType::f64: return 8;
    case ElemType::i32: return 4;
    case ElemType::i64: return 8;
    case ElemType::bf16: return 2;
  }
  return 0;
}

std::string_view elem_name(ElemType t) {
  switch (t) {
    case ElemType::f32: return "f32";
    case ElemType::f64: return "f64";
    case ElemType::i32: return "i32";
    case ElemType::i64: return "i64";
    case ElemType::bf16: return "bf16";
  }
  return "?";
}

std::string memory_refusal(Backend backend, Device memory, ElemType type, CommOp op) {
  const bool host = memory.kind == DeviceKind::cpu;
  if (op == CommOp::barrier) return {};  // moves no memory
  if (backend == Backend::mpi) {
    if (!host)
      return origami::detail::concat("memory on ", to_string(memory),
                            ", but the MPI backend moves host memory only (MPI is not assumed CUDA-aware): device "
                            "tensors go over NCCL, in Groups created with a CUDA compute device");
    return {};
  }
  if (host)
    return "host memory, but the NCCL backend moves device memory only: host tensors go over MPI";
  return {};
}

namespace ring_bytes {

int64_t all_reduce(int64_t count, size_t elem, int rank, int n) {
  if (n <= 1) return 0;
  const int64_t own = count / n + (rank < count % n ? 1 : 0);
  return 2 * (count - own) * static_cast<int64_t>(elem);
}

int64_t all_gather(int64_t send_count, size_t elem, int n) {
  return static_cast<int64_t>(n - 1) * send_count * static_cast<int64_t>(elem);
}

int64_t reduce_scatter(int64_t recv_count, size_t elem, int n) {
  return static_cast<int64_t>(n - 1) * recv_count * static_cast<int64_t>(elem);
}

int64_t reduce_scatter_v(std::span<const int64_t> counts, size_t elem, int rank) {
  return all_to_all_v(counts, elem, rank);  // every block but our own leaves once
}

int64_t all_to_all_v(std::span<const int64_t> send_counts, size_t elem, int rank) {
  int64_t sent = 0;
  for (size_t p = 0; p < send_counts.size(); ++p)
    if (static_cast<int>(p) != rank) sent += send_counts[p];
  return sent * static_cast<int64_t>(elem);
}

int64_t broadcast(int64_t count, size_t elem, int rank, int root, int n) {
  if (n <= 1 || rank == (root + n - 1) % n) return 0;
  return count * static_cast<int64_t>(elem);
}

}  // namespace ring_bytes

namespace {

// What a waiting rank answers the census with: "group dp op all_reduce seq
// 2, 3.1 s so far" (the part before the comma names the op).
std::string op_text(const detail::PendingOp& op) {
  return origami::detail::concat("group ", op.group, " op ", op_name(op.op), op.peer_note, " seq ", op.seq);
}
std::string census_text(const detail::PendingOp& op, double waited_s) {
  char s[32];
  std::snprintf(s, sizeof s, ", %.1f s so far", waited_s);
  return op_text(op) + s;
}

// How long a timed-out rank waits for the other members' answers.
constexpr double kCensusWaitSeconds = 2.0;

[[noreturn]] void abort_on_timeout(detail::PendingOp& op, double waited_s) {
  char msg[512];
  const int me = world_rank_for_diagnostics();
  std::snprintf(msg, sizeof msg,
                "[rank %d] collective timeout: group %s op %s%s seq %lld bytes %lld memory %s after %.1f s", me,
                op.group.c_str(), std::string(op_name(op.op)).c_str(), op.peer_note.c_str(),
                static_cast<long long>(op.seq), static_cast<long long>(op.bytes), to_string(op.memory).c_str(),
                waited_s);
  // The message goes out first: a backend abort that itself stalls must not
  // swallow it.
  std::fprintf(stderr, "%s\n", msg);
  std::fflush(stderr);
  // Then who the group is missing: the other members' answers (census.h;
  // the MPI backend's ops, whose peers wait on the host too).
  if (op.memory.is_host() && op.members && op.members->size() > 1) {
    const std::vector<census::Answer> answers = census::ask(*op.members, census_text(op, waited_s), kCensusWaitSeconds);
    std::string lines = origami::detail::concat(
        "[rank ", me, "] where ", answers.size() + 1 < op.members->size() ? "the next " : "the other ", answers.size(),
        " member", answers.size() == 1 ? "" : "s", " of group ", op.group, " are (asked for ", kCensusWaitSeconds,
        " s):\n");
    for (const std::string& l : census::report(answers, op_text(op)))
      lines += origami::detail::concat("[rank ", me, "]   ", l, "\n");
    std::fputs(lines.c_str(), stderr);
    std::fflush(stderr);
  }
  op.abort_backend();
  abort_job(kExitTimeout, "");
}

}  // namespace

namespace detail {

PendingOp::~PendingOp() {
  if (hold_ids_.empty()) return;
  TrackedAllocator& allocator = TrackedAllocator::of(memory);
  for (int64_t id : hold_ids_) allocator.unhold(id);
}

void PendingOp::hold_device_buffers(const InFlightRegions& regions, const std::string& holder) {
  TrackedAllocator& allocator = TrackedAllocator::of(memory);
  if (regions.read_bytes > 0) hold_ids_.push_back(allocator.hold(regions.read, regions.read_bytes, holder));
  if (regions.write_bytes > 0) hold_ids_.push_back(allocator.hold(regions.write, regions.write_bytes, holder));
}

}  // namespace detail

// MPI_Test (or cudaEventQuery) polling with a deadline. The first polls spin
// for latency; after that each poll yields the core, because test jobs run
// several ranks per core and a spinning rank would starve the peer it waits on.
void Request::wait(bool sleep_when_idle) {
  if (!op_) return;
  using Clock = std::chrono::steady_clock;
  if (!op_->test()) {
    const auto t0 = Clock::now();
    // Time this process did not run (RunningClock) is not waiting: when its
    // peers stopped too, or this rank is the one that fell behind. Otherwise
    // a job suspended past the timeout and resumed ended as a collective
    // timeout at its first poll.
    RunningClock waited(t0);
    double next_census_s = 0.1;  // a wait this long answers the census every 20 ms
    for (int polls = 0; !op_->test(); ++polls) {
      const double waited_s = waited.seconds();
      if (sleep_when_idle && waited_s > 1e-3)
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      else if (polls >= 256)
        sched_yield();
      if (waited_s > op_->timeout_s) abort_on_timeout(*op_, waited_s);
      if (waited_s > next_census_s) {
        census::answer(census_text(*op_, waited_s));
        next_census_s = waited_s + 0.02;
      }
    }
    add_exposed(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  op_.reset();
}

void Request::add_exposed(double host_wait_s) {
  if (op_->exposed_sink) *op_->exposed_sink += op_->exposed_seconds(host_wait_s);
}

void Request::wait_on(void* cuda_stream) {
  if (!op_) return;
  if (op_->enqueue_wait(cuda_stream)) {
    op_.reset();  // the stream holds the dependency now; the event may go
    return;
  }
  wait();
}

bool Request::wait_for(double seconds) {
  auto deadline = std::chrono::steady_clock::now() +
                  std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(seconds));
  return wait_until(deadline);
}

bool Request::wait_until(std::chrono::steady_clock::time_point& deadline) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  if (!op_ || op_->test()) {
    op_.reset();
    return true;
  }
  RunningClock running(t0);
  double next_census_s = 0.1;  // as in wait(): a long wait answers the census
  for (int polls = 0; !op_->test(); ++polls) {
    const auto now = Clock::now();
    deadline += running.poll_gap(now);  // not run: no wait (see wait())
    if (now > deadline) return false;   // counted when a later wait completes it
    if (polls >= 256) std::this_thread::sleep_for(std::chrono::microseconds(100));
    if (const double waited_s = std::chrono::duration<double>(now - t0).count(); waited_s > next_census_s) {
      census::answer(census_text(*op_, waited_s));
      next_census_s = waited_s + 0.02;
    }
  }
  add_exposed(std::chrono::duration<double>(Clock::now() - t0).count());
  op_.reset();
  return true;
}

bool Request::test() {
  if (!op_) return true;
  if (!op_->test()) return false;
  op_.reset();
  return true;
}

Communicator::Communicator(std::string name, std::vector<int> members, int rank, CommOptions options)
    : name_(std::move(name)),
      members_(std::move(members)),
      shared_members_(std::make_shared<const std::vector<int>>(members_)),
      rank_(rank),
      options_(options) {
  ORIGAMI_CHECK(!members_.empty() && rank_ >= 0 && rank_ < static_cast<int>(members_.size()), "group ", name_,
                ": rank ", rank_, " of ", members_.size());
  ORIGAMI_CHECK(options_.timeout_s > 0, "group ", name_, ": collective timeout must be positive, got ",
                options_.timeout_s);
}

int64_t Communicator::total_bytes() const {
  int64_t b = 0;
  for (const OpStats& s : stats_) b += s.bytes;
  return b;
}

void Communicator::check_peer(int peer, const char* what) const {
  ORIGAMI_CHECK(peer >= 0 && peer < size(), "group ", name_, ": ", what, " rank ", peer, " outside group of ", size());
}

void Communicator::check_block_counts(std::span<const int64_t> counts, int64_t buffer, const char* op,
                                      const char* which) const {
  ORIGAMI_CHECK(static_cast<int64_t>(counts.size()) == size(), "group ", name_, " ", op, ": ", counts.size(),
                " counts for a group of ", size());
  int64_t total = 0;
  for (int p = 0; p < size(); ++p) {
    ORIGAMI_CHECK(counts[p] >= 0, "group ", name_, " ", op, ": negative count for rank ", p);
    total += counts[p];
  }
  ORIGAMI_CHECK(total == buffer, "group ", name_, " ", op, ": counts sum to ", total, ", the ", which, " buffer holds ",
                buffer);
}

detail::InFlightRegions Communicator::in_flight_regions(const Call& c) const {
  const auto bytes = [&](int64_t count) { return static_cast<size_t>(count) * elem_size(c.type); };
  const auto total = [](std::span<const int64_t> counts) {
    return std::accumulate(counts.begin(), counts.end(), int64_t{0});
  };
  const auto* send = static_cast<const std::byte*>(c.send);
  auto* recv = static_cast<std::byte*>(c.recv);
  detail::InFlightRegions r;
  switch (c.op) {
    case CommOp::all_reduce: r = {recv, bytes(c.recv_count), recv, bytes(c.recv_count)}; break;
    case CommOp::all_gather:
    case CommOp::reduce_scatter: r = {send, bytes(c.send_count), recv, bytes(c.recv_count)}; break;
    // The blocks the counts name, not the buffers' whole length.
    case CommOp::all_to_all_v: r = {send, bytes(total(c.send_counts)), recv, bytes(total(c.recv_counts))}; break;
    case CommOp::send: r = {send, bytes(c.send_count), nullptr, 0}; break;
    case CommOp::recv: r = {nullptr, 0, recv, bytes(c.recv_count)}; break;
    case CommOp::broadcast:  // the root reads its buffer, every other rank's is written
      r = rank_ == c.peer ? detail::InFlightRegions{recv, bytes(c.recv_count), nullptr, 0}
                          : detail::InFlightRegions{nullptr, 0, recv, bytes(c.recv_count)};
      break;
    case CommOp::barrier: break;
  }
  return r;
}

Request Communicator::launch(Call c, int64_t bytes) {
  const int64_t n = size();
  switch (c.op) {
    case CommOp::all_gather:
      if (!c.recv_counts.empty()) {
        check_block_counts(c.recv_counts, c.recv_count, "all_gather_v", "recv");
        ORIGAMI_CHECK(c.send_count == c.recv_counts[rank_], "group ", name_, " all_gather_v: send holds ",
                      c.send_count, " elements, this rank's count is ", c.recv_counts[rank_]);
        break;
      }
      ORIGAMI_CHECK(c.recv_count == n * c.send_count, "group ", name_, " all_gather: recv holds ", c.recv_count,
                    " elements, expected ", n, " x ", c.send_count);
      break;
    case CommOp::reduce_scatter:
      if (!c.send_counts.empty()) {
        check_block_counts(c.send_counts, c.send_count, "reduce_scatter_v", "send");
        ORIGAMI_CHECK(c.recv_count == c.send_counts[rank_], "group ", name_, " reduce_scatter_v: recv holds ",
                      c.recv_count, " elements, this rank's count is ", c.send_counts[rank_]);
        break;
      }
      ORIGAMI_CHECK(c.send_count == n * c.recv_count, "group ", name_, " reduce_scatter: send holds ", c.send_count,
                    " elements, expected ", n, " x ", c.recv_count);
      break;
    case CommOp::all_to_all_v: {
      ORIGAMI_CHECK(static_cast<int64_t>(c.send_counts.size()) == n && static_cast<int64_t>(c.recv_counts.size()) == n,
                    "group ", name_, " all_to_all_v: ", c.send_counts.size(), " send and ", c.recv_counts.size(),
                    " recv counts for a group of ", n);
      int64_t s = 0, r = 0;
      for (int64_t p = 0; p < n; ++p) {
        ORIGAMI_CHECK(c.send_counts[p] >= 0 && c.recv_counts[p] >= 0, "group ", name_,
                      " all_to_all_v: negative count for rank ", p);
        s += c.send_counts[p];
        r += c.recv_counts[p];
      }
      ORIGAMI_CHECK(s <= c.send_count && r <= c.recv_count, "group ", name_, " all_to_all_v: counts sum to ", s,
                    " sent / ", r, " received, buffers hold ", c.send_count, " / ", c.recv_count);
      break;
    }
    default: break;
  }
  if (options_.p2p_by_order && (c.op == CommOp::send || c.op == CommOp::recv)) c.tag = 0;
  if (!c.memory) c.memory = locate(c);
  const std::string refused = refusal(c);
  ORIGAMI_CHECK(refused.empty(), "group ", name_, " ", op_name(c.op), " of ", elem_name(c.type), ": ", refused);
  const int64_t seq = seq_++;
  OpStats& st = stats_[static_cast<size_t>(c.op)];
  st.calls += 1;
  st.bytes += bytes;
  if (c.memory->kind != DeviceKind::cpu) {
    st.device_calls += 1;
    st.device_bytes += bytes;
  }
  std::unique_ptr<detail::InFlightCheck> check;
  if (options_.check_in_flight && c.memory->is_host() && c.op != CommOp::barrier) {
    check = std::make_unique<detail::InFlightCheck>(
        in_flight_regions(c), c.type, origami::detail::concat("group ", name_, " ", op_name(c.op), " seq ", seq));
    c.send = check->staged(c.send);
    c.recv = check->staged(c.recv);
  }
  c.seq = seq;
  c.bytes = bytes;
  std::unique_ptr<detail::PendingOp> op = start(c);
  if (check) op = detail::InFlightCheck::wrap(std::move(check), std::move(op));
  op->group = name_;
  op->op = c.op;
  op->seq = seq;
  op->bytes = bytes;
  if (c.op == CommOp::send || c.op == CommOp::recv)
    op->peer_note = origami::detail::concat(" (", c.op == CommOp::send ? "to" : "from", " world rank ", members_[c.peer],
                                            ", ", (c.op == CommOp::send ? c.send_count : c.recv_count) *
                                                      static_cast<int64_t>(elem_size(c.type)),
                                            " bytes)");
  op->members = shared_members_;
  op->memory = *c.memory;
  if (!c.memory->is_host() && c.op != CommOp::barrier)
    op->hold_device_buffers(in_flight_regions(c),
                            origami::detail::concat("group ", name_, " ", op_name(c.op), " seq ", seq));
  op->timeout_s = options_.timeout_s;
  op->exposed_sink = &st.exposed_s;
  op->launched();
  return Request(std::move(op));
}

// ---- the one path of every call ----------------------------------------------------------------------

void Communicator::pair(Call& c, const Buffer& send, const Buffer& recv) const {
  ORIGAMI_CHECK(send.type == recv.type, "group ", name_, " ", op_name(c.op), ": send is ", elem_name(send.type),
                ", recv is ", elem_name(recv.type));
  ORIGAMI_CHECK(send.memory.has_value() == recv.memory.has_value() && (!send.memory || *send.memory == *recv.memory),
                "group ", name_, " ", op_name(c.op), ": send memory on ",
                send.memory ? to_string(*send.memory) : "(span)", ", recv memory on ",
                recv.memory ? to_string(*recv.memory) : "(span)", " (one call moves memory of one device)");
  c.type = send.type;
  c.memory = send.memory;
  c.send = send.data;
  c.recv = const_cast<void*>(recv.data);  // a Buffer holds either side; recv sides are writable
  c.send_count = send.count;
  c.recv_count = recv.count;
}

Request Communicator::start_all_reduce(const Buffer& data, ReduceOp op) {
  Call c;
  c.op = CommOp::all_reduce;
  c.reduce = op;
  pair(c, data, data);
  return launch(c, ring_bytes::all_reduce(c.send_count, elem_size(c.type), rank(), size()));
}

Request Communicator::start_all_gather(const Buffer& send, const Buffer& recv, std::span<const int64_t> recv_counts) {
  Call c;
  c.op = CommOp::all_gather;
  pair(c, send, recv);
  c.recv_counts = recv_counts;
  return launch(c, ring_bytes::all_gather(c.send_count, elem_size(c.type), size()));
}

Request Communicator::start_reduce_scatter(const Buffer& send, const Buffer& recv, std::span<const int64_t> counts,
                                           ReduceOp op) {
  Call c;
  c.op = CommOp::reduce_scatter;
  c.reduce = op;
  pair(c, send, recv);
  c.send_counts = counts;
  const size_t es = elem_size(c.type);
  return launch(c, counts.empty() ? ring_bytes::reduce_scatter(c.recv_count, es, size())
                                  : ring_bytes::reduce_scatter_v(counts, es, rank()));
}

Request Communicator::start_all_to_all_v(const Buffer& send, std::span<const int64_t> send_counts, const Buffer& recv,
                                         std::span<const int64_t> recv_counts) {
  Call c;
  c.op = CommOp::all_to_all_v;
  pair(c, send, recv);
  c.send_counts = send_counts;
  c.recv_counts = recv_counts;
  return launch(c, ring_bytes::all_to_all_v(send_counts, elem_size(c.type), rank()));
}

Request Communicator::start_send(const Buffer& data, int peer, int tag) {
  check_peer(peer, "send");
  Call c;
  c.op = CommOp::send;
  c.type = data.type;
  c.memory = data.memory;
  c.send = data.data;
  c.send_count = data.count;
  c.peer = peer;
  c.tag = tag;
  return launch(c, c.send_count * static_cast<int64_t>(elem_size(c.type)));
}

Request Communicator::start_recv(const Buffer& data, int peer, int tag) {
  check_peer(peer, "recv");
  Call c;
  c.op = CommOp::recv;
  c.type = data.type;
  c.memory = data.memory;
  c.recv = const_cast<void*>(data.data);
  c.recv_count = data.count;
  c.peer = peer;
  c.tag = tag;
  return launch(c, 0);
}

Request Communicator::start_broadcast(const Buffer& data, int root) {
  check_peer(root, "broadcast root");
  Call c;
  c.op = CommOp::broadcast;
  pair(c, data, data);
  c.peer = root;
  return launch(c, ring_bytes::broadcast(c.send_count, elem_size(c.type), rank(), root, size()));
}

Request Communicator::barrier_async() {
  Call c;
  c.op = CommOp::barrier;  // no buffers: locate() says which memory's backend synchronizes
  return launch(c, 0);
}

}  // namespace origami::comm

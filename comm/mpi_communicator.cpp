// MPI backend: each op maps to one nonblocking MPI collective or point-to-point
// call; the PendingOp keeps the MPI_Request and any count arrays MPI reads
// until completion.
#include "comm/mpi_communicator.h"

#include <climits>

#include "kernels/bf16.h"
#include "kernels/check.h"

namespace origami::comm {

namespace {

MPI_Datatype mpi_type(ElemType t) {
  switch (t) {
    case ElemType::f32: return MPI_FLOAT;
    case ElemType::f64: return MPI_DOUBLE;
    case ElemType::i32: return MPI_INT32_T;
    case ElemType::i64: return MPI_INT64_T;
    case ElemType::bf16: return MPI_UINT16_T;  // 16-bit words; reductions through bf16_op
  }
  return MPI_DATATYPE_NULL;
}

// MPI has no bf16 type: a bf16 reduction combines 16-bit words with a user
// op that widens both operands exactly, adds (or takes the max) in fp32 and
// rounds to nearest even, as NCCL's bf16 reductions do per combining step.
template <ReduceOp kOp>
void bf16_combine(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) {
    const float x = bf16_value(a[i]), y = bf16_value(b[i]);
    b[i] = bf16_bits(kOp == ReduceOp::max ? (x > y || x != x ? x : y) : x + y);
  }
}

// Created once, on first use (MPI is initialized: a communicator exists);
// never freed (MPI_Finalize releases them).
MPI_Op bf16_op(ReduceOp op) {
  static const MPI_Op sum = [] {
    MPI_Op o;
    MPI_CHECK(MPI_Op_create(&bf16_combine<ReduceOp::sum>, /*commute=*/1, &o));
    return o;
  }();
  static const MPI_Op max = [] {
    MPI_Op o;
    MPI_CHECK(MPI_Op_create(&bf16_combine<ReduceOp::max>, /*commute=*/1, &o));
    return o;
  }();
  return op == ReduceOp::max ? max : sum;
}

MPI_Op mpi_op(ReduceOp op, ElemType t) {
  if (t == ElemType::bf16) return bf16_op(op);
  return op == ReduceOp::max ? MPI_MAX : MPI_SUM;
}

class MpiPending final : public detail::PendingOp {
 public:
  bool test() override {
    int done = 0;
    MPI_CHECK(MPI_Test(&req, &done, MPI_STATUS_IGNORE));
    return done != 0;
  }
  MPI_Request req = MPI_REQUEST_NULL;
  std::vector<int> counts;  // count/displacement arrays MPI reads until completion
};

// MPI counts are int; bigger messages are a caller bug at today's sizes.
int as_count(int64_t n, const std::string& group, CommOp op) {
  ORIGAMI_CHECK(n >= 0 && n <= INT_MAX, "group ", group, " ", op_name(op), ": ", n,
                " elements exceed the MPI count limit");
  return static_cast<int>(n);
}

}  // namespace

MpiCommunicator::MpiCommunicator(MPI_Comm comm, std::string name, std::vector<int> members, CommOptions options)
    : Communicator(
          std::move(name), std::move(members),
          [comm] {
            int r = 0;
            MPI_CHECK(MPI_Comm_rank(comm, &r));
            return r;
          }(),
          options),
      comm_(comm) {
  int n = 0;
  MPI_CHECK(MPI_Comm_size(comm_, &n));
  ORIGAMI_CHECK(n == size(), "group ", this->name(), ": MPI communicator of ", n, " ranks for ", size(), " members");
}

MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

std::unique_ptr<detail::PendingOp> MpiCommunicator::start(const Call& c) {
  auto p = std::make_unique<MpiPending>();
  const MPI_Datatype t = mpi_type(c.type);
  const std::string& g = name();
  switch (c.op) {
    case CommOp::all_reduce:
      MPI_CHECK(
          MPI_Iallreduce(MPI_IN_PLACE, c.recv, as_count(c.recv_count, g, c.op), t, mpi_op(c.reduce, c.type), comm_, &p->req));
      break;
    case CommOp::all_gather: {
      if (!c.recv_counts.empty()) {  // all_gather_v
        const int n = size();
        p->counts.resize(2 * static_cast<size_t>(n));
        int64_t off = 0;
        for (int i = 0; i < n; ++i) {
          p->counts[i] = as_count(c.recv_counts[i], g, c.op);
          p->counts[n + i] = as_count(off, g, c.op);
          off += c.recv_counts[i];
        }
        MPI_CHECK(MPI_Iallgatherv(c.send, as_count(c.send_count, g, c.op), t, c.recv, p->counts.data(),
                                  p->counts.data() + n, t, comm_, &p->req));
        break;
      }
      const int n = as_count(c.send_count, g, c.op);
      // The send block already sitting at this rank's slot of recv means in place.
      const void* own =
          static_cast<const char*>(c.recv) + static_cast<size_t>(rank()) * c.send_count * elem_size(c.type);
      MPI_CHECK(MPI_Iallgather(c.send == own ? MPI_IN_PLACE : c.send, n, t, c.recv, n, t, comm_, &p->req));
      break;
    }
    case CommOp::reduce_scatter:
      if (!c.send_counts.empty()) {  // reduce_scatter_v
        p->counts.resize(static_cast<size_t>(size()));
        for (int i = 0; i < size(); ++i) p->counts[i] = as_count(c.send_counts[i], g, c.op);
        MPI_CHECK(MPI_Ireduce_scatter(c.send, c.recv, p->counts.data(), t, mpi_op(c.reduce, c.type), comm_, &p->req));
        break;
      }
      MPI_CHECK(MPI_Ireduce_scatter_block(c.send, c.recv, as_count(c.recv_count, g, c.op), t, mpi_op(c.reduce, c.type), comm_,
                                          &p->req));
      break;
    case CommOp::all_to_all_v: {
      const int n = size();
      p->counts.resize(4 * static_cast<size_t>(n));
      int* sc = p->counts.data();
      int* sd = sc + n;
      int* rc = sd + n;
      int* rd = rc + n;
      int64_t so = 0, ro = 0;
      for (int i = 0; i < n; ++i) {
        sc[i] = as_count(c.send_counts[i], g, c.op);
        rc[i] = as_count(c.recv_counts[i], g, c.op);
        sd[i] = as_count(so, g, c.op);
        rd[i] = as_count(ro, g, c.op);
        so += c.send_counts[i];
        ro += c.recv_counts[i];
      }
      MPI_CHECK(MPI_Ialltoallv(c.send, sc, sd, t, c.recv, rc, rd, t, comm_, &p->req));
      break;
    }
    case CommOp::send:
      MPI_CHECK(MPI_Isend(c.send, as_count(c.send_count, g, c.op), t, c.peer, c.tag, comm_, &p->req));
      break;
    case CommOp::recv:
      MPI_CHECK(MPI_Irecv(c.recv, as_count(c.recv_count, g, c.op), t, c.peer, c.tag, comm_, &p->req));
      break;
    case CommOp::broadcast:
      MPI_CHECK(MPI_Ibcast(c.recv, as_count(c.recv_count, g, c.op), t, c.peer, comm_, &p->req));
      break;
    case CommOp::barrier: MPI_CHECK(MPI_Ibarrier(comm_, &p->req)); break;
  }
  return p;
}

std::unique_ptr<MpiCommunicator> split_mpi(MPI_Comm parent, const RankGroups& groups, std::string name,
                                           CommOptions options) {
  int me = 0;
  MPI_CHECK(MPI_Comm_rank(parent, &me));
  int color = MPI_UNDEFINED, key = 0;
  const RankGroup* mine = nullptr;
  for (size_t g = 0; g < groups.size(); ++g)
    for (size_t i = 0; i < groups[g].size(); ++i)
      if (groups[g][i] == me) {
        ORIGAMI_CHECK(mine == nullptr, "split ", name, ": rank ", me, " is in two groups");
        color = static_cast<int>(g);
        key = static_cast<int>(i);  // group rank = position in the ascending member list
        mine = &groups[g];
      }
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_CHECK(MPI_Comm_split(parent, color, key, &comm));
  if (!mine) return nullptr;
  return std::make_unique<MpiCommunicator>(comm, std::move(name), *mine, options);
}

std::unique_ptr<MpiCommunicator> whole_mpi(MPI_Comm parent, std::string name, CommOptions options) {
  int size = 0;
  MPI_CHECK(MPI_Comm_size(parent, &size));
  RankGroup all(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) all[static_cast<size_t>(r)] = r;
  return split_mpi(parent, RankGroups{all}, std::move(name), options);
}

std::unique_ptr<MpiCommunicator> node_mpi(MPI_Comm parent, std::string name, CommOptions options) {
  int parent_rank = 0, world_rank = 0, size = 0;
  MPI_CHECK(MPI_Comm_rank(parent, &parent_rank));
  MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_CHECK(MPI_Comm_split_type(parent, MPI_COMM_TYPE_SHARED, parent_rank, MPI_INFO_NULL, &comm));
  MPI_CHECK(MPI_Comm_size(comm, &size));
  // Blocking, like the split just before it: both happen once at start-up.
  std::vector<int> members(static_cast<size_t>(size));
  MPI_CHECK(MPI_Allgather(&world_rank, 1, MPI_INT, members.data(), 1, MPI_INT, comm));
  return std::make_unique<MpiCommunicator>(comm, std::move(name), std::move(members), options);
}

}  // namespace origami::comm

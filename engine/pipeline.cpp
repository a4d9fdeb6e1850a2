// Pipeline stages and the 1F1B schedule (see pipeline.h).
#include "engine/pipeline.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <limits>
#include <map>
#include <tuple>

#include "engine/plan.h"
#include "kernels/allocator.h"
#include "kernels/check.h"

namespace origami {

PipelineStage pipeline_stage(int64_t num_layers, int64_t pp, int64_t index, const std::vector<int64_t>& pp_layers,
                             int64_t virtual_stages) {
  ORIGAMI_CHECK(pp >= 1 && index >= 0 && index < pp && virtual_stages >= 1, "pipeline stage ", index, " of ", pp,
                " with ", virtual_stages, " chunks");
  const std::vector<int64_t> per_stage = plan::stage_layers(num_layers, pp * virtual_stages, pp_layers);
  PipelineStage s;
  s.index = index;
  s.count = pp;
  s.chunks.clear();
  int64_t first = 0;
  for (int64_t u = 0; u < pp * virtual_stages; ++u) {
    const int64_t n = per_stage[static_cast<size_t>(u)];
    if (u % pp == index) s.chunks.push_back({first, first + n});
    first += n;
  }
  return s;
}

int stage_root_rank(const comm::Groups& groups) {
  const comm::RankGroup roots = groups.layout().group_of(comm::GroupKind::pp, 0);
  return roots.at(static_cast<size_t>(groups.coords().pp));
}

const char* schedule_name(PipeSchedule s) {
  switch (s) {
    case PipeSchedule::one_f_one_b: return "1f1b";
    case PipeSchedule::interleaved: return "interleaved";
    case PipeSchedule::zb_h1: return "zb-h1";
  }
  return "?";
}

std::vector<PipeOp> one_f_one_b(int64_t stage, int64_t stages, int64_t m) {
  ORIGAMI_CHECK(stages >= 1 && stage >= 0 && stage < stages && m >= 1, "1F1B: stage ", stage, " of ", stages, ", ",
                m, " micro-batches");
  const int64_t warmup = std::min(stages - stage - 1, m);
  std::vector<PipeOp> ops;
  int64_t f = 0, b = 0;
  for (; f < warmup; ++f) ops.push_back({PipeOp::forward, f});
  for (; f < m; ++f, ++b) {
    ops.push_back({PipeOp::forward, f});
    ops.push_back({PipeOp::backward, b});
  }
  for (; b < m; ++b) ops.push_back({PipeOp::backward, b});
  return ops;
}

namespace {

void check_spec(const PipeScheduleSpec& spec) {
  const int64_t p = spec.stages, m = spec.micro_batches, v = spec.virtual_stages;
  ORIGAMI_CHECK(p >= 1 && m >= 1 && v >= 1, "pipeline schedule: ", p, " stages, ", m, " micro-batches, ", v,
                " virtual stages");
  if (spec.kind == PipeSchedule::interleaved) {
    if (v < 2 || p < 2)
      throw UserError("parallel.pp_schedule = \"interleaved\" needs parallel.pp >= 2 and parallel.virtual_stages >= 2 "
                      "(got pp = " + std::to_string(p) + ", virtual_stages = " + std::to_string(v) +
                      "); with one chunk per rank use \"1f1b\"");
    if (m % p != 0)
      throw UserError("parallel.pp_schedule = \"interleaved\": the micro-batches per step (training.global_batch / "
                      "(training.micro_batch · DP) = " + std::to_string(m) +
                      ") must be a multiple of parallel.pp = " + std::to_string(p) +
                      " (micro-batches advance through the chunks in groups of pp)");
  } else if (v != 1) {
    throw UserError("parallel.virtual_stages = " + std::to_string(v) +
                    " needs parallel.pp_schedule = \"interleaved\" (1f1b and zb-h1 run one chunk per rank)");
  }
}

}  // namespace

std::vector<PipeOp> interleaved_one_f_one_b(int64_t stage, int64_t p, int64_t m, int64_t v) {
  check_spec({PipeSchedule::interleaved, p, m, v});
  ORIGAMI_CHECK(stage >= 0 && stage < p, "interleaved 1F1B: stage ", stage, " of ", p);
  const int64_t total = m * v;
  const int64_t warmup = m == p ? total : std::min(total, (p - stage - 1) * 2 + (v - 1) * p);
  auto micro_batch = [&](int64_t k) { return (k / (p * v)) * p + k % p; };
  auto forward = [&](int64_t k) { return PipeOp{PipeOp::forward, micro_batch(k), (k % (p * v)) / p}; };
  auto backward = [&](int64_t k) { return PipeOp{PipeOp::backward, micro_batch(k), v - 1 - (k % (p * v)) / p}; };
  std::vector<PipeOp> ops;
  int64_t f = 0, b = 0;
  for (; f < warmup; ++f) ops.push_back(forward(f));
  for (; f < total; ++f, ++b) {
    ops.push_back(forward(f));
    ops.push_back(backward(b));
  }
  for (; b < total; ++b) ops.push_back(backward(b));
  return ops;
}

std::vector<PipeOp> zb_h1(int64_t stage, int64_t p, int64_t m) {
  ORIGAMI_CHECK(p >= 1 && stage >= 0 && stage < p && m >= 1, "ZB-H1: stage ", stage, " of ", p, ", ", m,
                " micro-batches");
  // Every stage's 1F1B list, run in lockstep with unit op times; W's fill
  // the slots where a stage's next F or B has no input yet.
  std::vector<std::vector<PipeOp>> fb(p), out(p);
  for (int64_t s = 0; s < p; ++s) fb[s] = one_f_one_b(s, p, m);
  constexpr int64_t kNever = std::numeric_limits<int64_t>::max();
  std::vector<std::vector<int64_t>> f_done(p, std::vector<int64_t>(m, kNever)), b_done = f_done;
  std::vector<size_t> next(p, 0);
  std::vector<int64_t> w_next(p, 0), b_count(p, 0);
  for (int64_t t = 0;; ++t) {
    bool left = false;
    std::vector<PipeOp> pick(p, PipeOp{PipeOp::weight, -1});
    for (int64_t s = 0; s < p; ++s) {
      bool ready = false;
      if (next[s] < fb[s].size()) {
        const PipeOp& op = fb[s][next[s]];
        const int64_t j = op.micro_batch;
        ready = op.kind == PipeOp::forward ? (s == 0 || f_done[s - 1][j] <= t)
                                           : (s == p - 1 ? f_done[s][j] <= t : b_done[s + 1][j] <= t);
      }
      const int64_t pending = b_count[s] - w_next[s];
      if (pending > 0 && (pending >= p || !ready))
        pick[s] = {PipeOp::weight, w_next[s]};
      else if (ready)
        pick[s] = fb[s][next[s]];
      left = left || next[s] < fb[s].size() || w_next[s] < m;
    }
    if (!left) break;
    for (int64_t s = 0; s < p; ++s) {
      const PipeOp& op = pick[s];
      if (op.micro_batch < 0) continue;
      out[s].push_back(op);
      if (op.kind == PipeOp::weight) {
        ++w_next[s];
        continue;
      }
      ++next[s];
      (op.kind == PipeOp::forward ? f_done : b_done)[s][op.micro_batch] = t + 1;
      if (op.kind == PipeOp::backward) ++b_count[s];
    }
    ORIGAMI_CHECK(t < 8 * p * m + 8, "ZB-H1 construction did not finish");
  }
  return out[stage];
}

std::vector<PipeOp> pipeline_schedule(const PipeScheduleSpec& spec, int64_t stage) {
  check_spec(spec);
  switch (spec.kind) {
    case PipeSchedule::one_f_one_b: return one_f_one_b(stage, spec.stages, spec.micro_batches);
    case PipeSchedule::interleaved:
      return interleaved_one_f_one_b(stage, spec.stages, spec.micro_batches, spec.virtual_stages);
    case PipeSchedule::zb_h1: return zb_h1(stage, spec.stages, spec.micro_batches);
  }
  ORIGAMI_CHECK(false, "unknown pipeline schedule");
  return {};
}

namespace {

// Receives each rank keeps posted ahead (run_pipeline and simulate_pipeline).
constexpr size_t kReceivesAhead = 2;

// Where an op's input comes from and its output goes: the pipeline rank and
// tag, or rank −1 for none (the first virtual stage's forward input, the
// last's backward input, and both ends' outputs; W ops have neither).
struct Peer {
  int rank = -1, tag = 0;
};
struct OpPeers {
  Peer in, out;
};
OpPeers op_peers(const PipeOp& op, int64_t stage, int64_t p, int64_t v) {
  if (op.kind == PipeOp::weight) return {};
  const int64_t u = op.chunk * p + stage, last = p * v - 1;
  auto at = [&](int64_t w, bool activation) {
    return Peer{static_cast<int>(w % p), activation ? activation_tag(w / p) : gradient_tag(w / p)};
  };
  OpPeers r;
  if (op.kind == PipeOp::forward) {
    if (u > 0) r.in = {static_cast<int>((u - 1) % p), activation_tag(op.chunk)};
    if (u < last) r.out = at(u + 1, true);
  } else {
    if (u < last) r.in = {static_cast<int>((u + 1) % p), gradient_tag(op.chunk)};
    if (u > 0) r.out = at(u - 1, false);
  }
  return r;
}

}  // namespace

PipelineSimulation simulate_pipeline(const PipeScheduleSpec& spec, double t_f, double t_b, double t_w) {
  const int64_t p = spec.stages, v = spec.virtual_stages;
  std::vector<std::vector<PipeOp>> ops(p);
  std::vector<std::vector<OpPeers>> peers(p);
  bool has_w = false;
  for (int64_t s = 0; s < p; ++s) {
    ops[s] = pipeline_schedule(spec, s);
    for (const PipeOp& op : ops[s]) {
      peers[s].push_back(op_peers(op, s, p, v));
      has_w = has_w || op.kind == PipeOp::weight;
    }
  }
  const double backward_time = has_w ? t_b : t_b + t_w;
  // Messages by queue (source, destination, tag), in posting order; the
  // n-th receive a rank posts on a queue matches the n-th send on it.
  using Queue = std::tuple<int, int, int>;
  struct Posted {
    PipeOp op;  // the sender's op (sends) or the receiver's (receives)
    double at;
    size_t k = 0;  // its index in the sender's op list (sends)
  };
  std::map<Queue, std::vector<Posted>> sends, recvs;
  struct Rank {
    size_t k = 0;             // next op
    double clock = 0;
    size_t recv_posted = 0;   // ops before this index have their receive posted (if they need one)
    std::map<Queue, size_t> sent, received;  // per queue: sends / receives consumed so far
    int64_t saved = 0, pending = 0;
    // Per op: its end, the receives posted after it (ops before this index),
    // and when the receiver took its send (its consuming op's start).
    std::vector<double> end, taken;
    std::vector<size_t> posted_after;
  };
  std::vector<Rank> rk(p);
  PipelineSimulation sim;
  sim.busy.assign(p, 0.0);
  sim.finish.assign(p, 0.0);
  sim.max_saved.assign(p, 0);
  sim.max_pending_w.assign(p, 0);
  // Keeps the receives of the next kReceivesAhead ops at or after `from`
  // that need one posted.
  auto post_next_receive = [&](int64_t s, size_t from) {
    Rank& r = rk[s];
    size_t pending = 0;
    for (size_t k = from; k < r.recv_posted; ++k) pending += peers[s][k].in.rank >= 0;
    for (size_t k = std::max(from, r.recv_posted); k < ops[s].size() && pending < kReceivesAhead; ++k) {
      r.recv_posted = k + 1;
      if (peers[s][k].in.rank >= 0) {
        recvs[{peers[s][k].in.rank, static_cast<int>(s), peers[s][k].in.tag}].push_back({ops[s][k], r.clock});
        ++pending;
      }
    }
  };
  for (int64_t s = 0; s < p; ++s) {
    rk[s].taken.assign(ops[s].size(), std::numeric_limits<double>::infinity());
    post_next_receive(s, 0);
  }
  std::vector<size_t> posted_first(p);  // before the first op
  for (int64_t s = 0; s < p; ++s) posted_first[s] = rk[s].recv_posted;
  // Each rank's own order fixes its times, so the order ranks advance in
  // here does not change the result.
  for (bool progress = true; progress;) {
    progress = false;
    for (int64_t s = 0; s < p; ++s) {
      Rank& r = rk[s];
      while (r.k < ops[s].size()) {
        const PipeOp& op = ops[s][r.k];
        const OpPeers& io = peers[s][r.k];
        {
          double start = r.clock;
          if (io.in.rank >= 0) {
            const Queue q{io.in.rank, static_cast<int>(s), io.in.tag};
            const size_t n = r.received[q];
            const auto it = sends.find(q);
            if (it == sends.end() || it->second.size() <= n) break;  // not sent yet
            const Posted& msg = it->second[n];
            if (msg.op.micro_batch != op.micro_batch && sim.error.empty())
              sim.error = "rank " + std::to_string(s) + " expected micro-batch " + std::to_string(op.micro_batch) +
                          " on tag " + std::to_string(io.in.tag) + " and received " + std::to_string(msg.op.micro_batch);
            ++r.received[q];
            start = std::max({start, msg.at, recvs[q][n].at});
            rk[io.in.rank].taken[msg.k] = start;
          }
          const double d = op.kind == PipeOp::forward ? t_f : op.kind == PipeOp::backward ? backward_time : t_w;
          r.clock = start + d;
          sim.busy[s] += d;
          if (op.kind == PipeOp::forward) sim.max_saved[s] = std::max(sim.max_saved[s], ++r.saved);
          if (op.kind == PipeOp::backward) {
            --r.saved;
            if (has_w) sim.max_pending_w[s] = std::max(sim.max_pending_w[s], ++r.pending);
          }
          if (op.kind == PipeOp::weight) --r.pending;
          if (io.out.rank >= 0) sends[{static_cast<int>(s), io.out.rank, io.out.tag}].push_back({op, r.clock, r.k});
          post_next_receive(s, r.k + 1);
          r.end.push_back(r.clock);
          r.posted_after.push_back(r.recv_posted);
        }
        ++r.k;
        progress = true;
      }
    }
  }
  sim.finished = true;
  sim.boundary_buffers.resize(p);
  for (int64_t s = 0; s < p; ++s) {
    const Rank& r = rk[s];
    const size_t n = r.end.size();
    // Op j holds the receives posted for ops j+1 .. posted_after[j-1] − 1,
    // and every send of an op i < j not yet freed: run_pipeline frees a
    // send after the first op m ≥ i that ends once its receiver has taken
    // it (ends are nondecreasing; never taken: at the end of the schedule).
    std::vector<int64_t> needs_recv(n + 1, 0), in_flight(n + 1, 0);
    for (size_t k = 0; k < n; ++k) needs_recv[k + 1] = needs_recv[k] + (peers[s][k].in.rank >= 0);
    for (size_t i = 0; i < n; ++i) {
      if (peers[s][i].out.rank < 0) continue;
      const size_t freed = static_cast<size_t>(std::lower_bound(r.end.begin() + i, r.end.end(), r.taken[i]) -
                                               r.end.begin());  // the op after which it goes (n: never)
      in_flight[i + 1] += 1;
      in_flight[std::min(freed + 1, n)] -= 1;
    }
    std::vector<int64_t>& b = sim.boundary_buffers[s];
    int64_t sends = 0;
    for (size_t j = 0; j < n; ++j) {
      sends += in_flight[j];
      const size_t posted = std::max(j + 1, j == 0 ? posted_first[s] : r.posted_after[j - 1]);
      b.push_back(sends + needs_recv[posted] - needs_recv[j + 1]);
    }
  }
  for (int64_t s = 0; s < p; ++s) {
    sim.finished = sim.finished && rk[s].k == ops[s].size();
    sim.finish[s] = rk[s].clock;
    sim.makespan = std::max(sim.makespan, rk[s].clock);
  }
  return sim;
}

std::string untagged_order_problem(const PipeScheduleSpec& spec) {
  std::vector<std::vector<PipeOp>> stage_ops;
  for (int64_t s = 0; s < spec.stages; ++s) stage_ops.push_back(pipeline_schedule(spec, s));
  return untagged_order_problem(spec, stage_ops);
}

std::string untagged_order_problem(const PipeScheduleSpec& spec, const std::vector<std::vector<PipeOp>>& stage_ops) {
  const int64_t p = spec.stages, v = spec.virtual_stages;
  ORIGAMI_CHECK(static_cast<int64_t>(stage_ops.size()) == p, "untagged_order_problem: ", stage_ops.size(),
                " op lists for ", p, " stages");
  struct Message {
    PipeOp op;
    int tag;
  };
  // By (source, destination): sends in the source's op order, receives in the destination's.
  std::map<std::pair<int, int>, std::vector<Message>> sent, received;
  for (int64_t s = 0; s < p; ++s)
    for (const PipeOp& op : stage_ops[s]) {
      const OpPeers io = op_peers(op, s, p, v);
      if (io.in.rank >= 0) received[{io.in.rank, static_cast<int>(s)}].push_back({op, io.in.tag});
      if (io.out.rank >= 0) sent[{static_cast<int>(s), io.out.rank}].push_back({op, io.out.tag});
    }
  for (const auto& [pair, out] : sent) {
    const std::vector<Message>& in = received[pair];
    if (in.size() != out.size())
      return detail::concat("stage ", pair.first, " sends ", out.size(), " messages to stage ", pair.second,
                            ", which receives ", in.size());
    for (size_t n = 0; n < in.size(); ++n)
      if (in[n].tag != out[n].tag || in[n].op.micro_batch != out[n].op.micro_batch)
        return detail::concat("message ", n, " from stage ", pair.first, " to stage ", pair.second,
                              " carries micro-batch ", out[n].op.micro_batch, " (tag ", out[n].tag,
                              "); the receive that takes it expects micro-batch ", in[n].op.micro_batch, " (tag ",
                              in[n].tag, ")");
  }
  if (received.size() != sent.size()) return "a stage receives from a stage that sends it nothing";
  return {};
}

double predicted_bubble(const PipeScheduleSpec& spec, double t_f, double t_b, double t_w) {
  check_spec(spec);
  const auto p = static_cast<double>(spec.stages), m = static_cast<double>(spec.micro_batches),
             v = static_cast<double>(spec.virtual_stages);
  switch (spec.kind) {
    case PipeSchedule::one_f_one_b: return (p - 1) / (m + p - 1);
    case PipeSchedule::interleaved: return (p - 1) / (v * m + p - 1);
    case PipeSchedule::zb_h1: {
      const PipelineSimulation sim = simulate_pipeline(spec, t_f, t_b, t_w);
      ORIGAMI_CHECK(sim.finished, "ZB-H1 simulation did not finish");
      return sim.idle_fraction(0);
    }
  }
  return 0;
}

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// A boundary tensor on the wire; the tensor lives until the request completes.
struct Transfer {
  Tensor data;
  comm::Request request;
};

}  // namespace

// Protocol: after each op its output's send is posted and left in flight
// (completed later, all of them before the flush), and the receives of the
// next kReceivesAhead ops that need one are posted; an op waits only for its
// own input. No rank ever blocks on a send, so the schedule alone decides
// who waits for whom, and simulate_pipeline (which runs this protocol) shows
// every schedule deadlock-free with its formula's makespan. Waiting for each
// send before the next compute (Megatron's pairing) would tie the sender to
// the receiver's progress: a large message under OpenMPI's shared-memory
// single copy completes only when the receiver, inside MPI, copies it, so a
// sender waiting while its receiver computes another chunk idles for that
// compute — measured: interleaved PP 2 idled 17% against its 5.9% bubble.
StageTiming run_pipeline(comm::Communicator* pp, const PipeScheduleSpec& spec, const Shape& boundary,
                         const StageForward& forward, const StageBackward& backward, const StageWeight& weight,
                         HeldActivations* held) {
  const int64_t stage = comm::group_rank(pp), stages = comm::group_size(pp);
  ORIGAMI_CHECK(stages == spec.stages, "pipeline schedule for ", spec.stages, " stages on a pp group of ", stages);
  const std::vector<PipeOp> ops = pipeline_schedule(spec, stage);
  std::vector<OpPeers> peers;
  for (const PipeOp& op : ops) {
    peers.push_back(op_peers(op, stage, spec.stages, spec.virtual_stages));
    ORIGAMI_CHECK(op.kind != PipeOp::weight || weight, "pipeline: the schedule has W ops and no weight pass");
  }
  StageTiming t;
  // On CUDA the compute stream waits for a boundary tensor (its stall is the
  // pp group's exposed time) and the host goes on queueing; on MPI the host
  // waits, and that wait is the stage's idle time.
  auto wait = [&](comm::Request& r) {
    const auto t0 = Clock::now();
    pp->complete(r, /*sleep_when_idle=*/true);
    t.idle_s += seconds_since(t0);
  };
  const auto activation = static_cast<size_t>(MemCategory::activation);
  const int64_t boundary_bytes = shape_numel(boundary) * static_cast<int64_t>(dtype_size(spec.dtype));
  // Receives in flight, by op, in schedule order: after each op the
  // receives of the next kReceivesAhead ops that need one are posted. One is
  // not enough: an interleaved rank's next op may wait on one neighbour
  // while the other neighbour's send, for a later op, must be matched first.
  std::deque<std::pair<size_t, Transfer>> incoming;
  std::vector<Transfer> outgoing;  // sends in flight
  size_t unposted = 0;  // ops before this index have their receive posted (if they need one)
  auto post_receive_after = [&](size_t from) {
    for (size_t k = std::max(from, unposted); k < ops.size() && incoming.size() < kReceivesAhead; ++k) {
      unposted = k + 1;
      if (peers[k].in.rank < 0) continue;
      Tensor x = Tensor::empty(boundary, spec.dtype, MemCategory::activation, spec.device);
      comm::Request r = pp->recv_async(x, peers[k].in.rank, peers[k].in.tag);
      incoming.emplace_back(k, Transfer{std::move(x), std::move(r)});
    }
  };
  post_receive_after(0);
  for (size_t k = 0; k < ops.size(); ++k) {
    const PipeOp& op = ops[k];
    Tensor in;
    if (peers[k].in.rank >= 0) {
      ORIGAMI_CHECK(!incoming.empty() && incoming.front().first == k, "pipeline: op ", k, " has no receive posted");
      wait(incoming.front().second.request);
      in = std::move(incoming.front().second.data);
      incoming.pop_front();
    }
    const auto t0 = Clock::now();
    Tensor out;
    switch (op.kind) {
      case PipeOp::forward: out = forward(op.chunk, op.micro_batch, std::move(in)); break;
      case PipeOp::backward: out = backward(op.chunk, op.micro_batch, std::move(in)); break;
      case PipeOp::weight: weight(op.chunk, op.micro_batch); break;
    }
    t.busy_s += seconds_since(t0);
    if (peers[k].out.rank >= 0) {
      ORIGAMI_CHECK(out.defined() && out.shape() == boundary, "pipeline stage ", stage, " chunk ", op.chunk,
                    ": boundary tensor of shape ", out.defined() ? shape_string(out.shape()) : "(none)", ", expected ",
                    shape_string(boundary));
      comm::Request r = pp->send_async(out, peers[k].out.rank, peers[k].out.tag);
      outgoing.push_back({std::move(out), std::move(r)});
    }
    post_receive_after(k + 1);
    // Sends the receivers have taken free their tensors (theirs now).
    std::erase_if(outgoing, [](Transfer& x) { return x.request.test(); });
    if (held && held->ledger) {  // not counting the posted receives' buffers or the sends in flight
      const int64_t now = held->ledger->snapshot().current[activation] -
                          static_cast<int64_t>(incoming.size() + outgoing.size()) * boundary_bytes;
      held->peak_bytes = std::max(held->peak_bytes, now);
    }
  }
  for (Transfer& x : outgoing) wait(x.request);
  outgoing.clear();
  // Flush: a stage is idle until the whole pipeline has drained (the last
  // stages finish first), which is what makes every stage's idle share the
  // bubble when stages are equal. On CUDA the host is ahead of its device
  // here; the trainer drains after synchronizing it (StageTiming).
  if (pp && !pp->compute_stream()) {
    comm::Request drained = pp->barrier_async();
    wait(drained);
  }
  if (held) t.held_activation_bytes = held->peak_bytes;
  return t;
}

}  // namespace origami

// Pipeline parallelism without ranks (engine/pipeline.h):
//  - one_f_one_b's schedule, as properties over every (stages 1..5, stage,
//    micro-batches 1..9): each micro-batch forwarded once, then backwarded
//    once, both in order; forwards before the first backward and the
//    micro-batches in flight bounded by min(stages − stage, m); the last stage
//    alternates F B;
//  - a discrete-event simulation of all stages joined by FIFO queues (one per
//    direction and neighbour pair, as run_one_f_one_b's tags make them): the
//    schedules never deadlock, every receive pops the micro-batch the
//    schedule expects, and with forward 1 and backward 2 time units the
//    makespan is (m + p − 1)·(t_f + t_b) — the bubble (p − 1)/(m + p − 1);
//  - pipeline_stage(): even split with the remainder on the first stages, an
//    explicit split with an empty stage, and the UserError of a bad list.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <deque>
#include <random>

#include "engine/pipeline.h"
#include "kernels/check.h"
#include "test_seed.h"

namespace origami {
namespace {

std::string where(int64_t stage, int64_t stages, int64_t m) {
  return "stage " + std::to_string(stage) + " of " + std::to_string(stages) + ", m = " + std::to_string(m);
}

TEST(OneFOneB, ScheduleProperties) {
  for (int64_t p = 1; p <= 5; ++p)
    for (int64_t s = 0; s < p; ++s)
      for (int64_t m = 1; m <= 9; ++m) {
        SCOPED_TRACE(where(s, p, m));
        const std::vector<PipeOp> ops = one_f_one_b(s, p, m);
        ASSERT_EQ(static_cast<int64_t>(ops.size()), 2 * m);
        std::vector<int64_t> forward_at(m, -1), backward_at(m, -1);
        int64_t next_f = 0, next_b = 0, in_flight = 0, max_in_flight = 0, before_first_backward = -1;
        for (int64_t i = 0; i < static_cast<int64_t>(ops.size()); ++i) {
          const PipeOp& op = ops[i];
          ASSERT_GE(op.micro_batch, 0);
          ASSERT_LT(op.micro_batch, m);
          if (op.kind == PipeOp::forward) {
            EXPECT_EQ(op.micro_batch, next_f++) << "forwards in order 0..m-1";
            EXPECT_EQ(forward_at[op.micro_batch], -1) << "forwarded twice";
            forward_at[op.micro_batch] = i;
            max_in_flight = std::max(max_in_flight, ++in_flight);
          } else {
            if (before_first_backward < 0) before_first_backward = i;
            EXPECT_EQ(op.micro_batch, next_b++) << "backwards in order 0..m-1";
            EXPECT_EQ(backward_at[op.micro_batch], -1) << "backwarded twice";
            EXPECT_GE(forward_at[op.micro_batch], 0) << "backward before its forward";
            backward_at[op.micro_batch] = i;
            --in_flight;
          }
        }
        EXPECT_EQ(next_f, m);
        EXPECT_EQ(next_b, m);
        EXPECT_EQ(in_flight, 0);
        // Warm-up min(p − s − 1, m), then one steady forward when any is left.
        EXPECT_EQ(before_first_backward, std::min(p - s, m));
        EXPECT_EQ(max_in_flight, std::min(p - s, m));
        if (s == p - 1) {
          for (int64_t i = 0; i < 2 * m; ++i)
            EXPECT_EQ(ops[i], (PipeOp{i % 2 == 0 ? PipeOp::forward : PipeOp::backward, i / 2})) << "op " << i;
        }
      }
}

// All p stages of a pipeline, each running its own one_f_one_b list, joined
// by FIFO queues: activations s → s+1, gradients s+1 → s. A stage may run its
// next op when its input is queued (the first stage's forwards and the last
// stage's backwards need none). Time: an op starts when both its stage and
// its input are ready. Because each stage's order is fixed, the times do not
// depend on which ready stage the loop picks (`rng` picks at random; null:
// the lowest ready stage).
struct Message {
  int64_t micro_batch;
  double ready;
};
struct Simulation {
  bool finished = false;
  double makespan = 0;
  std::vector<double> busy, finish;  // per stage
};

Simulation simulate(int64_t p, int64_t m, double t_f, double t_b, std::mt19937* rng) {
  std::vector<std::vector<PipeOp>> ops(p);
  for (int64_t s = 0; s < p; ++s) ops[s] = one_f_one_b(s, p, m);
  std::vector<size_t> next(p, 0);
  std::vector<std::deque<Message>> activations(p), gradients(p);  // into stage s
  std::vector<std::vector<bool>> forwarded(p, std::vector<bool>(m, false));
  std::vector<double> clock(p, 0.0);
  Simulation sim;
  sim.busy.assign(p, 0.0);
  auto ready = [&](int64_t s) {
    if (next[s] == ops[s].size()) return false;
    const PipeOp& op = ops[s][next[s]];
    if (op.kind == PipeOp::forward) return s == 0 || !activations[s].empty();
    return s == p - 1 || !gradients[s].empty();
  };
  for (;;) {
    std::vector<int64_t> candidates;
    for (int64_t s = 0; s < p; ++s)
      if (ready(s)) candidates.push_back(s);
    if (candidates.empty()) break;
    const int64_t s =
        rng ? candidates[std::uniform_int_distribution<size_t>(0, candidates.size() - 1)(*rng)] : candidates[0];
    const PipeOp op = ops[s][next[s]++];
    double start = clock[s];
    if (op.kind == PipeOp::forward) {
      if (s > 0) {
        const Message msg = activations[s].front();
        activations[s].pop_front();
        EXPECT_EQ(msg.micro_batch, op.micro_batch) << "stage " << s << " received another micro-batch's activation";
        start = std::max(start, msg.ready);
      }
      forwarded[s][op.micro_batch] = true;
      clock[s] = start + t_f;
      sim.busy[s] += t_f;
      if (s < p - 1) activations[s + 1].push_back({op.micro_batch, clock[s]});
    } else {
      if (s < p - 1) {
        const Message msg = gradients[s].front();
        gradients[s].pop_front();
        EXPECT_EQ(msg.micro_batch, op.micro_batch) << "stage " << s << " received another micro-batch's gradient";
        start = std::max(start, msg.ready);
      }
      EXPECT_TRUE(forwarded[s][op.micro_batch]) << "stage " << s << " backward before its own forward";
      clock[s] = start + t_b;
      sim.busy[s] += t_b;
      if (s > 0) gradients[s - 1].push_back({op.micro_batch, clock[s]});
    }
  }
  sim.finished = true;
  for (int64_t s = 0; s < p; ++s) {
    sim.finished = sim.finished && next[s] == ops[s].size() && activations[s].empty() && gradients[s].empty();
    sim.makespan = std::max(sim.makespan, clock[s]);
  }
  sim.finish = clock;
  return sim;
}

TEST(OneFOneB, AllStagesTogetherFinishWithTheExpectedMakespan) {
  std::mt19937 rng(testing::test_seed(20240611));
  const double t_f = 1, t_b = 2;
  for (int64_t p = 1; p <= 6; ++p)
    for (int64_t m = 1; m <= 10; ++m) {
      SCOPED_TRACE("p = " + std::to_string(p) + ", m = " + std::to_string(m));
      const Simulation in_order = simulate(p, m, t_f, t_b, nullptr);
      ASSERT_TRUE(in_order.finished) << "deadlock: some stage waits on a message that is never sent";
      // Critical path (derivation): stage 0's forwards 0..p−1 run back to back
      // from t = 0 (warm-up p − 1, then the first steady one); micro-batch
      // 0's forward ends on the last stage at p·t_f, where its backward starts
      // at once, and its gradient takes p backwards to leave stage 0 at
      // p·t_f + p·t_b. From there every stage is in steady state, one F and
      // one B per micro-batch (t_f + t_b ≥ the wait on either neighbour, as
      // the neighbours have the same period), so stage 0 ends m − 1 periods
      // later: p(t_f + t_b) + (m − 1)(t_f + t_b) = (m + p − 1)(t_f + t_b).
      EXPECT_DOUBLE_EQ(in_order.makespan, static_cast<double>(m + p - 1) * (t_f + t_b));
      for (int64_t s = 0; s < p; ++s) {
        EXPECT_DOUBLE_EQ(in_order.busy[s], static_cast<double>(m) * (t_f + t_b));
        // Idle over the whole step is the bubble (p − 1)/(m + p − 1) on every
        // stage. A stage's own run ends s backwards before stage 0's, so the
        // idle time run_one_f_one_b can measure on stage s (from the step's
        // start to its last op) is (p − 1)(t_f + t_b) − s·t_b, the bubble only
        // on stage 0.
        EXPECT_DOUBLE_EQ(in_order.finish[s], in_order.makespan - static_cast<double>(s) * t_b) << "stage " << s;
        EXPECT_NEAR((in_order.makespan - in_order.busy[s]) / in_order.makespan,
                    static_cast<double>(p - 1) / static_cast<double>(m + p - 1), 1e-12);
      }
      // Any interleaving of the ready stages gives the same run.
      for (int trial = 0; trial < 5; ++trial) {
        const Simulation shuffled = simulate(p, m, t_f, t_b, &rng);
        ASSERT_TRUE(shuffled.finished) << "deadlock in interleaving " << trial;
        EXPECT_DOUBLE_EQ(shuffled.makespan, in_order.makespan);
      }
    }
}

TEST(OneFOneB, MakespanHoldsForOtherOpTimes) {
  // The derivation above only needs t_f, t_b > 0; check a few ratios.
  for (auto [t_f, t_b] : {std::pair{1.0, 1.0}, std::pair{1.0, 3.0}, std::pair{2.0, 1.0}})
    for (int64_t p = 1; p <= 6; ++p)
      for (int64_t m = 1; m <= 10; ++m) {
        const Simulation sim = simulate(p, m, t_f, t_b, nullptr);
        ASSERT_TRUE(sim.finished);
        EXPECT_DOUBLE_EQ(sim.makespan, static_cast<double>(m + p - 1) * (t_f + t_b))
            << "t_f " << t_f << ", t_b " << t_b << ", p " << p << ", m " << m;
      }
}

// ---- every schedule, as data and through simulate_pipeline ----------------------------------

struct SpecCase {
  PipeScheduleSpec spec;
  std::string name() const {
    return std::string(schedule_name(spec.kind)) + " p " + std::to_string(spec.stages) + " m " +
           std::to_string(spec.micro_batches) + " v " + std::to_string(spec.virtual_stages);
  }
};

// Every spec of the range: p <= 6, m <= 12, v <= 3 (interleaved
// needs p >= 2, v >= 2 and m % p == 0).
std::vector<SpecCase> all_specs() {
  std::vector<SpecCase> out;
  for (int64_t p = 1; p <= 6; ++p)
    for (int64_t m = 1; m <= 12; ++m) {
      out.push_back({{PipeSchedule::one_f_one_b, p, m, 1}});
      out.push_back({{PipeSchedule::zb_h1, p, m, 1}});
      for (int64_t v = 2; v <= 3; ++v)
        if (p >= 2 && m % p == 0) out.push_back({{PipeSchedule::interleaved, p, m, v}});
    }
  return out;
}

TEST(PipeSchedules, EveryOpOnceForwardBeforeBackwardBeforeWeight) {
  for (const SpecCase& c : all_specs()) {
    const PipeScheduleSpec& spec = c.spec;
    const int64_t v = spec.virtual_stages, m = spec.micro_batches;
    const bool has_w = spec.kind == PipeSchedule::zb_h1;
    for (int64_t s = 0; s < spec.stages; ++s) {
      SCOPED_TRACE(c.name() + ", stage " + std::to_string(s));
      const std::vector<PipeOp> ops = pipeline_schedule(spec, s);
      ASSERT_EQ(static_cast<int64_t>(ops.size()), (has_w ? 3 : 2) * m * v);
      // Per (chunk, micro-batch): the index of its F, B and W.
      std::vector<std::array<int64_t, 3>> at(static_cast<size_t>(m * v), {-1, -1, -1});
      for (int64_t i = 0; i < static_cast<int64_t>(ops.size()); ++i) {
        const PipeOp& op = ops[i];
        ASSERT_TRUE(op.micro_batch >= 0 && op.micro_batch < m && op.chunk >= 0 && op.chunk < v) << "op " << i;
        int64_t& slot = at[static_cast<size_t>(op.chunk * m + op.micro_batch)][op.kind];
        EXPECT_EQ(slot, -1) << "op " << i << " runs twice";
        slot = i;
      }
      for (const auto& [f, b, w] : at) {
        EXPECT_GE(f, 0);
        EXPECT_GT(b, f) << "backward before its forward";
        if (has_w) {
          EXPECT_GT(w, b) << "W before its B";
        } else {
          EXPECT_EQ(w, -1);
        }
      }
      if (spec.kind == PipeSchedule::zb_h1) {  // 1F1B's order of F and B
        std::vector<PipeOp> fb;
        for (const PipeOp& op : ops)
          if (op.kind != PipeOp::weight) fb.push_back(op);
        EXPECT_EQ(fb, one_f_one_b(s, spec.stages, m));
      }
    }
  }
}

// simulate_pipeline runs run_pipeline's protocol (post the send with the next
// receive, wait for the send to be matched) over every rank: no spec
// deadlocks, every receive gets the micro-batch it expects, and with equal
// op times the makespan is the formula:
//   1F1B        (m + p − 1)·(t_f + t_b + t_w)
//   interleaved (v·m + p − 1)·(t_f + t_b + t_w), times per chunk
//   ZB-H1       3m + p − 1 op times when m >= p; 2(p + m) − 1 when m < p
//               (then the fill and drain dominate: p forwards down, p
//               backwards up, and m − 1 more F and B on the critical stage
//               plus its last W)
TEST(PipeSchedules, NoDeadlockAndTheMakespanFormula) {
  for (const SpecCase& c : all_specs()) {
    SCOPED_TRACE(c.name());
    const PipeScheduleSpec& spec = c.spec;
    const PipelineSimulation sim = simulate_pipeline(spec, 1, 1, 1);
    ASSERT_TRUE(sim.finished) << "deadlock";
    EXPECT_EQ(sim.error, "");
    const double p = static_cast<double>(spec.stages), m = static_cast<double>(spec.micro_batches),
                 v = static_cast<double>(spec.virtual_stages);
    double expected = 0;
    switch (spec.kind) {
      case PipeSchedule::one_f_one_b: expected = 3 * (m + p - 1); break;
      case PipeSchedule::interleaved: expected = 3 * (v * m + p - 1); break;
      case PipeSchedule::zb_h1: expected = m >= p ? 3 * m + p - 1 : 2 * (p + m) - 1; break;
    }
    EXPECT_DOUBLE_EQ(sim.makespan, expected);
    for (int64_t s = 0; s < spec.stages; ++s) EXPECT_DOUBLE_EQ(sim.busy[s], 3 * m * v) << "stage " << s;
    if (spec.kind != PipeSchedule::zb_h1 || m >= p) {
      EXPECT_NEAR(sim.idle_fraction(0), predicted_bubble(spec), 1e-12);
    }
  }
}

// NCCL's point-to-point ops carry no tags: on the pipeline's channels
// (comm::CommOptions::ring_p2p) the n-th message from one stage to another is
// the n-th receive posted there. On every spec that is the message the
// tagged receive expects. A deliberately swapped pair is caught.
TEST(PipeSchedules, MessagesArriveInTheOrderTheirReceivesArePosted) {
  for (const SpecCase& c : all_specs()) {
    SCOPED_TRACE(c.name());
    EXPECT_EQ(untagged_order_problem(c.spec), "");
  }
  // Stage 0 of 1F1B (p 3, m 4) running its second and third forwards the
  // other way round sends micro-batch 2 where stage 1 expects 1.
  const PipeScheduleSpec spec{PipeSchedule::one_f_one_b, 3, 4, 1};
  std::vector<std::vector<PipeOp>> ops;
  for (int64_t s = 0; s < 3; ++s) ops.push_back(pipeline_schedule(spec, s));
  ASSERT_EQ(ops[0][1].kind, PipeOp::forward);
  ASSERT_EQ(ops[0][2].kind, PipeOp::forward);
  std::swap(ops[0][1], ops[0][2]);
  const std::string tag = std::to_string(activation_tag(0));
  EXPECT_EQ(untagged_order_problem(spec, ops), "message 1 from stage 0 to stage 1 carries micro-batch 2 (tag " + tag +
                                                   "); the receive that takes it expects micro-batch 1 (tag " + tag + ")");
}

// Memory: 1F1B and ZB-H1 hold at most min(p − s, m) micro-batches' saved
// activations; ZB-H1 keeps at most min(p, m) micro-batches' W operands on
// top. Interleaved holds Megatron's warm-up count plus one.
TEST(PipeSchedules, HeldActivationBounds) {
  for (const SpecCase& c : all_specs()) {
    SCOPED_TRACE(c.name());
    const PipeScheduleSpec& spec = c.spec;
    const PipelineSimulation sim = simulate_pipeline(spec, 1, 1, 1);
    ASSERT_TRUE(sim.finished);
    const int64_t p = spec.stages, m = spec.micro_batches, v = spec.virtual_stages;
    for (int64_t s = 0; s < p; ++s) {
      if (spec.kind == PipeSchedule::interleaved) {
        const int64_t warmup = m == p ? m * v : std::min(m * v, (p - s - 1) * 2 + (v - 1) * p);
        EXPECT_EQ(sim.max_saved[s], std::min(m * v, warmup + 1)) << "stage " << s;
      } else {
        EXPECT_EQ(sim.max_saved[s], std::min(p - s, m)) << "stage " << s;
      }
      EXPECT_LE(sim.max_pending_w[s], spec.kind == PipeSchedule::zb_h1 ? std::min(p, m) : 0) << "stage " << s;
    }
  }
}

// The boundary tensors alive beside each op (the plan's memory replay
// counts them): receives posted for later ops, and sends the receiver has
// not taken when the sender's latest op ended. 1F1B, p = 2, m = 3, every op
// one time unit. Stage 0 runs F0 F1 B0 F2 B1 B2, stage 1 F0 B0 F1 B1 F2 B2.
// Stage 0 posts B0's and B1's receives at the start (B2's once B0's is
// taken), so it holds two until B1; F1's send, sent at t = 2, is taken
// when stage 1 starts F1 at t = 3, during stage 0's B0 (t = 2-4), so B0
// holds it beside B1's receive. Stage 1 holds F1's receive during F0, then
// F1's and F2's during B0; its sends are taken as they are sent (stage 0
// waits for each).
TEST(PipeSchedules, BoundaryTensorsBesideEachOp) {
  const PipelineSimulation sim = simulate_pipeline({PipeSchedule::one_f_one_b, 2, 3, 1}, 1, 1, 1);
  ASSERT_TRUE(sim.finished);
  ASSERT_EQ(sim.boundary_buffers.size(), 2u);
  EXPECT_EQ(sim.boundary_buffers[0], (std::vector<int64_t>{2, 2, 2, 2, 1, 0}));
  EXPECT_EQ(sim.boundary_buffers[1], (std::vector<int64_t>{1, 2, 1, 1, 0, 0}));
  // Every schedule: never more than the receives posted ahead plus the
  // sends of the ops before.
  for (const SpecCase& c : all_specs()) {
    SCOPED_TRACE(c.name());
    const PipelineSimulation all = simulate_pipeline(c.spec, 1, 1, 1);
    for (int64_t st = 0; st < c.spec.stages; ++st) {
      const std::vector<PipeOp> ops = pipeline_schedule(c.spec, st);
      ASSERT_EQ(all.boundary_buffers[st].size(), ops.size());
      for (size_t k = 0; k < ops.size(); ++k) {
        EXPECT_GE(all.boundary_buffers[st][k], 0);
        EXPECT_LE(all.boundary_buffers[st][k], 2 + static_cast<int64_t>(k)) << "op " << k;
      }
      EXPECT_EQ(all.boundary_buffers[st].back(), 0) << "the last op: nothing posted, every send taken";
    }
  }
}

TEST(PipeSchedules, SpecRulesAreUserErrors) {
  EXPECT_THROW(pipeline_schedule({PipeSchedule::interleaved, 4, 6, 2}, 0), UserError);  // m % p
  EXPECT_THROW(pipeline_schedule({PipeSchedule::interleaved, 4, 8, 1}, 0), UserError);  // v = 1
  EXPECT_THROW(pipeline_schedule({PipeSchedule::one_f_one_b, 4, 8, 2}, 0), UserError);  // v without interleaving
  EXPECT_THROW(pipeline_schedule({PipeSchedule::zb_h1, 4, 8, 2}, 0), UserError);
}

TEST(PipeSchedules, InterleavedAssignsChunksToVirtualStages) {
  // 8 layers, pp 2, v 2: virtual stages 0..3 of 2 layers; rank 0 holds
  // virtual stages 0 and 2, rank 1 stages 1 and 3.
  const PipelineStage r0 = pipeline_stage(8, 2, 0, {}, 2), r1 = pipeline_stage(8, 2, 1, {}, 2);
  ASSERT_EQ(r0.virtual_stages(), 2);
  EXPECT_EQ(r0.chunks[0].first_layer, 0);
  EXPECT_EQ(r0.chunks[1].first_layer, 4);
  EXPECT_EQ(r1.chunks[0].first_layer, 2);
  EXPECT_EQ(r1.chunks[1].end_layer, 8);
  EXPECT_TRUE(r0.first_chunk(0) && !r0.first_chunk(1) && !r0.last_chunk(1));
  EXPECT_TRUE(r1.last_chunk(1) && !r1.last_chunk(0));
  EXPECT_TRUE(r0.owns_layer(5) && !r0.owns_layer(3));
  // An explicit list has one count per virtual stage.
  const PipelineStage e = pipeline_stage(8, 2, 1, {1, 3, 2, 2}, 2);
  EXPECT_EQ(e.chunks[0].first_layer, 1);
  EXPECT_EQ(e.chunks[0].end_layer, 4);
  EXPECT_EQ(e.chunks[1].first_layer, 6);
}

std::vector<std::pair<int64_t, int64_t>> ranges(int64_t layers, int64_t pp, const std::vector<int64_t>& list = {}) {
  std::vector<std::pair<int64_t, int64_t>> r;
  for (int64_t s = 0; s < pp; ++s) {
    const PipelineStage st = pipeline_stage(layers, pp, s, list);
    EXPECT_EQ(st.index, s);
    EXPECT_EQ(st.count, pp);
    EXPECT_EQ(st.first(), s == 0);
    EXPECT_EQ(st.last(), s == pp - 1);
    for (int64_t l = -1; l <= layers; ++l)
      EXPECT_EQ(st.owns_layer(l), st.chunks[0].contains(l)) << "stage " << s << ", layer " << l;
    r.emplace_back(st.chunks[0].first_layer, st.chunks[0].end_layer);
  }
  return r;
}

using Ranges = std::vector<std::pair<int64_t, int64_t>>;

TEST(PipelineStage, EvenSplitPutsTheRemainderOnTheFirstStages) {
  EXPECT_EQ(ranges(7, 3), (Ranges{{0, 3}, {3, 5}, {5, 7}}));
  EXPECT_EQ(ranges(8, 4), (Ranges{{0, 2}, {2, 4}, {4, 6}, {6, 8}}));
  EXPECT_EQ(ranges(5, 1), (Ranges{{0, 5}}));
  EXPECT_EQ(ranges(2, 4), (Ranges{{0, 1}, {1, 2}, {2, 2}, {2, 2}})) << "more stages than layers: empty last stages";
  // Every layer owned by exactly one stage, for many splits.
  for (int64_t layers = 0; layers <= 9; ++layers)
    for (int64_t pp = 1; pp <= 5; ++pp) {
      const Ranges r = ranges(layers, pp);
      for (int64_t l = 0; l < layers; ++l) {
        int owners = 0;
        for (int64_t s = 0; s < pp; ++s) owners += pipeline_stage(layers, pp, s).owns_layer(l);
        EXPECT_EQ(owners, 1) << layers << " layers over " << pp << ", layer " << l;
      }
      EXPECT_EQ(r.front().first, 0);
      EXPECT_EQ(r.back().second, layers);
      for (int64_t s = 0; s + 1 < pp; ++s) {
        const int64_t n = r[s].second - r[s].first, n1 = r[s + 1].second - r[s + 1].first;
        EXPECT_TRUE(n == n1 || n == n1 + 1) << "longer stages first, by at most one layer";
      }
    }
}

TEST(PipelineStage, ExplicitListMayHaveAnEmptyStage) {
  EXPECT_EQ(ranges(5, 3, {3, 0, 2}), (Ranges{{0, 3}, {3, 3}, {3, 5}}));
  const PipelineStage empty = pipeline_stage(5, 3, 1, {3, 0, 2});
  for (int64_t l = 0; l < 5; ++l) EXPECT_FALSE(empty.owns_layer(l));
  EXPECT_FALSE(empty.first());
  EXPECT_FALSE(empty.last());
  EXPECT_EQ(ranges(4, 2, {0, 4}), (Ranges{{0, 0}, {0, 4}})) << "the first stage may hold only the embedding";
}

TEST(PipelineStage, InvalidExplicitListIsAUserError) {
  EXPECT_THROW(pipeline_stage(5, 3, 0, {3, 2}), UserError) << "too few stages";
  EXPECT_THROW(pipeline_stage(5, 3, 0, {1, 1, 1, 2}), UserError) << "too many stages";
  EXPECT_THROW(pipeline_stage(5, 3, 0, {3, 1, 2}), UserError) << "sums to 6";
  EXPECT_THROW(pipeline_stage(5, 3, 0, {4, -1, 2}), UserError) << "negative count";
  try {
    pipeline_stage(5, 3, 2, {3, 1, 2});
    ADD_FAILURE() << "no error";
  } catch (const UserError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("pp_layers"), std::string::npos) << msg;
    EXPECT_NE(msg.find("num_layers = 5"), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace origami

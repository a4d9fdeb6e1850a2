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
#include <deque>
#include <random>

#include "engine/pipeline.h"
#include "kernels/check.h"

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
  std::mt19937 rng(20240611);
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

std::vector<std::pair<int64_t, int64_t>> ranges(int64_t layers, int64_t pp, const std::vector<int64_t>& list = {}) {
  std::vector<std::pair<int64_t, int64_t>> r;
  for (int64_t s = 0; s < pp; ++s) {
    const PipelineStage st = pipeline_stage(layers, pp, s, list);
    EXPECT_EQ(st.index, s);
    EXPECT_EQ(st.count, pp);
    EXPECT_EQ(st.first(), s == 0);
    EXPECT_EQ(st.last(), s == pp - 1);
    for (int64_t l = -1; l <= layers; ++l)
      EXPECT_EQ(st.owns_layer(l), l >= st.first_layer && l < st.end_layer) << "stage " << s << ", layer " << l;
    r.emplace_back(st.first_layer, st.end_layer);
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

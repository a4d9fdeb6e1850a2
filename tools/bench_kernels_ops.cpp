// The cases of `origami bench kernels` (the driver and the report are
// tools/bench_kernels.cpp): per op its inputs, one call, its work per call
// and the outputs the driver checks. Inputs are fresh random tensors on the
// context's device; outputs the op overwrites start as NaN, the ones it
// accumulates into as 0. Work per call:
//   gemm 2·M·N·K; grouped GEMM 2·(Σ rows)·M·K;
//   causal attention forward 2·2·B·H·S²·d/2 (QKᵀ and PV over the half of
//   the score matrix the mask keeps, as FlashAttention counts it),
//   backward 2.5× forward;
//   everything else bytes read + written, each op's list beside it (index
//   tensors and per-row statistics counted where they are a visible share).
#include <cmath>
#include <memory>

#include "kernels/adamw.h"
#include "kernels/attention.h"
#include "kernels/cross_entropy.h"
#include "kernels/elementwise.h"
#include "kernels/embedding.h"
#include "kernels/gemm.h"
#include "kernels/grouped_gemm.h"
#include "kernels/moe_ops.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"
#include "tools/bench_kernels.h"

namespace origami::tools::kernel_bench {

// C[M, N] = op(A)·op(B) + beta·C, A [M, K] or [K, M], B [K, N] or [N, K].
Case gemm_case(const ExecContext& ctx, DType dt, int64_t M, int64_t N, int64_t K, Trans ta, Trans tb, float beta) {
  Tensor A = random(ctx, ta == Trans::no ? Shape{M, K} : Shape{K, M}, dt, "A");
  Tensor B = random(ctx, tb == Trans::no ? Shape{K, N} : Shape{N, K}, dt, "B");
  Tensor C = beta == 0.0f ? output(ctx, {M, N}, dt) : filled(ctx, {M, N}, dt, 0.0f);
  Case c{"gemm", dims({M, N, K}), std::string(to_string(dt))};
  c.flops = 2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
  c.run = [&ctx, A, B, C, ta, tb, beta]() mutable { gemm(ctx, A, ta, B, tb, C, 1.0f, beta); };
  c.outputs = {C};
  return c;
}

// Every linear of one transformer layer on T tokens: forward Y = X·Wᵀ, data
// grad dX = dY·W, weight grad dW += dYᵀ·X (dense/attention.cpp, mlp.cpp).
void bench_gemms(const ExecContext& ctx, Runner& r, const ShapeSet& s, DType dt) {
  struct Linear {
    const char* name;
    int64_t in, out;
  };
  const int64_t T = s.T();
  const Linear linears[] = {{"q", s.D, s.Hq * s.hd},  // k and v: "kv", each
                            {"kv", s.D, s.Hkv * s.hd},
                            {"out", s.Hq * s.hd, s.D},
                            {"mlp_up", s.D, s.F},  // gate and up, each
                            {"mlp_down", s.F, s.D}};
  for (const Linear& l : linears) {
    const std::string k = std::string("gemm/") + l.name;
    r.bench(k + ".fwd", [&] { return gemm_case(ctx, dt, T, l.out, l.in, Trans::no, Trans::yes, 0.0f); });
    r.bench(k + ".dgrad", [&] { return gemm_case(ctx, dt, T, l.in, l.out, Trans::no, Trans::no, 0.0f); });
    r.bench(k + ".wgrad", [&] { return gemm_case(ctx, dt, l.out, l.in, T, Trans::yes, Trans::no, 1.0f); });
  }
}

// The experts' three products (moe/experts.cpp), N = T·k rows in E equal
// segments. Then the forward gate/up product of coarse experts (8, top-2, of
// the dense MLP's width: Mixtral's shape in the model set) in the CUDA
// backend's automatic schedule, and forced into one grouped cuBLAS call
// (kernels/cuda/grouped_gemm.cu: why products that fill the GPU run alone).
void bench_grouped(const ExecContext& ctx, Runner& r, const ShapeSet& s, DType dt) {
  const int64_t E = s.E, N = s.N(), rows = N / E, D = s.D, F = s.Fe;
  const std::string dts(to_string(dt));
  auto equal_segments = [](int64_t experts, int64_t each) {
    std::vector<GemmSegment> segments;
    for (int64_t e = 0; e < experts; ++e) segments.push_back({e, each});
    return segments;
  };
  const std::vector<GemmSegment> segments = equal_segments(E, rows);
  // Y [n, out] = X [n, in] · op(W), W [experts, out, in] (trans) or [experts, in, out].
  auto product_of = [&](int64_t experts, int64_t each, int64_t in, int64_t out, Trans tw, GroupedGemmSchedule how) {
    const int64_t n = experts * each;
    Tensor X = random(ctx, {n, in}, dt, "X");
    Tensor W = random(ctx, tw == Trans::yes ? Shape{experts, out, in} : Shape{experts, in, out}, dt, "W");
    Tensor Y = output(ctx, {n, out}, dt);
    Case c{"grouped_gemm", std::to_string(experts) + "x(" + dims({each, out, in}) + ")", dts};
    c.flops = 2.0 * static_cast<double>(n) * static_cast<double>(out) * static_cast<double>(in);
    c.run = [&ctx, X, W, Y, tw, segs = equal_segments(experts, each), how]() mutable {
      grouped_gemm(ctx, X, W, tw, segs, Y, 0.0f, how);
    };
    c.outputs = {Y};
    return c;
  };
  auto product = [&](int64_t in, int64_t out, Trans tw) {
    return product_of(E, rows, in, out, tw, GroupedGemmSchedule::automatic);
  };
  // dW [E, M, K] += Σ dY [N, M]ᵀ · X [N, K] per segment.
  auto wgrad = [&](int64_t M, int64_t K) {
    Tensor dY = random(ctx, {N, M}, dt, "dY"), X = random(ctx, {N, K}, dt, "X");
    Tensor dW = filled(ctx, {E, M, K}, dt, 0.0f);
    Case c{"grouped_gemm_wgrad", std::to_string(E) + "x(" + dims({M, K, rows}) + ")", dts};
    c.flops = 2.0 * static_cast<double>(N) * static_cast<double>(M) * static_cast<double>(K);
    c.run = [&ctx, dY, X, dW, segments]() mutable { grouped_gemm_wgrad(ctx, dY, X, segments, dW, 1.0f); };
    c.outputs = {dW};
    return c;
  };
  r.bench("grouped_gemm/gate_up.fwd", [&] { return product(D, F, Trans::yes); });  // gate and up, each
  r.bench("grouped_gemm/down.fwd", [&] { return product(F, D, Trans::yes); });
  r.bench("grouped_gemm/down.dgrad", [&] { return product(D, F, Trans::no); });
  r.bench("grouped_gemm/gate_up.dgrad", [&] { return product(F, D, Trans::no); });
  r.bench("grouped_gemm_wgrad/gate_up", [&] { return wgrad(F, D); });
  r.bench("grouped_gemm_wgrad/down", [&] { return wgrad(D, F); });
  constexpr int64_t kCoarse = 8, kCoarseTopK = 2;
  const int64_t coarse_rows = s.T() * kCoarseTopK / kCoarse;
  r.bench("grouped_gemm/coarse.fwd", [&] {
    return product_of(kCoarse, coarse_rows, D, s.F, Trans::yes, GroupedGemmSchedule::automatic);
  });
  r.bench("grouped_gemm/coarse.grouped", [&] {
    return product_of(kCoarse, coarse_rows, D, s.F, Trans::yes, GroupedGemmSchedule::grouped);
  });
}

void bench_attention(const ExecContext& ctx, Runner& r, const ShapeSet& s, DType dt) {
  const AttentionDims d{s.B, s.S, s.S, s.Hq, s.Hkv, s.hd};
  const std::string shape = "B" + std::to_string(s.B) + " S" + std::to_string(s.S) + " H" + std::to_string(s.Hq) + "/" +
                            std::to_string(s.Hkv) + " d" + std::to_string(s.hd) + " causal";
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.hd));
  const double fwd_flops = 2.0 * 2.0 * static_cast<double>(s.B * s.Hq) * static_cast<double>(s.S) *
                           static_cast<double>(s.S) * static_cast<double>(s.hd) / 2.0;
  struct Inputs {
    Tensor q, k, v, pos, o, lse;
  };
  auto inputs = [&] {
    return Inputs{random(ctx, {s.B, s.S, s.Hq, s.hd}, dt, "q"),  random(ctx, {s.B, s.S, s.Hkv, s.hd}, dt, "k"),
                  random(ctx, {s.B, s.S, s.Hkv, s.hd}, dt, "v"), positions(ctx, s.S),
                  output(ctx, {s.B, s.S, s.Hq, s.hd}, dt),       output(ctx, {s.B, s.Hq, s.S}, DType::f32)};
  };
  r.bench("attention_forward", [&] {
    Inputs in = inputs();
    Tensor ws = ctx.workspace(attention_forward_workspace_bytes(ctx, d));
    Case c{"attention_forward", shape, std::string(to_string(dt))};
    c.flops = fwd_flops;
    c.run = [&ctx, d, in, ws, scale]() mutable {
      attention_forward(ctx, d, in.q, in.k, in.v, in.pos, in.pos, scale, in.o, in.lse, ws);
    };
    c.outputs = {in.o, in.lse};
    return c;
  });
  r.bench("attention_backward", [&] {
    Inputs in = inputs();
    {
      Tensor ws = ctx.workspace(attention_forward_workspace_bytes(ctx, d));
      attention_forward(ctx, d, in.q, in.k, in.v, in.pos, in.pos, scale, in.o, in.lse, ws);
    }
    Tensor dout = random(ctx, in.o.shape(), dt, "do");
    Tensor dq = output(ctx, in.q.shape(), dt), dk = output(ctx, in.k.shape(), dt), dv = output(ctx, in.v.shape(), dt);
    Tensor ws = ctx.workspace(attention_backward_workspace_bytes(ctx, d));
    Case c{"attention_backward", shape, std::string(to_string(dt))};
    c.flops = 2.5 * fwd_flops;
    c.run = [&ctx, d, in, dout, dq, dk, dv, ws, scale]() mutable {
      attention_backward(ctx, d, in.q, in.k, in.v, in.o, in.lse, dout, in.pos, in.pos, scale, dq, dk, dv, ws);
    };
    c.outputs = {dq, dk, dv};
    return c;
  });
}

// rmsnorm, rope, swiglu: bandwidth-bound, bytes = their tensors read + written.
void bench_dense(const ExecContext& ctx, Runner& r, const ShapeSet& s, DType dt) {
  const int64_t T = s.T(), D = s.D;
  const double e = static_cast<double>(dtype_size(dt));
  const std::string dts(to_string(dt));
  auto td = [](int64_t a, int64_t b) { return static_cast<double>(a) * static_cast<double>(b); };
  r.bench("rmsnorm_forward", [&] {  // x, w read; y, rstd written
    Tensor x = random(ctx, {T, D}, dt, "x"), w = random(ctx, {D}, dt, "w", 0.1f);
    Tensor y = output(ctx, {T, D}, dt), rstd = output(ctx, {T}, DType::f32);
    Case c{"rmsnorm_forward", dims({T, D}), dts};
    c.bytes = (2 * td(T, D) + D) * e + 4.0 * T;
    c.run = [&ctx, x, w, y, rstd]() mutable { rmsnorm_forward(ctx, x, w, 1e-5f, y, rstd); };
    c.outputs = {y, rstd};
    return c;
  });
  r.bench("rmsnorm_backward", [&] {  // dy, x, w, rstd read; dx written; dw read and written
    Tensor x = random(ctx, {T, D}, dt, "x"), w = random(ctx, {D}, dt, "w", 0.1f);
    Tensor y = output(ctx, {T, D}, dt), rstd = output(ctx, {T}, DType::f32);
    rmsnorm_forward(ctx, x, w, 1e-5f, y, rstd);
    Tensor dy = random(ctx, {T, D}, dt, "dy"), dx = output(ctx, {T, D}, dt), dw = filled(ctx, {D}, dt, 0.0f);
    Tensor ws = ctx.workspace(rmsnorm_backward_workspace_bytes(ctx, T, D));
    Case c{"rmsnorm_backward", dims({T, D}), dts};
    c.bytes = (3 * td(T, D) + 3.0 * D) * e + 4.0 * T;
    c.run = [&ctx, dy, x, w, rstd, dx, dw, ws]() mutable { rmsnorm_backward(ctx, dy, x, w, rstd, dx, dw, ws); };
    c.outputs = {dx, dw};
    return c;
  });
  // rope on q (k is the same kernel on Hkv heads): x read and written in place.
  const Shape q_shape{s.B, s.S, s.Hq, s.hd};
  const double q_bytes = 2 * td(T, s.Hq * s.hd) * e + 4.0 * s.S;
  for (const bool fwd : {true, false})
    r.bench(fwd ? "rope_forward" : "rope_backward", [&] {
      Tensor x = random(ctx, q_shape, dt, "x"), pos = positions(ctx, s.S);
      Case c{fwd ? "rope_forward" : "rope_backward", dims({s.B, s.S, s.Hq, s.hd}), dts};
      c.bytes = q_bytes;
      c.run = [&ctx, x, pos, fwd]() mutable {
        if (fwd)
          rope_forward(ctx, x, pos, 10000.0f);
        else
          rope_backward(ctx, x, pos, 10000.0f);
      };
      c.outputs = {x};
      return c;
    });
  // swiglu at the experts' shape: N routed rows of width Fe.
  const int64_t N = s.N(), F = s.Fe;
  r.bench("swiglu_forward", [&] {  // gate, up read; h written
    Tensor g = random(ctx, {N, F}, dt, "g"), u = random(ctx, {N, F}, dt, "u"), h = output(ctx, {N, F}, dt);
    Case c{"swiglu_forward", dims({N, F}), dts};
    c.bytes = 3 * td(N, F) * e;
    c.run = [&ctx, g, u, h]() mutable { swiglu_forward(ctx, g, u, h); };
    c.outputs = {h};
    return c;
  });
  r.bench("swiglu_backward", [&] {  // dh, gate, up read; dgate, dup written
    Tensor dh = random(ctx, {N, F}, dt, "dh"), g = random(ctx, {N, F}, dt, "g"), u = random(ctx, {N, F}, dt, "u");
    Tensor dg = output(ctx, {N, F}, dt), du = output(ctx, {N, F}, dt);
    Case c{"swiglu_backward", dims({N, F}), dts};
    c.bytes = 5 * td(N, F) * e;
    c.run = [&ctx, dh, g, u, dg, du]() mutable { swiglu_backward(ctx, dh, g, u, dg, du); };
    c.outputs = {dg, du};
    return c;
  });
}

// Embedding and cross-entropy over the vocabulary, AdamW over a flat shard.
void bench_loss_optimizer(const ExecContext& ctx, Runner& r, const ShapeSet& s, DType dt) {
  const int64_t T = s.T(), D = s.D, V = s.V;
  const double e = static_cast<double>(dtype_size(dt));
  const double TD = static_cast<double>(T) * static_cast<double>(D);
  const double TV = static_cast<double>(T) * static_cast<double>(V);
  const std::string dts(to_string(dt));
  const std::string shape = "T" + std::to_string(T) + " V" + std::to_string(V) + " D" + std::to_string(D);
  r.bench("embedding_forward", [&] {  // ids read; T table rows read, out written
    Tensor ids = random_ids(ctx, T, V, 1), table = random(ctx, {V, D}, dt, "table"), out = output(ctx, {T, D}, dt);
    Case c{"embedding_forward", shape, dts};
    c.bytes = 4.0 * T + 2 * TD * e;
    c.run = [&ctx, ids, table, out]() mutable { embedding_forward(ctx, ids, table, 0, out); };
    c.outputs = {out};
    return c;
  });
  r.bench("embedding_backward", [&] {  // ids, dout read; the ids' table rows read and written
    // (random ids over V: nearly all distinct, so ~T rows)
    Tensor ids = random_ids(ctx, T, V, 2), dout = random(ctx, {T, D}, dt, "dout");
    Tensor dtable = filled(ctx, {V, D}, dt, 0.0f);
    Case c{"embedding_backward", shape, dts};
    c.bytes = 4.0 * T + 3 * TD * e;
    c.run = [&ctx, ids, dout, dtable]() mutable { embedding_backward(ctx, ids, dout, 0, dtable); };
    c.outputs = {dtable};
    return c;
  });
  const std::string ce_shape = dims({T, V});
  r.bench("cross_entropy_forward", [&] {  // logits, targets read; loss, lse written
    Tensor logits = random(ctx, {T, V}, dt, "logits"), targets = random_ids(ctx, T, V, 3);
    Tensor loss = output(ctx, {T}, DType::f32), lse = output(ctx, {T}, DType::f32);
    Case c{"cross_entropy_forward", ce_shape, dts};
    c.bytes = TV * e + 12.0 * T;
    c.run = [&ctx, logits, targets, loss, lse]() mutable { cross_entropy_forward(ctx, logits, targets, loss, lse); };
    c.outputs = {loss, lse};
    return c;
  });
  r.bench("cross_entropy_backward", [&] {  // logits, targets, lse read; dlogits written
    Tensor logits = random(ctx, {T, V}, dt, "logits"), targets = random_ids(ctx, T, V, 4);
    Tensor loss = output(ctx, {T}, DType::f32), lse = output(ctx, {T}, DType::f32);
    cross_entropy_forward(ctx, logits, targets, loss, lse);
    Tensor dlogits = output(ctx, {T, V}, dt);
    const float scale = 1.0f / static_cast<float>(T);
    Case c{"cross_entropy_backward", ce_shape, dts};
    c.bytes = 2 * TV * e + 8.0 * T;
    c.run = [&ctx, logits, targets, lse, scale, dlogits]() mutable {
      cross_entropy_backward(ctx, logits, targets, lse, scale, dlogits);
    };
    c.outputs = {dlogits};
    return c;
  });
  r.bench("adamw_update", [&] {  // param, grad, m, v read; param, m, v written (f32 master shard)
    const int64_t n = s.adamw_params;
    Tensor p = random(ctx, {n}, DType::f32, "p"), g = random(ctx, {n}, DType::f32, "g", 1e-3f);
    Tensor m = filled(ctx, {n}, DType::f32, 0.0f), v = filled(ctx, {n}, DType::f32, 0.0f);
    Case c{"adamw_update", std::to_string(n), "f32"};
    c.bytes = 28.0 * static_cast<double>(n);
    const AdamWStep step{1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1};
    c.run = [&ctx, p, g, m, v, step]() mutable { adamw_update(ctx, p, g, m, v, step); };
    c.outputs = {p};
    return c;
  });
  // A unit's whole step as the engine makes it (engine/optimizer.cpp): the
  // gradient scaled in place by the clip, AdamW on the f32 master in two
  // runs of different weight decay, and with bf16 data the working copy
  // written. Bytes: grad read + written, master, m, v read + written, the
  // copy written. `.calls` times the calls it fuses (scale_inplace, then
  // per run adamw_update and cast), which move more than those bytes (the
  // gradient and the master read once more each): over the same bytes its
  // GB/s is lower by what fusing saves. The clip scale is near 1, so
  // repeated calls never shrink the gradient into denormals.
  for (const bool fused : {true, false})
    r.bench(fused ? "adamw_unit" : "adamw_unit.calls", [&, fused] {
      const int64_t n = s.adamw_params;
      const bool bf16 = dt == DType::bf16;
      Tensor master = random(ctx, {n}, DType::f32, "master"), g = random(ctx, {n}, dt, "g", 1e-3f);
      Tensor m = filled(ctx, {n}, DType::f32, 0.0f), v = filled(ctx, {n}, DType::f32, 0.0f);
      Tensor copy = bf16 ? output(ctx, {n}, DType::bf16) : Tensor();
      const std::vector<AdamWSegment> runs{{0, n / 2, 0.1f}, {n / 2, n - n / 2, 0.0f}};
      Case c{fused ? "adamw_update_fused" : "scale_inplace+adamw_update+cast", std::to_string(n), dts};
      c.bytes = (2.0 * e + 24.0 + (bf16 ? 2.0 : 0.0)) * static_cast<double>(n);
      const AdamWStep step{1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1};
      constexpr float kClip = 0.999f;
      c.run = [&ctx, master, g, m, v, copy, runs, step, fused]() mutable {
        if (fused) return adamw_update_fused(ctx, master, g, m, v, copy, runs, kClip, step);
        scale_inplace(ctx, g, kClip);
        for (const AdamWSegment& run : runs) {
          const auto part = [&](const Tensor& t) { return t.flat_view(run.begin, run.numel, {run.numel}); };
          Tensor pr = part(master), gr = part(g), mr = part(m), vr = part(v);
          AdamWStep st = step;
          st.weight_decay = run.weight_decay;
          adamw_update(ctx, pr, gr, mr, vr, st);
          if (!copy.defined()) continue;
          Tensor out = part(copy);
          cast(ctx, pr, out);
        }
      };
      c.outputs = {master};
      if (bf16) c.outputs.push_back(copy);
      return c;
    });
}

// The MoE routing path of one layer (see the header): bytes = logits read,
// x read and x_ND written (permute), y_ND read and out written (un-permute);
// the index maps and counts are a few percent more and not counted.
void bench_routing(const ExecContext& ctx, Runner& r, const ShapeSet& s, DType dt) {
  r.bench("moe_routing_permute", [&] {
    const int64_t T = s.T(), E = s.E, K = s.K, D = s.D, N = s.N();
    Tensor logits = random(ctx, {T, E}, DType::f32, "router_logits");  // (T, E), f32 router
    Tensor x = random(ctx, {T, D}, dt, "x");                           // (T, D) tokens in
    Tensor y = random(ctx, {N, D}, dt, "y");                           // (N, D) stand-in for the experts' rows
    Tensor scores = output(ctx, {T, E}, DType::f32), weight = output(ctx, {T, K}, DType::f32);
    Tensor lse = output(ctx, {T}, DType::f32);
    Tensor expert = empty(ctx, {T, K}, DType::i32), kept = empty(ctx, {T, K}, DType::u8);
    Tensor counts_3E = empty(ctx, {3, E}, DType::i64);  // routed | kept | rows, one host read
    Tensor routed_E = counts_3E.flat_view(0, E, {E}), kept_E = counts_3E.flat_view(E, E, {E});
    Tensor rows_E = counts_3E.flat_view(2 * E, E, {E});
    Tensor row_of = empty(ctx, {T, K}, DType::i32), row_token = empty(ctx, {N}, DType::i32);
    Tensor row_slot = empty(ctx, {N}, DType::i32);
    Tensor x_ND = output(ctx, {N, D}, dt), out = output(ctx, {T, D}, dt);
    MoeTopkParams p;
    p.score_function = MoeScore::softmax;
    p.top_k = K;
    auto wrong = std::make_shared<std::string>();
    Case c{"moe_routing+permute",
           "T" + std::to_string(T) + " E" + std::to_string(E) + " top" + std::to_string(K) + " D" + std::to_string(D),
           std::string(to_string(dt)) + ", f32 router"};
    const double e = static_cast<double>(dtype_size(dt));
    c.bytes = 4.0 * static_cast<double>(T * E) + 2.0 * static_cast<double>(T + N) * static_cast<double>(D) * e;
    c.run = [=, &ctx]() mutable {
      moe_topk_forward(ctx, logits, Tensor(), p, scores, expert, weight, lse);
      // Capacity T: a token's k experts are distinct, so no expert gets more than T slots.
      moe_capacity_mask(ctx, expert, weight, E, /*capacity=*/T, MoeDrop::probs, kept);
      moe_expert_histogram(ctx, expert, Tensor(), E, routed_E);
      moe_expert_histogram(ctx, expert, kept, E, kept_E);
      moe_expert_rows(ctx, kept_E, -1, rows_E);
      // The dispatcher's device-to-host point: the counts size the permuted buffer.
      ctx.synchronize();
      const Tensor counts = counts_3E.to(Device::cpu());
      int64_t rows = 0;
      for (int64_t i = 0; i < E; ++i) rows += counts.data<int64_t>()[2 * E + i];
      if (rows != N) {
        *wrong = "routing kept " + std::to_string(rows) + " rows, expected every one of " + std::to_string(N);
        return;
      }
      moe_permutation_maps(ctx, expert, kept, rows_E, row_of, row_token, row_slot);
      moe_permute_rows(ctx, x, row_token, x_ND);
      moe_unpermute_rows(ctx, y, row_of, weight, out);
    };
    c.outputs = {x_ND, out};
    c.verify = [wrong] { return *wrong; };
    return c;
  });
}

}  // namespace origami::tools::kernel_bench

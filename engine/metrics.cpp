// Per-step metrics (see metrics.h).
#include "engine/metrics.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "engine/files.h"
#include "kernels/check.h"

namespace origami {

nlohmann::ordered_json to_json(const MoeLayerRecord& r) {
  int64_t routed = 0, kept = 0, max_load = 0;
  for (size_t e = 0; e < r.routed_per_expert.size(); ++e) {
    routed += r.routed_per_expert[e];
    kept += r.kept_per_expert[e];
    max_load = std::max(max_load, r.routed_per_expert[e]);
  }
  const double mean_load = static_cast<double>(routed) / static_cast<double>(std::max<size_t>(1, r.routed_per_expert.size()));
  return {{"layer", r.layer},
          {"tokens_per_expert", r.routed_per_expert},
          {"kept_per_expert", r.kept_per_expert},
          {"tokens_per_ep_rank", r.tokens_per_ep_rank},
          {"dropped_fraction", routed > 0 ? static_cast<double>(routed - kept) / static_cast<double>(routed) : 0.0},
          {"max_over_mean", mean_load > 0 ? static_cast<double>(max_load) / mean_load : 0.0}};
}

namespace {
nlohmann::ordered_json ledger_json(const LedgerSnapshot& s) {
  nlohmann::ordered_json mem;
  for (int c = 0; c < kNumMemCategories; ++c) {
    mem[std::string(to_string(static_cast<MemCategory>(c)))] = s.peak[c];
  }
  mem["total"] = s.peak_total;
  // State that outlives the step (ZeRO shards or whole units), ARCHITECTURE.md §6.
  mem["persistent"] = {{"param", s.current[static_cast<int>(MemCategory::param)]},
                       {"grad", s.current[static_cast<int>(MemCategory::grad)]},
                       {"optim", s.current[static_cast<int>(MemCategory::optim)]}};
  return mem;
}
}  // namespace

nlohmann::ordered_json to_json(const StepMetrics& m) {
  nlohmann::ordered_json mem = ledger_json(m.mem);
  if (!m.mem_device.is_host()) {
    mem["device"] = to_string(m.mem_device);
    if (m.host_mem) mem["host"] = ledger_json(*m.host_mem);
  }
  nlohmann::ordered_json j = {{"step", m.step},         {"lm_loss", m.lm_loss},   {"grad_norm", m.grad_norm},
                              {"lr", m.lr},             {"tokens", m.tokens},     {"step_time_s", m.step_time_s},
                              {"tokens_per_s", m.tokens_per_s}, {"gflops", m.gflops}, {"mem", mem}};
  if (m.peak_gflops > 0) {
    j["peak_gflops"] = m.peak_gflops;
    j["mfu"] = m.mfu;
  }
  j["comm_exposed_s"] = m.comm_exposed_s;
  if (!m.comm_bytes.empty()) {
    nlohmann::ordered_json comm = nlohmann::ordered_json::object();
    for (const auto& [group, bytes] : m.comm_bytes) comm[group] = bytes;
    j["comm_bytes"] = comm;
  }
  if (!m.comm_a2a_s.empty()) {
    nlohmann::ordered_json a2a = nlohmann::ordered_json::object();
    for (const auto& [group, seconds] : m.comm_a2a_s) a2a[group] = seconds;
    j["comm_a2a_s"] = a2a;
  }
  j["samples"] = {{"first", m.first_sample}, {"count", m.samples}, {"epoch", m.epoch}};
  if (m.checkpoint) {
    // A background save's sizes over the ranks are known when it completes
    // (checkpoint_done); its record has rank 0's share, which it is writing.
    if (m.checkpoint->background)
      j["checkpoint"] = {{"dir", m.checkpoint->dir},
                         {"async", true},
                         {"rank_bytes", m.checkpoint->max_rank_bytes},
                         {"blocked_s", m.checkpoint->blocked_s},
                         {"host_staged_bytes", m.checkpoint->host_staged_bytes}};
    else
      j["checkpoint"] = {{"dir", m.checkpoint->dir},
                         {"async", false},
                         {"max_rank_bytes", m.checkpoint->max_rank_bytes},
                         {"total_bytes", m.checkpoint->total_bytes},
                         {"blocked_s", m.checkpoint->blocked_s},
                         {"host_staged_bytes", m.checkpoint->host_staged_bytes}};
  }
  if (m.checkpoint_done)
    j["checkpoint_done"] = {{"dir", m.checkpoint_done->dir},
                            {"written_s", m.checkpoint_done->written_s},
                            {"max_rank_bytes", m.checkpoint_done->max_rank_bytes},
                            {"total_bytes", m.checkpoint_done->total_bytes}};
  if (!m.stopped_by.empty()) j["stopped_by"] = m.stopped_by;
  if (!m.stages.empty()) {
    j["pipeline"] = nlohmann::ordered_json::array();
    for (size_t s = 0; s < m.stages.size(); ++s)
      j["pipeline"].push_back({{"stage", s},
                               {"busy_s", m.stages[s].busy_s},
                               {"idle_s", m.stages[s].idle_s},
                               {"idle_fraction", m.stages[s].idle_fraction()},
                               {"held_activation_bytes", m.stages[s].held_activation_bytes}});
  }
  if (!m.moe.empty()) {
    j["aux_loss"] = m.aux_loss;
    j["z_loss"] = m.z_loss;
    j["moe"] = nlohmann::ordered_json::array();
    for (const MoeLayerRecord& r : m.moe) j["moe"].push_back(to_json(r));
  }
  return j;
}

std::string format_bytes(int64_t bytes) {
  char buf[32];
  const double b = static_cast<double>(bytes);
  if (b >= 1 << 30) std::snprintf(buf, sizeof buf, "%.2fG", b / (1 << 30));
  else if (b >= 1 << 20) std::snprintf(buf, sizeof buf, "%.1fM", b / (1 << 20));
  else std::snprintf(buf, sizeof buf, "%.1fK", b / 1024);
  return buf;
}

std::string format_step_line(const StepMetrics& m) {
  char buf[768];
  const auto& pk = m.mem.peak;
  std::string pipe;  // idle share of each stage's schedule, e.g. " | pp idle 27/25/26/30%"
  if (m.stages.size() > 1) {
    pipe = " | pp idle ";
    for (size_t s = 0; s < m.stages.size(); ++s) {
      char pct[16];
      std::snprintf(pct, sizeof pct, "%s%.0f", s ? "/" : "", 100 * m.stages[s].idle_fraction());
      pipe += pct;
    }
    pipe += "%";
  }
  char moe[96] = "";
  if (!m.moe.empty()) {
    double worst = 0;
    for (const MoeLayerRecord& r : m.moe) worst = std::max(worst, to_json(r)["max_over_mean"].get<double>());
    std::snprintf(moe, sizeof moe, " | aux %.4f z %.4f | load max/mean %.2f", m.aux_loss, m.z_loss, worst);
  }
  // TFLOP/s where a rank reaches them (GPUs), GFLOP/s below.
  char rate[64];
  if (m.gflops >= 1000) std::snprintf(rate, sizeof rate, "%.1f TFLOP/s", m.gflops / 1000);
  else std::snprintf(rate, sizeof rate, "%.1f GFLOP/s", m.gflops);
  char mfu[32] = "";
  if (m.peak_gflops > 0) std::snprintf(mfu, sizeof mfu, " (MFU %.1f%%)", 100 * m.mfu);
  char comm[48] = "";
  if (m.comm_exposed_s > 0) std::snprintf(comm, sizeof comm, " | comm exposed %.0f ms", 1e3 * m.comm_exposed_s);
  std::snprintf(buf, sizeof buf,
                "step %5lld/%lld | lm loss %.4f%s | grad norm %.3f | lr %.3e | %.0f tok/s | %s%s%s | "
                "mem param %s grad %s optim %s act %s ws %s%s",
                static_cast<long long>(m.step), static_cast<long long>(m.total_steps), m.lm_loss, moe, m.grad_norm,
                m.lr, m.tokens_per_s, rate, mfu, comm, format_bytes(pk[0]).c_str(), format_bytes(pk[1]).c_str(),
                format_bytes(pk[2]).c_str(), format_bytes(pk[3]).c_str(), format_bytes(pk[5]).c_str(), pipe.c_str());
  std::string line = buf;
  if (m.checkpoint) {
    char ck[160];
    std::snprintf(ck, sizeof ck, " | %s %s (%s%s, %s%.2f s)", m.checkpoint->background ? "saving" : "saved",
                  std::filesystem::path(m.checkpoint->dir).filename().string().c_str(),
                  format_bytes(m.checkpoint->max_rank_bytes).c_str(), m.checkpoint->background ? " on rank 0" : "/rank",
                  m.checkpoint->background ? "blocked " : "", m.checkpoint->blocked_s);
    line += ck;
  }
  if (!m.stopped_by.empty()) line += " | stopped by " + m.stopped_by;
  return line;
}

MetricsWriter::MetricsWriter(const std::string& dir, int64_t resumed_step, const std::string& config_text) {
  if (dir.empty()) return;
  check_writable_dir(dir, "logging.dir");
  if (!config_text.empty()) {
    OutputFile config(dir + "/config.toml", OutputFile::Mode::truncate);
    config.write(config_text);
    config.close();
  }
  const std::string path = dir + "/metrics.jsonl";
  // Only a regular file holds earlier records to keep (a FIFO to a consumer
  // has none, and reading it would wait for a writer).
  if (resumed_step > 0 && std::filesystem::is_regular_file(path)) {
    // Streamed line by line: the run's earlier records, up to the resumed step.
    const std::string kept = path + ".resume";
    int64_t last_kept = 0, unreadable = 0;
    {
      std::ifstream in(path);
      OutputFile out(kept, OutputFile::Mode::truncate);
      std::string line;
      while (std::getline(in, line)) {
        const nlohmann::json rec = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
        if (!rec.is_object() || !rec.contains("step") || !rec["step"].is_number_integer()) {
          unreadable += !line.empty();
          continue;
        }
        if (const int64_t step = rec["step"].get<int64_t>(); step <= resumed_step) {
          out.write(line + "\n");
          last_kept = std::max(last_kept, step);
        }
      }
      out.sync();
      out.close();
    }
    rename_durably(kept, path);
    // What the file lacks, said once: a torn last line (a full disk, a
    // kill mid-write) or steps without a record (a write that failed).
    if (unreadable > 0)
      std::fprintf(stderr, "origami: warning: %s: %lld line(s) that are not step records dropped (a line torn by a "
                   "full disk or a kill)\n", path.c_str(), static_cast<long long>(unreadable));
    if (last_kept < resumed_step)
      std::fprintf(stderr, "origami: warning: %s: the records end at step %lld and the run resumes at step %lld: "
                   "steps %lld to %lld have none\n", path.c_str(), static_cast<long long>(last_kept),
                   static_cast<long long>(resumed_step), static_cast<long long>(last_kept + 1),
                   static_cast<long long>(resumed_step));
    out_ = std::make_unique<OutputFile>(path, OutputFile::Mode::append);
    return;
  }
  // A resume into a logging.dir without the run's records (a new directory,
  // or the file removed) starts the file at the resumed step: said, since
  // `origami imbalance` then sees only part of the run.
  if (resumed_step > 0 && !std::filesystem::exists(path))
    std::fprintf(stderr, "origami: warning: %s did not exist: the run resumes at step %lld, so steps 1 to %lld have "
                 "no record in it\n", path.c_str(), static_cast<long long>(resumed_step),
                 static_cast<long long>(resumed_step));
  out_ = std::make_unique<OutputFile>(path, OutputFile::Mode::truncate);
}

void MetricsWriter::write(const StepMetrics& m) {
  if (!out_) return;
  // Flushed per record: a run that dies keeps every step it finished, and a
  // full disk shows at the step that hit it.
  try {
    out_->write(to_json(m).dump() + "\n");
    out_->flush();
  } catch (const UserError&) {
    out_.reset();  // the file is closed; later records are dropped
    throw;
  }
  if (!warned_unlinked_ && out_->unlinked()) {
    warned_unlinked_ = true;
    std::fprintf(stderr,
                 "origami: warning: %s was deleted during the run (logging.dir removed?); the records from step %lld "
                 "on are lost, and `origami imbalance` and resuming cannot read them; training continues\n",
                 out_->path().c_str(), static_cast<long long>(m.step));
  }
}

void MetricsWriter::close() {
  if (!out_) return;
  std::unique_ptr<OutputFile> f = std::move(out_);
  f->close();
}

}  // namespace origami

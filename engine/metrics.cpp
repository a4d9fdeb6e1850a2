// Per-step metrics (see metrics.h).
#include "engine/metrics.h"

#include <cstdio>
#include <filesystem>

#include "kernels/check.h"

namespace origami {

nlohmann::ordered_json to_json(const StepMetrics& m) {
  nlohmann::ordered_json mem, peak;
  for (int c = 0; c < kNumMemCategories; ++c) {
    mem[std::string(to_string(static_cast<MemCategory>(c)))] = m.mem.peak[c];
  }
  mem["total"] = m.mem.peak_total;
  return {{"step", m.step},         {"lm_loss", m.lm_loss},   {"grad_norm", m.grad_norm},
          {"lr", m.lr},             {"tokens", m.tokens},     {"step_time_s", m.step_time_s},
          {"tokens_per_s", m.tokens_per_s}, {"gflops", m.gflops}, {"mem", mem}};
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
  char buf[512];
  const auto& pk = m.mem.peak;
  std::snprintf(buf, sizeof buf,
                "step %5lld/%lld | lm loss %.4f | grad norm %.3f | lr %.3e | %.0f tok/s | %.1f GFLOP/s | "
                "mem param %s grad %s optim %s act %s ws %s",
                static_cast<long long>(m.step), static_cast<long long>(m.total_steps), m.lm_loss, m.grad_norm, m.lr,
                m.tokens_per_s, m.gflops, format_bytes(pk[0]).c_str(), format_bytes(pk[1]).c_str(),
                format_bytes(pk[2]).c_str(), format_bytes(pk[3]).c_str(), format_bytes(pk[5]).c_str());
  return buf;
}

MetricsWriter::MetricsWriter(const std::string& dir) {
  if (dir.empty()) return;
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/metrics.jsonl";
  out_.open(path, std::ios::trunc);
  if (!out_) ORIGAMI_USER_ERROR(path, ": cannot open for writing (logging.dir)");
}

void MetricsWriter::write(const StepMetrics& m) {
  if (!out_.is_open()) return;
  out_ << to_json(m).dump() << "\n";
  out_.flush();
}

}  // namespace origami

// share_failures: one all_reduce of the worst status; only when someone
// failed, the statuses and messages themselves (all_gather of lengths, then
// all_gather_v of the characters, one i32 each: messages are short and the
// Communicator moves typed elements).
#include "comm/agreement.h"

#include <algorithm>
#include <chrono>

#include "comm/layout.h"

namespace origami::comm {

namespace {

using Clock = std::chrono::steady_clock;

// Waits for `r` until the deadline (moved by time this process did not
// run); false (the request abandoned) when late.
bool finish(Request& r, Clock::time_point& deadline) {
  if (r.wait_until(deadline)) return true;
  r.abandon();
  return false;
}

}  // namespace

std::optional<std::vector<RankFailure>> share_failures(Communicator& group, int status, const std::string& message,
                                                       double wait_s) {
  if (group.size() == 1) {
    if (status == 0) return std::vector<RankFailure>{};
    return std::vector<RankFailure>{{0, status, message}};
  }
  auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(wait_s));
  int64_t worst = status;
  Request r = group.all_reduce_async(std::span<int64_t>(&worst, 1), ReduceOp::max);
  if (!finish(r, deadline)) return std::nullopt;
  if (worst == 0) return std::vector<RankFailure>{};

  const int n = group.size();
  const std::string text = status != 0 ? message : std::string();
  int64_t mine[2] = {status, static_cast<int64_t>(text.size())};
  std::vector<int64_t> heads(2 * static_cast<size_t>(n));
  r = group.all_gather_async(std::span<const int64_t>(mine, 2), std::span<int64_t>(heads));
  if (!finish(r, deadline)) return std::nullopt;
  std::vector<int64_t> lengths(static_cast<size_t>(n));
  int64_t total = 0;
  for (int p = 0; p < n; ++p) total += lengths[p] = heads[2 * p + 1];
  std::vector<int32_t> chars_out(text.begin(), text.end()), chars_in(static_cast<size_t>(total));
  r = group.all_gather_v_async(std::span<const int32_t>(chars_out), std::span<int32_t>(chars_in), lengths);
  if (!finish(r, deadline)) return std::nullopt;

  std::vector<RankFailure> failures;
  int64_t at = 0;
  for (int p = 0; p < n; ++p) {
    const auto len = static_cast<std::ptrdiff_t>(lengths[p]);
    if (heads[2 * p] != 0) {
      std::string m(chars_in.begin() + at, chars_in.begin() + at + len);
      failures.push_back({p, static_cast<int>(heads[2 * p]), std::move(m)});
    }
    at += len;
  }
  return failures;
}

std::string format_failures(const std::vector<RankFailure>& failures, int group_size) {
  // Distinct messages in order of their first rank.
  std::vector<std::pair<std::string, std::vector<int>>> by_message;
  for (const RankFailure& f : failures) {
    auto it = std::find_if(by_message.begin(), by_message.end(), [&](const auto& m) { return m.first == f.message; });
    if (it == by_message.end()) by_message.push_back({f.message, {f.rank}});
    else it->second.push_back(f.rank);
  }
  std::string out;
  for (const auto& [msg, ranks] : by_message) {
    if (!out.empty()) out += '\n';
    const bool everyone = by_message.size() == 1 && static_cast<int>(ranks.size()) == group_size;
    if (everyone) {
      out += "error: " + msg;
    } else {
      out += (ranks.size() == 1 ? "error [rank " : "error [ranks ") + rank_list(ranks) + "]: " + msg;
    }
  }
  return out;
}

int failure_status(const std::vector<RankFailure>& failures) {
  int s = 0;
  for (const RankFailure& f : failures) s = std::max(s, f.status);
  return s;
}

void agree(Communicator& group, int status, const std::string& message, const std::optional<MeetingWait>& wait) {
  const double seconds = wait ? wait->seconds : group.timeout_s();
  auto failures = share_failures(group, status, message, seconds);
  if (!failures) {
    abort_job(kExitTimeout, origami::detail::concat("[rank ", world_rank_for_diagnostics(), "] the ranks of group ",
                                            group.name(), " did not all report within ", seconds, " s",
                                            wait && !wait->setting.empty() ? " (" + wait->setting + ")" : std::string(),
                                            status != 0 ? "; this rank's error: " + message : std::string()));
  }
  if (!failures->empty()) throw JobError(format_failures(*failures, group.size()), failure_status(*failures));
}

}  // namespace origami::comm

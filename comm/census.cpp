// The census of a timed-out collective (census.h).
#include "comm/census.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "kernels/check.h"

namespace origami::comm::census {

namespace {

constexpr int kMaxText = 256;  // an answer's bytes at most

bool mpi_running() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

// "rank 3" or "ranks 1, 4-7".
std::string ranks_text(std::vector<int> ranks) {
  std::sort(ranks.begin(), ranks.end());
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (i > 0) s += ", ";
    s += std::to_string(ranks[i]);
    if (j > i) s += "-" + std::to_string(ranks[j]);
    i = j + 1;
  }
  return s;
}

}  // namespace

void answer(const std::string& where) {
  if (!mpi_running()) return;
  for (;;) {
    int found = 0;
    MPI_Message msg;
    MPI_Status st;
    if (MPI_Improbe(MPI_ANY_SOURCE, kAskTag, MPI_COMM_WORLD, &found, &msg, &st) != MPI_SUCCESS || !found) return;
    char none = 0;
    MPI_Mrecv(&none, 1, MPI_CHAR, &msg, MPI_STATUS_IGNORE);
    const std::string text = where.substr(0, kMaxText);
    // A small message, sent eagerly: the asker posted nothing to wait on it,
    // and it may have ended the job already, which ends this rank too.
    MPI_Send(text.data(), static_cast<int>(text.size()), MPI_CHAR, st.MPI_SOURCE, kReplyTag, MPI_COMM_WORLD);
  }
}

std::vector<Answer> ask(std::span<const int> ranks, const std::string& where, double wait_s) {
  std::vector<Answer> answers;
  if (!mpi_running()) return answers;
  int me = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  static const char question = 1;  // outlives the sends, which are never waited for
  std::vector<MPI_Request> sends;
  for (const int r : ranks) {
    if (r == me) continue;
    answers.push_back({r, false, {}});
    sends.emplace_back();
    MPI_Isend(const_cast<char*>(&question), 1, MPI_CHAR, r, kAskTag, MPI_COMM_WORLD, &sends.back());
  }
  size_t open = answers.size();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(wait_s);
  while (open > 0 && std::chrono::steady_clock::now() < deadline) {
    answer(where);
    int found = 0;
    MPI_Message msg;
    MPI_Status st;
    if (MPI_Improbe(MPI_ANY_SOURCE, kReplyTag, MPI_COMM_WORLD, &found, &msg, &st) == MPI_SUCCESS && found) {
      int count = 0;
      MPI_Get_count(&st, MPI_CHAR, &count);
      std::string text(static_cast<size_t>(std::clamp(count, 0, kMaxText)), '\0');
      MPI_Mrecv(text.data(), static_cast<int>(text.size()), MPI_CHAR, &msg, MPI_STATUS_IGNORE);
      for (Answer& a : answers)
        if (a.rank == st.MPI_SOURCE && !a.answered) {
          a.answered = true;
          a.where = std::move(text);
          --open;
          break;
        }
      continue;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  // The questions to ranks that never answered stay posted: the job ends
  // next, and a stopped rank would never take them.
  for (MPI_Request& r : sends) MPI_Request_free(&r);
  return answers;
}

std::vector<std::string> report(const std::vector<Answer>& answers, const std::string& same_op) {
  std::vector<std::string> lines;
  std::vector<int> silent, here;
  std::vector<const Answer*> elsewhere;
  for (const Answer& a : answers) {
    if (!a.answered)
      silent.push_back(a.rank);
    else if (a.where.rfind(same_op + ",", 0) == 0)
      here.push_back(a.rank);
    else
      elsewhere.push_back(&a);
  }
  if (!silent.empty())
    lines.push_back(ranks_text(silent) + ": no answer (not waiting in any collective: still computing, stopped, or gone)");
  constexpr size_t kListed = 16;
  for (size_t i = 0; i < elsewhere.size() && i < kListed; ++i)
    lines.push_back(ranks_text({elsewhere[i]->rank}) + ": waiting in " + elsewhere[i]->where);
  if (elsewhere.size() > kListed)
    lines.push_back(detail::concat(elsewhere.size() - kListed, " more waiting in other ops"));
  if (!here.empty()) lines.push_back(ranks_text(here) + ": waiting in this op too");
  return lines;
}

}  // namespace origami::comm::census

// The census of a timed-out collective (census.h).
#include "comm/census.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "comm/layout.h"
#include "kernels/check.h"
#include "kernels/mpi_diagnostics.h"

namespace origami::comm::census {

namespace {

constexpr int kAskTag = 1, kAnswerTag = 2;
constexpr int kMaxText = 256;  // an answer's bytes at most

// The diagnostics communicator while MPI runs, else MPI_COMM_NULL.
MPI_Comm census_comm() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized ? diagnostics_comm() : MPI_COMM_NULL;
}

// "rank 3" or "ranks 1, 4-7".
std::string ranks_text(std::vector<int> ranks) {
  std::sort(ranks.begin(), ranks.end());
  return (ranks.size() == 1 ? "rank " : "ranks ") + rank_list(ranks);
}

}  // namespace

void answer(const std::string& where) {
  const MPI_Comm comm = census_comm();
  if (comm == MPI_COMM_NULL) return;
  // A bounded batch: the caller's wait goes on polling its own op between.
  for (int n = 0; n < 64; ++n) {
    int found = 0;
    MPI_Message msg;
    MPI_Status st;
    if (MPI_Improbe(MPI_ANY_SOURCE, kAskTag, comm, &found, &msg, &st) != MPI_SUCCESS || !found) return;
    char question = 0;
    if (MPI_Mrecv(&question, 1, MPI_CHAR, &msg, MPI_STATUS_IGNORE) != MPI_SUCCESS) return;
    // Sent and never waited for: the asker may have ended the job (and this
    // rank with it) before it takes the answer. The text stays allocated
    // for the same reason; a job that asked is ending.
    const std::string* text = new std::string(where.substr(0, kMaxText));
    MPI_Request r;
    if (MPI_Isend(text->data(), static_cast<int>(text->size()), MPI_CHAR, st.MPI_SOURCE, kAnswerTag, comm, &r) ==
        MPI_SUCCESS)
      MPI_Request_free(&r);
  }
}

std::vector<int> whom_to_ask(std::span<const int> members, int me) {
  const auto self = std::find(members.begin(), members.end(), me);
  ORIGAMI_CHECK(self != members.end(), "census: rank ", me, " is not a member of the group it asks");
  const size_t n = members.size(), at = static_cast<size_t>(self - members.begin());
  std::vector<int> ranks;
  for (size_t k = 1; k < n && k <= static_cast<size_t>(kAskAtMost); ++k) ranks.push_back(members[(at + k) % n]);
  return ranks;
}

std::vector<Answer> ask(std::span<const int> members, const std::string& where, double wait_s) {
  std::vector<Answer> answers;
  const MPI_Comm comm = census_comm();
  if (comm == MPI_COMM_NULL) return answers;
  int me = 0;
  MPI_Comm_rank(comm, &me);
  static const char question = 1;  // outlives the sends, which are never waited for
  for (const int r : whom_to_ask(members, me)) {
    MPI_Request req;
    if (MPI_Isend(const_cast<char*>(&question), 1, MPI_CHAR, r, kAskTag, comm, &req) != MPI_SUCCESS) continue;
    MPI_Request_free(&req);  // a stopped rank never takes it; the job ends next
    answers.push_back({r, false, {}});
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(wait_s);
  while (std::chrono::steady_clock::now() < deadline) {
    answer(where);
    int found = 0;
    MPI_Message msg;
    MPI_Status st;
    if (MPI_Improbe(MPI_ANY_SOURCE, kAnswerTag, comm, &found, &msg, &st) != MPI_SUCCESS) break;
    if (!found) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }
    int count = 0;
    MPI_Get_count(&st, MPI_CHAR, &count);
    std::string text(static_cast<size_t>(std::clamp(count, 0, kMaxText)), '\0');
    if (MPI_Mrecv(text.data(), static_cast<int>(text.size()), MPI_CHAR, &msg, MPI_STATUS_IGNORE) != MPI_SUCCESS) break;
    for (Answer& a : answers)
      if (a.rank == st.MPI_SOURCE && !a.answered) {
        a.answered = true;
        a.where = std::move(text);
        break;
      }
  }
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
    lines.push_back(ranks_text(silent) +
                    ": no answer (not in a host wait of a collective: still computing, blocked elsewhere, stopped, or "
                    "gone)");
  for (const Answer* a : elsewhere) lines.push_back(ranks_text({a->rank}) + ": waiting in " + a->where);
  if (!here.empty()) lines.push_back(ranks_text(here) + ": waiting in this op too");
  return lines;
}

}  // namespace origami::comm::census

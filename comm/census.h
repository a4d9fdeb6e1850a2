// Who is missing from a collective that timed out. Every rank standing in a
// bounded wait (Request::wait) answers, now and then, a "where are you?"
// from any rank with the op it waits in; a rank whose op timed out asks the
// other members of that op's group before it ends the job, and prints
// each one's answer, or that it gave none: a rank that is computing, is
// stopped or is gone cannot answer, and that rank is usually the one the
// others wait for. Without it each waiting rank only names its own op, and
// the one rank that never arrives prints nothing.
//
// Messages go point to point over MPI_COMM_WORLD under two reserved tags
// (kAskTag, kReplyTag). Nothing else in the engine sends point to point on
// MPI_COMM_WORLD itself (every group has its own communicator), so they can
// match nothing else; collectives there have a context of their own.
// Matched probes (MPI_Improbe/MPI_Mrecv) keep two threads from taking one
// message. Only waits answer: the NCCL watchdog's thread and the set-up
// deadlines report without asking.
#pragma once
#include <span>
#include <string>
#include <vector>

namespace origami::comm::census {

inline constexpr int kAskTag = 32001, kReplyTag = 32002;

// Answers every question that has arrived, with `where` (what this rank
// waits in: "group dp op all_reduce seq 2, 3.1 s so far"). Cheap when none
// has; a no-op without MPI.
void answer(const std::string& where);

struct Answer {
  int rank = -1;      // world rank asked
  bool answered = false;
  std::string where;  // its answer
};

// Asks each of `ranks` (world ranks; this rank is skipped) where it is and
// waits up to `wait_s` for the answers, answering others' questions with
// `where` meanwhile (several ranks may time out and ask at once).
std::vector<Answer> ask(std::span<const int> ranks, const std::string& where, double wait_s);

// The report's lines: ranks that gave no answer first (compressed into
// ranges), then the others' answers, those waiting in `same_op` counted
// rather than listed past a few.
std::vector<std::string> report(const std::vector<Answer>& answers, const std::string& same_op);

}  // namespace origami::comm::census

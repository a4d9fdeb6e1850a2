// Who is missing from a collective that timed out. Every rank standing in a
// bounded host wait (Request::wait, wait_until) answers, now and then, a
// "where are you?" from any rank with the op it waits in; a rank whose op
// timed out asks other members of that op's group before it ends the job,
// and prints each one's answer, or that it gave none: a rank that is
// computing, blocked outside a host wait, stopped or gone cannot answer,
// and that rank is usually the one the others wait for. Without it each
// waiting rank names only its own op, and the one rank that never arrives
// prints nothing.
//
// Messages go point to point over the diagnostics communicator
// (kernels/mpi_diagnostics.h: errors returned, so a failed census only
// shortens the report). Matched probes (MPI_Improbe/MPI_Mrecv) keep two
// threads from taking one message; answers are sent without waiting (the
// asker may have ended the job already). In a large group each rank asks
// only the next kAskAtMost members after it (group order, wrapping), so a
// world-wide hang costs N·kAskAtMost messages, not N², and each member is
// still asked by the ranks before it. The MPI backend's waits answer; GPU
// ops are reported by the NCCL watchdog, which does not ask.
#pragma once
#include <span>
#include <string>
#include <vector>

namespace origami::comm::census {

inline constexpr int kAskAtMost = 32;

// Answers the questions that have arrived, with `where` (what this rank
// waits in: "group dp op all_reduce seq 2, 3.1 s so far"). Cheap when none
// has; a no-op without the diagnostics communicator.
void answer(const std::string& where);

struct Answer {
  int rank = -1;  // world rank asked
  bool answered = false;
  std::string where;  // its answer
};

// Whom `me` asks among `members` (world ranks, `me` among them): the next
// kAskAtMost after it in group order, wrapping (all the others in a group
// of up to kAskAtMost + 1).
std::vector<int> whom_to_ask(std::span<const int> members, int me);

// Asks up to kAskAtMost of `members` (world ranks, this rank among them)
// where they are, and answers others' questions with `where` meanwhile
// for the whole `wait_s` (several ranks time out and ask at once; one that
// stopped answering early would read as missing to the later ones).
std::vector<Answer> ask(std::span<const int> members, const std::string& where, double wait_s);

// The report's lines: ranks that gave no answer first (runs as ranges),
// then the answers of ranks waiting elsewhere, then those waiting in
// `same_op` (the asker's op text), counted.
std::vector<std::string> report(const std::vector<Answer>& answers, const std::string& same_op);

}  // namespace origami::comm::census

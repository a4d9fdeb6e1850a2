// Failures that every rank learns about. A user error raised on some ranks
// only (its own data file unreadable, a write that only rank 0 does) must
// neither leave the other ranks waiting in a collective until the timeout nor
// lose its message. share_failures is the meeting point: every member of a
// group calls it at the same place in its program, saying whether it failed;
// all of them learn every failure, with its rank, and leave together.
//
// Invariants: the group's ranks call share_failures the same number of times
// in the same order (like any collective); the result is identical on every
// member; a group where nobody failed costs one all_reduce of one integer.
#pragma once
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "kernels/check.h"

namespace origami::comm {

struct RankFailure {
  int rank = 0;  // in the group (the world rank when the group is the world)
  int status = 0;
  std::string message;
};

// Collective over `group`: this rank's exit status (0: fine) and message.
// Returns every member's failure, ascending rank (empty when all are fine),
// or nullopt when the others did not all arrive within `wait_s` seconds
// (some rank is stuck elsewhere, or gone): the caller then aborts the job.
std::optional<std::vector<RankFailure>> share_failures(Communicator& group, int status, const std::string& message,
                                                       double wait_s);

// As the user reads them: "error: msg" when every member failed with the same
// message, else a line per distinct message, "error [rank 1]: msg" or
// "error [ranks 0, 2-3]: msg".
std::string format_failures(const std::vector<RankFailure>& failures, int group_size);
// The job's exit status: the largest of the failures'.
int failure_status(const std::vector<RankFailure>& failures);

// A meeting's own wait, and the setting that gave it (named when it runs out).
struct MeetingWait {
  double seconds = 0;
  std::string setting;  // e.g. "runtime.io_timeout_s"
};

// Collective over `group`: when any member failed (status != 0), throws a
// JobError on every member carrying every failing member's message (status:
// failure_status). When the members do not all arrive within `wait` (the
// group's collective timeout unless given), aborts the job (kExitTimeout),
// naming this rank, the wait's setting and its own error if it had one.
void agree(Communicator& group, int status, const std::string& message,
           const std::optional<MeetingWait>& wait = std::nullopt);

// Runs `fn` on every member of `group`; a UserError on any member becomes a
// JobError on every member (agree), as does a filesystem_error (its paths
// are the user's: checkpoint, logging and data directories). The meeting
// waits `wait` (the group's collective timeout unless given): work whose
// length is file I/O on some ranks only (rank 0 writing the export, a slow
// disk under one rank's checkpoint shard) passes runtime.io_timeout_s.
template <class Fn>
void run_agreed(Communicator& group, Fn&& fn, const std::optional<MeetingWait>& wait = std::nullopt) {
  int status = 0;
  std::string message;
  try {
    fn();
  } catch (const JobError&) {
    throw;  // already agreed by an inner meeting of the same ranks
  } catch (const UserError& e) {
    status = e.exit_status();
    message = e.what();
  } catch (const std::filesystem::filesystem_error& e) {
    status = kExitUserError;
    message = e.what();
  }
  agree(group, status, message, wait);
}

}  // namespace origami::comm

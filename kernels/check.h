// One error family for the whole engine.
//  - ORIGAMI_CHECK(cond, msg...): an internal invariant. On failure it prints
//    "file:line [rank R] check failed: cond: msg" and aborts the whole job
//    (MPI_Abort when MPI is up), so a broken rank never leaves others hanging.
//  - UserError: bad config, data, checkpoint or CLI input. Thrown with a
//    message naming the file, key or offset and the rule; the CLI prints it and
//    exits with status 2.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace origami {

class UserError : public std::runtime_error {
 public:
  explicit UserError(const std::string& what) : std::runtime_error(what) {}
};

// Rank of this process in MPI_COMM_WORLD, or 0 before MPI_Init / without MPI.
int world_rank_for_diagnostics();

[[noreturn]] void fail_check(const char* file, int line, const char* cond, const std::string& msg);

namespace detail {
template <class... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace origami

#define ORIGAMI_CHECK(cond, ...)                                                           \
  do {                                                                                     \
    if (!(cond)) [[unlikely]]                                                              \
      ::origami::fail_check(__FILE__, __LINE__, #cond, ::origami::detail::concat("" __VA_OPT__(, ) __VA_ARGS__)); \
  } while (0)

#define MPI_CHECK(call)                                                                    \
  do {                                                                                     \
    int origami_mpi_rc_ = (call);                                                          \
    if (origami_mpi_rc_ != 0) [[unlikely]]                                                 \
      ::origami::fail_check(__FILE__, __LINE__, #call,                                     \
                            ::origami::detail::concat("MPI error code ", origami_mpi_rc_)); \
  } while (0)

// Throws UserError with the concatenated message.
#define ORIGAMI_USER_ERROR(...) throw ::origami::UserError(::origami::detail::concat(__VA_ARGS__))

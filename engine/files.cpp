// Checked file input and output (see files.h).
#include "engine/files.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <string.h>  // strnlen
#include <filesystem>
#include <mutex>

#include "kernels/check.h"

namespace origami {

namespace {

// Paths are quoted whole unless absurdly long (a path the OS refuses anyway).
std::string shown(const std::string& path) { return shorten(path, 240); }

const char* file_kind(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "not a regular file";
}

}  // namespace

InputFile::InputFile(std::string path, std::string_view what) : path_(std::move(path)), what_(what) {
  // O_NONBLOCK: opening a FIFO that has no writer returns at once instead of
  // waiting for one; the type check below then refuses it.
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd_ < 0) ORIGAMI_USER_ERROR(shown(path_), ": cannot open the ", what_, ": ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    const int err = errno;
    ::close(fd_);
    ORIGAMI_USER_ERROR(shown(path_), ": cannot stat the ", what_, ": ", std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd_);
    ORIGAMI_USER_ERROR(shown(path_), ": is ", file_kind(st.st_mode), " (rule: the ", what_, " must be a regular file)");
  }
  // Regular files never block; reads should not see O_NONBLOCK either way.
  ::fcntl(fd_, F_SETFL, ::fcntl(fd_, F_GETFL) & ~O_NONBLOCK);
  size_ = static_cast<int64_t>(st.st_size);
}

InputFile::~InputFile() {
  if (fd_ >= 0) ::close(fd_);
}

void InputFile::read_at(int64_t offset, void* out, int64_t bytes) const {
  auto* p = static_cast<char*>(out);
  int64_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(fd_, p + done, static_cast<size_t>(bytes - done), static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) ORIGAMI_USER_ERROR(shown(path_), ": byte offset ", offset + done, ": read failed: ", std::strerror(errno));
    if (n == 0)
      ORIGAMI_USER_ERROR(shown(path_), ": byte offset ", offset + done, ": the file ends ", bytes - done,
                         " bytes early (it changed while being read?)");
    done += n;
  }
}

std::string InputFile::read_all(int64_t max_bytes) const {
  if (size_ > max_bytes)
    ORIGAMI_USER_ERROR(shown(path_), ": ", size_, " bytes: too large for a ", what_, " (at most ", max_bytes, " bytes)");
  std::string text(static_cast<size_t>(size_), '\0');
  read_at(0, text.data(), size_);
  return text;
}

OutputFile::OutputFile(std::string path, Mode mode) : path_(std::move(path)) {
  // O_NONBLOCK: opening a FIFO that no process reads fails at once (ENXIO)
  // instead of waiting for a reader that may never come; a FIFO something
  // reads (a pipe to a consumer) is a fine output.
  // Mode 0666, as fopen's: the umask decides.
  const int flags = O_WRONLY | O_CREAT | O_CLOEXEC | O_NONBLOCK | (mode == Mode::append ? O_APPEND : O_TRUNC);
  const int fd = ::open(path_.c_str(), flags, 0666);
  if (fd < 0 && errno == ENXIO)
    ORIGAMI_USER_ERROR(shown(path_), ": is a FIFO that no process reads (rule: an output is a regular file, a ",
                       "device, or a FIFO something reads; writing would wait forever)");
  if (fd < 0) fail("cannot open for writing", errno);
  // Writes block as usual: into a pipe, they wait while its reader catches up.
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  f_ = ::fdopen(fd, mode == Mode::append ? "ab" : "wb");
  if (!f_) {
    const int err = errno;
    ::close(fd);
    fail("cannot open for writing", err);
  }
}

OutputFile::~OutputFile() {
  if (f_) std::fclose(f_);
}

void OutputFile::fail(const char* what, int err) {
  if (f_) {
    std::fclose(f_);
    f_ = nullptr;
  }
  ORIGAMI_USER_ERROR(shown(path_), ": ", what, ": ", std::strerror(err));
}

void OutputFile::write(const void* data, size_t bytes) {
  ORIGAMI_CHECK(f_, path_, ": write after close");
  if (bytes > 0 && std::fwrite(data, 1, bytes, f_) != bytes) fail("write failed", errno);
}

void OutputFile::flush() {
  ORIGAMI_CHECK(f_, path_, ": flush after close");
  if (std::fflush(f_) != 0) fail("write failed", errno);
}

bool OutputFile::unlinked() const {
  struct stat st {};
  return f_ != nullptr && ::fstat(::fileno(f_), &st) == 0 && S_ISREG(st.st_mode) && st.st_nlink == 0;
}

void OutputFile::sync() {
  flush();
  // EINVAL: the file does not support syncing (a pipe, /dev/null); nothing
  // to make durable then.
  if (::fsync(::fileno(f_)) != 0 && errno != EINVAL && errno != EROFS) fail("fsync failed", errno);
}

void OutputFile::close() {
  ORIGAMI_CHECK(f_, path_, ": closed twice");
  std::FILE* f = f_;
  f_ = nullptr;
  const bool flushed = std::fflush(f) == 0;
  const int err = errno;
  if (std::fclose(f) != 0 || !flushed) ORIGAMI_USER_ERROR(shown(path_), ": write failed: ", std::strerror(flushed ? errno : err));
}

namespace {
// The live mappings, for the SIGBUS handler: fixed slots written before the
// mapping is used and cleared before it is unmapped, read only by the
// handler (atomics and plain chars: async-signal-safe).
struct MappingSlot {
  std::atomic<uintptr_t> begin{0}, end{0};
  char path[240] = {};
};
MappingSlot g_mappings[64];

void write_all_stderr(const char* s, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(2, s, n);
    if (w <= 0) return;
    s += w, n -= static_cast<size_t>(w);
  }
}

void on_sigbus(int, siginfo_t* info, void*) {
  const auto at = reinterpret_cast<uintptr_t>(info->si_addr);
  char rank[12];  // the rank in decimal, written backwards from the end (no snprintf in a handler)
  char* digit = rank + sizeof rank;
  for (int r = world_rank_for_diagnostics(); digit == rank + sizeof rank || r > 0; r /= 10)
    *--digit = static_cast<char>('0' + r % 10);
  // One line, one write(2): ranks sharing a pipe to the launcher (under
  // PIPE_BUF, a write is never split) print whole lines, not interleaved pieces.
  char line[512];
  size_t n = 0;
  auto put = [&](const char* s, size_t len) {
    len = std::min(len, sizeof line - n);
    std::memcpy(line + n, s, len);
    n += len;
  };
  const char* head = "error [rank ";
  put(head, std::strlen(head));
  put(digit, static_cast<size_t>(rank + sizeof rank - digit));
  put("]: ", 3);
  const char* path = nullptr;
  for (const MappingSlot& m : g_mappings)
    if (at >= m.begin.load() && at < m.end.load()) path = m.path;
  if (path) {
    put(path, ::strnlen(path, sizeof g_mappings[0].path));
    const char* rule = ": the file shrank while mapped (truncated or rewritten in place, or its disk failed; rule: "
                       "inputs must not change while origami reads them)\n";
    put(rule, std::strlen(rule));
  } else {
    const char* other = "SIGBUS outside any mapped input file\n";
    put(other, std::strlen(other));
  }
  if (n == sizeof line) line[n - 1] = '\n';
  write_all_stderr(line, n);
  ::raise(SIGBUS);  // SA_RESETHAND: the default action now, so the launcher sees the signal
}

void register_mapping(const void* data, size_t bytes, const std::string& path) {
  static std::once_flag installed;
  std::call_once(installed, [] {
    struct sigaction sa {};
    sa.sa_sigaction = on_sigbus;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_SIGINFO | SA_RESETHAND | SA_ONSTACK;
    ::sigaction(SIGBUS, &sa, nullptr);
  });
  for (MappingSlot& m : g_mappings) {
    uintptr_t free_slot = 0;
    if (!m.begin.compare_exchange_strong(free_slot, reinterpret_cast<uintptr_t>(data))) continue;
    std::snprintf(m.path, sizeof m.path, "%s", shown(path).c_str());
    m.end.store(reinterpret_cast<uintptr_t>(data) + bytes);
    return;
  }
  // More than 64 live mappings: this one goes unnamed in a SIGBUS report.
}

void unregister_mapping(const void* data) {
  for (MappingSlot& m : g_mappings)
    if (m.begin.load() == reinterpret_cast<uintptr_t>(data)) {
      m.end.store(0);
      m.begin.store(0);
    }
}
}  // namespace

void ReplacedFiles::check_replaceable(const std::string& path) {
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (std::filesystem::exists(st) && !std::filesystem::is_regular_file(st))
    ORIGAMI_USER_ERROR(shown(path), ": exists and is not a regular file (rule: an output of this kind is a regular "
                       "file, replaced whole once complete)");
}

WriterLock::WriterLock(const std::string& path, std::string_view what) {
  // The lock must be on the file the path names when the writer opens it:
  // one taken on a file that its writer renamed into place meanwhile (the
  // previous writer's commit) guards nothing, so that case opens again.
  for (int attempt = 0;; ++attempt) {
    // O_NONBLOCK: a FIFO at the path never holds up the open.
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NONBLOCK, 0666);  // the umask decides, as for OutputFile
    if (fd_ < 0) ORIGAMI_USER_ERROR(shown(path), ": cannot open for writing: ", std::strerror(errno));
    // The writer's own file, left behind as a FIFO: the writer would fill
    // it and then wait forever, this lock's descriptor being its reader.
    if (struct stat own {}; ::fstat(fd_, &own) == 0 && S_ISFIFO(own.st_mode)) {
      ::close(fd_);
      fd_ = -1;
      ORIGAMI_USER_ERROR(shown(path), ": is a FIFO (", what, " writes its data there first, then renames it into "
                         "place; rule: remove what is at that path)");
    }
    if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      ::close(fd_);
      fd_ = -1;
      if (err == EWOULDBLOCK)
        ORIGAMI_USER_ERROR(shown(path), ": another process is writing it (", what,
                           "; rule: one writer per output: give each run or job its own)");
      ORIGAMI_USER_ERROR(shown(path), ": cannot lock: ", std::strerror(err));
    }
    struct stat held {}, named {};
    if (::fstat(fd_, &held) == 0 && ::stat(path.c_str(), &named) == 0 && held.st_dev == named.st_dev &&
        held.st_ino == named.st_ino)
      return;
    ::close(fd_);
    fd_ = -1;
    if (attempt == 100) ORIGAMI_USER_ERROR(shown(path), ": replaced by other processes while being locked (", what, ")");
  }
}

WriterLock::~WriterLock() {
  if (fd_ >= 0) ::close(fd_);
}

ReplacedFiles::ReplacedFiles(std::vector<std::string> destinations, std::vector<std::string> stale)
    : destinations_(std::move(destinations)), stale_(std::move(stale)) {
  for (const std::string& d : destinations_) check_replaceable(d);
  for (const std::string& d : stale_) check_replaceable(d);
  // In order, so of two writers the second is refused at the first file,
  // before it truncates anything of the first's. A refused writer never
  // reaches the destructor, which removes .tmp files.
  for (size_t i = 0; i < destinations_.size(); ++i) locks_.emplace_back(tmp(i), "an export to the same directory");
}

ReplacedFiles::~ReplacedFiles() {
  if (committed_) return;
  std::error_code ec;
  for (size_t i = 0; i < destinations_.size(); ++i) std::filesystem::remove(tmp(i), ec);
}

void ReplacedFiles::commit() {
  for (size_t i = 0; i < destinations_.size(); ++i) rename_durably(tmp(i), destinations_[i]);
  committed_ = true;
  for (const std::string& path : stale_) {
    std::error_code ec;
    if (!std::filesystem::remove(path, ec)) {
      if (ec)
        ORIGAMI_USER_ERROR(shown(path), ": cannot remove it (an earlier write's, beside the files that replaced it): ",
                           ec.message());
      continue;  // not there
    }
    sync_dir(std::filesystem::path(path).parent_path().string());
  }
}

void unmap_file(const void* data, size_t bytes) {
  if (!data) return;
  unregister_mapping(data);
  ::munmap(const_cast<void*>(data), bytes);
}

MappedFile::MappedFile(std::string path, std::string_view what) : path_(std::move(path)) {
  const InputFile in(path_, what);
  size_ = in.size();
  if (size_ == 0) return;
  void* p = ::mmap(nullptr, static_cast<size_t>(size_), PROT_READ, MAP_SHARED, in.fd(), 0);
  if (p == MAP_FAILED) ORIGAMI_USER_ERROR(shown(path_), ": cannot map the ", what, ": ", std::strerror(errno));
  data_ = static_cast<const unsigned char*>(p);
  register_mapping(data_, static_cast<size_t>(size_), path_);
}

MappedFile::~MappedFile() { unmap_file(data_, static_cast<size_t>(size_)); }

void sync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) ORIGAMI_USER_ERROR(shown(dir), ": cannot open the directory to sync it: ", std::strerror(errno));
  const bool ok = ::fsync(fd) == 0 || errno == EINVAL || errno == EROFS;
  const int err = errno;
  ::close(fd);
  if (!ok) ORIGAMI_USER_ERROR(shown(dir), ": fsync of the directory failed: ", std::strerror(err));
}

void rename_durably(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0)
    ORIGAMI_USER_ERROR(shown(from), ": cannot rename to ", shown(to), ": ", std::strerror(errno));
  const std::filesystem::path parent = std::filesystem::path(to).parent_path();
  sync_dir(parent.empty() ? std::string(".") : parent.string());
}

namespace {
std::string host_name() {
  char host[256] = "?";
  ::gethostname(host, sizeof host - 1);
  return host;
}
}  // namespace

DirectoryLock::DirectoryLock(const std::string& dir, std::string_view key) : dir_(dir), key_(key) { lock(false); }

void DirectoryLock::lock(bool retaking) {
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) ORIGAMI_USER_ERROR(key_, " = \"", shorten(dir_), "\": cannot create the directory: ", ec.message());
  const std::string path = dir_ + "/.origami.lock";
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
  if (fd < 0) ORIGAMI_USER_ERROR(shown(path), ": cannot open the run's lock file: ", std::strerror(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char holder[512] = {};
    const ssize_t n = ::pread(fd, holder, sizeof holder - 1, 0);
    std::string who(holder, n > 0 ? static_cast<size_t>(n) : 0);
    while (!who.empty() && (who.back() == '\n' || who.back() == '\0')) who.pop_back();
    ::close(fd);
    if (err == EWOULDBLOCK)
      ORIGAMI_USER_ERROR(key_, " = \"", shorten(dir_), "\": ",
                         retaking ? "was moved or removed while this run used it, and " : "",
                         "another origami run uses this directory (",
                         who.empty() ? std::string("its lock file is ") + shown(path) : who,
                         "; rule: one run per directory: give this run its own, or wait for that one to end)");
    ORIGAMI_USER_ERROR(shown(path), ": cannot lock: ", std::strerror(err));
  }
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
  // Who holds it, for the message another run prints: a hint only, so a
  // failure to write it (a full disk) is no reason to stop.
  const std::string who = "pid " + std::to_string(::getpid()) + " on " + host_name() + "\n";
  if (::ftruncate(fd_, 0) == 0) (void)!::pwrite(fd_, who.data(), who.size(), 0);
}

void DirectoryLock::check_held() {
  struct stat held {}, now {};
  const std::string path = dir_ + "/.origami.lock";
  if (::fstat(fd_, &held) != 0) return;
  if (::stat(path.c_str(), &now) == 0) {
    if (held.st_dev == now.st_dev && held.st_ino == now.st_ino) return;
  } else if (errno != ENOENT) {
    return;  // cannot tell (a stale NFS handle, permissions): no evidence it moved
  }
  lock(true);
  std::fprintf(stderr, "origami: warning: %s = \"%s\" was moved or removed during the run; its lock is taken again\n",
               key_.c_str(), shorten(dir_).c_str());
}

DirectoryLock::~DirectoryLock() {
  if (fd_ >= 0) ::close(fd_);  // closing releases the lock
}

void check_writable_dir(const std::string& dir, std::string_view key) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) ORIGAMI_USER_ERROR(key, " = \"", shorten(dir), "\": cannot create the directory: ", ec.message());
  if (!std::filesystem::is_directory(dir, ec))
    ORIGAMI_USER_ERROR(key, " = \"", shorten(dir), "\": exists and is not a directory");
  // Host and pid: ranks on several nodes may probe one shared directory at once.
  const std::string probe = dir + "/.origami-write-probe-" + host_name() + "-" + std::to_string(::getpid());
  try {
    OutputFile f(probe, OutputFile::Mode::truncate);
    f.write("probe\n");
    f.sync();
    f.close();
  } catch (const UserError& e) {
    std::filesystem::remove(probe, ec);
    ORIGAMI_USER_ERROR(key, " = \"", shorten(dir), "\": the directory is not writable: ", e.what());
  }
  std::filesystem::remove(probe, ec);
}

}  // namespace origami

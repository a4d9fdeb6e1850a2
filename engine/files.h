// Files the engine reads and writes, with every failure a UserError that names
// the file and the OS's reason:
//  - InputFile opens only regular files, checking the type before anything
//    can block (a FIFO with no writer, a device, a directory), and reads by
//    offset with every short read reported.
//  - OutputFile checks every write, flush, sync and close, so a full disk
//    never passes as success.
//  - MappedFile maps a regular file read-only (checkpoint shards are read
//    by byte range without copying whole files); a mapped file that shrinks
//    under the process is reported by name at the SIGBUS it causes.
//  - ReplacedFiles writes outputs beside their destinations and renames them
//    over the old ones only when all are complete (exports).
//  - DirectoryLock keeps a second run out of a run's output directories.
//  - sync_dir and rename_durably make a rename survive a crash: the file is
//    synced before, the directory after.
//  - check_writable_dir proves an output directory usable before a run
//    spends hours producing what would go there.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace origami {

class InputFile {
 public:
  // `what` says what the file is for in messages ("dataset index", ...).
  InputFile(std::string path, std::string_view what);
  ~InputFile();
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  const std::string& path() const { return path_; }
  int fd() const { return fd_; }
  int64_t size() const { return size_; }
  // Exactly `bytes` bytes from `offset` (UserError if the file ends first).
  void read_at(int64_t offset, void* out, int64_t bytes) const;
  // The whole file; UserError when it is larger than `max_bytes`.
  std::string read_all(int64_t max_bytes) const;

 private:
  std::string path_, what_;
  int fd_ = -1;
  int64_t size_ = 0;
};

class OutputFile {
 public:
  enum class Mode { truncate, append };
  OutputFile(std::string path, Mode mode);
  // Closes a file still open without reporting (call close() to know).
  ~OutputFile();
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;

  const std::string& path() const { return path_; }
  void write(const void* data, size_t bytes);
  void write(std::string_view text) { write(text.data(), text.size()); }
  // Hands everything written so far to the OS, where a full disk shows.
  void flush();
  // flush() and fsync: on stable storage.
  void sync();
  void close();
  // Whether the file has no name left (deleted, or its directory removed,
  // while open): writes still succeed, into an inode nobody can read.
  bool unlinked() const;

 private:
  [[noreturn]] void fail(const char* what, int err);
  std::string path_;
  std::FILE* f_ = nullptr;
};

// A regular file mapped read-only (an empty file maps to no bytes). While
// mapped (also after release(), until unmap_file), a read past the end of a
// file that shrank under it (a dataset truncated or rewritten in place)
// raises SIGBUS: the process's handler prints which file, then dies of that
// signal, so the launcher ends the job (it was a bare "Bus error").
class MappedFile {
 public:
  MappedFile(std::string path, std::string_view what);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const { return path_; }
  int64_t size() const { return size_; }
  const unsigned char* data() const { return data_; }
  // Hands the mapping (data, bytes) to the caller, who must unmap it with
  // unmap_file.
  std::pair<const unsigned char*, size_t> release() {
    auto r = std::make_pair(data_, static_cast<size_t>(size_));
    data_ = nullptr;
    size_ = 0;
    return r;
  }

 private:
  std::string path_;
  int64_t size_ = 0;
  const unsigned char* data_ = nullptr;
};

// An exclusive advisory lock (flock) on a file about to be written, taken
// before anything truncates it and held until the object goes: two
// processes writing one output (two runs sharing an export.dir, an export
// beside a run, two preprocess jobs with one prefix) would otherwise
// interleave their bytes into one file that both call complete. The
// kernel releases it however the process ends. UserError naming the file
// when another process holds it.
class WriterLock {
 public:
  WriterLock(const std::string& path, std::string_view what);
  ~WriterLock();
  WriterLock(WriterLock&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  WriterLock& operator=(WriterLock&&) = delete;
  WriterLock(const WriterLock&) = delete;

 private:
  int fd_ = -1;
};

// Files written beside their destinations (<destination>.tmp) and renamed
// over them only once all are complete (commit): a failure before that (a
// full disk) leaves the previous files as they were and removes the partial
// ones. A destination that exists and is not a regular file (a FIFO, a
// directory) is refused before anything is written. Exports use it.
// `stale`: files of the same set that this write leaves out (an earlier
// export's optimizer.safetensors beside new weights): removed at commit, so
// what is there afterwards is this write's alone.
class ReplacedFiles {
 public:
  explicit ReplacedFiles(std::vector<std::string> destinations, std::vector<std::string> stale = {});
  ~ReplacedFiles();  // not committed: removes the .tmp files
  ReplacedFiles(const ReplacedFiles&) = delete;
  ReplacedFiles& operator=(const ReplacedFiles&) = delete;
  std::string tmp(size_t i) const { return destinations_.at(i) + ".tmp"; }
  void commit();

  // UserError unless `path` is absent or a regular file (a symlink to one).
  static void check_replaceable(const std::string& path);

 private:
  std::vector<std::string> destinations_;
  std::vector<std::string> stale_;
  std::vector<WriterLock> locks_;  // on each .tmp, before it is written
  bool committed_ = false;
};

// munmap of a mapping MappedFile::release handed out.
void unmap_file(const void* data, size_t bytes);

// fsync of a directory: its entries (a file created or renamed there) on
// stable storage. UserError naming the directory.
void sync_dir(const std::string& dir);
// rename(2) `from` to `to` (replacing a file `to`), then sync_dir of the
// target's directory. UserError naming both paths.
void rename_durably(const std::string& from, const std::string& to);

// An advisory lock on a run's output directory (flock of dir/.origami.lock,
// created with the directory if need be), held while the object lives and
// released by the kernel however the process ends: two runs never write one
// directory at once (their checkpoints interleave, one's metrics are lost,
// one prunes what the other loads). UserError naming `key`, the directory
// and the holder's pid and host when another process holds it.
class DirectoryLock {
 public:
  DirectoryLock(const std::string& dir, std::string_view key);
  ~DirectoryLock();
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

  // The directory moved away or removed during the run takes the lock with
  // it, and a second run would then be let in: when the lock file is no
  // longer the one held, it is taken again (a warning on stderr), or, when
  // another run holds the new one, UserError naming the key.
  void check_held();

 private:
  void lock(bool retaking);
  std::string dir_, key_;
  int fd_ = -1;
};

// Creates `dir` (and parents) if needed and creates, writes and removes a
// probe file in it. UserError naming `key` (e.g. "logging.dir"), the
// directory and the reason otherwise.
void check_writable_dir(const std::string& dir, std::string_view key);

}  // namespace origami

// Megatron indexed dataset reader (mmap + full validation) and writer.
// Every validation failure is a UserError of the form
//   "<file>: byte offset <N>: <what went wrong> (rule: <the rule broken>)"
// so a user can find the bad bytes with a hex dump.
#include "engine/indexed_dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>

#include "engine/files.h"
#include "kernels/check.h"

namespace origami {

static_assert(std::endian::native == std::endian::little, "the .idx/.bin format is little endian");

namespace {

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr uint64_t kVersion = 1;
constexpr uint64_t kVersionOffset = 9;
constexpr uint64_t kDtypeOffset = 17;
constexpr uint64_t kNumSequencesOffset = 18;
constexpr uint64_t kNumDocumentsOffset = 26;
constexpr uint64_t kHeaderBytes = 34;

constexpr const char* kPointerRule =
    "pointers[0] == 0 and pointers[i] == pointers[i-1] + sizes[i-1]*itemsize";

bool is_token_dtype(IndexDType dt) {
  return dt == IndexDType::u8 || dt == IndexDType::u16 || dt == IndexDType::i32 || dt == IndexDType::i64;
}

// Decimal text of a 128-bit unsigned value (array ends can exceed 2^64 when a
// corrupt header declares absurd counts).
std::string u128_string(unsigned __int128 v) {
  if (v == 0) return "0";
  std::string s;
  while (v > 0) {
    s.insert(s.begin(), static_cast<char>('0' + static_cast<int>(v % 10)));
    v /= 10;
  }
  return s;
}

// What a dataset file is, in messages.
std::string dataset_file_kind(const std::string& prefix) {
  const std::string p = shorten(prefix, 100);
  return detail::concat("indexed dataset file (a dataset is the pair ", p, ".bin + ", p, ".idx)");
}

// Bounds-checked little-endian reads of the (packed, unaligned) .idx.
struct IdxParser {
  const std::string& path;
  const uint8_t* p;
  uint64_t size;

  template <class T>
  T load(uint64_t off) const {
    T v;
    std::memcpy(&v, p + off, sizeof(T));
    return v;
  }
  void need_header_field(uint64_t off, uint64_t n, const char* field) const {
    if (off + n > size) {
      ORIGAMI_USER_ERROR(path, ": byte offset ", off, ": truncated header: ", field, " needs bytes [", off, ", ",
                         off + n, ") but the file has ", size,
                         " bytes (rule: the .idx starts with a 34-byte header)");
    }
  }
  // Checks that count items of item_bytes fit from off; returns the end.
  uint64_t need_array(uint64_t off, uint64_t count, uint64_t item_bytes, const char* name,
                      const char* count_name) const {
    unsigned __int128 end = static_cast<unsigned __int128>(off) + static_cast<unsigned __int128>(count) * item_bytes;
    if (end > size) {
      ORIGAMI_USER_ERROR(path, ": byte offset ", off, ": truncated ", name, " array: ", count_name, " = ", count,
                         " entries of ", item_bytes, " bytes end at byte offset ", u128_string(end),
                         " but the file has ", size,
                         " bytes (rule: the .idx must hold every array its header declares)");
    }
    return static_cast<uint64_t>(end);
  }
};

template <class T>
void check_tokens(const std::string& bin_path, const T* tokens, int64_t n, int64_t vocab_size) {
  // The common case is clean data: a branch-light scan first, then locate.
  bool bad = false;
  for (int64_t i = 0; i < n; ++i) {
    int64_t t = static_cast<int64_t>(tokens[i]);
    bad |= (t < 0) | (t >= vocab_size);
  }
  if (!bad) return;
  for (int64_t i = 0; i < n; ++i) {
    int64_t t = static_cast<int64_t>(tokens[i]);
    if (t < 0 || t >= vocab_size) {
      ORIGAMI_USER_ERROR(bin_path, ": byte offset ", i * static_cast<int64_t>(sizeof(T)), ": token id ", t,
                         " is out of range for vocab_size ", vocab_size,
                         " (rule: every token id t satisfies 0 <= t < vocab_size; was the data tokenized with "
                         "a different vocabulary?)");
    }
  }
}

template <class T>
void convert_tokens(const T* src, int64_t count, int32_t* out) {
  for (int64_t i = 0; i < count; ++i) out[i] = static_cast<int32_t>(src[i]);
}

}  // namespace

std::string_view to_string(IndexDType dt) {
  switch (dt) {
    case IndexDType::u8: return "u8";
    case IndexDType::i8: return "i8";
    case IndexDType::i16: return "i16";
    case IndexDType::i32: return "i32";
    case IndexDType::i64: return "i64";
    case IndexDType::f32: return "f32";
    case IndexDType::f64: return "f64";
    case IndexDType::u16: return "u16";
  }
  return "unknown";
}

int64_t index_dtype_size(IndexDType dt) {
  switch (dt) {
    case IndexDType::u8: return 1;
    case IndexDType::u16: return 2;
    case IndexDType::i32: return 4;
    case IndexDType::i64: return 8;
    default: break;
  }
  ORIGAMI_CHECK(false, "not a token dtype: ", to_string(dt));
  return 0;
}

IndexDType smallest_token_dtype(int64_t vocab_size) {
  ORIGAMI_CHECK(vocab_size > 0, "vocab_size ", vocab_size);
  if (vocab_size <= 256) return IndexDType::u8;
  if (vocab_size <= 65536) return IndexDType::u16;
  return IndexDType::i32;
}

// ---------------------------------------------------------------- reader

IndexedDataset IndexedDataset::open(const std::string& prefix, int64_t vocab_size) {
  ORIGAMI_CHECK(vocab_size > 0 && vocab_size <= int64_t{std::numeric_limits<int32_t>::max()} + 1,
                "vocab_size ", vocab_size);
  IndexedDataset ds;
  ds.prefix_ = prefix;
  ds.vocab_size_ = vocab_size;
  const std::string idx_path = prefix + ".idx";
  const std::string bin_path = prefix + ".bin";

  // The index is small: parse it into vectors and unmap it on return.
  MappedFile idx(idx_path, dataset_file_kind(prefix));
  IdxParser in{idx_path, idx.data(), static_cast<uint64_t>(idx.size())};

  in.need_header_field(0, sizeof(kMagic), "magic");
  if (std::memcmp(in.p, kMagic, sizeof(kMagic)) != 0) {
    std::string found;
    static const char* hex = "0123456789abcdef";
    for (size_t i = 0; i < sizeof(kMagic); ++i) {
      found += "\\x";
      found += hex[in.p[i] >> 4];
      found += hex[in.p[i] & 15];
    }
    ORIGAMI_USER_ERROR(idx_path, ": byte offset 0: bad magic \"", found,
                       "\" (rule: a Megatron indexed dataset .idx starts with \"MMIDIDX\\x00\\x00\")");
  }
  in.need_header_field(kVersionOffset, 8, "version");
  const uint64_t version = in.load<uint64_t>(kVersionOffset);
  if (version != kVersion) {
    ORIGAMI_USER_ERROR(idx_path, ": byte offset ", kVersionOffset, ": unsupported version ", version,
                       " (rule: only indexed dataset version ", kVersion, " is supported)");
  }
  in.need_header_field(kDtypeOffset, 1, "dtype code");
  const uint8_t code = in.load<uint8_t>(kDtypeOffset);
  const auto dtype = static_cast<IndexDType>(code);
  if (!is_token_dtype(dtype)) {
    std::string name = (code >= 1 && code <= 8) ? " (" + std::string(to_string(dtype)) + ")" : "";
    ORIGAMI_USER_ERROR(idx_path, ": byte offset ", kDtypeOffset, ": unsupported token dtype code ",
                       static_cast<int>(code), name,
                       " (rule: the dtype code is 1 (u8), 8 (u16), 4 (i32) or 5 (i64))");
  }
  ds.dtype_ = dtype;
  const int64_t itemsize = index_dtype_size(dtype);
  in.need_header_field(kNumSequencesOffset, 8, "num_sequences");
  in.need_header_field(kNumDocumentsOffset, 8, "num_documents");
  const uint64_t num_sequences = in.load<uint64_t>(kNumSequencesOffset);
  const uint64_t num_documents = in.load<uint64_t>(kNumDocumentsOffset);

  const uint64_t sizes_off = kHeaderBytes;
  const uint64_t pointers_off = in.need_array(sizes_off, num_sequences, 4, "sizes", "num_sequences");
  const uint64_t doc_idx_off = in.need_array(pointers_off, num_sequences, 8, "pointers", "num_sequences");
  const uint64_t idx_end = in.need_array(doc_idx_off, num_documents, 8, "doc_idx", "num_documents");
  if (idx_end != in.size) {
    ORIGAMI_USER_ERROR(idx_path, ": byte offset ", idx_end, ": ", in.size - idx_end,
                       " trailing bytes after the doc_idx array (rule: the .idx ends where its last array ends)");
  }

  const auto n = static_cast<int64_t>(num_sequences);
  ds.sizes_.resize(n);
  ds.token_starts_.resize(n);
  if (n > 0) std::memcpy(ds.sizes_.data(), in.p + sizes_off, n * sizeof(int32_t));
  int64_t tokens = 0;
  int64_t expected_pointer = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (ds.sizes_[i] < 0) {
      ORIGAMI_USER_ERROR(idx_path, ": byte offset ", sizes_off + 4 * i, ": sizes[", i, "] = ", ds.sizes_[i],
                         " is negative (rule: sequence sizes are token counts >= 0)");
    }
    const auto pointer = in.load<int64_t>(pointers_off + 8 * i);
    if (pointer != expected_pointer) {
      ORIGAMI_USER_ERROR(idx_path, ": byte offset ", pointers_off + 8 * i, ": pointers[", i, "] = ", pointer,
                         ", expected ", expected_pointer,
                         i == 0 ? std::string() : " = pointers[" + std::to_string(i - 1) + "] + sizes[" +
                                                      std::to_string(i - 1) + "]*" + std::to_string(itemsize),
                         " (rule: ", kPointerRule, ")");
    }
    ds.token_starts_[i] = tokens;
    tokens += ds.sizes_[i];
    expected_pointer += int64_t{ds.sizes_[i]} * itemsize;
  }
  ds.num_tokens_ = tokens;

  // Megatron's IndexedDataset asserts document_indices[-1] == the sequence
  // count, so an empty doc_idx, or one that stops short, is refused there too.
  if (num_documents == 0) {
    ORIGAMI_USER_ERROR(idx_path, ": byte offset ", kNumDocumentsOffset,
                       ": num_documents = 0 (rule: doc_idx holds at least one entry, the last equal to num_sequences "
                       "= ", n, "; Megatron refuses the file too)");
  }
  ds.doc_idx_.resize(num_documents);
  int64_t prev = 0;
  for (uint64_t j = 0; j < num_documents; ++j) {
    const auto d = in.load<int64_t>(doc_idx_off + 8 * j);
    if (d < prev || d > n) {
      ORIGAMI_USER_ERROR(idx_path, ": byte offset ", doc_idx_off + 8 * j, ": doc_idx[", j, "] = ", d,
                         " (rule: doc_idx is non-decreasing within [0, num_sequences = ", n, "])");
    }
    ds.doc_idx_[j] = prev = d;
  }
  if (prev != n) {
    ORIGAMI_USER_ERROR(idx_path, ": byte offset ", doc_idx_off + 8 * (num_documents - 1), ": doc_idx[",
                       num_documents - 1, "] = ", prev,
                       " (rule: the last doc_idx entry equals num_sequences = ", n,
                       ", so every sequence belongs to a document; Megatron refuses the file too)");
  }

  MappedFile bin(bin_path, dataset_file_kind(prefix));
  const auto expected_bytes = static_cast<uint64_t>(tokens * itemsize);
  if (static_cast<uint64_t>(bin.size()) != expected_bytes) {
    ORIGAMI_USER_ERROR(bin_path, ": byte offset ", std::min<uint64_t>(static_cast<uint64_t>(bin.size()), expected_bytes),
                       ": size mismatch: expected ", expected_bytes, " bytes (", tokens, " tokens x ", itemsize,
                       " bytes of ", to_string(dtype), ", as ", idx_path, " declares) but the file has ",
                       bin.size(), " bytes (rule: the .bin holds exactly the tokens its .idx declares)");
  }
  // The mapping is page aligned and every pointer is a multiple of itemsize,
  // so typed access to the stream is aligned.
  switch (dtype) {
    case IndexDType::u8:
      check_tokens(bin_path, bin.data(), tokens, vocab_size);
      break;
    case IndexDType::u16:
      check_tokens(bin_path, reinterpret_cast<const uint16_t*>(bin.data()), tokens, vocab_size);
      break;
    case IndexDType::i32:
      check_tokens(bin_path, reinterpret_cast<const int32_t*>(bin.data()), tokens, vocab_size);
      break;
    case IndexDType::i64:
      check_tokens(bin_path, reinterpret_cast<const int64_t*>(bin.data()), tokens, vocab_size);
      break;
    default: ORIGAMI_CHECK(false, "unreachable");
  }
  auto [data, bytes] = bin.release();
  ds.bin_ = data;
  ds.bin_bytes_ = bytes;
  return ds;
}

IndexedDataset::IndexedDataset(IndexedDataset&& other) noexcept { *this = std::move(other); }

IndexedDataset& IndexedDataset::operator=(IndexedDataset&& other) noexcept {
  if (this != &other) {
    unmap();
    prefix_ = std::move(other.prefix_);
    dtype_ = other.dtype_;
    vocab_size_ = other.vocab_size_;
    num_tokens_ = other.num_tokens_;
    sizes_ = std::move(other.sizes_);
    token_starts_ = std::move(other.token_starts_);
    doc_idx_ = std::move(other.doc_idx_);
    bin_ = std::exchange(other.bin_, nullptr);
    bin_bytes_ = std::exchange(other.bin_bytes_, 0);
  }
  return *this;
}

IndexedDataset::~IndexedDataset() { unmap(); }

void IndexedDataset::unmap() {
  unmap_file(bin_, bin_bytes_);
  bin_ = nullptr;
  bin_bytes_ = 0;
}

int64_t IndexedDataset::sequence_length(int64_t i) const {
  ORIGAMI_CHECK(i >= 0 && i < num_sequences(), "sequence ", i, " of ", num_sequences());
  return sizes_[i];
}

int64_t IndexedDataset::sequence_start(int64_t i) const {
  ORIGAMI_CHECK(i >= 0 && i < num_sequences(), "sequence ", i, " of ", num_sequences());
  return token_starts_[i];
}

void IndexedDataset::sequence(int64_t i, int32_t* out) const {
  read_tokens(sequence_start(i), sequence_length(i), out);
}

std::vector<int32_t> IndexedDataset::sequence(int64_t i) const {
  std::vector<int32_t> out(sequence_length(i));
  sequence(i, out.data());
  return out;
}

void IndexedDataset::read_tokens(int64_t first, int64_t count, int32_t* out) const {
  ORIGAMI_CHECK(first >= 0 && count >= 0 && first + count <= num_tokens_, "tokens [", first, ", ", first + count,
                ") of ", num_tokens_, " in ", prefix_);
  if (count == 0) return;
  switch (dtype_) {
    case IndexDType::u8: convert_tokens(bin_ + first, count, out); break;
    case IndexDType::u16: convert_tokens(reinterpret_cast<const uint16_t*>(bin_) + first, count, out); break;
    case IndexDType::i32: convert_tokens(reinterpret_cast<const int32_t*>(bin_) + first, count, out); break;
    case IndexDType::i64: convert_tokens(reinterpret_cast<const int64_t*>(bin_) + first, count, out); break;
    default: ORIGAMI_CHECK(false, "unreachable");
  }
  // Every token passed the scan at open, so one out of range now means the
  // mapped file was rewritten in place since (a shrunk one is SIGBUS's). The
  // reader may be one rank in the middle of a step, its peers waiting in a
  // collective: the job ends here, naming the file, rather than as a failed
  // check deeper down (a "bug", exit 4) or a timeout. An i64 read is widened
  // before the check (the conversion to int32 may have wrapped).
  bool bad = false;
  for (int64_t i = 0; i < count; ++i) bad |= (out[i] < 0) | (out[i] >= vocab_size_);
  if (dtype_ == IndexDType::i64) {
    const auto* src = reinterpret_cast<const int64_t*>(bin_) + first;
    for (int64_t i = 0; i < count; ++i) bad |= (src[i] < 0) | (src[i] >= vocab_size_);
  }
  if (!bad) return;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t t = dtype_ == IndexDType::i64 ? reinterpret_cast<const int64_t*>(bin_)[first + i] : out[i];
    if (t >= 0 && t < vocab_size_) continue;
    abort_job(kExitUserError,
              detail::concat("error [rank ", world_rank_for_diagnostics(), "]: ", bin_path(), ": token ", first + i,
                             " is ", t, ", outside [0, ", vocab_size_, "), and every token was in range when the run "
                             "opened the file: it was rewritten during the run (rule: a data file must not change "
                             "while a run reads it)"));
  }
}

// ---------------------------------------------------------------- writer

namespace {

template <class T>
void append_pod(std::vector<uint8_t>& buf, const T& v) {
  const auto* b = reinterpret_cast<const uint8_t*>(&v);
  buf.insert(buf.end(), b, b + sizeof(T));
}

// `first`: the document's token index of tokens[0].
template <class T>
void pack_tokens(std::span<const int32_t> tokens, int64_t doc, int64_t first, IndexDType dt,
                 std::vector<uint8_t>& out) {
  const int64_t max = static_cast<int64_t>(std::numeric_limits<T>::max());
  out.resize(tokens.size() * sizeof(T));
  auto* dst = reinterpret_cast<T*>(out.data());
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int32_t t = tokens[i];
    if (t < 0 || t > max) {
      ORIGAMI_USER_ERROR("document ", doc, ", token ", first + static_cast<int64_t>(i), ": id ", t,
                         " does not fit the dataset dtype ", to_string(dt), " (rule: token ids are in [0, ", max,
                         "])");
    }
    dst[i] = static_cast<T>(t);
  }
}

}  // namespace

IndexedDatasetWriter::IndexedDatasetWriter(std::string prefix, IndexDType dtype)
    : prefix_(std::move(prefix)), dtype_(dtype), lock_(prefix_ + ".bin.tmp", "a preprocess to the same output prefix") {
  ORIGAMI_CHECK(is_token_dtype(dtype), "writer dtype must be u8, u16, i32 or i64, got ", to_string(dtype));
  bin_ = std::make_unique<OutputFile>(bin_path() + ".tmp", OutputFile::Mode::truncate);
}

IndexedDatasetWriter::~IndexedDatasetWriter() {
  if (finalized_) return;
  bin_.reset();
  std::remove((bin_path() + ".tmp").c_str());
  std::remove((idx_path() + ".tmp").c_str());
}

void IndexedDatasetWriter::add_document(std::span<const int32_t> tokens) {
  ORIGAMI_CHECK(open_tokens_ == 0, "add_document inside a document written in pieces on ", prefix_);
  append(tokens);
  end_document();
}

void IndexedDatasetWriter::append(std::span<const int32_t> tokens) {
  ORIGAMI_CHECK(!finalized_, "append after finalize on ", prefix_);
  const int64_t doc = num_sequences();
  const auto n = static_cast<int64_t>(tokens.size());
  if (n > std::numeric_limits<int32_t>::max() - open_tokens_) {
    ORIGAMI_USER_ERROR("document ", doc, " has ", open_tokens_ + n,
                       " tokens (rule: a sequence holds at most 2^31-1 tokens, its size is an i32)");
  }
  switch (dtype_) {
    case IndexDType::u8: pack_tokens<uint8_t>(tokens, doc, open_tokens_, dtype_, scratch_); break;
    case IndexDType::u16: pack_tokens<uint16_t>(tokens, doc, open_tokens_, dtype_, scratch_); break;
    case IndexDType::i32: pack_tokens<int32_t>(tokens, doc, open_tokens_, dtype_, scratch_); break;
    case IndexDType::i64: pack_tokens<int64_t>(tokens, doc, open_tokens_, dtype_, scratch_); break;
    default: ORIGAMI_CHECK(false, "unreachable");
  }
  bin_->write(scratch_.data(), scratch_.size());
  open_tokens_ += n;
}

void IndexedDatasetWriter::end_document() {
  ORIGAMI_CHECK(!finalized_, "end_document after finalize on ", prefix_);
  sizes_.push_back(static_cast<int32_t>(open_tokens_));
  pointers_.push_back(bin_bytes_);
  bin_bytes_ += open_tokens_ * index_dtype_size(dtype_);
  num_tokens_ += open_tokens_;
  open_tokens_ = 0;
}

void IndexedDatasetWriter::finalize() {
  ORIGAMI_CHECK(!finalized_, "finalize called twice on ", prefix_);
  ORIGAMI_CHECK(open_tokens_ == 0, "finalize inside a document written in pieces on ", prefix_);
  const std::string bin_tmp = bin_path() + ".tmp";
  const std::string idx_tmp = idx_path() + ".tmp";
  bin_->sync();
  bin_->close();

  const auto n = static_cast<uint64_t>(sizes_.size());
  std::vector<uint8_t> idx;
  idx.reserve(kHeaderBytes + n * 20 + 8);
  idx.insert(idx.end(), kMagic, kMagic + sizeof(kMagic));
  append_pod(idx, kVersion);
  append_pod(idx, static_cast<uint8_t>(dtype_));
  append_pod(idx, n);
  append_pod(idx, n + 1);  // doc_idx = 0, 1, ..., n: one document per sequence
  for (int32_t s : sizes_) append_pod(idx, s);
  for (int64_t p : pointers_) append_pod(idx, p);
  for (uint64_t d = 0; d <= n; ++d) append_pod(idx, static_cast<int64_t>(d));

  {
    OutputFile f(idx_tmp, OutputFile::Mode::truncate);
    f.write(idx.data(), idx.size());
    f.sync();
    f.close();
  }
  // The two renames are not jointly atomic: .bin goes first, so a crash in
  // between leaves a new .bin beside the old .idx, which the reader's size and
  // token checks reject unless the two happen to agree in size.
  rename_durably(bin_tmp, bin_path());
  rename_durably(idx_tmp, idx_path());
  finalized_ = true;
}

}  // namespace origami

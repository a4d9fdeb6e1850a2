// Data layer tests: indexed dataset round trip and one test per corruption
// (each asserting the error names the file, the byte offset and the rule),
// GptDataset windows and shuffle properties, the §8 batch rule, preprocess of
// every input format.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "engine/dataset.h"
#include "engine/indexed_dataset.h"
#include "engine/metrics.h"
#include "engine/preprocess.h"
#include "kernels/check.h"

namespace fs = std::filesystem;
using namespace origami;

namespace {

using Docs = std::vector<std::vector<int32_t>>;

class DataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = std::random_device{}();
    rng_.seed(seed_);
    dir_ = fs::temp_directory_path() /
           ("origami_data_" + std::to_string(::getpid()) + "_" + std::to_string(seed_));
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // Fresh random documents: lengths 0..max_len (some empty), ids in [0, vocab).
  Docs random_docs(int n, int max_len, int32_t vocab) {
    Docs docs(n);
    for (auto& d : docs) {
      d.resize(std::uniform_int_distribution<int>(0, max_len)(rng_));
      for (auto& t : d) t = std::uniform_int_distribution<int32_t>(0, vocab - 1)(rng_);
    }
    return docs;
  }

  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
  fs::path dir_;
};

void write_dataset(const std::string& prefix, const Docs& docs, IndexDType dtype) {
  IndexedDatasetWriter w(prefix, dtype);
  for (const auto& d : docs) w.add_document(d);
  w.finalize();
}

std::vector<int32_t> concat(const Docs& docs) {
  std::vector<int32_t> s;
  for (const auto& d : docs) s.insert(s.end(), d.begin(), d.end());
  return s;
}

std::string read_bytes(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

template <class T>
void patch(const std::string& p, size_t offset, T value) {
  std::string b = read_bytes(p);
  ASSERT_LE(offset + sizeof(T), b.size());
  std::memcpy(b.data() + offset, &value, sizeof(T));
  write_bytes(p, b);
}

void truncate_to(const std::string& p, size_t size) { fs::resize_file(p, size); }

// Runs fn, expects a UserError whose message contains every needle.
void expect_user_error(const std::function<void()>& fn, const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "expected a UserError";
  } catch (const UserError& e) {
    const std::string msg = e.what();
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "missing \"" << n << "\" in: " << msg;
  }
}

constexpr int32_t kVocab = 257;

// ---------------------------------------------------------------- round trip

TEST_F(DataTest, RoundTripEveryTokenDtype) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  for (auto [dtype, vocab] : {std::pair{IndexDType::u8, 256}, std::pair{IndexDType::u16, 50000},
                              std::pair{IndexDType::i32, 1 << 20}, std::pair{IndexDType::i64, 1 << 30}}) {
    SCOPED_TRACE(std::string(to_string(dtype)));
    const Docs docs = random_docs(37, 300, vocab);
    const std::string prefix = path("rt_" + std::string(to_string(dtype)));
    write_dataset(prefix, docs, dtype);
    EXPECT_FALSE(fs::exists(prefix + ".bin.tmp"));
    EXPECT_FALSE(fs::exists(prefix + ".idx.tmp"));

    IndexedDataset ds = IndexedDataset::open(prefix, vocab);
    ASSERT_EQ(ds.num_sequences(), 37);
    EXPECT_EQ(ds.dtype(), dtype);
    const auto stream = concat(docs);
    ASSERT_EQ(ds.num_tokens(), static_cast<int64_t>(stream.size()));
    ASSERT_TRUE(std::any_of(stream.begin(), stream.end(), [](int32_t t) { return t != 0; }));
    for (int64_t i = 0; i < ds.num_sequences(); ++i) EXPECT_EQ(ds.sequence(i), docs[i]) << "sequence " << i;
    std::vector<int64_t> doc_idx(38);
    std::iota(doc_idx.begin(), doc_idx.end(), 0);
    EXPECT_EQ(std::vector<int64_t>(ds.doc_idx().begin(), ds.doc_idx().end()), doc_idx);
    std::vector<int32_t> all(stream.size());
    ds.read_tokens(0, ds.num_tokens(), all.data());
    EXPECT_EQ(all, stream);
    // The .bin is exactly the token stream in the dtype.
    EXPECT_EQ(static_cast<int64_t>(fs::file_size(prefix + ".bin")), ds.num_tokens() * index_dtype_size(dtype));
    // Moving keeps the mapping valid.
    IndexedDataset moved = std::move(ds);
    EXPECT_EQ(moved.sequence(36), docs[36]);
  }
}

// A .bin truncated while mapped: the read past its new end is SIGBUS, and
// the handler names the file before the process dies of it (it was a bare
// "Bus error" from the launcher).
TEST_F(DataTest, ADatasetTruncatedWhileMappedDiesNamingTheFile) {
  const Docs docs = random_docs(64, 2000, kVocab);
  const std::string prefix = path("shrinks");
  write_dataset(prefix, docs, IndexDType::u16);
  EXPECT_DEATH(
      {
        IndexedDataset ds = IndexedDataset::open(prefix, kVocab);
        fs::resize_file(prefix + ".bin", 100);
        for (int64_t i = ds.num_sequences() - 1; i >= 0; --i) (void)ds.sequence(i);
      },
      prefix + ".bin: the file shrank while mapped \\(truncated or rewritten in place");
}

// logging.dir removed under a run: the metrics writes still succeed (into
// an inode without a name), so the writer says so, once, naming the file and
// the first lost step; training is not stopped for its log.
TEST_F(DataTest, AMetricsFileDeletedUnderTheRunIsReportedOnce) {
  const std::string log_dir = path("log");
  MetricsWriter writer(log_dir);
  StepMetrics m;
  m.step = 1;
  ::testing::internal::CaptureStderr();
  writer.write(m);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  fs::remove_all(log_dir);
  ::testing::internal::CaptureStderr();
  for (m.step = 2; m.step <= 4; ++m.step) EXPECT_NO_THROW(writer.write(m));
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find(log_dir + "/metrics.jsonl was deleted during the run"), std::string::npos) << err;
  EXPECT_NE(err.find("from step 2 on are lost"), std::string::npos) << err;
  EXPECT_EQ(err.find("deleted"), err.rfind("deleted")) << "warned once: " << err;
  EXPECT_NO_THROW(writer.close());
}

TEST_F(DataTest, WriterRejectsTokenThatDoesNotFitDtype) {
  IndexedDatasetWriter w(path("fit"), IndexDType::u8);
  std::vector<int32_t> doc = {1, 2, 300};
  expect_user_error([&] { w.add_document(doc); }, {"document 0", "300", "u8"});
}

TEST(SmallestTokenDtype, ByVocab) {
  EXPECT_EQ(smallest_token_dtype(256), IndexDType::u8);
  EXPECT_EQ(smallest_token_dtype(257), IndexDType::u16);
  EXPECT_EQ(smallest_token_dtype(65536), IndexDType::u16);
  EXPECT_EQ(smallest_token_dtype(65537), IndexDType::i32);
}

// ---------------------------------------------------------------- corruption
// A good 5-sequence u16 dataset: sizes at 34, pointers at 54, doc_idx (6
// entries) at 94, end of .idx at 142.

class CorruptTest : public DataTest {
 protected:
  void SetUp() override {
    DataTest::SetUp();
    prefix_ = path("bad");
    docs_ = {{1, 2, 3}, {4, 5}, {6, 7, 8, 9}, {10}, {11, 12, 256}};
    write_dataset(prefix_, docs_, IndexDType::u16);
    idx_ = prefix_ + ".idx";
    bin_ = prefix_ + ".bin";
    ASSERT_EQ(fs::file_size(idx_), 142u);
    ASSERT_EQ(fs::file_size(bin_), 13u * 2);
    ASSERT_NO_THROW(IndexedDataset::open(prefix_, kVocab));
  }
  void expect_open_error(const std::vector<std::string>& needles) {
    expect_user_error([&] { IndexedDataset::open(prefix_, kVocab); }, needles);
  }
  std::string prefix_, idx_, bin_;
  Docs docs_;
};

TEST_F(CorruptTest, WrongMagic) {
  patch<char>(idx_, 3, 'X');
  expect_open_error({idx_, "byte offset 0", "bad magic", "MMIDIDX"});
}

TEST_F(CorruptTest, WrongVersion) {
  patch<uint64_t>(idx_, 9, 2);
  expect_open_error({idx_, "byte offset 9", "unsupported version 2", "version 1"});
}

TEST_F(CorruptTest, BadDtypeCode) {
  // Megatron's codes: float64 = 6, float32 = 7 (neither is a token type).
  patch<uint8_t>(idx_, 17, 6);
  expect_open_error({idx_, "byte offset 17", "dtype code 6 (f64)", "1 (u8), 8 (u16)"});
  patch<uint8_t>(idx_, 17, 7);
  expect_open_error({idx_, "byte offset 17", "dtype code 7 (f32)", "1 (u8), 8 (u16)"});
}

TEST_F(CorruptTest, UnknownDtypeCode) {
  patch<uint8_t>(idx_, 17, 99);
  expect_open_error({idx_, "byte offset 17", "dtype code 99", "1 (u8), 8 (u16)"});
}

TEST_F(CorruptTest, TruncatedHeader) {
  truncate_to(idx_, 20);
  expect_open_error({idx_, "byte offset 18", "truncated header", "num_sequences", "20 bytes"});
}

TEST_F(CorruptTest, TruncatedSizesArray) {
  truncate_to(idx_, 50);
  expect_open_error({idx_, "byte offset 34", "truncated sizes array", "byte offset 54", "file has 50 bytes",
                     "every array its header declares"});
}

TEST_F(CorruptTest, TruncatedPointersArray) {
  truncate_to(idx_, 80);
  expect_open_error({idx_, "byte offset 54", "truncated pointers array", "byte offset 94", "file has 80 bytes",
                     "every array its header declares"});
}

TEST_F(CorruptTest, TruncatedDocIdx) {
  truncate_to(idx_, 141);
  expect_open_error({idx_, "byte offset 94", "truncated doc_idx array", "byte offset 142", "file has 141 bytes",
                     "every array its header declares"});
}

TEST_F(CorruptTest, HugeDeclaredCountIsTruncationNotOverflow) {
  patch<uint64_t>(idx_, 18, ~uint64_t{0});
  expect_open_error({idx_, "byte offset 34", "truncated sizes array", "file has 142 bytes"});
}

TEST_F(CorruptTest, TrailingIdxBytes) {
  write_bytes(idx_, read_bytes(idx_) + "xx");
  expect_open_error({idx_, "byte offset 142", "2 trailing bytes", "ends where its last array ends"});
}

TEST_F(CorruptTest, PointersInconsistentWithSizes) {
  patch<int64_t>(idx_, 54 + 8 * 2, 12);  // sequence 2 starts at byte 10
  expect_open_error({idx_, "byte offset 70", "pointers[2] = 12, expected 10", "pointers[1] + sizes[1]*2",
                     "pointers[i] == pointers[i-1] + sizes[i-1]*itemsize"});
}

TEST_F(CorruptTest, FirstPointerNotZero) {
  patch<int64_t>(idx_, 54, 2);
  expect_open_error({idx_, "byte offset 54", "pointers[0] = 2, expected 0", "pointers[0] == 0"});
}

TEST_F(CorruptTest, NegativeSize) {
  patch<int32_t>(idx_, 34 + 4, -1);
  expect_open_error({idx_, "byte offset 38", "sizes[1] = -1", "token counts >= 0"});
}

TEST_F(CorruptTest, DocIdxOutOfRange) {
  patch<int64_t>(idx_, 94 + 8 * 3, 9);
  expect_open_error({idx_, "byte offset 118", "doc_idx[3] = 9", "non-decreasing within [0, num_sequences = 5]"});
}

// Megatron's IndexedDataset asserts document_indices[-1] == the sequence
// count; these indexes fail there too.
TEST_F(CorruptTest, DocIdxEmptyIsRefusedLikeMegatron) {
  patch<uint64_t>(idx_, 26, 0);
  truncate_to(idx_, 94);
  expect_open_error({idx_, "byte offset 26", "num_documents = 0", "last equal to num_sequences = 5", "Megatron"});
}

TEST_F(CorruptTest, DocIdxNotEndingAtSequenceCountIsRefusedLikeMegatron) {
  patch<int64_t>(idx_, 94 + 8 * 5, 4);  // doc_idx = 0, 1, 2, 3, 4, 4: sequence 4 in no document
  expect_open_error({idx_, "byte offset 134", "doc_idx[5] = 4", "equals num_sequences = 5", "Megatron"});
}

TEST_F(CorruptTest, BinTooShort) {
  truncate_to(bin_, 24);
  expect_open_error({bin_, "byte offset 24", "size mismatch", "expected 26 bytes", "has 24 bytes",
                     "exactly the tokens its .idx declares"});
}

TEST_F(CorruptTest, BinTooLong) {
  write_bytes(bin_, read_bytes(bin_) + std::string(4, '\0'));
  expect_open_error({bin_, "byte offset 26", "size mismatch", "expected 26 bytes", "has 30 bytes",
                     "exactly the tokens its .idx declares"});
}

TEST_F(CorruptTest, TokenIdNotBelowVocab) {
  patch<uint16_t>(bin_, 2 * 7, 300);  // token 7 (sequence 2)
  expect_open_error({bin_, "byte offset 14", "token id 300", "vocab_size 257", "0 <= t < vocab_size"});
  // The boundary: id == vocab_size is already out of range.
  patch<uint16_t>(bin_, 2 * 7, 257);
  expect_open_error({bin_, "byte offset 14", "token id 257", "vocab_size 257"});
}

TEST_F(DataTest, NegativeTokenIdInI32Dataset) {
  const std::string prefix = path("neg");
  write_dataset(prefix, {{5, 6, 7, 8}}, IndexDType::i32);
  patch<int32_t>(prefix + ".bin", 8, -3);
  expect_user_error([&] { IndexedDataset::open(prefix, kVocab); },
                    {prefix + ".bin", "byte offset 8", "token id -3", "vocab_size 257", "0 <= t < vocab_size"});
}

TEST_F(CorruptTest, MissingBin) {
  fs::remove(bin_);
  expect_open_error({bin_, "cannot open", "No such file", "pair " + prefix_ + ".bin + " + prefix_ + ".idx"});
}

TEST_F(CorruptTest, MissingIdx) {
  fs::remove(idx_);
  expect_open_error({idx_, "cannot open", "No such file", "pair " + prefix_ + ".bin + " + prefix_ + ".idx"});
}

// ---------------------------------------------------------------- windows

TEST_F(DataTest, WindowsAreExactStreamSlicesInFileOrder) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const Docs docs = random_docs(20, 50, kVocab);
  const std::string prefix = path("win");
  write_dataset(prefix, docs, IndexDType::u16);
  IndexedDataset ds = IndexedDataset::open(prefix, kVocab);
  const auto stream = concat(docs);
  const int64_t n = static_cast<int64_t>(stream.size());
  for (int64_t L : {int64_t{1}, int64_t{7}, int64_t{16}, n - 1}) {
    GptDataset gpt(ds, L, /*shuffle=*/false, 99);
    ASSERT_EQ(gpt.num_windows(), (n - 1) / L) << "L " << L;
    std::vector<int32_t> out(L + 1);
    for (int64_t s = 0; s < 2 * gpt.num_windows(); ++s) {  // two epochs, both in file order
      const int64_t w = s % gpt.num_windows();
      EXPECT_EQ(gpt.window_of(s), w);
      gpt.get(s, out.data());
      ASSERT_TRUE(std::equal(out.begin(), out.end(), stream.begin() + w * L)) << "L " << L << " sample " << s;
    }
    // The last window ends inside the stream; one more would not fit.
    EXPECT_LE(gpt.num_windows() * L + 1, n);
    EXPECT_GT((gpt.num_windows() + 1) * L + 1, n);
  }
}

TEST_F(DataTest, TooFewTokensForOneWindow) {
  const std::string prefix = path("short");
  write_dataset(prefix, {{1, 2, 3, 256}}, IndexDType::u16);
  IndexedDataset ds = IndexedDataset::open(prefix, kVocab);
  EXPECT_EQ(GptDataset(ds, 3, false, 0).num_windows(), 1);  // exactly seq_len + 1 tokens
  expect_user_error([&] { GptDataset(ds, 4, false, 0); }, {prefix, "4 tokens", "seq_len 4", "seq_len + 1 = 5"});
}

// Tokens are checked once, at open; a file rewritten in place afterwards
// (same size, a token out of range) ends the job at the read that meets it,
// naming the file and the token, with exit 2 (not a failed check deeper down).
TEST_F(DataTest, ATokenRewrittenOutOfRangeAfterOpenEndsTheJobNamingTheFile) {
  const std::string prefix = path("rewritten");
  write_dataset(prefix, {{1, 2, 3, 256}, {4, 5, 256}}, IndexDType::u16);
  IndexedDataset ds = IndexedDataset::open(prefix, kVocab);
  std::vector<int32_t> out(7);
  ds.read_tokens(0, 7, out.data());
  EXPECT_EQ(out, (std::vector<int32_t>{1, 2, 3, 256, 4, 5, 256}));
  {
    std::fstream bin(prefix + ".bin", std::ios::in | std::ios::out | std::ios::binary);
    bin.seekp(5 * 2);  // token 5, a u16
    const uint16_t bad = 65535;
    bin.write(reinterpret_cast<const char*>(&bad), sizeof bad);
    ASSERT_TRUE(bin.good());
  }
  ds.read_tokens(0, 5, out.data());  // before the rewritten token: read as ever
  EXPECT_EXIT(ds.read_tokens(2, 4, out.data()), ::testing::ExitedWithCode(2),
              "rewritten.bin: token 5 is 65535, outside \\[0, " + std::to_string(kVocab) +
                  "\\), and every token was in range when the run opened the file: it was rewritten during the run");
}

TEST_F(DataTest, ShuffleIsSeededPermutationPerEpoch) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const Docs docs = random_docs(40, 100, kVocab);
  const std::string prefix = path("shuf");
  write_dataset(prefix, docs, IndexDType::u16);
  IndexedDataset ds = IndexedDataset::open(prefix, kVocab);
  const auto stream = concat(docs);
  const int64_t L = 8;
  const uint64_t seed = seed_;
  GptDataset a(ds, L, /*shuffle=*/true, seed);
  GptDataset b(ds, L, /*shuffle=*/true, seed);
  GptDataset other_seed(ds, L, /*shuffle=*/true, seed + 1);
  const int64_t W = a.num_windows();
  ASSERT_GT(W, 50);

  auto order = [&](const GptDataset& g, int64_t epoch) {
    std::vector<int64_t> o(W);
    for (int64_t i = 0; i < W; ++i) o[i] = g.window_of(epoch * W + i);
    return o;
  };
  std::vector<int64_t> identity(W);
  std::iota(identity.begin(), identity.end(), 0);
  const auto e0 = order(a, 0), e1 = order(a, 1);
  for (const auto& o : {e0, e1}) {
    auto sorted = o;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(sorted, identity) << "an epoch must visit every window exactly once";
  }
  EXPECT_NE(e0, identity);
  EXPECT_NE(e0, e1) << "epochs must be shuffled differently";
  EXPECT_EQ(order(b, 1), e1) << "same seed, same order (queried in a different epoch order)";
  EXPECT_EQ(order(b, 0), e0);
  EXPECT_NE(order(other_seed, 0), e0);
  EXPECT_EQ(e0, shuffled_order(W, seed, 0));

  std::vector<int32_t> out(L + 1);
  for (int64_t s = 0; s < 2 * W; s += 7) {
    a.get(s, out.data());
    const int64_t w = a.window_of(s);
    ASSERT_TRUE(std::equal(out.begin(), out.end(), stream.begin() + w * L)) << "sample " << s;
  }
}

// Pins the generator: a checkpoint's data position must name the same samples
// on every build and platform, so this order may never change silently. The
// values were cross-checked against an independent Python transcription of
// SplitMix64 + rejection sampling + Fisher-Yates.
TEST(Shuffle, GoldenOrder) {
  EXPECT_EQ(shuffled_order(10, 1234, 0), (std::vector<int64_t>{2, 8, 9, 6, 3, 4, 1, 5, 0, 7}));
  EXPECT_EQ(shuffled_order(10, 1234, 1), (std::vector<int64_t>{8, 0, 7, 6, 9, 1, 3, 4, 5, 2}));
}

// Fisher-Yates with unbiased bounds makes all n! orders equally likely:
// 24000 epochs over 4 windows give each of the 24 orders 1000 hits expected,
// sd ~31; [850, 1150] is a ±4.8 sd band.
TEST(Shuffle, OrdersAreUniform) {
  std::map<std::vector<int64_t>, int> counts;
  for (int64_t e = 0; e < 24000; ++e) ++counts[shuffled_order(4, 7, e)];
  ASSERT_EQ(counts.size(), 24u);
  for (const auto& [perm, c] : counts) {
    EXPECT_GE(c, 850);
    EXPECT_LE(c, 1150);
  }
}

// ---------------------------------------------------------------- batch rule

TEST(SampleIndex, GlobalBatchIsTheSameSetUnderEveryLayout) {
  for (int64_t B : {8, 16, 24}) {
    for (int64_t g : {0, 1, 5}) {
      std::vector<int64_t> expected(B);
      std::iota(expected.begin(), expected.end(), g * B);
      for (int64_t dp : {1, 2, 4, 8}) {
        for (int64_t mb : {1, 2, 3, 4, 8}) {
          if (B % (dp * mb) != 0) continue;
          std::vector<int64_t> got;
          for (int64_t a = 0; a < B / (dp * mb); ++a)
            for (int64_t r = 0; r < dp; ++r)
              for (int64_t i = 0; i < mb; ++i) got.push_back(sample_index(g, B, a, dp, r, mb, i));
          std::sort(got.begin(), got.end());
          EXPECT_EQ(got, expected) << "B " << B << " g " << g << " DP " << dp << " mb " << mb;
        }
      }
    }
  }
}

TEST(SampleIndex, Formula) {
  // DP=1, mb=B: row i of global batch g is sample g·B + i.
  for (int64_t i = 0; i < 8; ++i) EXPECT_EQ(sample_index(3, 8, 0, 1, 0, 8, i), 24 + i);
  // DP=2, mb=B/4: two accumulation steps; rank 1 at step 1 takes rows 6, 7.
  EXPECT_EQ(sample_index(0, 8, 1, 2, 1, 2, 0), 6);
  EXPECT_EQ(sample_index(0, 8, 1, 2, 1, 2, 1), 7);
  EXPECT_EQ(sample_index(2, 8, 0, 2, 1, 2, 0), 18);
  // A micro-batch is contiguous within a rank's step.
  EXPECT_EQ(sample_index(1, 16, 1, 2, 0, 4, 3) - sample_index(1, 16, 1, 2, 0, 4, 0), 3);
}

// ---------------------------------------------------------------- preprocess

std::vector<int32_t> byte_doc(const std::string& text) {
  std::vector<int32_t> d;
  for (unsigned char c : text) d.push_back(c);
  d.push_back(kEodToken);
  return d;
}

struct ProgressLog {
  std::vector<std::pair<int64_t, int64_t>> calls;
  std::function<void(int64_t, int64_t)> fn() {
    return [this](int64_t d, int64_t t) { calls.emplace_back(d, t); };
  }
  void check(int64_t total) const {
    ASSERT_FALSE(calls.empty());
    for (size_t i = 0; i < calls.size(); ++i) {
      EXPECT_EQ(calls[i].second, total);
      if (i > 0) {
        EXPECT_GE(calls[i].first, calls[i - 1].first);
      }
    }
    EXPECT_EQ(calls.back().first, total);
  }
};

PreprocessStats preprocess(const std::vector<std::string>& inputs, const std::string& prefix,
                           PreprocessOptions::Format format, ProgressLog* log = nullptr) {
  PreprocessOptions o;
  o.inputs = inputs;
  o.output_prefix = prefix;
  o.format = format;
  return run_preprocess(o, log ? log->fn() : nullptr);
}

void expect_sequences(const std::string& prefix, const std::vector<std::string>& texts) {
  IndexedDataset ds = IndexedDataset::open(prefix, kByteVocabSize);
  EXPECT_EQ(ds.dtype(), IndexDType::u16);
  ASSERT_EQ(ds.num_sequences(), static_cast<int64_t>(texts.size()));
  for (size_t i = 0; i < texts.size(); ++i) EXPECT_EQ(ds.sequence(i), byte_doc(texts[i])) << "document " << i;
}

TEST_F(DataTest, PreprocessText) {
  const std::string bin_text("bytes \x00\x01\xff\xc3\xa9\n", 12);
  write_bytes(path("a.txt"), "hello world\n");
  write_bytes(path("empty.txt"), "");
  write_bytes(path("b.txt"), bin_text);
  ProgressLog log;
  const auto stats = preprocess({path("a.txt"), path("empty.txt"), path("b.txt")}, path("text"),
                                PreprocessOptions::Format::text, &log);
  EXPECT_EQ(stats.documents, 2);
  EXPECT_EQ(stats.tokens, 12 + 1 + 12 + 1);
  EXPECT_EQ(stats.bytes, 24);
  EXPECT_EQ(stats.bin_path, path("text") + ".bin");
  EXPECT_EQ(stats.idx_path, path("text") + ".idx");
  log.check(24);
  expect_sequences(path("text"), {"hello world\n", bin_text});
}

// A text input is streamed in 1 MiB pieces: a document over several pieces,
// its last one partial, comes out whole and in order.
TEST_F(DataTest, PreprocessTextStreamsADocumentLargerThanItsPieces) {
  std::string text((3 << 20) + 17, '\0');
  for (char& c : text) c = static_cast<char>(std::uniform_int_distribution<int>(0, 255)(rng_));
  write_bytes(path("big.txt"), text);
  write_bytes(path("small.txt"), "after\n");
  ProgressLog log;
  const auto stats =
      preprocess({path("big.txt"), path("small.txt")}, path("big"), PreprocessOptions::Format::text, &log);
  EXPECT_EQ(stats.documents, 2);
  EXPECT_EQ(stats.tokens, static_cast<int64_t>(text.size()) + 1 + 6 + 1);
  log.check(static_cast<int64_t>(text.size()) + 6);
  expect_sequences(path("big"), {text, "after\n"});
}

// A text file is one document, and a document's size is an i32: a larger
// file is refused by its size, before any input is read (a sparse file, so
// the test writes nothing; the file before it is not read either: no
// progress was reported, which reading its 2 MiB would have been).
TEST_F(DataTest, PreprocessRefusesATextFileOverTheDocumentLimitUpFront) {
  {
    std::ofstream f(path("huge.txt"), std::ios::binary);
    ASSERT_TRUE(f.good());
  }
  fs::resize_file(path("huge.txt"), uint64_t{1} << 31);
  write_bytes(path("small.txt"), std::string(2 << 20, 'a'));
  ProgressLog log;
  expect_user_error(
      [&] { preprocess({path("small.txt"), path("huge.txt")}, path("o"), PreprocessOptions::Format::text, &log); },
      {path("huge.txt"), "byte offset 0", "a document of 2147483648 bytes", "2^31-1 tokens"});
  EXPECT_TRUE(log.calls.empty()) << "input was read before the size was checked";
  EXPECT_FALSE(fs::exists(path("o.bin")));
  EXPECT_FALSE(fs::exists(path("o.bin.tmp")));
}

// A document written in pieces equals the same tokens added at once.
TEST_F(DataTest, WriterDocumentInPiecesEqualsOneDocument) {
  const Docs docs = random_docs(6, 300, 1000);
  write_dataset(path("whole"), docs, IndexDType::u16);
  {
    IndexedDatasetWriter w(path("pieces"), IndexDType::u16);
    for (const auto& d : docs) {
      const std::span<const int32_t> all(d);
      const size_t cut = d.empty() ? 0 : std::uniform_int_distribution<size_t>(0, d.size())(rng_);
      w.append(all.first(cut));
      w.append(all.subspan(cut));
      w.end_document();
    }
    w.finalize();
  }
  for (const char* ext : {".bin", ".idx"}) {
    std::ifstream a(path("whole") + ext, std::ios::binary), b(path("pieces") + ext, std::ios::binary);
    const std::string whole((std::istreambuf_iterator<char>(a)), {}), pieces((std::istreambuf_iterator<char>(b)), {});
    EXPECT_EQ(whole, pieces) << ext;
  }
  // A token that does not fit is named by its index in the document, not in the piece.
  IndexedDatasetWriter w(path("bad"), IndexDType::u8);
  const std::vector<int32_t> ok(10, 7), bad{1, 300};
  w.append(ok);
  expect_user_error([&] { w.append(bad); }, {"document 0, token 11", "300"});
}

TEST_F(DataTest, PreprocessJsonl) {
  write_bytes(path("a.jsonl"),
              "{\"text\": \"first doc\", \"id\": 1}\n"
              "\n"
              "{\"text\": \"caf\\u00e9 \\\"q\\\"\\nline2\"}\r\n"
              "{\"text\": \"\"}\n"
              "{\"meta\": {\"x\": 1}, \"text\": \"last\"}");  // no final newline
  ProgressLog log;
  const auto stats = preprocess({path("a.jsonl")}, path("jl"), PreprocessOptions::Format::jsonl, &log);
  EXPECT_EQ(stats.documents, 3);
  log.check(stats.bytes);
  expect_sequences(path("jl"), {"first doc", "caf\xc3\xa9 \"q\"\nline2", "last"});
}

TEST_F(DataTest, PreprocessFortune) {
  write_bytes(path("f"), "one\n%\ntwo\n  indented\n%\n%\n\n%\nthree\n");
  const auto stats = preprocess({path("f"), path("f")}, path("fo"), PreprocessOptions::Format::fortune);
  EXPECT_EQ(stats.documents, 6);
  expect_sequences(path("fo"), {"one\n", "two\n  indented\n", "three\n", "one\n", "two\n  indented\n", "three\n"});
}

TEST_F(DataTest, PreprocessRealFortunesFile) {
  const std::string fortunes = "/usr/share/games/fortunes/fortunes";
  if (!fs::exists(fortunes)) GTEST_SKIP() << fortunes << " is not installed";
  ProgressLog log;
  const auto stats = preprocess({fortunes}, path("real"), PreprocessOptions::Format::fortune, &log);
  EXPECT_GT(stats.documents, 100);
  log.check(static_cast<int64_t>(fs::file_size(fortunes)));
  IndexedDataset ds = IndexedDataset::open(path("real"), kByteVocabSize);
  EXPECT_EQ(ds.num_sequences(), stats.documents);
  EXPECT_EQ(ds.num_tokens(), stats.tokens);
  // Each document is its bytes then exactly one EOD; no separator lines leak in.
  for (int64_t i = 0; i < ds.num_sequences(); ++i) {
    const auto seq = ds.sequence(i);
    ASSERT_GE(seq.size(), 2u);
    EXPECT_EQ(seq.back(), kEodToken);
    EXPECT_EQ(std::count(seq.begin(), seq.end(), kEodToken), 1);
    const std::string text(seq.begin(), seq.end() - 1);
    EXPECT_EQ(text.find("\n%\n"), std::string::npos);
    EXPECT_NE(text.substr(0, 2), "%\n");
  }
  // The whole file is usable as training data.
  GptDataset gpt(ds, 64, /*shuffle=*/true, 1);
  EXPECT_GT(gpt.num_windows(), 100);
}

TEST_F(DataTest, PreprocessBadJsonlLineIsNotJson) {
  write_bytes(path("bad.jsonl"), "{\"text\": \"ok\"}\n{\"text\": oops}\n");
  expect_user_error([&] { preprocess({path("bad.jsonl")}, path("o"), PreprocessOptions::Format::jsonl); },
                    {path("bad.jsonl"), "line 2", "byte offset 15", "not valid JSON",
                     "one JSON object per line with a string field \"text\""});
  EXPECT_FALSE(fs::exists(path("o.bin")));
  EXPECT_FALSE(fs::exists(path("o.idx")));
  EXPECT_FALSE(fs::exists(path("o.bin.tmp")));
}

TEST_F(DataTest, PreprocessBadJsonlLineNotObject) {
  write_bytes(path("arr.jsonl"), "[1, 2]\n");
  expect_user_error([&] { preprocess({path("arr.jsonl")}, path("o"), PreprocessOptions::Format::jsonl); },
                    {path("arr.jsonl"), "line 1", "byte offset 0", "expected a JSON object, got array"});
}

TEST_F(DataTest, PreprocessBadJsonlLineMissingText) {
  write_bytes(path("nt.jsonl"), "{\"text\": \"a\"}\n\n{\"body\": \"a\"}\n");
  expect_user_error([&] { preprocess({path("nt.jsonl")}, path("o"), PreprocessOptions::Format::jsonl); },
                    {path("nt.jsonl"), "line 3", "byte offset 15", "no field \"text\""});
}

TEST_F(DataTest, PreprocessBadJsonlLineTextNotString) {
  write_bytes(path("num.jsonl"), "{\"text\": 42}\n");
  expect_user_error([&] { preprocess({path("num.jsonl")}, path("o"), PreprocessOptions::Format::jsonl); },
                    {path("num.jsonl"), "line 1", "field \"text\" is a JSON number, not a string"});
}

TEST_F(DataTest, PreprocessMissingInput) {
  expect_user_error([&] { preprocess({path("nope.txt")}, path("o"), PreprocessOptions::Format::text); },
                    {path("nope.txt"), "existing, readable file"});
}

TEST_F(DataTest, PreprocessNoDocuments) {
  write_bytes(path("blank"), "%\n%\n");
  expect_user_error([&] { preprocess({path("blank")}, path("o"), PreprocessOptions::Format::fortune); },
                    {path("blank"), "no documents"});
  EXPECT_FALSE(fs::exists(path("o.bin")));
}

TEST(PreprocessFormat, Parse) {
  EXPECT_EQ(parse_preprocess_format("jsonl"), PreprocessOptions::Format::jsonl);
  expect_user_error([] { parse_preprocess_format("csv"); }, {"csv", "text, jsonl, fortune"});
}

}  // namespace

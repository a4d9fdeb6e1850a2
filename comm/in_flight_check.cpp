// The in-flight check (see in_flight_check.h).
#include "comm/in_flight_check.h"

#include <algorithm>
#include <cstring>

#include "kernels/allocator.h"
#include "kernels/check.h"

namespace origami::comm::detail {

namespace {

// Poison: a NaN for the floating types (a read shows in every sum it
// enters), a large negative value for integers (counts and ids are checked
// against negatives). A block of 4 KiB of it per type, filled and compared
// a block at a time (element by element it was most of the check's cost).
const std::vector<std::byte>& poison_block(ElemType type) {
  auto block = [](auto v) {
    std::vector<std::byte> b(4096);
    for (size_t at = 0; at < b.size(); at += sizeof v) std::memcpy(b.data() + at, &v, sizeof v);
    return b;
  };
  static const std::vector<std::byte> f32 = block(uint32_t{0xFFA5A5A5u}), f64 = block(uint64_t{0xFFF5A5A5A5A5A5A5ull}),
                                      bf16 = block(uint16_t{0xFFA5u}), i32 = block(uint32_t{0xA5A5A5A5u}),
                                      i64 = block(uint64_t{0xA5A5A5A5A5A5A5A5ull});
  switch (type) {
    case ElemType::f32: return f32;
    case ElemType::f64: return f64;
    case ElemType::bf16: return bf16;
    case ElemType::i32: return i32;
    case ElemType::i64: return i64;
  }
  return f32;
}

class CheckedOp final : public PendingOp {
 public:
  CheckedOp(std::unique_ptr<InFlightCheck> check, std::unique_ptr<PendingOp> op)
      : check_(std::move(check)), op_(std::move(op)) {}
  bool test() override {
    if (done_) return true;
    if (!op_->test()) return false;
    check_->finish();
    done_ = true;
    return true;
  }
  void abort_backend() override { op_->abort_backend(); }
  // The caller's buffers receive the results when the host sees the op
  // complete, so the host waits (no stream holds it: the memory is host memory).
  bool enqueue_wait(void*) override { return false; }
  double exposed_seconds(double host_wait_s) override { return op_->exposed_seconds(host_wait_s); }
  void launched() override {
    op_->group = group;
    op_->op = op;
    op_->seq = seq;
    op_->bytes = bytes;
    op_->memory = memory;
    op_->timeout_s = timeout_s;
    op_->launched();
  }

 private:
  std::unique_ptr<InFlightCheck> check_;
  std::unique_ptr<PendingOp> op_;
  bool done_ = false;
};

}  // namespace

InFlightCheck::InFlightCheck(const InFlightRegions& regions, ElemType type, std::string what)
    : regions_(regions), type_(type), what_(std::move(what)) {
  if (regions_.read_bytes == 0) regions_.read = nullptr;
  if (regions_.write_bytes == 0) regions_.write = nullptr;
  const std::byte* r0 = regions_.read;
  const std::byte* r1 = r0 ? r0 + regions_.read_bytes : nullptr;
  const std::byte* w0 = regions_.write;
  const std::byte* w1 = w0 ? w0 + regions_.write_bytes : nullptr;
  auto stage = [&](const std::byte* begin, const std::byte* end) {
    Stage s{begin, static_cast<size_t>(end - begin), {}};
    s.copy.assign(begin, end);
    stages_.push_back(std::move(s));
  };
  // Overlapping regions share one copy, so that offsets between them (an
  // in-place call's) hold in the copy too.
  if (r0 && w0 && r0 < w1 && w0 < r1) {
    stage(std::min(r0, w0), std::max(r1, w1));
  } else {
    if (r0) stage(r0, r1);
    if (w0) stage(w0, w1);
  }
  if (w0) {
    ORIGAMI_CHECK(regions_.write_bytes % elem_size(type_) == 0, what_, ": a receive region of ",
                  regions_.write_bytes, " bytes is not whole elements");
    const std::vector<std::byte>& p = poison_block(type_);
    for (size_t at = 0; at < regions_.write_bytes; at += p.size())
      std::memcpy(regions_.write + at, p.data(), std::min(p.size(), regions_.write_bytes - at));
  }
  for (const Stage& s : stages_) holds_.push_back(TrackedAllocator::host().hold(s.user, s.bytes, what_));
}

InFlightCheck::~InFlightCheck() { release_holds(); }

void InFlightCheck::release_holds() {
  for (int64_t id : holds_) TrackedAllocator::host().unhold(id);
  holds_.clear();
}

const InFlightCheck::Stage* InFlightCheck::stage_of(const void* p) const {
  const auto* b = static_cast<const std::byte*>(p);
  for (const Stage& s : stages_)
    if (b >= s.user && b < s.user + s.bytes) return &s;
  return nullptr;
}

void* InFlightCheck::staged(const void* p) const {
  const Stage* s = stage_of(p);
  if (!s) return const_cast<void*>(p);
  return const_cast<std::byte*>(s->copy.data()) + (static_cast<const std::byte*>(p) - s->user);
}

void InFlightCheck::check_unchanged(const std::byte* begin, const std::byte* end) const {
  if (begin >= end) return;
  const auto* copy = static_cast<const std::byte*>(staged(begin));
  if (std::memcmp(begin, copy, static_cast<size_t>(end - begin)) == 0) return;
  size_t at = 0;
  while (begin[at] == copy[at]) ++at;
  const size_t es = elem_size(type_);
  ORIGAMI_CHECK(false, what_, ": its send buffer was written while the op was in flight (", elem_name(type_),
                " element ", (begin + at - regions_.read) / es, " of ", regions_.read_bytes / es,
                " changed): write a buffer an op reads only after its wait (Communicator::complete)");
}

void InFlightCheck::finish() {
  if (finished_) return;
  finished_ = true;
  const std::byte* r0 = regions_.read;
  const std::byte* r1 = r0 ? r0 + regions_.read_bytes : nullptr;
  const std::byte* w0 = regions_.write;
  const std::byte* w1 = w0 ? w0 + regions_.write_bytes : nullptr;
  // Read bytes outside the written ones must be as the launch found them.
  if (r0 && w0) {
    check_unchanged(r0, std::min(r1, w0));
    check_unchanged(std::max(r0, w1), r1);
  } else if (r0) {
    check_unchanged(r0, r1);
  }
  if (w0) {
    const std::vector<std::byte>& p = poison_block(type_);
    for (size_t at = 0; at < regions_.write_bytes; at += p.size()) {
      const size_t n = std::min(p.size(), regions_.write_bytes - at);
      if (std::memcmp(w0 + at, p.data(), n) == 0) continue;
      size_t e = at;  // the first element written
      while (std::memcmp(w0 + e, p.data(), elem_size(type_)) == 0) e += elem_size(type_);
      ORIGAMI_CHECK(false, what_, ": its receive buffer was written while the op was in flight (", elem_name(type_),
                    " element ", e / elem_size(type_), " of ", regions_.write_bytes / elem_size(type_),
                    "): write a buffer an op fills only after its wait (Communicator::complete)");
    }
    std::memcpy(regions_.write, staged(w0), regions_.write_bytes);
  }
  release_holds();
}

std::unique_ptr<PendingOp> InFlightCheck::wrap(std::unique_ptr<InFlightCheck> check, std::unique_ptr<PendingOp> op) {
  return std::make_unique<CheckedOp>(std::move(check), std::move(op));
}

}  // namespace origami::comm::detail

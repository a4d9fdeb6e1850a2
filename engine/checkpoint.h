// Sharded checkpoints (ARCHITECTURE.md §8): save what each rank owns, load
// into any layout.
//
// On disk, under checkpoint.dir:
//   step-00001000/                 a complete checkpoint (written as
//                                  step-00001000.tmp/, renamed when complete)
//     rank-00003-model.safetensors what world rank 3 stores of the params
//                                  (and, on each stage's first rank, the MoE
//                                  expert bias)
//     rank-00003-optim.safetensors the same pieces of the AdamW moments,
//                                  keys <name>.exp_avg and <name>.exp_avg_sq
//     metadata.json                written last by rank 0
//   latest                         "step-00001000\n", replaced by rename
// Which pieces a rank stores is engine/checkpoint_shards.h (from the unit
// table). A file's tensors are 1-D runs of their slice; its
// __metadata__["DCP_SHARDING_INFO"] (PyTorch DCP's key) maps each to its
// global_shape, saved_offsets and slice_shape (the rectangular slice of the
// global tensor) and flat_range (the row-major element range of that slice),
// so an outside reader can reassemble every tensor from the files alone.
// metadata.json holds the step, the saving layout and config, the training
// state (optimizer steps, LR, consumed samples and the sampler's epoch and
// offset, the seed: training draws no other random numbers), every file with
// its size and XXH3-64 digest, and every tensor's global shape and shards.
//
// Invariants: a directory without the .tmp suffix is complete (every rank's
// files synced, then metadata.json synced, then the rename); `latest` only
// ever names a complete one; nothing is gathered: each rank writes and reads
// only its own pieces.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/agreement.h"
#include "comm/communicator.h"
#include "comm/groups.h"
#include "engine/config.h"
#include "engine/checkpoint_shards.h"
#include "engine/model.h"
#include "engine/safetensors.h"
#include "engine/units.h"

namespace origami {

// The wait of the meetings where ranks wait on each other's file I/O
// (saves, loads, init_from_hf, the export): runtime.io_timeout_s.
inline comm::MeetingWait io_meeting_wait(const Config& cfg) {
  return {cfg.runtime.io_timeout_s, "runtime.io_timeout_s"};
}

// Training state beside the tensors.
struct TrainState {
  int64_t step = 0;              // optimizer steps taken (the LR schedule's position)
  double lr = 0;                 // the last step's LR (shown by inspect)
  int64_t consumed_samples = 0;  // samples of every global batch so far
  int64_t windows_per_epoch = 0;  // the sampler's epoch length: epoch = consumed / windows
  uint64_t seed = 0;             // data order and init: counter-based, no stream state
  bool shuffle = true;
  std::string config;            // loaded only: the saving run's canonical config (metadata.json)
};

struct CheckpointSaveStats {
  std::string dir;           // the step directory
  bool background = false;   // checkpoint.async: written on a thread
  int64_t rank_bytes = 0;    // this rank's files (a background save's start: its tensors' bytes)
  int64_t max_rank_bytes = 0, total_bytes = 0;  // every rank's files (a background save: 0 until complete)
  double seconds = 0;        // how long the save blocked training on this rank
  double written_s = 0;      // start to complete (a background save: known at completion)
  // Host memory the save held at its peak on this rank (measured on the
  // host ledger): a background save's copy of the rank's whole state; a
  // synchronous save of device state one tensor at a time; 0 for a
  // synchronous save of host state, written in place.
  int64_t host_staged_bytes = 0;
};

std::string step_dir_name(int64_t step);  // "step-00001000", "step-123456789"
// The step a step directory's name holds; -1 for any name step_dir_name
// does not write (one spelling per step: no extra leading zeros).
int64_t step_of(const std::string& name);

// Writes checkpoints into `dir`, keeping the newest `keep` complete ones (0:
// all). Every call is collective over `world` (every rank of the job).
// A save writes step-N.tmp/ (rank 0 creates it; each rank writes and syncs
// its two files), then completes: the ranks' digests are gathered, rank 0
// writes and syncs metadata.json, renames the directory, replaces `latest`
// and prunes. Synchronous (background = false): save() does all of it.
// Background (checkpoint.async): save() only copies the rank's pieces (the
// time training is blocked) and a thread writes them; poll(), called once
// per step, completes the save at the first step boundary where every rank's
// thread is done; the next save() and wait() complete it first. A failure of
// the writing on any rank is a JobError on every rank at completion, and
// `latest` still names the previous checkpoint.
class CheckpointWriter {
 public:
  // io_wait bounds the meetings where ranks wait for each other's writes
  // (io_meeting_wait).
  CheckpointWriter(std::string dir, int64_t keep, bool background, comm::MeetingWait io_wait);
  ~CheckpointWriter();  // joins a running thread; a save never completed stays a .tmp
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  CheckpointSaveStats save(const Config& cfg, const Model& model, const TrainState& state, const comm::Groups& groups,
                           comm::Communicator& world);
  // The stats of a background save completed now, if one was.
  std::optional<CheckpointSaveStats> poll(comm::Communicator& world);
  std::optional<CheckpointSaveStats> wait(comm::Communicator& world);
  bool pending() const { return pending_ != nullptr; }

 private:
  struct Pending;
  std::string dir_;
  int64_t keep_ = 0;
  bool background_ = false;
  comm::MeetingWait io_wait_;
  std::unique_ptr<Pending> pending_;
};

// checkpoint.load resolved: nullopt to start fresh ("" , or "latest" with no
// `latest` file in checkpoint.dir); else a step directory (as given, or
// under checkpoint.dir). UserError when a named directory is missing.
std::optional<std::string> resolve_load(const CheckpointConfig& ck);

// Removes <dir>/*.tmp: saves a killed job left behind (rank 0, at start).
void remove_partial_checkpoints(const std::string& dir);

// Collective over `world`: verifies every file's size and digest (each file
// by one rank), then reads this rank's parameters (as its ZeRO stage holds
// them), moments and expert bias from the byte ranges that hold them.
// UserError naming the file and key for a checkpoint that disagrees with
// the config's model shape, a missing or truncated file, a digest mismatch,
// or a missing metadata.json.
TrainState load_checkpoint(const std::string& step_dir, const Config& cfg, Model& model, const comm::Groups& groups,
                           comm::Communicator& world);

// One saved shard: world rank `rank` stored `range` of the tensor.
struct SavedShard {
  int rank = 0;
  int64_t slice_dim = -1, slice_start = 0;
  Shape slice_shape;
  int64_t begin = 0, end = 0;
};
struct SavedTensor {
  Shape global_shape;
  bool state = false;  // not a parameter (expert bias): no moments
  std::vector<SavedShard> shards;
};
struct SavedFile {
  std::string name;
  int64_t bytes = 0;
  uint64_t xxh3 = 0;
  int rank = 0;
};

// metadata.json of a step directory, validated (UserError naming the file
// and key).
struct CheckpointInfo {
  std::string dir;
  int64_t step = 0;
  std::string save_id;            // the save's 64 random bits, hex ("" in a save without one)
  uint64_t metadata_xxh3 = 0;     // of metadata.json's bytes: which lists every file's digest
  int64_t world = 1, tp = 1, cp = 1, pp = 1, ep = 1, etp = 1, dp = 1, edp = 1, zero_stage = 0;
  std::string order;
  std::vector<int64_t> stage_layers;
  std::map<std::string, int64_t> model;  // the shape keys: "model.hidden_size" -> 256
  TrainState train;
  std::string config;  // canonical_text of the saving run
  std::vector<SavedFile> files;
  std::map<std::string, SavedTensor> tensors;  // by name
  std::vector<std::string> order_of_tensors;   // as saved: the unit table's order
};
CheckpointInfo read_checkpoint_info(const std::string& step_dir);
// Recomputes every file's size and digest; UserError for the first mismatch.
void verify_checkpoint_files(const CheckpointInfo& info, int rank = 0, int ranks = 1);
// Every file present at the size metadata.json records (a stat each; the
// digests are verify_checkpoint_files's); UserError for the first that is not.
void check_checkpoint_file_sizes(const CheckpointInfo& info);

// Reads saved tensors by element range, each file mapped once (its size
// checked against metadata.json before its header is read).
class CheckpointReader {
 public:
  explicit CheckpointReader(const CheckpointInfo& info);
  ~CheckpointReader();
  // Fills `dst` (the data of `dst_range` of tensor `name`) from the shards;
  // moment: "" for the parameter (or state tensor), "exp_avg", "exp_avg_sq".
  // UserError naming metadata.json and the tensor when the checkpoint lacks
  // it, its global shape differs, or its shards do not cover dst_range.
  void read(const std::string& name, const std::string& moment, const SliceRange& dst_range, float* dst);

 private:
  const SafetensorsFile& file(int rank, bool optim);
  const CheckpointInfo& info_;
  std::map<std::pair<int, bool>, std::unique_ptr<SafetensorsFile>> files_;
};

// Fills what this rank holds — its parameters as its ZeRO stage holds them
// and, with_moments, the AdamW moments; the MoE expert biases — calling
// read(name, moment, range, dst) for each tensor piece (moment "" for the
// parameter). The one walk over a rank's state that loading checkpoints and
// Hugging Face weights share.
using ReadFn = std::function<void(const std::string& name, const std::string& moment, const SliceRange& range,
                                  float* dst)>;
void fill_held_state(Model& model, const comm::Groups& groups, bool with_moments, const ReadFn& read);

// checkpoint.init_from_hf: initial weights from a consolidated Hugging Face
// directory — model.safetensors, or HF's shards model-0000i-of-0000n.safetensors
// with model.safetensors.index.json — into any layout. Collective over
// `world`; each rank maps the files and copies only its own slices. Tensor
// names and global shapes must be the config's (UserError naming the file and
// tensor); the moments start at zero.
void load_hf_init(const std::string& dir, const Config& cfg, Model& model, const comm::Groups& groups,
                  comm::Communicator& world);

// `origami export --checkpoint`: the checkpoint's model consolidated into
// <out_dir>/model.safetensors + config.json (the layout of export_hf, the
// same bytes as the saving run's own export), read and written one tensor at
// a time so memory stays near the largest tensor. with_optimizer: also
// <out_dir>/optimizer.safetensors, each parameter's <name>.exp_avg and
// <name>.exp_avg_sq. Every file's digest is verified first.
void export_checkpoint(const std::string& step_dir, const std::string& out_dir, bool with_optimizer);
// The config that wrote the checkpoint (its metadata.json copy).
Config checkpoint_config(const CheckpointInfo& info);

}  // namespace origami

// Consolidated Hugging Face files and checkpoints (see checkpoint.h):
// exporting a checkpoint (no model, no ranks: the shards of each tensor are
// read into one buffer of its global shape and written, then the next), and
// initial weights from a consolidated file into any layout.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "comm/agreement.h"

#include "engine/checkpoint.h"
#include "engine/export.h"
#include "engine/files.h"
#include "engine/preflight.h"

namespace origami {

Config checkpoint_config(const CheckpointInfo& info) {
  return parse_config(info.config, info.dir + "/metadata.json (config)");
}

void export_checkpoint(const std::string& step_dir, const std::string& out_dir, bool with_optimizer) {
  const CheckpointInfo info = read_checkpoint_info(step_dir);
  verify_checkpoint_files(info);
  const Config cfg = checkpoint_config(info);
  const UnitTable table(cfg.model, cfg.moe);
  const std::vector<std::string> names = export_tensor_order(table, cfg.model, cfg.moe);
  check_writable_dir(out_dir, "--out");  // created if need be; its errors name the option
  // A failed export (a full disk) leaves the previous one whole (files.h).
  // Without --optimizer, an earlier export's moments are removed: they
  // would sit beside other weights with nothing to tell them apart. So is
  // an HF index: its shards' weights are what this file replaces.
  std::vector<std::string> destinations = {out_dir + "/model.safetensors", out_dir + "/config.json"};
  const std::string optimizer = out_dir + "/optimizer.safetensors";
  if (with_optimizer) destinations.push_back(optimizer);
  std::vector<std::string> stale = {out_dir + "/model.safetensors.index.json"};  // its shards are replaced
  if (!with_optimizer) stale.push_back(optimizer);
  ReplacedFiles files(destinations, stale);
  CheckpointReader reader(info);
  auto write = [&](const std::string& path, const std::vector<std::string>& moments) {
    std::vector<std::pair<std::string, Shape>> entries;
    std::vector<std::pair<std::string, std::string>> order;  // (tensor, moment)
    for (const std::string& name : names) {
      const auto it = info.tensors.find(name);
      if (it == info.tensors.end())
        ORIGAMI_USER_ERROR(step_dir, "/metadata.json: has no tensor '", name, "', which its own config's model has");
      for (const std::string& m : moments) {
        if (!m.empty() && it->second.state) continue;  // the expert bias has no moments
        entries.emplace_back(m.empty() ? name : name + "." + m, it->second.global_shape);
        order.emplace_back(name, m);
      }
    }
    SafetensorsWriter out(path, entries);
    for (size_t i = 0; i < order.size(); ++i) {
      Tensor t = Tensor::empty(entries[i].second, DType::f32, MemCategory::workspace);
      reader.read(order[i].first, order[i].second, whole_range(entries[i].second), t.f32());
      out.write_next(t.f32(), t.numel());
    }
    out.finish();
  };
  write(files.tmp(0), {""});
  if (with_optimizer) write(files.tmp(2), {"exp_avg", "exp_avg_sq"});
  OutputFile config(files.tmp(1), OutputFile::Mode::truncate);
  config.write(hf_config(cfg.model, cfg.moe).dump(2) + "\n");
  config.sync();
  config.close();
  files.commit();
}


void load_hf_init(const std::string& dir, const Config& cfg, Model& model, const comm::Groups& groups,
                  comm::Communicator& world) {
  HfFiles hf;
  std::string identity;
  comm::run_agreed(world, [&] {
    try {
      hf = open_hf_dir(dir);
    } catch (const UserError& e) {
      ORIGAMI_USER_ERROR(cfg.origin("checkpoint.init_from_hf"), ": checkpoint.init_from_hf: ", e.what());
    }
    identity = hf.identity();
    // Training may change the model's settings from the weights' (a longer
    // context's rope_theta): said, not refused as eval refuses it. Every
    // rank reads the file, so a malformed one fails alike.
    if (std::filesystem::exists(dir + "/config.json")) {
      const std::vector<std::string> differences = config_differences(cfg, dir, /*present_only=*/true);
      if (world.rank() == 0)
        for (const std::string& d : differences)
          std::fprintf(stderr, "origami: warning: checkpoint.init_from_hf: %s: training starts from these weights "
                       "under the config's setting\n", d.c_str());
    }
  }, io_meeting_wait(cfg));
  // Each rank opened the directory on its own file system view: copies per
  // node are fine, other weights are not (each rank would start its shards
  // from another model).
  check_same_lines(world, identity,
                   "the ranks of this job read different weights through checkpoint.init_from_hf (rule: one set of "
                   "weights for every rank: a path every node mounts, or identical copies; a relative path "
                   "resolves against each rank's working directory)");
  comm::run_agreed(world, [&] {
    const std::vector<std::string> wanted = export_tensor_order(model.units(), cfg.model, cfg.moe);
    const std::set<std::string> known(wanted.begin(), wanted.end());
    for (const auto& [tensor, file] : hf.by_tensor)
      if (!known.count(tensor))
        ORIGAMI_USER_ERROR(file->path(), ": tensor '", tensor, "' is not in the configured model (checkpoint.init_from_hf",
                           " must hold the model the config describes)");
    fill_held_state(model, groups, /*with_moments=*/false,
                    [&](const std::string& name, const std::string&, const SliceRange& range, float* dst) {
                      const auto it = hf.by_tensor.find(name);
                      if (it == hf.by_tensor.end())
                        ORIGAMI_USER_ERROR(dir, ": no file holds tensor '", name, "' (checkpoint.init_from_hf)");
                      const SafetensorsFile::Entry& e = it->second->entry(name);
                      if (e.shape != range.global_shape())
                        ORIGAMI_USER_ERROR(it->second->path(), ": tensor '", name, "' has shape ", shape_string(e.shape),
                                           ", the config needs ", shape_string(range.global_shape()));
                      copy_overlap(whole_range(e.shape), reinterpret_cast<const float*>(it->second->data(e)), range, dst);
                      for (int64_t i = 0; i < range.numel(); ++i)
                        if (!std::isfinite(dst[i]))
                          ORIGAMI_USER_ERROR(it->second->path(), ": tensor '", name, "' holds ", dst[i],
                                             " (rule: weights are finite numbers)");
                    });
  }, io_meeting_wait(cfg));
}

}  // namespace origami

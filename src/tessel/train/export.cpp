#include "tessel/train/export.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <vector>

#include "tessel/core/error.hpp"
#include "tessel/core/file_io.hpp"
#include "tessel/data/tokenizer.hpp"
#include "tessel/model/gpt.hpp"
#include "tessel/train/run_model.hpp"

namespace fs = std::filesystem;

namespace tessel::train {

namespace {

// Refuses an existing `out_dir` that holds anything but an earlier export's files (a run's or
// a data set's directory is no output); once it passed, removes what an export killed
// mid-write left there (`<file>.tmp.<pid>`).
void check_export_directory(const std::string& out_dir) {
  if (!fs::is_directory(out_dir)) return;
  std::vector<fs::path> leftovers;
  for (const auto& entry : fs::directory_iterator(out_dir)) {
    const std::string name = entry.path().filename().string();
    const std::optional<std::string> target = temporary_file_target(name);
    const std::string file = target.value_or(name);
    const bool ours = file == "tokenizer" ? entry.is_directory()
                                          : (file == kExportModelFile || file == "config.toml") &&
                                                entry.is_regular_file();
    if (!ours)
      input_error("export: ", out_dir, " holds ", name,
                  ", which is not what an export writes; export into a new or empty directory "
                  "(or over an earlier export)");
    if (target) leftovers.push_back(entry.path());
  }
  for (const fs::path& leftover : leftovers) fs::remove_all(leftover);
}

}  // namespace

ExportResult export_checkpoint(const std::string& checkpoint, const std::string& out_dir) {
  check_export_directory(out_dir);
  ExportResult r;
  auto loaded = load_trained_checkpoint(checkpoint);
  r.checkpoint = loaded.dir;
  CheckpointContent& content = loaded.content;
  // The model's registry order, whatever layout (dp, ep, pp) wrote the checkpoint.
  const Config config = checkpoint_config(loaded);
  std::map<std::string, size_t> position;
  const model::Gpt registry(config.model, 0, {}, model::BlockRange{0, 0, false, false});
  for (const std::string& name : registry.registry_names()) position.emplace(name, position.size());
  auto rank = [&](const NamedTensor& t) {
    const auto it = position.find(t.name);
    return it == position.end() ? position.size() : it->second;
  };
  std::stable_sort(content.model.begin(), content.model.end(),
                   [&](const NamedTensor& a, const NamedTensor& b) { return rank(a) < rank(b); });
  r.step = content.step;
  r.tensors = int64_t(content.model.size());
  // The model's ids mean nothing without their tokenizer: the run's copy goes along, checked
  // before anything is written, so that a bad copy leaves an earlier export whole.
  const std::string tokenizer = checkpoint_tokenizer_dir(loaded.dir);
  r.tokenizer = !tokenizer.empty() && data::tokenizer_name(tokenizer).has_value();
  if (r.tokenizer) data::load_tokenizer(tokenizer, config.model.vocab);
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (!fs::is_directory(out_dir)) input_error(out_dir, ": cannot create: ", ec.message());
  const std::string path = out_dir + "/" + kExportModelFile;
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  write_safetensors(tmp, content.model, {{"format", "pt"}, {"step", std::to_string(r.step)}});
  fsync_path(tmp);
  fs::rename(tmp, path, ec);
  if (ec) {
    const std::string reason = ec.message();
    fs::remove(tmp, ec);
    input_error(path, ": cannot put the export in place: ", reason);
  }
  fsync_path(out_dir);
  write_file_atomically(out_dir + "/config.toml", content.state.at("config").get<std::string>());
  if (r.tokenizer)
    data::save_tokenizer(tokenizer, out_dir + "/tokenizer");
  else
    fs::remove_all(out_dir + "/tokenizer");  // an earlier export's would speak for this model
  r.bytes = fs::file_size(path);
  return r;
}

}  // namespace tessel::train

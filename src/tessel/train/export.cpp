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
#include "tessel/train/safetensors.hpp"

namespace fs = std::filesystem;

namespace tessel::train {

namespace {

[[noreturn]] void refuse_output(const fs::path& path, const std::string& why) {
  input_error("export: ", path.string(), " is not what an export writes", why,
              "; export into a new or empty directory (or over an earlier export)");
}

// Refuses an export's tokenizer/ (or the staging copy of a killed export, `staging`, whose own
// atomic writes may have left temporary files) holding anything save_tokenizer does not write.
void check_exported_tokenizer(const fs::path& dir, bool staging) {
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    const std::string file = staging ? temporary_file_target(name).value_or(name) : name;
    if (!data::is_saved_tokenizer_file(file)) refuse_output(entry.path(), "");
    if (!entry.is_regular_file()) refuse_output(entry.path(), " (not a file)");
  }
}

// Refuses an existing `out_dir` that is not an earlier export (a run's or a data set's
// directory, or one holding a user's files under an export's names), looking into every file
// it would replace, before anything is written or removed; once it passed, removes what an
// export killed mid-write left there (`<file>.tmp.<pid>`).
void check_export_directory(const std::string& out_dir) {
  if (!fs::is_directory(out_dir)) return;
  const fs::path model = fs::path(out_dir) / kExportModelFile;
  std::vector<fs::path> leftovers;
  for (const auto& entry : fs::directory_iterator(out_dir)) {
    const std::string name = entry.path().filename().string();
    const std::optional<std::string> target = temporary_file_target(name);
    const std::string file = target.value_or(name);
    if (file == "tokenizer") {
      if (!entry.is_directory()) refuse_output(entry.path(), " (not a directory)");
      check_exported_tokenizer(entry.path(), target.has_value());
    } else if (file == kExportModelFile || file == "config.toml") {
      if (!entry.is_regular_file()) refuse_output(entry.path(), " (not a file)");
    } else {
      refuse_output(entry.path(), "");
    }
    if (target) leftovers.push_back(entry.path());
    // An export writes model.safetensors first: its config and tokenizer never stand alone.
    else if (file != kExportModelFile && !fs::exists(model))
      refuse_output(entry.path(), detail::concat(" (no ", kExportModelFile, " beside it)"));
  }
  if (fs::exists(model)) {
    // A file an export wrote, not one of that name: read its header only.
    std::map<std::string, std::string> metadata;
    try {
      metadata = read_safetensors_metadata(model.string());
    } catch (const InputError&) {  // no safetensors file: refused below
    }
    if (metadata["format"] != "pt" || !metadata.contains("step"))
      refuse_output(model, " (no safetensors header with an export's format and step metadata)");
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
  // The model's ids mean nothing without their tokenizer: the one generate decodes with goes
  // along, checked before anything is written, so that a bad copy leaves an earlier export whole.
  // Its absence is refused as generate refuses it (a run on shards without one has none).
  const std::string tokenizer =
      model_tokenizer(loaded.dir, config,
                      content.state.value("compatibility", nlohmann::json::object()), "export", "")
          .dir;
  r.tokenizer = data::tokenizer_name(tokenizer).has_value();
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

#include "tessel/train/checkpoint.hpp"

#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "tessel/core/error.hpp"
#include "tessel/core/file_io.hpp"

namespace fs = std::filesystem;

namespace tessel::train {

namespace {

constexpr const char* kManifest = "manifest.json";
constexpr int kFormatVersion = 1;

std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  if (!in) input_error(path.string(), ": cannot open");
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    input_error(path.string(), ": corrupt JSON (", e.what(), ")");
  }
}

bool is_complete(const fs::path& dir) {
  return fs::is_directory(dir) && fs::exists(dir / kManifest) && dir.extension() != ".incomplete";
}

// Complete checkpoint directories, oldest first (names sort by step).
std::vector<fs::path> complete_checkpoints(const fs::path& root) {
  std::vector<fs::path> dirs;
  if (!fs::is_directory(root)) return dirs;
  for (const auto& e : fs::directory_iterator(root)) {
    auto name = e.path().filename().string();
    if (name.rfind("step-", 0) == 0 && is_complete(e.path())) dirs.push_back(e.path());
  }
  std::sort(dirs.begin(), dirs.end());
  return dirs;
}

// Collective: throws on every rank when any rank's `failure` is set, so no rank is left
// waiting for a peer that gave up.
void agree(comm::Communicator& group, const std::string& failure, const fs::path& dir,
           const char* elsewhere) {
  if (comm::all_agree(group, failure.empty())) return;
  if (group.rank() == 0) fs::remove_all(fs::path(dir.string() + ".incomplete"));
  input_error("checkpoint ", dir.string(), " not saved: ", failure.empty() ? elsewhere : failure);
}

}  // namespace

uint32_t file_crc32(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) input_error(path, ": cannot open");
  std::vector<char> buf(1 << 20);
  uLong crc = crc32(0L, Z_NULL, 0);
  while (in) {
    in.read(buf.data(), std::streamsize(buf.size()));
    std::streamsize got = in.gcount();
    if (got > 0) crc = crc32(crc, reinterpret_cast<const Bytef*>(buf.data()), uInt(got));
  }
  return uint32_t(crc);
}

void restore_tensor(const std::vector<NamedTensor>& from, const std::string& name, Tensor to,
                    const std::string& source) {
  for (const auto& nt : from)
    if (nt.name == name) {
      if (nt.tensor.shape() != to.shape() || nt.tensor.dtype() != to.dtype())
        input_error(source, ": tensor '", name, "' is ", dtype_name(nt.tensor.dtype()), " ",
                    shape_str(nt.tensor.shape()), ", expected ", dtype_name(to.dtype()), " ",
                    shape_str(to.shape()));
      std::memcpy(to.raw(), nt.tensor.raw(), to.bytes());
      return;
    }
  input_error(source, ": tensor '", name, "' missing from the checkpoint");
}

CheckpointStore::CheckpointStore(std::string root, int64_t keep)
    : root_(std::move(root)), keep_(keep) {
  TESSEL_CHECK(keep_ >= 2, "keep_checkpoints must be >= 2");
}

void CheckpointStore::save(comm::Communicator& group, const CheckpointContent& content) {
  fs::path root(root_);
  fs::path final_dir = root / step_name(content.step);
  fs::path tmp_dir = root / (step_name(content.step) + ".incomplete");
  const std::pair<const char*, const std::vector<NamedTensor>*> files[] = {
      {"model.safetensors", &content.model}, {"optimizer.safetensors", &content.optimizer}};
  // Phase one: rank 0 writes the tensor files (durably); every rank reports success.
  std::string failure;
  if (group.rank() == 0) {
    try {
      fs::create_directories(root);
      fs::remove_all(tmp_dir);
      fs::create_directories(tmp_dir);
      for (const auto& [name, tensors] : files) {
        write_safetensors((tmp_dir / name).string(), *tensors);
        fsync_path((tmp_dir / name).string());
      }
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  agree(group, failure, final_dir, "another rank failed to write its part");
  // Phase two: the manifest (written last) makes the directory a checkpoint; the rename
  // publishes it and `latest` points at it. Each step is durable before the next.
  if (group.rank() == 0) {
    try {
      nlohmann::json manifest;
      manifest["format"] = "tessel-checkpoint";
      manifest["version"] = kFormatVersion;
      manifest["step"] = content.step;
      manifest["state"] = content.state;
      for (const auto& [name, tensors] : files) {
        fs::path p = tmp_dir / name;
        manifest["files"].push_back(
            {{"name", name}, {"bytes", fs::file_size(p)}, {"crc32", file_crc32(p.string())}});
      }
      write_file_atomically((tmp_dir / kManifest).string(), manifest.dump(2));
      fs::remove_all(final_dir);
      fs::rename(tmp_dir, final_dir);
      fsync_path(root.string());
      write_file_atomically((root / "latest").string(), step_name(content.step) + "\n");
      auto dirs = complete_checkpoints(root);
      for (size_t i = 0; i + size_t(keep_) < dirs.size(); ++i) fs::remove_all(dirs[i]);
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  agree(group, failure, final_dir, "rank 0 failed to commit it");
}

std::optional<std::string> CheckpointStore::latest() const {
  fs::path root(root_);
  std::ifstream in(root / "latest");
  std::string name;
  if (in >> name && is_complete(root / name)) return (root / name).string();
  auto dirs = complete_checkpoints(root);
  if (dirs.empty()) return std::nullopt;
  return dirs.back().string();
}

std::optional<CheckpointStore::Loaded> CheckpointStore::load_newest_valid(
    const std::function<void(const std::string&)>& warn) const {
  auto newest = latest();
  if (!newest) return std::nullopt;
  std::vector<std::string> candidates{*newest};
  auto dirs = complete_checkpoints(fs::path(root_));
  for (auto it = dirs.rbegin(); it != dirs.rend(); ++it)
    if (it->filename() < fs::path(*newest).filename()) candidates.push_back(it->string());
  std::exception_ptr newest_failure;
  for (size_t i = 0; i < candidates.size(); ++i) {
    try {
      return Loaded{candidates[i], load(candidates[i])};
    } catch (const InputError& e) {
      if (!newest_failure) newest_failure = std::current_exception();
      if (i + 1 < candidates.size()) warn(std::string(e.what()) + "; trying an older checkpoint");
    }
  }
  std::rethrow_exception(newest_failure);
}

void CheckpointStore::discard_newer_than(const std::string& dir) const {
  for (const auto& d : complete_checkpoints(fs::path(root_)))
    if (d.filename() > fs::path(dir).filename()) fs::remove_all(d);
}

CheckpointContent CheckpointStore::load(const std::string& dir_text) {
  fs::path dir(dir_text);
  fs::path manifest_path = dir / kManifest;
  if (!fs::exists(manifest_path))
    input_error(dir_text, ": not a complete checkpoint (no ", kManifest, ")");
  nlohmann::json manifest = read_json(manifest_path);
  CheckpointContent content;
  try {
    if (manifest.at("format") != "tessel-checkpoint" || manifest.at("version") != kFormatVersion)
      input_error(manifest_path.string(), ": unsupported checkpoint format or version");
    content.step = manifest.at("step").get<int64_t>();
    content.state = manifest.at("state");
    for (const auto& f : manifest.at("files")) {
      std::string name = f.at("name").get<std::string>();
      fs::path p = dir / name;
      if (!fs::exists(p)) input_error(p.string(), ": missing checkpoint file");
      if (fs::file_size(p) != f.at("bytes").get<uint64_t>())
        input_error(p.string(), ": size ", fs::file_size(p), " differs from the manifest's ",
                    f.at("bytes").get<uint64_t>(), " (truncated or corrupt)");
      if (file_crc32(p.string()) != f.at("crc32").get<uint32_t>())
        input_error(p.string(), ": checksum mismatch (corrupt checkpoint file)");
    }
  } catch (const nlohmann::json::exception& e) {
    input_error(manifest_path.string(), ": malformed manifest (", e.what(), ")");
  }
  content.model = read_safetensors((dir / "model.safetensors").string()).tensors;
  content.optimizer = read_safetensors((dir / "optimizer.safetensors").string()).tensors;
  return content;
}

}  // namespace tessel::train

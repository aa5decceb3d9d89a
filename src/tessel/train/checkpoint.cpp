#include "tessel/train/checkpoint.hpp"

#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>

#include "tessel/core/error.hpp"
#include "tessel/core/file_io.hpp"

namespace fs = std::filesystem;

namespace tessel::train {

namespace {

constexpr const char* kManifest = "manifest.json";
constexpr int kFormatVersion = 2;
constexpr const char* kKinds[2] = {"model", "optimizer"};
constexpr size_t kRecord = 5;  // per rank: ok, then bytes and CRC of its two files

std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

std::string shard_name(const char* kind, int rank, int ranks) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%s-%05d-of-%05d.safetensors", kind, rank, ranks);
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

std::vector<std::string> names_of(const std::vector<NamedTensor>& tensors) {
  std::vector<std::string> names;
  for (const auto& t : tensors) names.push_back(t.name);
  return names;
}

// Copies this rank's share of `replicated` (owner[i] == rank) and all of `own` into `into`,
// reusing its buffers when the shapes are those of the previous save.
void stage_share(const std::vector<NamedTensor>& replicated, const std::vector<int>& owner,
                 int rank, const std::vector<NamedTensor>& own, std::vector<NamedTensor>& into) {
  size_t j = 0;
  auto stage = [&](const NamedTensor& from) {
    const Tensor& src = from.tensor;
    if (j == into.size()) into.push_back({from.name, Tensor(src.shape(), src.dtype())});
    NamedTensor& dst = into[j++];
    if (dst.tensor.shape() != src.shape() || dst.tensor.dtype() != src.dtype())
      dst.tensor = Tensor(src.shape(), src.dtype());
    dst.name = from.name;
    std::memcpy(dst.tensor.raw(), src.raw(), src.bytes());
  };
  for (size_t i = 0; i < replicated.size(); ++i)
    if (owner[i] == rank) stage(replicated[i]);
  for (const NamedTensor& t : own) stage(t);
  into.resize(j);
}

// The names of `replicated`, then every rank's `own` in rank order (collective over
// `group`); a name listed twice is an error.
std::vector<std::string> gather_names(comm::Communicator& group,
                                      const std::vector<NamedTensor>& replicated,
                                      const std::vector<NamedTensor>& own) {
  std::string mine;
  for (const auto& t : own) mine += t.name + '\n';
  const int64_t n = int64_t(mine.size());
  std::vector<int64_t> sizes(size_t(group.size()));
  group.all_gather(&n, sizes.data(), 1, comm::ElemType::i64);
  const std::vector<size_t> counts(sizes.begin(), sizes.end());
  std::string all(std::accumulate(counts.begin(), counts.end(), size_t(0)), '\0');
  group.all_gatherv(mine.data(), all.data(), counts, comm::ElemType::u8);
  std::vector<std::string> names = names_of(replicated);
  for (size_t at = 0, end; (end = all.find('\n', at)) != std::string::npos; at = end + 1)
    names.push_back(all.substr(at, end - at));
  std::vector<std::string> sorted = names;
  std::sort(sorted.begin(), sorted.end());
  auto twice = std::adjacent_find(sorted.begin(), sorted.end());
  TESSEL_CHECK(twice == sorted.end(), "checkpoint tensor '", *twice,
               "' is listed by two ranks (or also as replicated)");
  return names;
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

std::vector<int> assign_writers(const std::vector<NamedTensor>& tensors, int ranks) {
  TESSEL_CHECK(ranks >= 1, "assign_writers needs at least one rank");
  std::vector<size_t> load(size_t(ranks), 0);
  std::vector<int> owner;
  for (const auto& t : tensors) {
    int r = int(std::min_element(load.begin(), load.end()) - load.begin());
    load[size_t(r)] += t.tensor.bytes();
    owner.push_back(r);
  }
  return owner;
}

CheckpointStore::CheckpointStore(std::string root, int64_t keep)
    : root_(std::move(root)), keep_(keep) {
  TESSEL_CHECK(keep_ == 0 || keep_ >= 2, "keep_checkpoints must be 0 (all) or >= 2");
}

void CheckpointStore::save(comm::Communicator& group, const CheckpointContent& content) {
  AsyncCheckpointer writer(*this, group);
  writer.save(content);
  writer.wait();
}

void CheckpointStore::sweep_leftovers() const {
  if (!fs::is_directory(root_)) return;
  for (const auto& e : fs::directory_iterator(root_))
    if (e.is_directory() && e.path().extension() == ".incomplete") fs::remove_all(e.path());
  remove_temporary_files(root_);
}

// ---------------------------------------------------------------------------
// AsyncCheckpointer

AsyncCheckpointer::AsyncCheckpointer(const CheckpointStore& store, comm::Communicator& group)
    : store_(store), group_(group), rank_(group.rank()), ranks_(group.size()) {
  writer_ = std::thread([this] { writer_loop(); });
}

AsyncCheckpointer::~AsyncCheckpointer() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  writer_.join();
  // A collective still pending here waits for peers that may never join it (this rank is
  // unwinding from an error): leave it to the process exit rather than block.
  if (request_ && !request_->done()) (void)request_.release();
}

void AsyncCheckpointer::writer_loop() {
  for (;;) {
    bool write = false;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [this] { return stop_ || job_write_ || job_commit_; });
      if (stop_) return;
      write = job_write_;
      job_write_ = job_commit_ = false;
    }
    std::string failure;
    try {
      if (write)
        write_files();
      else
        commit();
    } catch (const std::exception& e) {
      failure = e.what();
    }
    {
      std::lock_guard lock(mu_);
      failure_ = failure;
      staged_ = done_ = true;
    }
    cv_.notify_all();
  }
}

void AsyncCheckpointer::write_files() {
  const CheckpointContent& c = content_;
  const std::vector<NamedTensor>* kinds[2] = {&c.model, &c.optimizer};
  std::vector<NamedTensor>* staged[2] = {&staged_model_, &staged_optimizer_};
  const std::vector<NamedTensor>* own[2] = {&c.own_model, &c.own_optimizer};
  for (int k = 0; k < 2; ++k)
    stage_share(*kinds[k], assign_writers(*kinds[k], ranks_), rank_, *own[k], *staged[k]);
  {
    std::lock_guard lock(mu_);
    staged_ = true;
    // Only the staged copies are written from here. Dropping the views lets go of state the
    // trainer has since released (the Muon family's gathered momentum), which they would
    // otherwise keep alive until the next save.
    for (auto* list :
         {&content_.model, &content_.optimizer, &content_.own_model, &content_.own_optimizer})
      list->clear();
  }
  cv_.notify_all();
  record_.assign(kRecord, 0);
  fs::path tmp = fs::path(store_.root()) / (step_name(c.step) + ".incomplete");
  std::error_code ec;
  fs::create_directories(tmp, ec);  // every rank; the others may have made it already
  if (!fs::is_directory(tmp)) input_error(tmp.string(), ": cannot create: ", ec.message());
  for (int k = 0; k < 2; ++k) {
    std::string path = (tmp / shard_name(kKinds[k], rank_, ranks_)).string();
    uint32_t crc = 0;
    write_safetensors(path, *staged[k], {}, &crc);
    fsync_path(path);
    record_[1 + 2 * k] = int64_t(fs::file_size(path));
    record_[2 + 2 * k] = int64_t(crc);
  }
  if (on_files_written) on_files_written(c.step);
  record_[0] = 1;
}

void AsyncCheckpointer::commit() {
  const CheckpointContent& c = content_;
  fs::path root(store_.root());
  fs::path final_dir = root / step_name(c.step);
  fs::path tmp = root / (step_name(c.step) + ".incomplete");
  nlohmann::json manifest;
  manifest["format"] = "tessel-checkpoint";
  manifest["version"] = kFormatVersion;
  manifest["step"] = c.step;
  manifest["ranks"] = ranks_;
  manifest["tensors"] = {{"model", names_[0]}, {"optimizer", names_[1]}};
  manifest["state"] = c.state;
  manifest["files"] = nlohmann::json::array();
  for (int r = 0; r < ranks_; ++r)
    for (int k = 0; k < 2; ++k)
      manifest["files"].push_back({{"name", shard_name(kKinds[k], r, ranks_)},
                                   {"bytes", gathered_[kRecord * size_t(r) + 1 + 2 * size_t(k)]},
                                   {"crc32", gathered_[kRecord * size_t(r) + 2 + 2 * size_t(k)]}});
  write_file_atomically((tmp / kManifest).string(), manifest.dump(2));
  fs::remove_all(final_dir);
  fs::rename(tmp, final_dir);
  fsync_path(root.string());
  write_file_atomically((root / "latest").string(), step_name(c.step) + "\n");
  if (store_.keep() > 0) {  // 0 keeps every checkpoint
    auto dirs = complete_checkpoints(root);
    for (size_t i = 0; i + size_t(store_.keep()) < dirs.size(); ++i) fs::remove_all(dirs[i]);
  }
  if (on_committed) on_committed(final_dir.string(), c.step);
}

void AsyncCheckpointer::save(const CheckpointContent& content) {
  wait();  // at most one save in flight
  names_[0] = gather_names(group_, content.model, content.own_model);
  names_[1] = gather_names(group_, content.optimizer, content.own_optimizer);
  {
    std::lock_guard lock(mu_);
    content_ = content;
    failure_.clear();
    staged_ = done_ = false;
    job_write_ = true;
  }
  cv_.notify_all();
  stage_ = Stage::writing;
}

void AsyncCheckpointer::wait_staged() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [this] { return staged_; });
}

bool AsyncCheckpointer::staging() const {
  std::lock_guard lock(mu_);
  return !staged_;
}

void AsyncCheckpointer::poll() {
  advance(false);
}

void AsyncCheckpointer::wait() {
  advance(true);
}

void AsyncCheckpointer::fail(const std::string& why) {
  stage_ = Stage::idle;
  input_error("checkpoint ", (fs::path(store_.root()) / step_name(content_.step)).string(),
              " not saved: ", why);
}

// The commit protocol, run by the training thread: each stage either completes (and the
// next begins) or, without `block`, returns until the next call.
void AsyncCheckpointer::advance(bool block) {
  auto writer_done = [&] {
    std::unique_lock lock(mu_);
    if (block) cv_.wait(lock, [this] { return done_; });
    return done_;
  };
  auto request_done = [&] { return block ? (request_->wait(), true) : request_->test(); };
  auto agree_on_commit = [&](bool ok) {  // phase two: every rank's view of rank 0's commit
    agree_flag_ = ok ? 1 : 0;
    request_ = std::make_unique<comm::Request>(
        group_.iall_reduce(&agree_flag_, 1, comm::ElemType::i64, comm::ReduceOp::min));
    stage_ = Stage::agree_commit;
  };
  for (;;) {
    switch (stage_) {
      case Stage::idle:
        return;
      case Stage::writing:
        if (!writer_done()) return;
        gathered_.assign(kRecord * size_t(ranks_), 0);
        request_ = std::make_unique<comm::Request>(
            group_.iall_gather(record_.data(), gathered_.data(), kRecord, comm::ElemType::i64));
        stage_ = Stage::agree_files;
        break;
      case Stage::agree_files: {
        if (!request_done()) return;
        bool all_ok = true;
        for (int r = 0; r < ranks_; ++r) all_ok = all_ok && gathered_[kRecord * size_t(r)] == 1;
        if (!all_ok) {
          if (rank_ == 0)
            fs::remove_all(fs::path(store_.root()) / (step_name(content_.step) + ".incomplete"));
          fail(failure_.empty() ? "another rank failed to write its part" : failure_);
        }
        if (rank_ == 0) {
          {
            std::lock_guard lock(mu_);
            done_ = false;
            job_commit_ = true;
          }
          cv_.notify_all();
          stage_ = Stage::committing;
        } else {
          agree_on_commit(true);
        }
        break;
      }
      case Stage::committing:
        if (!writer_done()) return;
        agree_on_commit(failure_.empty());
        break;
      case Stage::agree_commit:
        if (!request_done()) return;
        if (agree_flag_ != 1) fail(failure_.empty() ? "rank 0 failed to commit it" : failure_);
        last_committed_ = content_.step;
        stage_ = Stage::idle;
        return;
    }
  }
}

// ---------------------------------------------------------------------------
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
    const std::function<void(const std::string&)>& warn, CheckpointParts parts) const {
  auto newest = latest();
  if (!newest) return std::nullopt;
  std::vector<std::string> candidates{*newest};
  auto dirs = complete_checkpoints(fs::path(root_));
  for (auto it = dirs.rbegin(); it != dirs.rend(); ++it)
    if (it->filename() < fs::path(*newest).filename()) candidates.push_back(it->string());
  std::exception_ptr newest_failure;
  for (size_t i = 0; i < candidates.size(); ++i) {
    try {
      return Loaded{candidates[i], load(candidates[i], parts)};
    } catch (const InputError& e) {
      if (!newest_failure) newest_failure = std::current_exception();
      if (i + 1 < candidates.size()) warn(std::string(e.what()) + "; trying an older checkpoint");
    }
  }
  std::rethrow_exception(newest_failure);
}

void warn_on_stderr(const std::string& why) {
  std::fprintf(stderr, "tessel: warning: %s\n", why.c_str());
}

CheckpointStore::Loaded load_run_checkpoint(const std::string& path) {
  if (!fs::is_directory(fs::path(path) / "checkpoints")) {
    if (!fs::exists(path)) input_error(path, ": no such run directory or checkpoint");
    if (!fs::exists(fs::path(path) / kManifest))
      input_error(path, ": neither a run directory (no checkpoints/) nor a checkpoint (no ",
                  kManifest, ")");
    return {path, CheckpointStore::load(path, CheckpointParts::model)};
  }
  // keep only matters for saving; 2 is the smallest the store accepts.
  auto loaded = CheckpointStore(path + "/checkpoints", 2)
                    .load_newest_valid(warn_on_stderr, CheckpointParts::model);
  if (!loaded) input_error(path, ": no complete checkpoint under ", path, "/checkpoints");
  return std::move(*loaded);
}

void CheckpointStore::discard_newer_than(const std::string& dir) const {
  for (const auto& d : complete_checkpoints(fs::path(root_)))
    if (d.filename() > fs::path(dir).filename()) fs::remove_all(d);
}

CheckpointContent CheckpointStore::load(const std::string& dir_text, CheckpointParts parts) {
  const int kinds = parts == CheckpointParts::all ? 2 : 1;  // kKinds: model first
  fs::path dir(dir_text);
  fs::path manifest_path = dir / kManifest;
  if (!fs::exists(manifest_path))
    input_error(dir_text, ": not a complete checkpoint (no ", kManifest, ")");
  nlohmann::json manifest = read_json(manifest_path);
  CheckpointContent content;
  std::vector<std::string> files;
  try {
    if (manifest.at("format") != "tessel-checkpoint" || manifest.at("version") != kFormatVersion)
      input_error(manifest_path.string(), ": unsupported checkpoint format or version");
    content.step = manifest.at("step").get<int64_t>();
    content.state = manifest.at("state");
    for (const auto& f : manifest.at("files")) {
      std::string name = f.at("name").get<std::string>();
      if (kinds == 1 && name.rfind(std::string(kKinds[1]) + "-", 0) == 0) continue;
      fs::path p = dir / name;
      if (!fs::exists(p)) input_error(p.string(), ": missing checkpoint file");
      if (fs::file_size(p) != f.at("bytes").get<uint64_t>())
        input_error(p.string(), ": size ", fs::file_size(p), " differs from the manifest's ",
                    f.at("bytes").get<uint64_t>(), " (truncated or corrupt)");
      if (file_crc32(p.string()) != f.at("crc32").get<uint32_t>())
        input_error(p.string(), ": checksum mismatch (corrupt checkpoint file)");
      files.push_back(name);
    }
    // Each kind's shares, merged by name into the saved order.
    std::vector<NamedTensor>* into[2] = {&content.model, &content.optimizer};
    for (int k = 0; k < kinds; ++k) {
      std::map<std::string, Tensor> by_name;
      std::string prefix = std::string(kKinds[k]) + "-";
      for (const auto& name : files)
        if (name.rfind(prefix, 0) == 0)
          for (auto& nt : read_safetensors((dir / name).string()).tensors)
            by_name[nt.name] = std::move(nt.tensor);
      for (const auto& name : manifest.at("tensors").at(kKinds[k])) {
        auto it = by_name.find(name.get<std::string>());
        if (it == by_name.end())
          input_error(manifest_path.string(), ": tensor '", name.get<std::string>(),
                      "' is in no checkpoint file");
        into[k]->push_back({it->first, it->second});
      }
    }
  } catch (const nlohmann::json::exception& e) {
    input_error(manifest_path.string(), ": malformed manifest (", e.what(), ")");
  }
  return content;
}

}  // namespace tessel::train

#include "tessel/train/checkpoint.hpp"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <set>
#include <tuple>

#include "tessel/core/error.hpp"
#include "tessel/core/file_io.hpp"

namespace fs = std::filesystem;

namespace tessel::train {

namespace {

constexpr const char* kManifest = "manifest.json";
// Phase one's records in `step-N.incomplete/`: rank 0's manifest without its "files", and each
// rank's list of the files it finished (done_name). With all of them a later start can complete
// a commit that the job did not live to agree on (CheckpointStore::recover_prepared).
constexpr const char* kDraft = "manifest.draft.json";
constexpr int kFormatVersion = 3;  // 3: row shards
constexpr int kOldestVersion = 2;  // still read
constexpr int kFiles = 3;          // per rank; the third only with row shards
constexpr const char* kKinds[kFiles] = {"model", "optimizer", "optimizer_shards"};
constexpr size_t kRecord = 1 + 2 * kFiles;  // per rank: ok, then bytes (-1: none) and CRC

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

std::string done_name(int rank, int ranks) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "rank-%05d-of-%05d.done.json", rank, ranks);
  return buf;
}

// A checkpoint that fails verification: a file missing, shorter or longer than the manifest
// says or not matching its checksum, a manifest that does not parse or contradicts itself.
// The only failure load_newest_valid falls back from (a resume then deletes the checkpoint):
// any other (a newer format, a file that cannot be read) says nothing about the checkpoint.
class DamagedCheckpoint : public InputError {
 public:
  using InputError::InputError;
};

template <class... Args>
[[noreturn]] void damaged(const Args&... args) {
  throw DamagedCheckpoint(detail::concat(args...));
}

void verify_crc32(const std::string& file, uint32_t crc32) {
  if (file_crc32(file) != crc32) damaged(file, ": checksum mismatch (corrupt checkpoint file)");
}

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  if (!in) input_error(path.string(), ": cannot open: ", std::strerror(errno));
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    damaged(path.string(), ": corrupt JSON (", e.what(), ")");
  }
}

// The step of a directory named exactly as step_name names it; -1 for any other name
// (`step-N.incomplete`, `step-N.deleted`, a copy such as `step-N.old`).
int64_t step_of(const fs::path& dir) {
  const std::string name = dir.filename().string();
  if (name.rfind("step-", 0) != 0) return -1;
  int64_t step = -1;
  const char* end = name.data() + name.size();
  const auto [at, ec] = std::from_chars(name.data() + 5, end, step);
  return ec == std::errc() && at == end && step >= 0 && name == step_name(step) ? step : -1;
}

// Complete checkpoint directories, oldest first. Only the `step-N` directories themselves
// count: never what `latest` names, which a crash before its rewrite or a hand edit can leave
// pointing at an older checkpoint or outside the run.
std::vector<fs::path> complete_checkpoints(const fs::path& root) {
  std::vector<std::pair<int64_t, fs::path>> found;
  if (!fs::is_directory(root)) return {};
  for (const auto& e : fs::directory_iterator(root)) {
    const int64_t step = step_of(e.path());
    if (step >= 0 && e.is_directory() && fs::exists(e.path() / kManifest))
      found.emplace_back(step, e.path());
  }
  std::sort(found.begin(), found.end());
  std::vector<fs::path> dirs;
  for (auto& [step, dir] : found) dirs.push_back(std::move(dir));
  return dirs;
}

// Deletes checkpoint directory `dir` so that a crash leaves either all of it or none under its
// name: it is renamed to `step-N.deleted` first (one rename, made durable), which
// sweep_leftovers removes after a crash; remove_all alone went file by file, and a kill left a
// manifest-less step-N that nothing ever removed.
void remove_checkpoint(const fs::path& dir) {
  fs::path doomed = dir;
  doomed += ".deleted";
  fs::remove_all(doomed);  // an earlier deletion's, cut short
  fs::rename(dir, doomed);
  fsync_path(dir.parent_path().string());
  fs::remove_all(doomed);
}

// The manifest less its "files": what rank 0 knows when a save starts, its phase-one draft.
nlohmann::json manifest_draft(int64_t step, int ranks, const std::vector<std::string> (&names)[2],
                              const nlohmann::json& shards, const nlohmann::json& state) {
  nlohmann::json manifest;
  manifest["format"] = "tessel-checkpoint";
  manifest["version"] = kFormatVersion;
  manifest["step"] = step;
  manifest["ranks"] = ranks;
  manifest["tensors"] = {{"model", names[0]}, {"optimizer", names[1]}};
  manifest["shards"] = shards;
  manifest["state"] = state;
  return manifest;
}

// `draft` with its "files": `records` holds kRecord values per rank of the draft's, as the
// agreement gathers them (ok, then per kind the file's bytes, -1 for none, and CRC). The one
// assembly of a manifest, for the commit and for a recovered one alike.
nlohmann::json finish_manifest(nlohmann::json draft, const std::vector<int64_t>& records) {
  const int ranks = draft.at("ranks").get<int>();
  TESSEL_CHECK(records.size() == kRecord * size_t(ranks), "checkpoint: ", records.size(),
               " file records for ", ranks, " ranks");
  draft["files"] = nlohmann::json::array();
  for (int r = 0; r < ranks; ++r)
    for (int k = 0; k < kFiles; ++k) {
      const int64_t* record = &records[kRecord * size_t(r) + 1 + 2 * size_t(k)];
      if (record[0] >= 0)
        draft["files"].push_back({{"name", shard_name(kKinds[k], r, ranks)},
                                  {"bytes", record[0]},
                                  {"crc32", record[1]}});
    }
  return draft;
}

// Phase two on disk, once every rank's files are durable: the manifest (atomically) into
// `step-N.incomplete/`, renamed to `step-N/`, `latest`, retention. The committed directory.
fs::path commit_checkpoint(const fs::path& root, int64_t keep, const nlohmann::json& manifest) {
  const std::string step = step_name(manifest.at("step").get<int64_t>());
  const fs::path final_dir = root / step, tmp = root / (step + ".incomplete");
  // A step-N without a manifest is no checkpoint tessel committed (a hand-made one): left
  // as it is, never deleted to make room.
  if (fs::exists(final_dir) && !fs::exists(final_dir / kManifest))
    input_error(final_dir.string(),
                " exists without a manifest (not a checkpoint tessel committed): move it away "
                "to commit the save of that step");
  write_file_atomically((tmp / kManifest).string(), manifest.dump(2));
  if (fs::exists(final_dir)) remove_checkpoint(final_dir);
  fs::rename(tmp, final_dir);
  fsync_path(root.string());
  write_file_atomically((root / "latest").string(), step + "\n");
  if (keep > 0) {  // 0 keeps every checkpoint
    auto dirs = complete_checkpoints(root);
    for (size_t i = 0; i + size_t(keep) < dirs.size(); ++i) remove_checkpoint(dirs[i]);
  }
  return final_dir;
}

// Whether the commit of `step` got as far as its rename: a failure after it (`latest`,
// retention, an fsync) leaves the save committed, and a restart resumes from it.
bool renamed_to_final(const fs::path& root, int64_t step) {
  return !fs::exists(root / (step_name(step) + ".incomplete")) &&
         fs::exists(root / step_name(step) / kManifest);
}

// A JSON file, or null when it is missing or does not parse.
nlohmann::json read_json_or_null(const fs::path& path) {
  std::ifstream in(path);
  if (!in) return nullptr;
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  return j.is_discarded() ? nlohmann::json() : j;
}

// The manifest of the save whose phase one `dir` (`step-N.incomplete/`) holds: its draft
// finished with every rank's done record, when the draft is this format's, of step `step`, and
// each of its ranks' done record is there, of that step and rank count, listing that rank's
// model and optimizer files (and its row-shard file, if it wrote one) and nothing else.
// nullopt otherwise (a rank died before its files were durable: the save is lost).
std::optional<nlohmann::json> prepared_manifest(const fs::path& dir, int64_t step) {
  try {
    const nlohmann::json draft = read_json_or_null(dir / kDraft);
    if (!draft.is_object() || draft.value("format", "") != "tessel-checkpoint" ||
        draft.value("version", 0) != kFormatVersion || draft.value("step", int64_t(-1)) != step)
      return std::nullopt;
    const int ranks = draft.at("ranks").get<int>();
    if (ranks < 1) return std::nullopt;
    std::vector<int64_t> records(kRecord * size_t(ranks), -1);
    for (int r = 0; r < ranks; ++r) {
      const nlohmann::json done = read_json_or_null(dir / done_name(r, ranks));
      if (!done.is_object() || done.value("step", int64_t(-1)) != step ||
          done.value("rank", -1) != r || done.value("ranks", -1) != ranks)
        return std::nullopt;
      int64_t* record = &records[kRecord * size_t(r)];
      record[0] = 1;
      for (const auto& f : done.at("files")) {
        const std::string name = f.at("name").get<std::string>();
        int k = 0;
        while (k < kFiles && name != shard_name(kKinds[k], r, ranks)) ++k;
        if (k == kFiles || record[1 + 2 * k] >= 0) return std::nullopt;
        record[1 + 2 * k] = f.at("bytes").get<int64_t>();
        record[2 + 2 * k] = f.at("crc32").get<uint32_t>();
        // The file as its rank recorded it (the CRC is the load's to check): one that the
        // storage lost or cut short makes the save lost, not a checkpoint that fails to load.
        if (record[1 + 2 * k] < 0 || !fs::is_regular_file(dir / name) ||
            int64_t(fs::file_size(dir / name)) != record[1 + 2 * k])
          return std::nullopt;
      }
      if (record[1] < 0 || record[3] < 0) return std::nullopt;  // model, optimizer: always
    }
    return finish_manifest(draft, records);
  } catch (const std::exception&) {  // a field of another type, a file that cannot be read
    return std::nullopt;
  }
}

// The newest save that every rank wrote and none committed: the `step-N.incomplete/` with the
// highest N above the newest complete checkpoint whose prepared_manifest there is.
std::optional<std::pair<fs::path, nlohmann::json>> newest_prepared(const fs::path& root) {
  if (!fs::is_directory(root)) return std::nullopt;
  const auto complete = complete_checkpoints(root);
  const int64_t newest = complete.empty() ? -1 : step_of(complete.back());
  std::vector<std::pair<int64_t, fs::path>> found;
  for (const auto& e : fs::directory_iterator(root))
    if (e.path().extension() == ".incomplete" && e.is_directory())
      if (const int64_t step = step_of(e.path().parent_path() / e.path().stem()); step > newest)
        found.emplace_back(step, e.path());
  std::sort(found.rbegin(), found.rend());
  for (const auto& [step, dir] : found)
    if (auto manifest = prepared_manifest(dir, step)) return std::pair{dir, std::move(*manifest)};
  return std::nullopt;
}

std::vector<std::string> names_of(const std::vector<NamedTensor>& tensors) {
  std::vector<std::string> names;
  for (const auto& t : tensors) names.push_back(t.name);
  return names;
}

std::string shard_key(const std::string& name, int64_t row0, int64_t row1) {
  return name + "[" + std::to_string(row0) + ":" + std::to_string(row1) + "]";
}

int64_t leading(const Tensor& t) {
  return t.shape().empty() ? 0 : t.shape()[0];
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

// Every rank's `lines` (without '\n'), in rank order (collective over `group`).
std::vector<std::vector<std::string>> gather_lines(comm::Communicator& group,
                                                   const std::vector<std::string>& lines) {
  std::string mine;
  for (const auto& line : lines) mine += line + '\n';
  const int64_t n = int64_t(mine.size());
  std::vector<int64_t> sizes(size_t(group.size()));
  group.all_gather(&n, sizes.data(), 1, comm::ElemType::i64);
  const std::vector<size_t> counts(sizes.begin(), sizes.end());
  std::string all(std::accumulate(counts.begin(), counts.end(), size_t(0)), '\0');
  group.all_gatherv(mine.data(), all.data(), counts, comm::ElemType::u8);
  std::vector<std::vector<std::string>> out(counts.size());
  size_t at = 0;
  for (size_t r = 0; r < counts.size(); ++r)
    for (const size_t end = at + counts[r]; at < end;) {
      const size_t newline = all.find('\n', at);
      out[r].push_back(all.substr(at, newline - at));
      at = newline + 1;
    }
  return out;
}

// The names of `replicated`, then every rank's `own` in rank order (collective over
// `group`); a name listed twice is an error.
std::vector<std::string> gather_names(comm::Communicator& group,
                                      const std::vector<NamedTensor>& replicated,
                                      const std::vector<NamedTensor>& own) {
  std::vector<std::string> names = names_of(replicated);
  for (const auto& rank_names : gather_lines(group, names_of(own)))
    names.insert(names.end(), rank_names.begin(), rank_names.end());
  std::vector<std::string> sorted = names;
  std::sort(sorted.begin(), sorted.end());
  auto twice = std::adjacent_find(sorted.begin(), sorted.end());
  TESSEL_CHECK(twice == sorted.end(), "checkpoint tensor '", *twice,
               "' is listed by two ranks (or also as replicated)");
  return names;
}

// The manifest's "shards" entries of every rank's row shards (collective over `group`).
nlohmann::json gather_shards(comm::Communicator& group, const std::vector<RowShard>& shards) {
  std::vector<std::string> mine;
  for (const RowShard& s : shards) {
    Shape shape = s.tensor.shape();
    TESSEL_CHECK(
        s.rows > 0 && !shape.empty() && shape[0] > 0 && s.row0 >= 0 && s.row0 + shape[0] <= s.rows,
        "row shard '", s.name, "' holds rows ", s.row0, " + ", shape_str(shape), " of ", s.rows);
    shape[0] = s.rows;
    mine.push_back(
        nlohmann::json(
            {{"name", s.name}, {"shape", shape}, {"rows", {s.row0, s.row0 + s.tensor.shape()[0]}}})
            .dump());
  }
  nlohmann::json out = nlohmann::json::array();
  const auto all = gather_lines(group, mine);
  for (size_t r = 0; r < all.size(); ++r)
    for (const auto& line : all[r]) {
      out.push_back(nlohmann::json::parse(line));
      out.back()["file"] = shard_name(kKinds[2], int(r), int(all.size()));
    }
  return out;
}

// The manifest's "shards" entries as locations in `dir` (CRC not set).
std::vector<ShardLocation> shard_locations(const nlohmann::json& shards, const fs::path& dir) {
  std::vector<ShardLocation> out;
  for (const auto& s : shards)
    out.push_back({s.at("name").get<std::string>(), s.at("shape").get<Shape>(),
                   s.at("rows").at(0).get<int64_t>(), s.at("rows").at(1).get<int64_t>(),
                   (dir / s.at("file").get<std::string>()).string(), 0});
  return out;
}

// Why `shards` do not describe their tensors once (empty when they do): the shards of a name
// must agree on its shape and cover its rows once, in order of rows, none empty, and no name
// may be in `whole` too.
std::string shard_tiling_problem(std::vector<ShardLocation> shards,
                                 const std::vector<std::string>& whole) {
  std::sort(shards.begin(), shards.end(), [](const ShardLocation& a, const ShardLocation& b) {
    return std::tie(a.name, a.row0) < std::tie(b.name, b.row0);
  });
  for (size_t i = 0; i < shards.size();) {
    const ShardLocation& first = shards[i];
    const std::string tensor = "row shards of '" + first.name + "'";
    if (std::find(whole.begin(), whole.end(), first.name) != whole.end())
      return "tensor '" + first.name + "' is saved whole and as row shards";
    if (first.shape.empty()) return tensor + " have no rows";
    int64_t next = 0;
    for (; i < shards.size() && shards[i].name == first.name; ++i) {
      const ShardLocation& s = shards[i];
      if (s.shape != first.shape)
        return tensor + " disagree on its shape (" + shape_str(first.shape) + ", " +
               shape_str(s.shape) + ")";
      if (s.row0 != next || s.row1 <= s.row0)
        return tensor + " do not cover its " + std::to_string(first.shape[0]) +
               " rows once: rows " + std::to_string(s.row0) + ":" + std::to_string(s.row1) +
               " follow row " + std::to_string(next);
      next = s.row1;
    }
    if (next != first.shape[0])
      return tensor + " end at row " + std::to_string(next) + " of " +
             std::to_string(first.shape[0]);
  }
  return "";
}

// Copies rows [first, first + count) of the tensor `to.name` from `src` (which holds its rows
// from `src_row0`) into `to`, once dtype, row shape and bounds agree (else an InputError
// naming `where`).
void copy_rows(const Tensor& src, int64_t src_row0, const RowShard& to, int64_t first,
               int64_t count, const std::string& where) {
  const Shape &a = src.shape(), &b = to.tensor.shape();
  if (src.dtype() != to.tensor.dtype() || a.empty() || b.empty() ||
      !std::equal(a.begin() + 1, a.end(), b.begin() + 1, b.end()) || first < src_row0 ||
      first + count > src_row0 + a[0] || first < to.row0 || first + count > to.row0 + b[0])
    input_error(where, ": tensor '", to.name, "' is ", dtype_name(src.dtype()), " ", shape_str(a),
                " from row ", src_row0, ", not rows ", first, ":", first + count, " of ",
                dtype_name(to.tensor.dtype()), " rows shaped like ", shape_str(b));
  if (count == 0) return;
  Tensor dst = to.tensor;  // a view of the state to restore
  const size_t row = dst.bytes() / size_t(b[0]);
  std::memcpy(static_cast<char*>(dst.raw()) + size_t(first - to.row0) * row,
              static_cast<const char*>(src.raw()) + size_t(first - src_row0) * row,
              size_t(count) * row);
}

// Every optimizer state name of `from` (whole tensors and row shards) by its stage_free_name:
// the candidates of a tensor under another stage split.
using NamesByStageFreeName = std::map<std::string, std::vector<std::string>>;
NamesByStageFreeName names_by_stage_free_name(const CheckpointContent& from) {
  std::set<std::string> names;
  for (const NamedTensor& t : from.optimizer) names.insert(t.name);
  for (const ShardLocation& s : from.shard_locations) names.insert(s.name);
  NamesByStageFreeName out;
  for (const std::string& n : names) out[stage_free_name(n)].push_back(n);
  return out;
}

// The name under which `from` holds the optimizer state `name`: `name` itself, else the one
// name that differs from it only in the stage prefix (another stage split, or a pipeline
// checkpoint resumed without one, or the reverse). Several stages hold a per-optimizer scalar
// (a step counter) each: they must agree, since one optimizer of the new split continues them
// all; under the checkpoint's own split (`same_stage_split`) each stage keeps its own. `name`
// when there is none (the caller reports it missing).
std::string checkpoint_state_name(const CheckpointContent& from,
                                  const NamesByStageFreeName& candidates, const std::string& name,
                                  const std::string& source, bool same_stage_split) {
  const auto found = candidates.find(stage_free_name(name));
  if (found == candidates.end()) return name;
  const std::vector<std::string>& names = found->second;
  if (names.size() == 1) return names.front();
  const bool own = std::find(names.begin(), names.end(), name) != names.end();
  if (own && same_stage_split) return name;
  auto whole = [&](const std::string& n) -> const NamedTensor* {
    for (const NamedTensor& t : from.optimizer)
      if (t.name == n) return &t;
    return nullptr;
  };
  const NamedTensor* first = whole(names.front());
  for (size_t i = 1; i < names.size(); ++i) {
    const NamedTensor* other = whole(names[i]);
    if (!first || !other)
      input_error(source, ": optimizer state '", names.front(), "' and '", names[i],
                  "' are saved in row shards by two stages, but this run's stage split continues "
                  "them as one tensor '",
                  stage_free_name(name),
                  "'; resume with the checkpoint's parallel.pp and "
                  "pipeline.layout");
    const bool same =
        first->tensor.shape() == other->tensor.shape() &&
        first->tensor.dtype() == other->tensor.dtype() &&
        std::memcmp(first->tensor.raw(), other->tensor.raw(), first->tensor.bytes()) == 0;
    if (!same)
      input_error(source, ": optimizer state '", names.front(), "' and '", names[i],
                  "' differ, but this run's stage split continues them as one tensor '",
                  stage_free_name(name),
                  "' (the stages took different numbers of optimizer steps); resume with the "
                  "checkpoint's parallel.pp and pipeline.layout");
  }
  return own ? name : names.front();
}

}  // namespace

std::string stage_free_name(const std::string& name) {
  constexpr std::string_view stage = "stage";
  if (name.rfind(stage, 0) != 0) return name;
  size_t i = stage.size();
  while (i < name.size() && name[i] >= '0' && name[i] <= '9') ++i;
  return i > stage.size() && i < name.size() && name[i] == '/' ? name.substr(i + 1) : name;
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

void restore_optimizer(const CheckpointContent& from, const std::vector<RowShard>& wanted,
                       const std::string& source, bool same_stage_split) {
  // The shards to copy from, by file, so that each file is read once.
  std::map<std::string, std::vector<std::pair<const ShardLocation*, const RowShard*>>> reads;
  const NamesByStageFreeName candidates = names_by_stage_free_name(from);
  for (const RowShard& w : wanted) {
    const int64_t n = leading(w.tensor), rows = w.rows > 0 ? w.rows : n;
    const std::string name =
        checkpoint_state_name(from, candidates, w.name, source, same_stage_split);
    auto whole = std::find_if(from.optimizer.begin(), from.optimizer.end(),
                              [&](const NamedTensor& t) { return t.name == name; });
    if (whole != from.optimizer.end() && w.rows == 0) {
      restore_tensor(from.optimizer, name, w.tensor, source);
      continue;
    }
    if (whole != from.optimizer.end()) {
      if (leading(whole->tensor) != rows)
        input_error(source, ": tensor '", w.name, "' has ", leading(whole->tensor),
                    " rows, expected ", rows);
      copy_rows(whole->tensor, 0, w, w.row0, n, source);
      continue;
    }
    bool found = false;
    for (const ShardLocation& s : from.shard_locations) {
      if (s.name != name) continue;
      if (s.shape[0] != rows)
        input_error(source, ": tensor '", w.name, "' has ", s.shape[0], " rows, expected ", rows);
      found = true;
      if (s.row0 < w.row0 + n && s.row1 > w.row0) reads[s.file].push_back({&s, &w});
    }
    if (!found) input_error(source, ": tensor '", w.name, "' missing from the checkpoint");
  }
  for (const auto& [file, copies] : reads) {
    verify_crc32(file, copies.front().first->crc32);
    const SafetensorsFile shards = read_safetensors(file);
    for (const auto& [s, w] : copies) {
      const std::string key = shard_key(s->name, s->row0, s->row1);
      const Tensor* t = shards.find(key);
      if (!t || leading(*t) != s->row1 - s->row0)
        input_error(file, ": tensor '", key, "' is missing or has the wrong number of rows");
      const int64_t first = std::max(s->row0, w->row0);
      copy_rows(*t, s->row0, *w, first, std::min(s->row1, w->row0 + leading(w->tensor)) - first,
                file);
    }
  }
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

std::string CheckpointStore::step_dir(int64_t step) const {
  return (fs::path(root_) / step_name(step)).string();
}

std::optional<int64_t> CheckpointStore::prepared() const {
  const auto found = newest_prepared(fs::path(root_));
  if (!found) return std::nullopt;
  return found->second.at("step").get<int64_t>();
}

std::optional<int64_t> CheckpointStore::recover_prepared() const {
  const auto found = newest_prepared(fs::path(root_));
  if (!found) return std::nullopt;
  const auto& [dir, manifest] = *found;
  try {
    remove_temporary_files(dir.string());  // an earlier recovery's, cut short
    // Without retention: the load has not verified this save yet, and a damaged one must not
    // cost an older good checkpoint. The next save's commit applies it.
    commit_checkpoint(fs::path(root_), 0, manifest);
  } catch (const std::exception& e) {
    const int64_t step = manifest.at("step").get<int64_t>();
    if (renamed_to_final(fs::path(root_), step))
      input_error(step_dir(step),
                  ": committed this save, which every rank finished writing, but then failed (",
                  e.what(), "); fix the cause and start again: the run resumes from it");
    input_error(dir.string(), ": cannot commit this save, which every rank finished writing (",
                e.what(), "); fix the cause and start again, or remove ", dir.string(),
                " to resume from the checkpoint before it");
  }
  return manifest.at("step").get<int64_t>();
}

void CheckpointStore::sweep_leftovers() const {
  if (!fs::is_directory(root_)) return;
  for (const auto& e : fs::directory_iterator(root_))
    if (e.is_directory() &&
        (e.path().extension() == ".incomplete" || e.path().extension() == ".deleted"))
      fs::remove_all(e.path());
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
  if (request_ && !request_->abandon()) (void)agreement_.release();
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
  const std::vector<NamedTensor>* own[2] = {&c.own_model, &c.own_optimizer};
  for (int k = 0; k < 2; ++k)
    stage_share(*kinds[k], assign_writers(*kinds[k], ranks_), rank_, *own[k], staging_[k]);
  std::vector<NamedTensor> shards;
  for (const RowShard& s : c.optimizer_shards)
    shards.push_back({shard_key(s.name, s.row0, s.row0 + s.tensor.shape()[0]), s.tensor});
  stage_share({}, {}, rank_, shards, staging_[2]);
  {
    std::lock_guard lock(mu_);
    staged_ = true;
    // Only the staged copies are written from here. Dropping the views lets go of state the
    // trainer may release meanwhile, which they would otherwise keep alive until the next
    // save.
    for (auto* list :
         {&content_.model, &content_.optimizer, &content_.own_model, &content_.own_optimizer})
      list->clear();
    content_.optimizer_shards.clear();
  }
  cv_.notify_all();
  agreement_->record.assign(kRecord, -1);
  const fs::path root(store_.root());
  fs::path tmp = root / (step_name(c.step) + ".incomplete");
  std::error_code ec;
  fs::create_directories(tmp, ec);  // every rank; the others may have made it already
  if (!fs::is_directory(tmp)) input_error(tmp.string(), ": cannot create: ", ec.message());
  if (rank_ == 0) {  // the draft a later start completes if this job ends before the commit
    fsync_path(root.string());
    draft_ = manifest_draft(c.step, ranks_, names_, shards_, c.state);
    write_file_atomically((tmp / kDraft).string(), draft_.dump(2));
  }
  nlohmann::json done = {
      {"step", c.step}, {"rank", rank_}, {"ranks", ranks_}, {"files", nlohmann::json::array()}};
  for (int k = 0; k < kFiles; ++k) {
    if (k == 2 && staging_[k].empty()) continue;  // no row shards on this rank
    const std::string name = shard_name(kKinds[k], rank_, ranks_);
    std::string path = (tmp / name).string();
    uint32_t crc = 0;
    write_safetensors(path, staging_[k], {}, &crc);
    fsync_path(path);
    agreement_->record[1 + 2 * k] = int64_t(fs::file_size(path));
    agreement_->record[2 + 2 * k] = int64_t(crc);
    done["files"].push_back(
        {{"name", name}, {"bytes", agreement_->record[1 + 2 * k]}, {"crc32", crc}});
  }
  if (on_files_written) on_files_written(c.step);
  // After the hook: a rank killed in the write (fault.kill_in) dies before its files count.
  write_file_atomically((tmp / done_name(rank_, ranks_)).string(), done.dump());
  agreement_->record[0] = 1;
}

void AsyncCheckpointer::commit() {
  const fs::path dir = commit_checkpoint(fs::path(store_.root()), store_.keep(),
                                         finish_manifest(draft_, agreement_->gathered));
  if (on_committed) on_committed(dir.string(), content_.step);
}

void AsyncCheckpointer::save(const CheckpointContent& content) {
  wait();  // at most one save in flight
  names_[0] = gather_names(group_, content.model, content.own_model);
  names_[1] = gather_names(group_, content.optimizer, content.own_optimizer);
  shards_ = gather_shards(group_, content.optimizer_shards);
  const std::string problem = shard_tiling_problem(shard_locations(shards_, ""), names_[1]);
  TESSEL_CHECK(problem.empty(), "checkpoint: ", problem);
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
  input_error("checkpoint ", store_.step_dir(content_.step), " not saved: ", why);
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
    agreement_->flag = ok ? 1 : 0;
    request_ = std::make_unique<comm::Request>(
        group_.iall_reduce(&agreement_->flag, 1, comm::ElemType::i64, comm::ReduceOp::min));
    stage_ = Stage::agree_commit;
  };
  for (;;) {
    switch (stage_) {
      case Stage::idle:
        return;
      case Stage::writing:
        if (!writer_done()) return;
        agreement_->gathered.assign(kRecord * size_t(ranks_), 0);
        request_ = std::make_unique<comm::Request>(group_.iall_gather(
            agreement_->record.data(), agreement_->gathered.data(), kRecord, comm::ElemType::i64));
        stage_ = Stage::agree_files;
        break;
      case Stage::agree_files: {
        if (!request_done()) return;
        bool all_ok = true;
        for (int r = 0; r < ranks_; ++r)
          all_ok = all_ok && agreement_->gathered[kRecord * size_t(r)] == 1;
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
        if (agreement_->flag != 1) {
          const std::string why = failure_.empty() ? "rank 0 failed to commit it" : failure_;
          if (renamed_to_final(fs::path(store_.root()), content_.step)) {
            stage_ = Stage::idle;
            input_error("checkpoint ", store_.step_dir(content_.step),
                        " is committed, but rank 0 failed after its rename: ", why,
                        " (a restart resumes from it)");
          }
          fail(why);
        }
        last_committed_ = content_.step;
        stage_ = Stage::idle;
        return;
    }
  }
}

// ---------------------------------------------------------------------------
std::optional<std::string> CheckpointStore::latest() const {
  auto dirs = complete_checkpoints(fs::path(root_));
  if (dirs.empty()) return std::nullopt;
  return dirs.back().string();
}

std::optional<CheckpointStore::Loaded> CheckpointStore::load_newest_valid(
    const std::function<void(const std::string&)>& warn, CheckpointParts parts,
    const std::function<std::string(const CheckpointContent&)>& state_problem) const {
  std::vector<std::string> candidates;  // newest first
  for (const auto& dir : complete_checkpoints(fs::path(root_))) candidates.push_back(dir.string());
  if (candidates.empty()) return std::nullopt;
  std::reverse(candidates.begin(), candidates.end());
  std::string failures;  // each damaged one's, newest first
  for (size_t i = 0; i < candidates.size(); ++i) {
    try {
      Loaded loaded{candidates[i], load(candidates[i], parts)};
      // The newest is chosen by name: a copy under a newer step's name would be taken for that
      // step, every resume would go back to its real one, and retention would delete the real
      // newer ones. (A checkpoint directory named explicitly loads whatever its name.)
      if (const int64_t named = step_of(candidates[i]); named != loaded.content.step)
        damaged(candidates[i], "/", kManifest, ": holds step ", loaded.content.step,
                ", not the step ", named,
                " its directory is named after (a copied or renamed checkpoint)");
      if (const std::string problem = state_problem ? state_problem(loaded.content) : "";
          !problem.empty())
        damaged(candidates[i], "/", kManifest, ": ", problem);
      // The row-shard files too, each once (in chunks, holding none): a damaged one falls back
      // to an older checkpoint here, before every rank reads its own and would stop.
      std::set<std::string> checked;
      for (const ShardLocation& s : loaded.content.shard_locations)
        if (checked.insert(s.file).second) verify_crc32(s.file, s.crc32);
      return loaded;
    } catch (const DamagedCheckpoint& e) {
      failures += (failures.empty() ? "" : "; ") + std::string(e.what());
      if (i + 1 < candidates.size()) warn(std::string(e.what()) + "; trying an older checkpoint");
    } catch (const InputError& e) {
      input_error(e.what(), " (", candidates[i],
                  " is not known to be damaged, so no older checkpoint is used in its place; to "
                  "use an older one, move it out of ",
                  root_, ")");
    }
  }
  input_error(candidates.size() == 1 ? "the only checkpoint"
                                     : detail::concat("all ", candidates.size(), " checkpoints"),
              " under ", root_, (candidates.size() == 1 ? " is" : " are"), " damaged: ", failures,
              "; to start over, use a new run.dir or remove ", root_);
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
  const CheckpointStore store(path + "/checkpoints", 2);
  auto loaded = store.load_newest_valid(warn_on_stderr, CheckpointParts::model);
  if (!loaded) {
    const auto prepared = store.prepared();
    input_error(path, ": no complete checkpoint under ", path, "/checkpoints",
                prepared ? " (" + step_name(*prepared) +
                               ".incomplete holds a save that every rank wrote: a training start "
                               "with train.resume = true commits it)"
                         : "");
  }
  return std::move(*loaded);
}

void CheckpointStore::discard_newer_than(const std::string& dir) const {
  for (const auto& d : complete_checkpoints(fs::path(root_)))
    if (step_of(d) > step_of(dir)) remove_checkpoint(d);
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
  std::map<std::string, uint32_t> shard_crcs;  // row-shard files, by path: verified when read
  try {
    // Another format or version is not damage: the checkpoint may be fine for what wrote it.
    if (manifest.at("format") != "tessel-checkpoint")
      input_error(manifest_path.string(), ": format ", manifest["format"].dump(),
                  " is not a tessel checkpoint's (\"tessel-checkpoint\")");
    if (const int version = manifest.at("version").get<int>();
        version < kOldestVersion || version > kFormatVersion)
      input_error(manifest_path.string(), ": checkpoint format version ", version, " is ",
                  version > kFormatVersion ? "newer" : "older", " than this tessel reads (",
                  kOldestVersion, " to ", kFormatVersion, "); use the tessel that wrote it");
    content.step = manifest.at("step").get<int64_t>();
    content.state = manifest.at("state");
    for (const auto& f : manifest.at("files")) {
      std::string name = f.at("name").get<std::string>();
      auto is = [&](int kind) { return name.rfind(std::string(kKinds[kind]) + "-", 0) == 0; };
      if (kinds == 1 && !is(0)) continue;
      fs::path p = dir / name;
      if (!fs::exists(p)) damaged(p.string(), ": missing checkpoint file");
      if (fs::file_size(p) != f.at("bytes").get<uint64_t>())
        damaged(p.string(), ": size ", fs::file_size(p), " differs from the manifest's ",
                f.at("bytes").get<uint64_t>(), " (truncated or corrupt)");
      if (is(2)) {
        shard_crcs[p.string()] = f.at("crc32").get<uint32_t>();
        continue;
      }
      verify_crc32(p.string(), f.at("crc32").get<uint32_t>());
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
          damaged(manifest_path.string(), ": tensor '", name.get<std::string>(),
                  "' is in no checkpoint file");
        into[k]->push_back({it->first, it->second});
      }
    }
    if (kinds == 2) {
      content.shard_locations =
          shard_locations(manifest.value("shards", nlohmann::json::array()), dir);
      for (ShardLocation& s : content.shard_locations) {
        auto crc = shard_crcs.find(s.file);
        if (crc == shard_crcs.end())
          damaged(manifest_path.string(), ": row shard '", s.name, "' lies in ", s.file,
                  ", which is not among its files");
        s.crc32 = crc->second;
      }
      const std::string problem =
          shard_tiling_problem(content.shard_locations, names_of(content.optimizer));
      if (!problem.empty()) damaged(manifest_path.string(), ": ", problem);
    }
  } catch (const nlohmann::json::exception& e) {
    damaged(manifest_path.string(), ": malformed manifest (", e.what(), ")");
  } catch (const std::filesystem::filesystem_error& e) {  // a file that cannot be examined
    input_error(manifest_path.string(), ": ", e.what());
  }
  return content;
}

}  // namespace tessel::train

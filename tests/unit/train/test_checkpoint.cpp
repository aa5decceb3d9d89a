#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <thread>

#include "support/expect_input_error.hpp"
#include "support/train_fixture.hpp"
#include "tessel/comm/single_communicator.hpp"
#include "tessel/core/error.hpp"
#include "tessel/core/file_io.hpp"
#include "tessel/train/checkpoint.hpp"
#include "tessel/train/safetensors.hpp"

using namespace tessel;
using namespace tessel::train;
namespace fs = std::filesystem;

namespace {

std::vector<NamedTensor> sample_tensors() {
  Tensor a({2, 3});
  for (int i = 0; i < 6; ++i) a.f32()[i] = 0.5f * float(i) - 1.0f;
  Tensor b({4}, DType::i32);
  for (int i = 0; i < 4; ++i) b.i32()[i] = -i * 1000;
  Tensor c = a.to(DType::bf16);
  return {{"w.a", a}, {"w.b", b}, {"w.c", c}};
}

void expect_equal_bytes(const Tensor& x, const Tensor& y) {
  ASSERT_EQ(x.shape(), y.shape());
  ASSERT_EQ(x.dtype(), y.dtype());
  EXPECT_EQ(std::memcmp(x.raw(), y.raw(), x.bytes()), 0);
}

template <class F>
std::string input_error_of(F f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

void corrupt_byte(const fs::path& path, std::streamoff offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char c;
  f.get(c);
  f.seekp(offset);
  f.put(char(c ^ 0x5a));
}

// Names and bytes of every tensor of `want` in `back`.
void expect_same_content(const CheckpointContent& back, const CheckpointContent& want) {
  ASSERT_EQ(back.model.size(), want.model.size());
  ASSERT_EQ(back.optimizer.size(), want.optimizer.size());
  for (size_t i = 0; i < want.model.size(); ++i) {
    EXPECT_EQ(back.model[i].name, want.model[i].name);
    expect_equal_bytes(back.model[i].tensor, want.model[i].tensor);
  }
  for (size_t i = 0; i < want.optimizer.size(); ++i)
    expect_equal_bytes(back.optimizer[i].tensor, want.optimizer[i].tensor);
}

CheckpointContent content_at(int64_t step) {
  CheckpointContent c;
  c.step = step;
  c.model = sample_tensors();
  Tensor m({3});
  m.f32()[0] = float(step);
  c.optimizer = {{"adamw.m/x", m}};
  c.state = {{"loader", {{"step", step}}}};
  return c;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream out;
  out << in.rdbuf();
  return out.str();
}

// Phase one of an asynchronous save of `content` on one rank, and no phase two: the writer
// writes the files and their records, then the checkpointer is destroyed without a poll (its
// job hung or died before the agreement). False when the writer did not finish in time.
bool write_without_commit(const CheckpointStore& store, const CheckpointContent& content) {
  comm::SingleCommunicator group;
  AsyncCheckpointer writer(store, group);
  writer.save(content);
  const std::string done =
      store.step_dir(content.step) + ".incomplete/rank-00000-of-00001.done.json";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!fs::exists(done))
    if (std::chrono::steady_clock::now() > deadline)
      return false;
    else
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
  return true;
}

}  // namespace

TEST(Safetensors, RoundTripKeepsOrderBytesAndMetadata) {
  std::string path = fixture::temp_dir("tessel-st") + "/t.safetensors";
  auto tensors = sample_tensors();
  write_safetensors(path, tensors, {{"format", "pt"}});
  SafetensorsFile f = read_safetensors(path);
  ASSERT_EQ(f.tensors.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(f.tensors[i].name, tensors[i].name);
    expect_equal_bytes(f.tensors[i].tensor, tensors[i].tensor);
  }
  EXPECT_EQ(f.metadata.at("format"), "pt");
  uint32_t crc = 0;  // computed while writing: the CRC of the file's bytes
  write_safetensors(path, tensors, {{"format", "pt"}}, &crc);
  EXPECT_EQ(crc, file_crc32(path));
  // The header length is a multiple of 8 so the data section is aligned.
  std::ifstream in(path, std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  EXPECT_EQ(n % 8, 0u);
}

TEST(Safetensors, AFileWithoutTensorsRoundTrips) {  // a rank's empty checkpoint share
  std::string path = fixture::temp_dir("tessel-st") + "/empty.safetensors";
  write_safetensors(path, {});
  EXPECT_TRUE(read_safetensors(path).tensors.empty());
}

TEST(Safetensors, CorruptFilesAreInputErrorsNamingTheFile) {
  std::string dir = fixture::temp_dir("tessel-st");
  std::string path = dir + "/t.safetensors";
  write_safetensors(path, sample_tensors());
  EXPECT_NE(input_error_of([&] { read_safetensors(dir + "/none.safetensors"); }).find("none"),
            std::string::npos);
  // Truncated data.
  fs::resize_file(path, fs::file_size(path) - 4);
  EXPECT_NE(input_error_of([&] { read_safetensors(path); }).find(path), std::string::npos);
  // Header length beyond the file.
  write_safetensors(path, sample_tensors());
  corrupt_byte(path, 7);
  EXPECT_NE(input_error_of([&] { read_safetensors(path); }).find("header"), std::string::npos);
  // Broken JSON.
  write_safetensors(path, sample_tensors());
  corrupt_byte(path, 8);
  EXPECT_NE(input_error_of([&] { read_safetensors(path); }).find(path), std::string::npos);
}

TEST(Checkpoint, SaveLoadRetentionAndLatest) {
  comm::SingleCommunicator group;
  std::string root = fixture::temp_dir("tessel-ckpt") + "/checkpoints";
  CheckpointStore store(root, 2);
  EXPECT_FALSE(store.latest().has_value());
  for (int64_t step : {10, 20, 30}) store.save(group, content_at(step));
  // keep = 2: step 10 is gone, `latest` names step 30.
  EXPECT_FALSE(fs::exists(root + "/step-00000010"));
  ASSERT_TRUE(store.latest().has_value());
  EXPECT_EQ(fs::path(*store.latest()).filename(), "step-00000030");
  CheckpointContent back = CheckpointStore::load(*store.latest());
  EXPECT_EQ(back.step, 30);
  EXPECT_EQ(back.state["loader"]["step"], 30);
  expect_same_content(back, content_at(30));
}

// keep = 0 keeps every checkpoint (spec: "0 = keep all").
TEST(Checkpoint, KeepZeroKeepsEveryCheckpoint) {
  comm::SingleCommunicator group;
  std::string root = fixture::temp_dir("tessel-ckpt-all") + "/checkpoints";
  CheckpointStore store(root, 0);
  for (int64_t step : {10, 20, 30}) store.save(group, content_at(step));
  for (const char* step : {"step-00000010", "step-00000020", "step-00000030"})
    EXPECT_TRUE(fs::exists(root + "/" + step)) << step;
  EXPECT_EQ(fs::path(*store.latest()).filename(), "step-00000030");
  expect_same_content(CheckpointStore::load(root + "/step-00000010"), content_at(10));
}

TEST(Checkpoint, IncompleteDirectoriesAreNeverLoaded) {
  comm::SingleCommunicator group;
  std::string root = fixture::temp_dir("tessel-ckpt") + "/checkpoints";
  CheckpointStore store(root, 3);
  store.save(group, content_at(5));
  // A crash mid-save leaves step-N.incomplete and maybe a stale `latest`.
  fs::create_directories(root + "/step-00000009.incomplete");
  std::ofstream(root + "/latest") << "step-00000009.incomplete\n";
  ASSERT_TRUE(store.latest().has_value());
  EXPECT_EQ(fs::path(*store.latest()).filename(), "step-00000005");
  // A directory whose manifest is missing is not a checkpoint.
  fs::create_directories(root + "/step-00000007");
  EXPECT_EQ(fs::path(*store.latest()).filename(), "step-00000005");
  EXPECT_NE(
      input_error_of([&] { CheckpointStore::load(root + "/step-00000007"); }).find("manifest.json"),
      std::string::npos);
}

// `latest` only points: naming an older checkpoint (a crash between the rename and its
// rewrite, a hand edit), another run's or a copy that is no `step-N` directory, it is never
// followed, and never hides the newest step directory.
TEST(Checkpoint, LatestNeverOverridesTheNewestStepDirectory) {
  comm::SingleCommunicator group;
  const std::string base = fixture::temp_dir("tessel-ckpt-latest");
  CheckpointStore other(base + "/other/checkpoints", 2);
  other.save(group, content_at(20));
  const std::string root = base + "/run/checkpoints";
  CheckpointStore store(root, 0);
  for (int64_t step : {5, 10, 15}) store.save(group, content_at(step));
  fs::copy(*other.latest(), root + "/step-00000020.old", fs::copy_options::recursive);
  for (const char* name :
       {"step-00000005", "../../other/checkpoints/step-00000020", "step-00000020.old"}) {
    std::ofstream(root + "/latest") << name << "\n";
    EXPECT_EQ(*store.latest(), root + "/step-00000015") << name;
    const auto loaded = store.load_newest_valid([](const std::string&) {});
    ASSERT_TRUE(loaded.has_value()) << name;
    EXPECT_EQ(loaded->content.step, 15) << name;
  }
  // A run without checkpoints of its own loads none, wherever its `latest` points.
  const std::string empty = base + "/empty";
  fs::create_directories(empty + "/checkpoints");
  std::ofstream(empty + "/checkpoints/latest") << "../../other/checkpoints/step-00000020\n";
  EXPECT_FALSE(CheckpointStore(empty + "/checkpoints", 2).latest().has_value());
  EXPECT_NE(input_error_of([&] { load_run_checkpoint(empty); }).find("no complete checkpoint"),
            std::string::npos);
}

TEST(Checkpoint, CorruptionIsDetectedByChecksumAndSize) {
  comm::SingleCommunicator group;
  std::string root = fixture::temp_dir("tessel-ckpt") + "/checkpoints";
  CheckpointStore store(root, 2);
  store.save(group, content_at(1));
  std::string dir = *store.latest();
  corrupt_byte(dir + "/model-00000-of-00001.safetensors",
               std::streamoff(fs::file_size(dir + "/model-00000-of-00001.safetensors") - 2));
  std::string what = input_error_of([&] { CheckpointStore::load(dir); });
  EXPECT_NE(what.find("model-00000-of-00001.safetensors"), std::string::npos) << what;
  EXPECT_NE(what.find("checksum"), std::string::npos) << what;
  store.save(group, content_at(2));
  dir = *store.latest();
  fs::resize_file(dir + "/optimizer-00000-of-00001.safetensors", 10);
  what = input_error_of([&] { CheckpointStore::load(dir); });
  EXPECT_NE(what.find("optimizer-00000-of-00001.safetensors"), std::string::npos) << what;
  // A model-only load (init_from, generate, export) neither reads nor needs the optimizer files.
  const CheckpointContent weights = CheckpointStore::load(dir, CheckpointParts::model);
  EXPECT_TRUE(weights.optimizer.empty());
  CheckpointContent want = content_at(2);
  want.optimizer.clear();
  expect_same_content(weights, want);
  std::ofstream(dir + "/manifest.json") << "{ not json";
  what = input_error_of([&] { CheckpointStore::load(dir); });
  EXPECT_NE(what.find("manifest.json"), std::string::npos) << what;
}

// When no checkpoint verifies, the error names each one with what failed in it (it used to
// name the newest alone: the others' reasons were warned about or, the oldest's, never shown).
TEST(Checkpoint, WhenNoneVerifiesTheErrorNamesEveryCheckpoint) {
  comm::SingleCommunicator group;
  std::string root = fixture::temp_dir("tessel-ckpt") + "/checkpoints";
  CheckpointStore store(root, 0);
  for (int64_t step : {1, 2}) store.save(group, content_at(step));
  const std::string older = root + "/step-00000001/model-00000-of-00001.safetensors";
  const std::string newer = root + "/step-00000002/model-00000-of-00001.safetensors";
  fs::resize_file(older, fs::file_size(older) - 1);
  corrupt_byte(newer, std::streamoff(fs::file_size(newer) - 2));
  std::vector<std::string> warned;
  const std::string what = input_error_of(
      [&] { store.load_newest_valid([&](const std::string& why) { warned.push_back(why); }); });
  for (const std::string& part : {older + ": size", newer + ": checksum mismatch"})
    EXPECT_NE(what.find(part), std::string::npos) << what;
  EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  ASSERT_EQ(warned.size(), 1u);  // while an older one was left to try
  EXPECT_NE(warned[0].find(newer), std::string::npos) << warned[0];
}

TEST(AsyncCheckpoint, ParametersChangedAfterSaveReturnsAreNotInTheCheckpoint) {
  comm::SingleCommunicator group;
  std::string root = fixture::temp_dir("tessel-ckpt") + "/checkpoints";
  CheckpointStore store(root, 2);
  AsyncCheckpointer writer(store, group);
  CheckpointContent live = content_at(3);  // views of "live" tensors
  const CheckpointContent want = content_at(3);
  writer.save(live);
  writer.wait_staged();  // what the trainer does before its optimizer step
  // The optimizer now changes everything while the writer is still writing.
  for (auto& nt : live.model) std::memset(nt.tensor.raw(), 0x7f, nt.tensor.bytes());
  for (auto& nt : live.optimizer) std::memset(nt.tensor.raw(), 0x7f, nt.tensor.bytes());
  writer.wait();
  EXPECT_EQ(writer.last_committed(), 3);
  expect_same_content(CheckpointStore::load(*store.latest()), want);
}

TEST(AsyncCheckpoint, OneSaveInFlightReusesStagingAndKeepsTheNewest) {
  comm::SingleCommunicator group;
  std::string root = fixture::temp_dir("tessel-ckpt") + "/checkpoints";
  CheckpointStore store(root, 2);
  AsyncCheckpointer writer(store, group);
  for (int64_t step : {1, 2, 3}) {
    writer.save(content_at(step));  // waits for the previous one to be committed
    EXPECT_TRUE(writer.in_flight());
    EXPECT_EQ(writer.last_committed(), step - 1 == 0 ? -1 : step - 1);
  }
  writer.wait();
  EXPECT_FALSE(writer.in_flight());
  EXPECT_EQ(fs::path(*store.latest()).filename(), "step-00000003");
  EXPECT_FALSE(fs::exists(root + "/step-00000001"));  // keep = 2
  EXPECT_TRUE(fs::exists(root + "/step-00000002/manifest.json"));
}

TEST(AsyncCheckpoint, AWriteFailureLeavesNoCheckpointAndNamesTheStep) {
  comm::SingleCommunicator group;
  std::string root = fixture::temp_dir("tessel-ckpt") + "/checkpoints";
  CheckpointStore store(root, 2);
  store.save(group, content_at(1));
  AsyncCheckpointer writer(store, group);
  writer.on_files_written = [](int64_t) { throw InputError("disk full (injected)"); };
  writer.save(content_at(2));
  std::string what = input_error_of([&] { writer.wait(); });
  EXPECT_NE(what.find("step-00000002 not saved: disk full (injected)"), std::string::npos) << what;
  EXPECT_FALSE(fs::exists(root + "/step-00000002.incomplete"));
  EXPECT_EQ(fs::path(*store.latest()).filename(), "step-00000001");
}

TEST(Checkpoint, SweepRemovesWhatAKilledSaveLeft) {
  comm::SingleCommunicator group;
  std::string root = fixture::temp_dir("tessel-ckpt") + "/checkpoints";
  CheckpointStore store(root, 2);
  store.save(group, content_at(4));
  fs::create_directories(root + "/step-00000008.incomplete");
  std::ofstream(root + "/step-00000008.incomplete/model-00000-of-00001.safetensors") << "x";
  // A deletion cut short: the renamed directory, part of its files gone.
  fs::create_directories(root + "/step-00000002.deleted");
  std::ofstream(root + "/step-00000002.deleted/model-00000-of-00001.safetensors") << "x";
  std::ofstream(root + "/latest.tmp.12345") << "step-00000008\n";
  std::ofstream(root + "/notes.tmp.txt") << "not ours";
  store.sweep_leftovers();
  EXPECT_FALSE(fs::exists(root + "/step-00000008.incomplete"));
  EXPECT_FALSE(fs::exists(root + "/step-00000002.deleted"));
  EXPECT_FALSE(fs::exists(root + "/latest.tmp.12345"));
  EXPECT_TRUE(fs::exists(root + "/notes.tmp.txt"));
  EXPECT_TRUE(fs::exists(root + "/step-00000004/manifest.json"));
}

// A save whose files every rank finished (the draft and each rank's done record are there)
// but that no agreement committed, the job having hung or died, is committed at the next
// start: the same manifest a commit writes, the tensors bitwise, `latest` and retention.
TEST(Checkpoint, RecoveryCommitsASaveEveryRankWroteButNoneCommitted) {
  comm::SingleCommunicator group;
  const std::string base = fixture::temp_dir("tessel-ckpt-recover");
  CheckpointStore store(base + "/run/checkpoints", 2);
  for (int64_t step : {2, 4}) store.save(group, content_at(step));
  ASSERT_TRUE(write_without_commit(store, content_at(8)));
  const std::string root = store.root();
  EXPECT_TRUE(fs::exists(root + "/step-00000008.incomplete/manifest.draft.json"));
  EXPECT_FALSE(fs::exists(root + "/step-00000008.incomplete/manifest.json"));
  EXPECT_EQ(fs::path(*store.latest()).filename(), "step-00000004");
  EXPECT_EQ(store.prepared(), std::optional<int64_t>(8));

  EXPECT_EQ(store.recover_prepared(), std::optional<int64_t>(8));
  store.sweep_leftovers();
  EXPECT_FALSE(fs::exists(root + "/step-00000008.incomplete"));
  EXPECT_EQ(fs::path(*store.latest()).filename(), "step-00000008");
  EXPECT_EQ(slurp(root + "/latest"), "step-00000008\n");
  EXPECT_TRUE(fs::exists(root + "/step-00000002"));  // retention waits for the next commit
  EXPECT_FALSE(store.prepared().has_value());
  const auto loaded = store.load_newest_valid([](const std::string& why) { FAIL() << why; });
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->content.step, 8);
  EXPECT_EQ(loaded->content.state, content_at(8).state);
  expect_same_content(loaded->content, content_at(8));
  // Exactly the manifest the writer's own commit writes.
  CheckpointStore committed(base + "/committed/checkpoints", 2);
  committed.save(group, content_at(8));
  EXPECT_EQ(nlohmann::json::parse(slurp(root + "/step-00000008/manifest.json")),
            nlohmann::json::parse(slurp(*committed.latest() + "/manifest.json")));
  EXPECT_FALSE(store.recover_prepared().has_value());  // nothing left to recover
  store.save(group, content_at(12));
  EXPECT_FALSE(fs::exists(root + "/step-00000002"));  // keep = 2
  EXPECT_FALSE(fs::exists(root + "/step-00000004"));
  EXPECT_TRUE(fs::exists(root + "/step-00000008"));
}

// A recovery that cannot commit says where the save stands: a hand-made step-N without a
// manifest is refused and left as it is (never deleted to make room), and a failure after the
// rename (here `latest` cannot be written) names the committed directory a restart resumes from.
TEST(Checkpoint, ARecoveryThatCannotCommitSaysWhereTheSaveStands) {
  CheckpointStore store(fixture::temp_dir("tessel-ckpt-recover-fails") + "/checkpoints", 2);
  ASSERT_TRUE(write_without_commit(store, content_at(8)));
  const std::string root = store.root(), final_dir = root + "/step-00000008";
  fs::create_directories(final_dir);
  std::ofstream(final_dir + "/NOTES.txt") << "mine\n";
  fixture::expect_input_error([&] { store.recover_prepared(); },
                              {root + "/step-00000008.incomplete: cannot commit this save",
                               final_dir + " exists without a manifest", "move it away"});
  EXPECT_TRUE(fs::exists(final_dir + "/NOTES.txt"));
  EXPECT_TRUE(fs::exists(root + "/step-00000008.incomplete"));
  fs::remove_all(final_dir);
  fs::remove(root + "/latest");
  fs::create_directories(root + "/latest/in-the-way");
  fixture::expect_input_error([&] { store.recover_prepared(); },
                              {final_dir + ": committed this save", "the run resumes from it"});
  EXPECT_TRUE(fs::exists(final_dir + "/manifest.json"));
  EXPECT_FALSE(fs::exists(root + "/step-00000008.incomplete"));
}

// generate, eval and export only load committed checkpoints; when a run's only save waits for a
// training start to commit it, their error says so.
TEST(Checkpoint, AReadOnlyLoadNamesASaveThatOnlyATrainingStartCommits) {
  const std::string run = fixture::temp_dir("tessel-ckpt-readonly");
  CheckpointStore store(run + "/checkpoints", 2);
  ASSERT_TRUE(write_without_commit(store, content_at(4)));
  fixture::expect_input_error(
      [&] { load_run_checkpoint(run); },
      {run + ": no complete checkpoint under " + run + "/checkpoints",
       "step-00000004.incomplete holds a save that every rank wrote: a training start with "
       "train.resume = true commits it"});
  fs::remove(store.root() + "/step-00000004.incomplete/rank-00000-of-00001.done.json");
  try {
    load_run_checkpoint(run);
    ADD_FAILURE() << "no InputError";
  } catch (const InputError& e) {
    EXPECT_EQ(std::string(e.what()).find("incomplete"), std::string::npos) << e.what();
  }
}

// A recovered save whose files the storage damaged fails the load's verification like any
// checkpoint, and costs nothing else: the resume falls back to the one before, and every older
// checkpoint is still there (the recovery applied no retention).
TEST(Checkpoint, ADamagedRecoveredSaveFallsBackAndKeepsTheOlderCheckpoints) {
  comm::SingleCommunicator group;
  CheckpointStore store(fixture::temp_dir("tessel-ckpt-recover-damaged") + "/checkpoints", 2);
  for (int64_t step : {2, 4}) store.save(group, content_at(step));
  ASSERT_TRUE(write_without_commit(store, content_at(8)));
  const std::string root = store.root();
  const std::string model = root + "/step-00000008.incomplete/model-00000-of-00001.safetensors";
  // The size its rank recorded, another CRC.
  corrupt_byte(model, std::streamoff(fs::file_size(model) - 1));
  EXPECT_EQ(store.recover_prepared(), std::optional<int64_t>(8));
  std::vector<std::string> warnings;
  const auto loaded =
      store.load_newest_valid([&](const std::string& why) { warnings.push_back(why); });
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->content.step, 4);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("step-00000008"), std::string::npos) << warnings[0];
  store.discard_newer_than(loaded->dir);
  EXPECT_FALSE(fs::exists(root + "/step-00000008"));
  EXPECT_TRUE(fs::exists(root + "/step-00000002"));
  EXPECT_TRUE(fs::exists(root + "/step-00000004"));
}

// Only a save every rank finished is recovered: without a rank's done record (it died in the
// write), with a record of another step or rank count, one that does not parse, without the
// draft, or at or below the newest complete checkpoint, the save is left to the sweep.
TEST(Checkpoint, ASaveWithoutEveryRanksAgreeingRecordsIsNotRecovered) {
  comm::SingleCommunicator group;
  const std::string done = "/step-00000008.incomplete/rank-00000-of-00001.done.json";
  const std::vector<std::pair<std::string, std::function<void(const std::string&)>>> cases = {
      {"done record missing", [&](const std::string& root) { fs::remove(root + done); }},
      {"done record of another step",
       [&](const std::string& root) {
         auto j = nlohmann::json::parse(slurp(root + done));
         j["step"] = 12;
         std::ofstream(root + done) << j.dump();
       }},
      {"done record of another rank count",
       [&](const std::string& root) {
         auto j = nlohmann::json::parse(slurp(root + done));
         j["ranks"] = 2;
         std::ofstream(root + done) << j.dump();
       }},
      {"done record cut short",
       [&](const std::string& root) {
         fs::resize_file(root + done, fs::file_size(root + done) / 2);
       }},
      {"done record naming another rank's file",
       [&](const std::string& root) {
         auto j = nlohmann::json::parse(slurp(root + done));
         j["files"][0]["name"] = "model-00001-of-00002.safetensors";
         std::ofstream(root + done) << j.dump();
       }},
      {"a file shorter than its done record says",
       [&](const std::string& root) {
         const std::string model =
             root + "/step-00000008.incomplete/model-00000-of-00001.safetensors";
         fs::resize_file(model, fs::file_size(model) - 1);
       }},
      {"draft missing",
       [&](const std::string& root) {
         fs::remove(root + "/step-00000008.incomplete/manifest.draft.json");
       }},
      {"not newer than the newest checkpoint",
       [&](const std::string& root) { CheckpointStore(root, 0).save(group, content_at(9)); }},
  };
  for (const auto& [what, damage] : cases) {
    SCOPED_TRACE(what);
    CheckpointStore store(fixture::temp_dir("tessel-ckpt-norecover") + "/checkpoints", 0);
    store.save(group, content_at(4));
    ASSERT_TRUE(write_without_commit(store, content_at(8)));
    damage(store.root());
    EXPECT_FALSE(store.prepared().has_value());
    EXPECT_FALSE(store.recover_prepared().has_value());
    store.sweep_leftovers();
    EXPECT_FALSE(fs::exists(store.root() + "/step-00000008.incomplete"));
    EXPECT_FALSE(fs::exists(store.root() + "/step-00000008"));
    EXPECT_NE(fs::path(*store.latest()).filename(), "step-00000008");
  }
}

TEST(Checkpoint, WritersSplitTheTensorsByBytes) {
  Tensor big({100}), mid({60}), small({30}), tiny({10});
  std::vector<NamedTensor> t = {{"a", big}, {"b", mid}, {"c", small}, {"d", tiny}};
  // a -> 0 (0 bytes so far); b -> 1; c -> 1 (240 < 400); d -> 1 (360 < 400).
  EXPECT_EQ(assign_writers(t, 2), (std::vector<int>{0, 1, 1, 1}));
  EXPECT_EQ(assign_writers(t, 1), (std::vector<int>{0, 0, 0, 0}));
  EXPECT_EQ(assign_writers(t, 5), (std::vector<int>{0, 1, 2, 3}));
}

// Optimizer state is found by its stage-free name: a pipeline stage's "stage<k>/..." restores
// one optimizer without a pipeline or another stage's under another split, and a plain
// optimizer's restores a stage's; a stage's own name wins where it is saved. Step counters
// that several stages saved must be equal: stages that took different numbers of steps cannot
// continue as one optimizer, refused naming both tensors and the settings to keep.
TEST(Checkpoint, OptimizerStateIsFoundUnderAnotherStageSplit) {
  auto counter = [](int32_t steps) {
    Tensor t({1}, DType::i32);
    t.i32()[0] = steps;
    return t;
  };
  auto moment = [](float first) {
    Tensor t({3});
    for (int i = 0; i < 3; ++i) t.f32()[i] = first + float(i);
    return t;
  };
  CheckpointContent piped;  // two stages, each with its own optimizer
  piped.optimizer = {{"stage0/adamw.step", counter(7)},
                     {"stage0/adamw.m/embed.weight", moment(1)},
                     {"stage1/adamw.step", counter(7)},
                     {"stage1/adamw.m/head.weight", moment(2)}};
  Tensor step({1}, DType::i32), embed({3}), head({3});
  restore_optimizer(
      piped, {{"adamw.step", step}, {"adamw.m/embed.weight", embed}, {"adamw.m/head.weight", head}},
      "ckpt");
  EXPECT_EQ(step.i32()[0], 7);
  expect_equal_bytes(embed, moment(1));
  expect_equal_bytes(head, moment(2));
  embed = Tensor({3});
  restore_optimizer(piped, {{"stage1/adamw.step", step}, {"stage1/adamw.m/embed.weight", embed}},
                    "ckpt");
  expect_equal_bytes(embed, moment(1));

  CheckpointContent plain;
  plain.optimizer = {{"adamw.step", counter(5)}, {"adamw.m/head.weight", moment(3)}};
  restore_optimizer(plain, {{"stage2/adamw.step", step}, {"stage2/adamw.m/head.weight", head}},
                    "ckpt");
  EXPECT_EQ(step.i32()[0], 5);
  expect_equal_bytes(head, moment(3));

  piped.optimizer[2].tensor = counter(6);
  const std::string error = input_error_of([&] {
    restore_optimizer(piped, {{"adamw.step", step}}, "ckpt");
  });
  for (const char* part : {"ckpt: optimizer state 'stage0/adamw.step' and 'stage1/adamw.step' "
                           "differ",
                           "one tensor 'adamw.step'", "different numbers of optimizer steps",
                           "parallel.pp and pipeline.layout"})
    EXPECT_NE(error.find(part), std::string::npos) << error;
  restore_optimizer(piped, {{"stage1/adamw.step", step}}, "ckpt");  // the same split
  EXPECT_EQ(step.i32()[0], 6);
  // The same names under other stage boundaries (same pp, another layout) are one counter too.
  EXPECT_NE(input_error_of([&] {
              restore_optimizer(piped, {{"stage1/adamw.step", step}}, "ckpt",
                                /*same_stage_split=*/false);
            }).find("different numbers of optimizer steps"),
            std::string::npos);
  EXPECT_NE(input_error_of([&] {
              restore_optimizer(piped, {{"stage1/adamw.v/head.weight", head}}, "ckpt");
            }).find("tensor 'stage1/adamw.v/head.weight' missing from the checkpoint"),
            std::string::npos);
}

TEST(Checkpoint, StageFreeNamesDropOnlyAStagePrefix) {
  EXPECT_EQ(stage_free_name("stage12/muon.m/blocks.0.attn.qkv.weight"),
            "muon.m/blocks.0.attn.qkv.weight");
  EXPECT_EQ(stage_free_name("stage0/experts/adamw.step"), "experts/adamw.step");
  for (const char* kept : {"adamw.step", "experts/muon.step", "stage/adamw.step", "stage1",
                           "stages1/adamw.step", "stage1x/adamw.step"})
    EXPECT_EQ(stage_free_name(kept), kept);
}

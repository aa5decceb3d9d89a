// Checkpoints of P real MPI ranks: each rank writes its share, the commit agrees over a
// communicator of the checkpointer's own while training collectives continue, and any
// rank loads the whole state; ZeRO-1 row shards are written by their ranks alone and re-cut
// on load for any rank count.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <thread>

#include "support/expect_input_error.hpp"
#include "support/param_fixture.hpp"
#include "support/train_fixture.hpp"
#include "tessel/comm/world.hpp"
#include "tessel/optim/muon.hpp"
#include "tessel/train/checkpoint.hpp"

using namespace tessel;
using namespace tessel::train;
namespace fs = std::filesystem;

namespace {

std::string shared_dir(comm::Communicator& world) {
  std::vector<uint8_t> buf(256, 0);
  if (world.rank() == 0) {
    std::string d = fixture::temp_dir("tessel-shards");
    std::copy(d.begin(), d.end(), buf.begin());
  }
  world.broadcast(buf, 0);
  return std::string(reinterpret_cast<const char*>(buf.data()));
}

// The same (replicated) state on every rank: 7 tensors of different sizes.
CheckpointContent replicated_state(int64_t step) {
  CheckpointContent c;
  c.step = step;
  for (int i = 0; i < 7; ++i) {
    Tensor t({int64_t(3 + 5 * i)});
    for (int64_t j = 0; j < t.numel(); ++j) t.f32()[j] = float(step * 100 + i * 10 + j);
    std::string name = "w";  // (not "w" + ...: a GCC 12 -Wrestrict false positive)
    name += std::to_string(i);
    c.model.push_back({name, t});
  }
  Tensor s({1}, DType::i32);
  s.i32()[0] = int32_t(step);
  c.optimizer.push_back({"adamw.step", s});
  c.state = {{"loader", {{"step", step}}}};
  return c;
}

}  // namespace

TEST(CheckpointShards, EveryRankWritesItsShareAndAnyRankLoadsTheWhole) {
  comm::Communicator& world = comm::world();
  const int P = world.size();
  std::string root = shared_dir(world) + "/checkpoints";
  CheckpointStore store(root, 2);
  auto ckpt_comm = world.split(0, world.rank());
  {
    AsyncCheckpointer writer(store, *ckpt_comm);
    writer.save(replicated_state(5));
    writer.wait_staged();
    // Training goes on (collectives on another communicator) while the commit progresses.
    // Ranks see the commit finish at different polls, so they agree on when to stop: a
    // rank-local loop condition left ranks in different numbers of all-reduces (a hang).
    double x = 1;
    for (int i = 0; i < 200 && !comm::all_agree(world, !writer.in_flight()); ++i) {
      world.all_reduce(std::span<double>(&x, 1));
      writer.poll();
    }
    writer.wait();
    EXPECT_EQ(writer.last_committed(), 5);
  }
  world.barrier();
  std::string dir = root + "/step-00000005";
  for (int r = 0; r < P; ++r) {
    char name[64];
    std::snprintf(name, sizeof name, "/model-%05d-of-%05d.safetensors", r, P);
    EXPECT_TRUE(fs::exists(dir + name)) << name;
  }
  CheckpointContent back = CheckpointStore::load(dir);
  CheckpointContent want = replicated_state(5);
  ASSERT_EQ(back.model.size(), want.model.size());
  for (size_t i = 0; i < want.model.size(); ++i) {
    EXPECT_EQ(back.model[i].name, want.model[i].name);
    EXPECT_EQ(std::memcmp(back.model[i].tensor.raw(), want.model[i].tensor.raw(),
                          want.model[i].tensor.bytes()),
              0);
  }
  ASSERT_EQ(back.optimizer.size(), 1u);
  EXPECT_EQ(back.optimizer[0].tensor.i32()[0], 5);
  world.barrier();
}

TEST(CheckpointShards, AFailureOnOneRankStopsEveryRankAndKeepsThePreviousCheckpoint) {
  comm::Communicator& world = comm::world();
  std::string root = shared_dir(world) + "/checkpoints";
  CheckpointStore store(root, 2);
  store.save(world, replicated_state(1));
  auto ckpt_comm = world.split(0, world.rank());
  AsyncCheckpointer writer(store, *ckpt_comm);
  if (world.rank() == world.size() - 1)
    writer.on_files_written = [](int64_t) { throw InputError("injected write failure"); };
  writer.save(replicated_state(2));
  std::string what;
  try {
    writer.wait();
  } catch (const InputError& e) {
    what = e.what();
  }
  EXPECT_NE(what.find("step-00000002 not saved"), std::string::npos) << what;
  world.barrier();
  ASSERT_TRUE(store.latest().has_value());
  EXPECT_EQ(fs::path(*store.latest()).filename(), "step-00000001");
  EXPECT_FALSE(fs::exists(root + "/step-00000002"));
  world.barrier();
}

// Sharded state (experts): each rank lists its own tensors besides the replicated ones; each is
// written once, by its rank, and the load holds replicated then own tensors in rank order,
// bitwise. A name listed by two ranks is refused before anything is written.
TEST(CheckpointShards, OwnTensorsAreWrittenOnceByTheirRank) {
  comm::Communicator& world = comm::world();
  const int P = world.size(), r = world.rank();
  std::string root = shared_dir(world) + "/checkpoints";
  CheckpointStore store(root, 2);
  auto own = [](int rank) {  // rank r owns r + 1 tensors
    std::vector<NamedTensor> out;
    for (int i = 0; i <= rank; ++i) {
      Tensor t({int64_t(2 + i)});
      for (int64_t j = 0; j < t.numel(); ++j) t.f32()[j] = float(1000 * rank + 10 * i + j);
      out.push_back({"experts." + std::to_string(rank) + "." + std::to_string(i), t});
    }
    return out;
  };
  CheckpointContent mine = replicated_state(3);
  mine.own_model = own(r);
  mine.own_optimizer = {{"m/experts." + std::to_string(r), own(r)[0].tensor}};
  store.save(world, mine);
  CheckpointContent back = CheckpointStore::load(root + "/step-00000003");
  CheckpointContent want = replicated_state(3);
  for (int q = 0; q < P; ++q)
    for (auto& t : own(q)) want.model.push_back(t);
  ASSERT_EQ(back.model.size(), want.model.size());
  for (size_t i = 0; i < want.model.size(); ++i) {
    EXPECT_EQ(back.model[i].name, want.model[i].name);
    ASSERT_EQ(back.model[i].tensor.bytes(), want.model[i].tensor.bytes());
    EXPECT_EQ(std::memcmp(back.model[i].tensor.raw(), want.model[i].tensor.raw(),
                          want.model[i].tensor.bytes()),
              0)
        << want.model[i].name;
  }
  ASSERT_EQ(back.optimizer.size(), size_t(1 + P));
  for (int q = 0; q < P; ++q)
    EXPECT_EQ(back.optimizer[size_t(1 + q)].name, "m/experts." + std::to_string(q));

  CheckpointContent twice = replicated_state(4);
  twice.own_model = own(0);  // every rank claims rank 0's tensors
  if (P > 1) {
    EXPECT_THROW(store.save(world, twice), Error);
  }
  world.barrier();
}

namespace {

std::string shard_file(const std::string& dir, int rank, int ranks) {
  char name[80];
  std::snprintf(name, sizeof name, "/optimizer_shards-%05d-of-%05d.safetensors", rank, ranks);
  return dir + name;
}

// A sharded (ZeRO-1) Muon-family optimizer over the fixture's parameters, one fused matrix in
// three row blocks; global-scope selection, so every rank count computes the same bits
// (muon_dion3.md T5).
struct Zero1 {
  fixture::ParamSet ps{fixture::muon_test_specs(), 1};
  optim::Muon opt;
  Zero1(optim::MuonVariant variant, comm::Communicator* group)
      : opt(ps.params, hyper(variant), {1e-2, 0.9, 0.95, 1e-8, 0.1},
            {ParamTag::hidden_matrix, ParamTag::embedding, ParamTag::head}, group,
            {{"b1.qkv", {8, 8, 8}}}) {}
  static optim::MuonHyper hyper(optim::MuonVariant variant) {
    optim::MuonHyper h;
    h.variant = variant;
    h.local_scope = false;
    h.weight_decay = 0.1;
    h.ns.gram_min = 8;
    return h;
  }
  void run(uint64_t seed, int steps) {
    for (int s = 0; s < steps; ++s) {
      ps.random_grads(seed + uint64_t(s));
      opt.step(0.5 + 0.2 * s);
    }
  }
  // What the trainer saves: the parameters and the whole state split between the ranks, the
  // row shards by their ranks.
  CheckpointContent content(int64_t step) {
    CheckpointContent c;
    c.step = step;
    c.model = {{"values", ps.values}};
    for (auto& st : opt.state())
      if (st.is_shard())
        c.optimizer_shards.push_back({st.name, st.tensor, st.row0, st.rows});
      else
        c.optimizer.push_back({st.name, st.tensor});
    return c;
  }
  void restore(const CheckpointContent& from, const std::string& dir) {
    restore_tensor(from.model, "values", ps.values, dir);
    std::vector<RowShard> wanted;
    for (auto& st : opt.state()) wanted.push_back({st.name, st.tensor, st.row0, st.rows});
    restore_optimizer(from, wanted, dir);
  }
};

}  // namespace

// ZeRO-1 state saved on P ranks as row shards (no rank's save holds more than its own rows
// of the momentum, none of another's) resumes on 1, 2 and 4 ranks (those <= P): the
// continuation equals the uninterrupted P-rank run bitwise. On P ranks again each rank reads
// its own shard file only: the other ranks' files are damaged in its private copy.
TEST(CheckpointShards, Zero1RowShardsResumeBitwiseOnAnyRankCount) {
  comm::Communicator& world = comm::world();
  const int P = world.size(), me = world.rank();
  for (optim::MuonVariant v : {optim::MuonVariant::muon, optim::MuonVariant::dion3}) {
    SCOPED_TRACE(testing::Message() << "variant " << int(v));
    Zero1 uninterrupted(v, &world);
    uninterrupted.run(10, 2);
    uninterrupted.run(20, 3);

    std::string root = shared_dir(world);
    Zero1 saver(v, &world);
    saver.run(10, 2);
    CheckpointContent content = saver.content(2);
    const std::string momentum = saver.opt.name() + ".m/";
    int64_t rows_here = 0, momentum_here = 0, momentum_all = 0;
    for (const RowShard& s : content.optimizer_shards)
      if (s.name.rfind(momentum, 0) == 0) momentum_here += s.tensor.numel();
    for (const NamedTensor& t : content.optimizer)
      EXPECT_NE(t.name.rfind(momentum, 0), 0u) << t.name << " saved whole";
    for (const Parameter& p : saver.ps.params)
      if (p.tag == ParamTag::hidden_matrix) {
        const int64_t rows = p.value.shape()[0], cols = p.value.shape()[1];
        for (int64_t b :
             p.name == "b1.qkv" ? std::vector<int64_t>{8, 8, 8} : std::vector<int64_t>{rows}) {
          const int64_t per = (b + P - 1) / P;
          rows_here += (std::min(b, (me + 1) * per) - std::min(b, me * per)) * cols;
        }
        momentum_all += rows * cols;
      }
    EXPECT_EQ(momentum_here, rows_here);  // this rank's ceil(rows / P) rows of each block
    world.all_reduce(std::span<int64_t>(&momentum_here, 1));
    EXPECT_EQ(momentum_here, momentum_all);
    CheckpointStore(root, 2).save(world, content);
    const std::string dir = root + "/step-00000002";
    EXPECT_TRUE(fs::exists(shard_file(dir, me, P)));

    for (int resume_ranks : {1, 2, 4}) {
      if (resume_ranks > P) continue;
      SCOPED_TRACE(testing::Message() << "resumed on " << resume_ranks);
      auto group = world.split(me < resume_ranks ? 0 : 1, me);
      if (me < resume_ranks) {
        std::string from = dir;
        if (resume_ranks == P) {  // a private copy with every other rank's shard file damaged
          from = fixture::temp_dir("tessel-own-shard");
          fs::copy(dir, from);
          for (int q = 0; q < P; ++q)
            if (q != me) {
              std::fstream f(shard_file(from, q, P),
                             std::ios::in | std::ios::out | std::ios::binary);
              f.seekp(-1, std::ios::end);
              f.put('\x5a');
            }
        }
        Zero1 resumed(v, group.get());
        resumed.restore(CheckpointStore::load(from), from);
        EXPECT_EQ(resumed.opt.step_count(), 2);
        resumed.run(20, 3);
        EXPECT_EQ(resumed.ps.snapshot(), uninterrupted.ps.snapshot());
      }
      world.barrier();
    }
  }
}

namespace {

// Phase one of a save of `content` on every rank, and no phase two: each rank's writer writes
// its files and done record, then every checkpointer is destroyed without a poll (the job hung
// or died before the agreement). False on a rank whose writer did not finish in time.
bool write_without_commit(comm::Communicator& world, const CheckpointStore& store,
                          const CheckpointContent& content) {
  auto group = world.split(0, world.rank());
  bool written = false;
  {
    AsyncCheckpointer writer(store, *group);
    writer.save(content);
    char done[96];
    std::snprintf(done, sizeof done, "/step-%08lld.incomplete/rank-%05d-of-%05d.done.json",
                  static_cast<long long>(content.step), world.rank(), world.size());
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!(written = fs::exists(store.root() + done)) &&
           std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  world.barrier();
  return written;
}

}  // namespace

// A save that every rank finished writing but whose commit its job did not live to agree on is
// committed by rank 0 at the next start, and resumes bitwise as the uninterrupted run (ZeRO-1
// row shards and each rank's own tensors too), on the saving rank count and on one rank.
// Without one rank's done record (it died in its write) the save is removed instead.
TEST(CheckpointShards, ASaveEveryRankWroteIsRecoveredWhenItsJobEndedBeforeTheCommit) {
  comm::Communicator& world = comm::world();
  const int P = world.size(), me = world.rank();
  Zero1 uninterrupted(optim::MuonVariant::muon, &world);
  uninterrupted.run(10, 2);
  uninterrupted.run(20, 3);
  const std::string root = shared_dir(world) + "/checkpoints";
  CheckpointStore store(root, 2);
  store.save(world, replicated_state(1));
  Zero1 saver(optim::MuonVariant::muon, &world);
  saver.run(10, 2);
  CheckpointContent content = saver.content(2);
  auto own = [](int rank) {
    Tensor t({3});
    for (int64_t j = 0; j < 3; ++j) t.f32()[j] = float(100 * rank + j);
    return NamedTensor{"own." + std::to_string(rank), t};
  };
  content.own_model = {own(me)};
  EXPECT_TRUE(write_without_commit(world, store, content));
  EXPECT_EQ(fs::path(store.latest().value_or("")).filename(), "step-00000001");
  if (me == 0) {
    EXPECT_EQ(store.recover_prepared(), std::optional<int64_t>(2));
    store.sweep_leftovers();
  }
  world.barrier();
  const std::string dir = root + "/step-00000002";
  EXPECT_EQ(store.latest().value_or(""), dir);
  const CheckpointContent back = CheckpointStore::load(dir);
  for (int q = 0; q < P; ++q) {
    const NamedTensor want = own(q);
    Tensor got({3});
    restore_tensor(back.model, want.name, got, dir);
    EXPECT_EQ(std::memcmp(got.raw(), want.tensor.raw(), want.tensor.bytes()), 0) << want.name;
  }
  for (int resume_ranks : std::set<int>{1, P}) {
    SCOPED_TRACE(testing::Message() << "resumed on " << resume_ranks);
    auto group = world.split(me < resume_ranks ? 0 : 1, me);
    if (me < resume_ranks) {
      Zero1 resumed(optim::MuonVariant::muon, group.get());
      resumed.restore(back, dir);
      EXPECT_EQ(resumed.opt.step_count(), 2);
      resumed.run(20, 3);
      EXPECT_EQ(resumed.ps.snapshot(), uninterrupted.ps.snapshot());
    }
    world.barrier();
  }

  EXPECT_TRUE(write_without_commit(world, store, saver.content(3)));
  if (me == 0) {
    char done[64];
    std::snprintf(done, sizeof done, "/rank-%05d-of-%05d.done.json", P - 1, P);
    fs::remove(root + "/step-00000003.incomplete" + done);
    EXPECT_FALSE(store.recover_prepared().has_value());
    store.sweep_leftovers();
    EXPECT_FALSE(fs::exists(root + "/step-00000003.incomplete"));
  }
  world.barrier();
  EXPECT_EQ(store.latest().value_or(""), dir);
  world.barrier();
}

// A checkpoint whose row shards do not describe their tensors once is refused with the
// manifest and the tensor named; a damaged shard file is refused when it is read; a save
// that lists a tensor whole and in row shards is refused before anything is written.
TEST(CheckpointShards, InconsistentRowShardsAreRefused) {
  comm::Communicator& world = comm::world();
  std::string root = shared_dir(world);
  Zero1 saver(optim::MuonVariant::muon, &world);
  saver.run(10, 1);
  CheckpointStore store(root, 2);
  CheckpointContent both = saver.content(1);
  both.optimizer.push_back({both.optimizer_shards[0].name, both.optimizer_shards[0].tensor});
  EXPECT_THROW(store.save(world, both), Error);
  store.save(world, saver.content(1));
  const std::string dir = root + "/step-00000001";
  if (world.rank() == 0) {
    auto edited = [&](const std::function<void(nlohmann::json&)>& edit) {
      const std::string copy = fixture::temp_dir("tessel-bad-shards");
      fs::copy(dir, copy);
      nlohmann::json manifest;
      std::ifstream(copy + "/manifest.json") >> manifest;
      edit(manifest);
      std::ofstream(copy + "/manifest.json") << manifest.dump();
      return copy;
    };
    const std::string gap = edited([](nlohmann::json& m) { m["shards"][0]["rows"][0] = 1; });
    fixture::expect_input_error([&] { CheckpointStore::load(gap); },
                                {"manifest.json", "row shards of 'muon.m/", "do not cover"});
    const std::string shape = edited([](nlohmann::json& m) { m["shards"][0]["shape"][1] = 3; });
    fixture::expect_input_error([&] { CheckpointStore::load(shape); }, {"disagree on its shape"});

    const std::string damaged = fixture::temp_dir("tessel-bad-shards");
    fs::copy(dir, damaged);
    {
      std::fstream f(shard_file(damaged, 0, world.size()),
                     std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(-1, std::ios::end);
      f.put('\x5a');
    }
    Zero1 one(optim::MuonVariant::muon, nullptr);
    const CheckpointContent loaded = CheckpointStore::load(damaged);  // sizes agree
    fixture::expect_input_error([&] { one.restore(loaded, damaged); },
                                {"optimizer_shards-00000", "checksum mismatch"});
  }
  world.barrier();
}

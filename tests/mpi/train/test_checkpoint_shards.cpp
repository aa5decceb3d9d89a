// Checkpoints of P real MPI ranks: each rank writes its share, the commit agrees over a
// communicator of the checkpointer's own while training collectives continue, and any
// rank loads the whole state.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>

#include "support/train_fixture.hpp"
#include "tessel/comm/world.hpp"
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

#pragma once
// Helpers for multi-rank trainer tests: directories every rank knows, one shared dataset,
// and the resume check.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "support/train_fixture.hpp"
#include "tessel/comm/communicator.hpp"
#include "tessel/train/trainer.hpp"

namespace tessel::fixture {

// A directory made by rank 0 and known to all ranks.
inline std::string shared_temp_dir(comm::Communicator& world, const std::string& stem) {
  std::vector<uint8_t> buf(256, 0);
  if (world.rank() == 0) {
    std::string d = temp_dir(stem);
    std::copy(d.begin(), d.end(), buf.begin());
  }
  world.broadcast(buf, 0);
  return std::string(reinterpret_cast<const char*>(buf.data()));
}

// A dataset made by rank 0 with `make` into `dir` (once: `dir` empty), known to all ranks.
inline const std::string& shared_once(comm::Communicator& world, std::string& dir,
                                      std::string (*make)(const std::string&)) {
  if (dir.empty()) {
    dir = shared_temp_dir(world, "tessel-dp-data");
    if (world.rank() == 0) make(dir);
    world.barrier();
  }
  return dir;
}

// The synthetic dataset, made once per test binary by rank 0.
inline std::string shared_dataset(comm::Communicator& world) {
  static std::string dir;
  return shared_once(world, dir, make_dataset);
}

// The second synthetic dataset (make_other_dataset), made once per test binary by rank 0.
inline std::string shared_other_dataset(comm::Communicator& world) {
  static std::string dir;
  return shared_once(world, dir, make_other_dataset);
}

// The synthetic SFT data set (make_sft_dataset), made once per test binary by rank 0.
inline std::string shared_sft_dataset(comm::Communicator& world) {
  static std::string dir;
  return shared_once(world, dir, make_sft_dataset);
}

// The tiny model with 4 blocks for pipeline runs, in a directory every rank knows: 8 steps of
// 4 micro-batches per rank, validated every 4, clipping in the early steps.
inline train::Config pipeline_config(comm::Communicator& world, const std::string& stem) {
  train::Config c = tiny_config(shared_dataset(world), shared_temp_dir(world, stem));
  c.model.layers = 4;
  c.train.steps = 8;
  c.train.accum = 4;
  c.train.eval_every = 4;
  c.train.grad_clip = 0.5;  // clipping fires in the early steps
  return c;
}

// Runs `c` to its end, lets rank 0 `break_newest` (remove or damage the newest checkpoint),
// then runs `c` again: the second run must resume from step `from` and repeat the first run's
// losses from there bitwise. Returns the first run.
inline train::TrainResult expect_resume_continues_bitwise(
    comm::Communicator& world, const train::Config& c, int64_t from,
    const std::function<void()>& break_newest) {
  auto full = run_on(world, c);
  if (world.rank() == 0) break_newest();
  world.barrier();
  auto resumed = run_on(world, c);
  EXPECT_EQ(resumed.resumed_from, from);
  EXPECT_EQ(int64_t(resumed.steps.size()), c.train.steps - from);
  for (size_t i = 0; i < resumed.steps.size() && from + i < full.steps.size(); ++i)
    EXPECT_EQ(resumed.steps[i].loss, full.steps[size_t(from) + i].loss) << "step " << from + 1 + i;
  return full;
}

// A run resumed from step `from` follows `full` from there up to summation order: losses
// within 1e-5 relative (a wrong data position or a lost optimizer tensor moves them by far
// more).
inline void expect_follows_to_rounding(const train::TrainResult& resumed,
                                       const train::TrainResult& full, int64_t from) {
  EXPECT_EQ(resumed.resumed_from, from);
  ASSERT_EQ(int64_t(resumed.steps.size()), int64_t(full.steps.size()) - from);
  for (size_t i = 0; i < resumed.steps.size(); ++i) {
    const double want = full.steps[size_t(from) + i].loss;
    EXPECT_NEAR(resumed.steps[i].loss, want, 1e-5 * want) << "step " << from + 1 + int64_t(i);
  }
}

}  // namespace tessel::fixture

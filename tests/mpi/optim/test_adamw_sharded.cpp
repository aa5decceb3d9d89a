// AdamW sharded over the ranks (ZeRO-1) on 2 and 4 ranks against AdamW on one process:
// bitwise equal parameters and gathered state, 1/P of the state per rank, one all_gatherv
// per step, and checkpoints that move between one process and P ranks.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "support/optimizer_state.hpp"
#include "support/param_fixture.hpp"
#include "tessel/comm/world.hpp"
#include "tessel/optim/adamw.hpp"

using namespace tessel;
using namespace tessel::optim;
using tessel::fixture::ParamSet;
using tessel::fixture::ParamSpec;
using tessel::fixture::state_bytes;

namespace {

const std::vector<ParamTag> kDecay = {ParamTag::hidden_matrix, ParamTag::embedding};
const AdamWHyper kHyper{1e-2, 0.9, 0.95, 1e-8, 0.1};

// Steps with gradients seeded from `seed`, `seed` + 1, ... (the same on every rank, as after
// the dp all-reduce) and an lr scale that follows the seed, so a run split in two repeats it.
void run(AdamW& opt, ParamSet& ps, uint64_t seed, int steps) {
  for (uint64_t s = seed; s < seed + uint64_t(steps); ++s) {
    ps.random_grads(s);
    opt.step(0.5 + 0.001 * double(s));
  }
}

// 3 elements, fewer than 4 ranks: a rank with an empty range. (In the muon test set the
// ranges cut through parameters.)
std::vector<ParamSpec> three_elements() {
  return {{"tiny", ParamTag::bias, {3}}};
}

// Every other parameter of a set: not one buffer, so the update is gathered through a copy
// (the whole set is gathered in place).
ParameterList every_other(const ParameterList& all) {
  ParameterList out;
  for (size_t i = 0; i < all.size(); i += 2) out.push_back(all[i]);
  return out;
}

TEST(AdamWSharded, BitwiseEqualToOneProcessWithItsShareOfTheState) {
  comm::Communicator& world = comm::world();
  const int P = world.size();
  for (const auto& [specs, subset] :
       {std::pair{fixture::muon_test_specs(), false}, std::pair{fixture::muon_test_specs(), true},
        std::pair{three_elements(), false}}) {
    SCOPED_TRACE(testing::Message() << specs.size() << " parameters, subset " << subset);
    ParamSet dist(specs, 1), one(specs, 1);
    AdamW a(subset ? every_other(dist.params) : dist.params, kHyper, kDecay, &world);
    AdamW b(subset ? every_other(one.params) : one.params, kHyper, kDecay, nullptr);
    int64_t total = 0;
    for (const Parameter& p : subset ? every_other(one.params) : one.params)
      total += p.value.numel();
    const int64_t chunk = (total + P - 1) / P;
    EXPECT_EQ(a.state_elements(),
              std::max<int64_t>(0, std::min(chunk, total - world.rank() * chunk)));
    EXPECT_EQ(b.state_elements(), total);
    run(a, dist, 100, 3);
    run(b, one, 100, 3);
    EXPECT_EQ(dist.snapshot(), one.snapshot());
    EXPECT_EQ(state_bytes(a), state_bytes(b));  // gathered: independent of P
    // And the step after a state() (which gathers) is still the same.
    run(a, dist, 200, 1);
    run(b, one, 200, 1);
    EXPECT_EQ(dist.snapshot(), one.snapshot());
  }
}

TEST(AdamWSharded, OneAllGatherOfTheParametersPerStep) {
  comm::Communicator& world = comm::world();
  ParamSet ps(fixture::muon_test_specs(), 2);
  AdamW opt(ps.params, kHyper, kDecay, &world);
  ps.random_grads(1);
  world.reset_traffic();
  opt.step(1.0);
  opt.step(1.0);
  const comm::Traffic t = world.traffic();
  const uint64_t calls = world.size() > 1 ? 2 : 0;  // one process: nothing to shard
  EXPECT_EQ(t.calls.all_gather, calls);
  EXPECT_EQ(t.calls.total(), calls);
  EXPECT_EQ(t.bytes.all_gather, calls * uint64_t(opt.state_elements()) * sizeof(float));
}

// A checkpoint holds full tensors: state saved on one process continues on P ranks, and state
// saved on P ranks continues on one process, both bitwise as the uninterrupted run.
TEST(AdamWSharded, CheckpointsMoveBetweenOneProcessAndPRanks) {
  comm::Communicator& world = comm::world();
  ParamSet ps(fixture::muon_test_specs(), 3);
  AdamW one(ps.params, kHyper, kDecay, nullptr);
  run(one, ps, 300, 2);
  const auto saved_one = state_bytes(one);
  const auto at_save = ps.snapshot();
  run(one, ps, 400, 2);
  const auto expected = ps.snapshot();

  std::memcpy(ps.values.f32(), at_save.data(), at_save.size() * sizeof(float));
  AdamW sharded(ps.params, kHyper, kDecay, &world);
  fixture::load_state_bytes(sharded, saved_one);
  run(sharded, ps, 400, 1);
  const auto saved_sharded = state_bytes(sharded);
  const auto mid = ps.snapshot();
  run(sharded, ps, 401, 1);
  EXPECT_EQ(ps.snapshot(), expected);

  std::memcpy(ps.values.f32(), mid.data(), mid.size() * sizeof(float));
  AdamW back(ps.params, kHyper, kDecay, nullptr);
  fixture::load_state_bytes(back, saved_sharded);
  run(back, ps, 401, 1);
  EXPECT_EQ(ps.snapshot(), expected);
}

}  // namespace

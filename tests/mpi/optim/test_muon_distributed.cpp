// Distributed Muon / Dion2 / Dion3 (ZeRO-1 megabatch, replicated, all-gather baseline) on 2
// and 4 ranks against the same optimizer on one process: bitwise equal parameters and state,
// collectives per step, bitwise resume.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "support/optimizer_state.hpp"
#include "support/param_fixture.hpp"
#include "tessel/comm/world.hpp"
#include "tessel/optim/muon.hpp"

using namespace tessel;
using namespace tessel::optim;
using tessel::fixture::ParamSet;
using tessel::fixture::state_bytes;

namespace {

const std::vector<ParamTag> kDecay = {ParamTag::hidden_matrix, ParamTag::embedding, ParamTag::head};
AdamWHyper adam() {
  return {1e-2, 0.9, 0.95, 1e-8, 0.1};
}

MuonHyper hyper(MuonVariant v, MuonMode mode, bool local) {
  MuonHyper h;
  h.variant = v;
  h.mode = mode;
  h.local_scope = local;
  h.lr = 0.05;
  h.weight_decay = 0.1;
  h.nesterov = v == MuonVariant::muon;
  h.ns.gram_min = 8;  // the Gram path on the wide test matrices too
  return h;
}

// Steps with gradients seeded from `seed` (the same on every rank, as after the dp
// all-reduce).
void run(Muon& opt, ParamSet& ps, uint64_t seed, int steps) {
  for (int s = 0; s < steps; ++s) {
    ps.random_grads(seed + uint64_t(s));
    opt.step(0.5 + 0.2 * s);
  }
}

struct Case {
  MuonVariant variant;
  MuonMode mode;
  bool local;
};

// Global-scope selection and plain Muon give, on P ranks, bitwise what one process gives.
TEST(MuonDistributed, BitwiseEqualToOneProcess) {
  comm::Communicator& world = comm::world();
  for (MuonVariant v : {MuonVariant::muon, MuonVariant::dion2, MuonVariant::dion3})
    for (MuonMode mode : {MuonMode::sharded, MuonMode::replicated, MuonMode::allgather}) {
      SCOPED_TRACE(testing::Message() << "variant " << int(v) << " mode " << int(mode));
      const MuonHyper h = hyper(v, mode, false);
      ParamSet dist(fixture::muon_test_specs(), 1), one(fixture::muon_test_specs(), 1);
      Muon a(dist.params, h, adam(), kDecay, &world);
      Muon b(one.params, h, adam(), kDecay, nullptr);
      run(a, dist, 100, 3);
      run(b, one, 100, 3);
      EXPECT_EQ(dist.snapshot(), one.snapshot());
      // The gathered checkpoint state is layout-independent.
      EXPECT_EQ(state_bytes(a), state_bytes(b));
    }
}

// Local scope selects per shard, so it differs from one process, but every rank ends with
// the same parameters and state (the parameters stay replicated).
TEST(MuonDistributed, LocalScopeKeepsRanksInAgreement) {
  comm::Communicator& world = comm::world();
  for (MuonVariant v : {MuonVariant::dion2, MuonVariant::dion3}) {
    ParamSet ps(fixture::muon_test_specs(), 2);
    Muon opt(ps.params, hyper(v, MuonMode::sharded, true), adam(), kDecay, &world);
    run(opt, ps, 200, 3);
    std::vector<float> mine = ps.snapshot(), root = mine;
    world.broadcast(root, 0);
    EXPECT_EQ(mine, root);
  }
}

// Sharded: one all_to_allv and one all_gatherv per shape group and step, nothing else;
// replicated: one all_gatherv per group; allgather baseline: one per matrix.
TEST(MuonDistributed, CollectivesPerStep) {
  comm::Communicator& world = comm::world();
  for (Case c : {Case{MuonVariant::muon, MuonMode::sharded, false},
                 Case{MuonVariant::dion3, MuonMode::sharded, true},
                 Case{MuonVariant::muon, MuonMode::replicated, false},
                 Case{MuonVariant::muon, MuonMode::allgather, false}}) {
    ParamSet ps(fixture::muon_test_specs(), 3);
    Muon opt(ps.params, hyper(c.variant, c.mode, c.local), adam(), kDecay, &world);
    EXPECT_EQ(opt.shape_groups(), 4);
    ps.random_grads(1);
    world.reset_traffic();
    opt.step(1.0);
    opt.step(1.0);
    const comm::TrafficCounts calls = world.traffic().calls;
    const uint64_t groups = uint64_t(opt.shape_groups()), mats = uint64_t(opt.matrices());
    if (c.mode == MuonMode::sharded) {
      EXPECT_EQ(calls.all_to_all, 2 * groups);
      EXPECT_EQ(calls.all_gather, 2 * groups);
      EXPECT_EQ(calls.total(), 2 * 2 * groups);  // 2 steps
    } else if (c.mode == MuonMode::replicated) {
      EXPECT_EQ(calls.total(), 2 * groups);
      EXPECT_EQ(calls.all_gather, 2 * groups);
    } else {
      EXPECT_EQ(calls.total(), 2 * mats);
      EXPECT_EQ(calls.all_gather, 2 * mats);
    }
  }
}

// Save (the collective state()), run on, restore into a fresh distributed optimizer: the
// continuation repeats bitwise.
TEST(MuonDistributed, ResumeIsBitwise) {
  comm::Communicator& world = comm::world();
  for (MuonVariant v : {MuonVariant::muon, MuonVariant::dion3}) {
    const MuonHyper h = hyper(v, MuonMode::sharded, true);
    ParamSet ps(fixture::muon_test_specs(), 4);
    Muon opt(ps.params, h, adam(), kDecay, &world);
    run(opt, ps, 300, 2);
    const auto saved = state_bytes(opt);
    const auto params = ps.snapshot();
    run(opt, ps, 400, 2);
    const auto expected = ps.snapshot();
    std::memcpy(ps.values.f32(), params.data(), params.size() * sizeof(float));
    Muon fresh(ps.params, h, adam(), kDecay, &world);
    fixture::load_state_bytes(fresh, saved);
    run(fresh, ps, 400, 2);
    EXPECT_EQ(ps.snapshot(), expected);
  }
}

}  // namespace

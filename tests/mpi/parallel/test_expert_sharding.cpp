// The expert-sharded gradient norm on 2 and 4 ranks: the dense gradients are replicated over
// the ep group, each rank holds its own experts'; the norm equals the naive norm of the whole
// set, and every rank gets the same bits.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "support/param_fixture.hpp"
#include "tessel/comm/world.hpp"
#include "tessel/optim/grad_clip.hpp"
#include "tessel/parallel/expert_sharding.hpp"

using namespace tessel;

TEST(ExpertSharding, GradNormAddsEachEpRanksExpertsOnceInEveryRanksBits) {
  comm::Communicator& world = comm::world();
  const int P = world.size();
  const std::vector<fixture::ParamSpec> dense_specs = {
      {"embed", ParamTag::embedding, {30, 16}}, {"b0.qkv", ParamTag::hidden_matrix, {4100, 3}}};
  const std::vector<fixture::ParamSpec> expert_specs = {
      {"fc_in", ParamTag::hidden_matrix, {24, 16}}, {"fc_out", ParamTag::hidden_matrix, {16, 777}}};
  fixture::ParamSet dense(dense_specs, 1);
  dense.random_grads(2);                   // the same on every rank
  std::vector<fixture::ParamSet> experts;  // every rank's experts, rank r's seeded by r
  for (int r = 0; r < P; ++r) {
    experts.emplace_back(expert_specs, 3);
    experts.back().random_grads(10 + uint64_t(r));
  }
  const double norm =
      parallel::expert_sharded_grad_norm(dense.params, experts[size_t(world.rank())].params, world);

  ParameterList all = dense.params;
  for (const auto& e : experts) all.insert(all.end(), e.params.begin(), e.params.end());
  const double naive = optim::naive::global_grad_norm(all);
  EXPECT_NEAR(norm, naive, 1e-12 * naive);
  // A rank that added its own experts only, or every rank's dense part, would be off by far more.
  std::vector<double> each(static_cast<size_t>(P));
  world.all_gather(&norm, each.data(), 1, comm::ElemType::f64);
  for (int r = 0; r < P; ++r) EXPECT_EQ(std::memcmp(&each[size_t(r)], &norm, sizeof norm), 0) << r;
}

// The expert-sharded gradient squares on 2 and 4 ranks: the dense gradients are replicated over
// the ep group, each rank holds its own experts'; their sum equals the naive norm^2 of the whole
// set, and every rank gets the same bits.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "support/param_fixture.hpp"
#include "tessel/comm/world.hpp"
#include "tessel/optim/grad_clip.hpp"
#include "tessel/parallel/expert_sharding.hpp"

using namespace tessel;

TEST(ExpertSharding, GradSquaresAddEachEpRanksExpertsOnceInEveryRanksBits) {
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
  // Registry order with the experts between dense parameters, as an MoE block has them.
  const ParameterList& mine = experts[size_t(world.rank())].params;
  const ParameterList held = {dense.params[0], mine[0], dense.params[1], mine[1]};
  const std::vector<double> squares =
      parallel::grad_squares(held, {false, true, false, true}, world);
  ASSERT_EQ(squares.size(), held.size());
  // A dense parameter's squares are its own; an expert parameter's are summed over the ranks.
  EXPECT_NEAR(squares[0], std::pow(optim::naive::global_grad_norm({dense.params[0]}), 2),
              1e-12 * squares[0]);
  ParameterList every_fc_out;
  for (const auto& e : experts) every_fc_out.push_back(e.params[1]);
  EXPECT_NEAR(squares[3], std::pow(optim::naive::global_grad_norm(every_fc_out), 2),
              1e-12 * squares[3]);
  const double norm = std::sqrt(std::accumulate(squares.begin(), squares.end(), 0.0));

  ParameterList all = dense.params;
  for (const auto& e : experts) all.insert(all.end(), e.params.begin(), e.params.end());
  const double naive = optim::naive::global_grad_norm(all);
  EXPECT_NEAR(norm, naive, 1e-12 * naive);
  // A rank that added its own experts only, or every rank's dense part, would be off by far more.
  std::vector<double> each(static_cast<size_t>(P));
  world.all_gather(&norm, each.data(), 1, comm::ElemType::f64);
  for (int r = 0; r < P; ++r) EXPECT_EQ(std::memcmp(&each[size_t(r)], &norm, sizeof norm), 0) << r;
}

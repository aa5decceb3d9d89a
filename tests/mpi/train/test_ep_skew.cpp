// The EP step-time skew of metrics.jsonl: the dispatch bytes' max / median over the ep group
// (the world) against the closed form of loads the test fixes, and the expert time's skew
// present and >= 1. Timing is never asserted beyond that.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "tessel/comm/world.hpp"
#include "tessel/moe/layer.hpp"
#include "tessel/parallel/expert_parallel.hpp"
#include "tessel/train/moe_metrics.hpp"
#include "unit/moe/moe_test_util.hpp"

using namespace tessel;
using VecF = std::vector<float>;

namespace {

constexpr int64_t kE = 8, kK = 2;

// Rank r holds 3 + 2 r tokens; its token i takes experts i mod E and (i + 1 + 3 r) mod E
// (distinct for r <= 3: 1 + 3 r is not a multiple of 8).
std::pair<int64_t, int64_t> experts_of(int r, int64_t i) {
  return {i % kE, (i + 1 + 3 * r) % kE};
}
int64_t tokens_of(int r) {
  return 3 + 2 * r;
}

TEST(EpSkew, DispatchBytesSkewIsTheClosedFormOfTheLoads) {
  comm::Communicator& world = comm::world();
  const int P = world.size(), me = world.rank();
  if (P % 2 != 0) GTEST_SKIP() << "the closed form below takes the median of an even count";
  moe::testing::Layout l;
  l.config.experts = kE;
  l.config.top_k = kK;
  l.shape = {kE, 4, 0, moe::ExpertMlp::gelu};  // C = E: the identity router
  std::vector<float> params = moe::testing::random_params(l, 5);
  std::fill(params.begin(), params.begin() + kE * kE, 0.0f);
  for (int64_t e = 0; e < kE; ++e) params[size_t(e * kE + e)] = 1.0f;
  // Logits 4 and 2 at the token's two experts, 0 elsewhere: its top-2 are those two.
  const int64_t N = tokens_of(me);
  VecF x(size_t(N * kE), 0.0f);
  for (int64_t i = 0; i < N; ++i) {
    const auto [a, b] = experts_of(me, i);
    x[size_t(i * kE + a)] = 4.0f;
    x[size_t(i * kE + b)] = 2.0f;
  }
  moe::MoeLayer layer(l.config, l.shape);
  parallel::ExpertParallelComm ep(world, world, nullptr);
  moe::LayerCache cache;
  VecF y(x.size());
  const VecF beta(size_t(kE), 0.0f);
  layer.forward(cache, y.data(), x.data(), N, moe::testing::bind<const float>(params.data(), l),
                beta.data(), ep);

  // Closed form: ep rank d holds experts [d E/P, (d+1) E/P) and receives every rank's rows
  // for them; bytes = rows x C x 4.
  const int64_t El = kE / P;
  std::vector<double> bytes(size_t(P), 0.0);
  for (int r = 0; r < P; ++r)
    for (int64_t i = 0; i < tokens_of(r); ++i) {
      const auto [a, b] = experts_of(r, i);
      bytes[size_t(a / El)] += double(kE * 4);
      bytes[size_t(b / El)] += double(kE * 4);
    }
  EXPECT_EQ(double(cache.received_rows * kE * 4), bytes[size_t(me)]);
  std::vector<double> sorted = bytes;
  std::sort(sorted.begin(), sorted.end());
  const double median = 0.5 * (sorted[size_t(P / 2 - 1)] + sorted[size_t(P / 2)]);  // P even
  const double want = sorted.back() / median;
  EXPECT_GT(want, 1.0) << "the loads must be uneven over the ep ranks";

  const nlohmann::json skew =
      train::ep_skew(world, cache.expert_seconds, double(cache.received_rows * kE) * sizeof(float));
  EXPECT_DOUBLE_EQ(skew["recv_bytes"].get<double>(), want);
  EXPECT_GE(skew["expert_time"].get<double>(), 1.0);
  EXPECT_TRUE(std::isfinite(skew["expert_time"].get<double>()));
  EXPECT_GT(cache.expert_seconds, 0.0);
}

}  // namespace

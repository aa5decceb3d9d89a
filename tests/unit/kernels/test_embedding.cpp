#include <gtest/gtest.h>

#include "kernel_test_util.hpp"
#include "tessel/core/error.hpp"
#include "tessel/kernels/cpu/embedding.hpp"

using namespace tessel;
using namespace tessel::kernels;
using namespace tessel::kernels::test;

namespace {
std::vector<int32_t> random_ids(Rng& rng, int64_t N, int64_t V) {
  std::vector<int32_t> ids(N);
  for (int32_t& id : ids) id = int32_t(rng.below(uint64_t(V)));
  return ids;
}
}  // namespace

// Forward and backward are exact (copies and sums in the same order), so fast f32 must
// equal naive f32 bitwise; naive f64 is checked against finite differences.
// The fixed shapes, then random ones with N <= 60, V <= 10, C <= 130.
TEST(Embedding, FastEqualsNaiveExactly) {
  for (auto [N, V, C] : with_random({{1, 3, 7}, {13, 5, 1}, {50, 7, 130}}, [](Rng& rng) {
         return std::tuple{uniform_int(rng, 1, 60), uniform_int(rng, 1, 10),
                           uniform_int(rng, 1, 130)};
       })) {
    SCOPED_TRACE(::testing::Message() << "N=" << N << " V=" << V << " C=" << C);
    Rng rng(1);
    const std::vector<int32_t> ids = random_ids(rng, N, V);  // V < N: ids repeat
    VecF table = randn(rng, V * C), dy = randn(rng, N * C), dtable0 = randn(rng, V * C);
    VecF y(N * C), yn(N * C);
    embedding_forward(y.data(), ids.data(), table.data(), N, V, C);
    naive::embedding_forward(yn.data(), ids.data(), table.data(), N, V, C);
    EXPECT_TRUE(bitwise_equal(y, yn));
    VecF dt = dtable0, dtn = dtable0;
    embedding_backward(dt.data(), dy.data(), ids.data(), N, V, C);
    naive::embedding_backward(dtn.data(), dy.data(), ids.data(), N, V, C);
    EXPECT_TRUE(bitwise_equal(dt, dtn));
  }
}

// N = 6, V = 4, C = 3, then random shapes with N <= 8, V <= 5, C <= 4.
TEST(Embedding, NaiveBackwardMatchesFiniteDifferences) {
  for (auto [N, V, C] : with_random({{6, 4, 3}}, [](Rng& rng) {
         return std::tuple{uniform_int(rng, 1, 8), uniform_int(rng, 1, 5), uniform_int(rng, 1, 4)};
       })) {
    SCOPED_TRACE(::testing::Message() << "N=" << N << " V=" << V << " C=" << C);
    Rng rng(2);
    const std::vector<int32_t> ids = random_ids(rng, N, V);
    VecD table = to_f64(randn(rng, V * C));
    const VecD r = to_f64(randn(rng, N * C));
    const auto loss = [&] {
      VecD y(N * C);
      naive::embedding_forward(y.data(), ids.data(), table.data(), N, V, C);
      return dot(r, y);
    };
    VecD dt(V * C, 0.0);
    naive::embedding_backward(dt.data(), r.data(), ids.data(), N, V, C);
    EXPECT_LT(rel_error(dt, numeric_grad(table, loss)), kFiniteDiff);
  }
}

TEST(Embedding, RejectsOutOfRangeIds) {
  const int64_t V = 5, C = 2;
  VecF table(V * C, 1.0f), y(2 * C), dt(V * C);
  for (int32_t bad : {5, -1}) {
    const std::vector<int32_t> ids = {1, bad};
    EXPECT_THROW(embedding_forward(y.data(), ids.data(), table.data(), 2, V, C), InputError);
    EXPECT_THROW(embedding_backward(dt.data(), y.data(), ids.data(), 2, V, C), InputError);
    EXPECT_THROW(naive::embedding_forward(y.data(), ids.data(), table.data(), 2, V, C), InputError);
  }
  try {
    const std::vector<int32_t> ids = {7};
    embedding_forward(y.data(), ids.data(), table.data(), 1, V, C);
    ADD_FAILURE() << "no InputError for id 7";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("7"), std::string::npos) << e.what();
  }
}

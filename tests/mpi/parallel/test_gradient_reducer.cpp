#include <gtest/gtest.h>

#include "tessel/comm/world.hpp"
#include "tessel/parallel/data_parallel.hpp"

using namespace tessel;

// Each rank holds gradients g_r[i] = (r + 1) * (i % 7 - 3) (small integers, so every
// partial sum is exact in f32); the reduced value is the closed form
// scale * (i % 7 - 3) * P (P + 1) / 2, compared exactly.
TEST(GradientReducer, SumsAndScalesEveryBucket) {
  comm::Communicator& world = comm::world();
  const int P = world.size();
  for (int64_t bucket_bytes : {4, 40, 1000, 1 << 20}) {  // 1 element per bucket up to 1 bucket
    Tensor g({1001});
    for (int64_t i = 0; i < 1001; ++i) g.f32()[i] = float((world.rank() + 1) * (i % 7 - 3));
    parallel::GradientReducer reducer(world, g, bucket_bytes);
    reducer.reduce(0.5f);
    for (int64_t i = 0; i < 1001; ++i)
      ASSERT_EQ(g.f32()[i], 0.5f * float((i % 7 - 3) * P * (P + 1) / 2)) << "element " << i;
  }
}

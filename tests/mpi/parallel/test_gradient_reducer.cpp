#include <gtest/gtest.h>

#include <climits>
#include <vector>

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

// Buckets started during the backward (start_from, as the model finishes gradients from the
// end of the buffer) reduce to the same closed form. Each start_from starts exactly the
// buckets lying wholly at or past its offset, none twice, and a later lower offset only adds;
// the reducer is reused for a second step.
TEST(GradientReducer, StartsEachBucketOnceItsGradientsAreFinal) {
  comm::Communicator& world = comm::world();
  const int P = world.size();
  const int64_t n = 1001, per_bucket = 10;  // 40-byte buckets begin at 0, 10, ..., 1000
  Tensor g({n});
  parallel::GradientReducer reducer(world, g, per_bucket * int64_t(sizeof(float)));
  ASSERT_EQ(reducer.num_buckets(), 101);
  for (int step = 0; step < 2; ++step) {
    for (int64_t i = 0; i < n; ++i) g.f32()[i] = float((world.rank() + 1) * (i % 7 - 3 + step));
    if (P > 1) {
      EXPECT_EQ(reducer.started_buckets(), 0);
      for (int64_t from : {1001, 995, 990, 990, 523, 17, 0}) {
        reducer.start_from(from);
        EXPECT_EQ(reducer.started_buckets(), (n - 1) / per_bucket + 1 - (from + 9) / per_bucket)
            << "from " << from;
      }
    }
    reducer.reduce(0.25f);
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(g.f32()[i], 0.25f * float((i % 7 - 3 + step) * P * (P + 1) / 2))
          << "step " << step << ", element " << i;
  }
}

// Buckets are bucket_bytes / 4 elements, but never more than MPI's int count: a 1 TiB bucket of
// a 5 Gi-element buffer is three all-reduces, not one that fails at the step's end.
TEST(GradientReducer, BucketsStayWithinMpisCount) {
  using V = std::vector<int64_t>;
  EXPECT_EQ(parallel::bucket_offsets(10, 8), (V{0, 2, 4, 6, 8}));
  EXPECT_EQ(parallel::bucket_offsets(10, 3), (V{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));  // at least 1
  EXPECT_EQ(parallel::bucket_offsets(10, int64_t(1) << 40, 4), (V{0, 4, 8}));
  EXPECT_EQ(parallel::bucket_offsets(10, 8, 4), (V{0, 2, 4, 6, 8}));  // the cap only caps
  EXPECT_EQ(parallel::bucket_offsets(int64_t(5) << 30, int64_t(1) << 40),
            (V{0, INT_MAX, 2 * int64_t(INT_MAX)}));
  EXPECT_TRUE(parallel::bucket_offsets(0, 8).empty());
}

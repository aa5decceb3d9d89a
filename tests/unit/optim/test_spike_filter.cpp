#include <gtest/gtest.h>

#include <vector>

#include "support/expect_input_error.hpp"
#include "tessel/optim/spike_filter.hpp"

using namespace tessel;
using namespace tessel::optim;

// Window 4, factor 3: nothing is skipped until 4 norms are known; then a norm above 3 x the
// median of the last 4 (an even count: the mean of the middle two) is. Skipped norms enter the
// window too, so a lasting rise is skipped only until it fills half the window.
TEST(SpikeFilter, SkipsNormsAboveFactorTimesTheWindowMedian) {
  SpikeFilter f(3.0, 4);
  for (double n : {1.0, 100.0, 2.0, 1.0}) EXPECT_FALSE(f.skip(n)) << n;  // filling the window
  EXPECT_EQ(f.median(), 1.5);                                            // {1, 1, 2, 100}
  EXPECT_FALSE(f.skip(4.5));                                             // 3 x 1.5: not above
  EXPECT_EQ(f.median(), 3.25);                                           // {1, 2, 4.5, 100}
  EXPECT_TRUE(f.skip(10.0));                                             // > 9.75
  EXPECT_TRUE(f.skip(50.0));                                             // {1, 2, 4.5, 10}: > 9.75
  EXPECT_EQ(f.median(), 7.25);                                           // {1, 4.5, 10, 50}
  EXPECT_TRUE(f.skip(50.0));                                             // > 21.75
  EXPECT_EQ(f.median(), 30.0);                                           // {4.5, 10, 50, 50}
  EXPECT_FALSE(f.skip(50.0));  // the rise is the new normal
  EXPECT_EQ(f.history(), (std::vector<double>{10.0, 50.0, 50.0, 50.0}));
}

// The history restores exactly (a resumed run decides alike), keeping the newest `window`;
// factor 0 never skips; bad settings name their key.
TEST(SpikeFilter, HistoryRestoresAndSettingsAreChecked) {
  SpikeFilter a(2.0, 3), b(2.0, 3);
  for (double n : {1.0, 2.0, 3.0}) a.skip(n);
  b.restore({7.0, 1.0, 2.0, 3.0});  // a longer history from a run with a larger window
  EXPECT_EQ(b.history(), a.history());
  EXPECT_EQ(a.skip(4.5), b.skip(4.5));
  SpikeFilter never(0.0, 1);
  never.skip(1.0);
  EXPECT_FALSE(never.skip(1e30));
  fixture::expect_input_error([] { SpikeFilter(1.0, 5); }, {"train.spike_factor = 1"});
  fixture::expect_input_error([] { SpikeFilter(-1.0, 5); },
                              {"train.spike_factor = -1", "0 = never skip"});
  fixture::expect_input_error([] { SpikeFilter(3.0, 0); }, {"train.spike_window = 0"});
}

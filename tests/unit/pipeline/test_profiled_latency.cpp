// profiled_link_latency against the simulator, whose link latency is known: fed a simulated
// timeline it must return exactly the latency the simulation used.
#include <gtest/gtest.h>

#include "tessel/pipeline/stage_executor.hpp"

using namespace tessel::pipeline;

TEST(ProfiledLinkLatency, RecoversTheSimulatorsLatency) {
  for (auto kind :
       {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::paci, ScheduleKind::zb_h1})
    for (int P : {2, 4})
      for (double latency : {0.0, 0.25, 1.5}) {
        SimOptions o;
        o.schedule = {kind, P, 6, 3, 2};
        o.costs = {{1.5, 2.5, 0.1, 1.0}, {1.0, 3.0, 0.1, 1.25}};  // ZB-H1's W: no message
        o.costs.resize(size_t(P), {1.25, 2.0, 0.1, 0.75});
        o.links = {{latency}};
        EXPECT_NEAR(profiled_link_latency(simulate(o).timeline, P), latency, 1e-12)
            << schedule_name(kind) << " P " << P;
      }
}

TEST(ProfiledLinkLatency, IsZeroWithoutMessages) {
  SimOptions o;
  o.schedule = {ScheduleKind::one_f_one_b, 1, 4, 2, 1};
  o.costs = {{1, 2, 0}};
  EXPECT_EQ(profiled_link_latency(simulate(o).timeline, 1), 0.0);
}

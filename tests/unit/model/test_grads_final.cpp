// Activations::on_grads_final: where a backward has finished with the flat gradient buffers,
// which the data-parallel all-reduce uses to start each bucket during the backward.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "tessel/core/error.hpp"
#include "tessel/model/gpt.hpp"
#include "unit/model/model_test_util.hpp"

using namespace tessel;
using namespace tessel::model;
using namespace tessel::model::testing;

// The backward reports after the head, each block and the embedding, offsets never growing,
// each block's report lower than the one before, the last {0, 0}; and every gradient a report
// calls final already holds the value the whole backward leaves, bitwise. The buffers hold an
// earlier micro-batch's gradients (accumulation): final means this backward adds nothing more.
// With a tied head (final only after the embedding), learned positions, MoE blocks (their
// experts in the experts' range) and recomputation.
TEST(GradsFinal, EveryGradientReportedFinalAlreadyHoldsItsEndValue) {
  for (const GptConfig& c : {gelu_config(), swiglu_config(), moe_config(gelu_config(), "1"),
                             moe_config(swiglu_config(), "all")})
    for (Recompute recompute : {Recompute::none, Recompute::blocks}) {
      SCOPED_TRACE(std::string(to_string(recompute)) + (c.moe_layers.empty() ? "" : ", MoE ") +
                   c.moe_layers + (c.tied_head ? ", tied" : ""));
      const int64_t B = 2, T = 6;
      Gpt gpt(c, 91);
      randomize_parameters(gpt, 92, 0.4f);
      auto acts = gpt.make_activations(B, T, gpt.block_range(), recompute);
      gpt.zero_grads();
      gpt.forward(*acts, random_batch(c, B, T, 93, false).inputs());
      gpt.backward(*acts, 1.0f);

      struct Report {
        GradsFinal at;
        std::vector<float> dense, experts;  // the gradients from `at` on, when reported
      };
      std::vector<Report> reports;
      const Tensor dense = gpt.dense_grads(), experts = gpt.expert_grads();
      gpt.forward(*acts, random_batch(c, B, T, 94, true).inputs());
      acts->on_grads_final = [&](GradsFinal f) {
        reports.push_back(
            {f, std::vector<float>(dense.f32() + f.dense, dense.f32() + dense.numel()),
             std::vector<float>(experts.f32() + f.experts, experts.f32() + experts.numel())});
      };
      gpt.backward(*acts, 0.7f);

      ASSERT_EQ(reports.size(), size_t(c.layers + 2));
      EXPECT_GT(reports.front().at.dense, 0);  // the head's report leaves the rest unfinished
      EXPECT_LT(reports.front().at.dense, dense.numel());
      EXPECT_EQ(reports.back().at.dense, 0);
      EXPECT_EQ(reports.back().at.experts, 0);
      for (size_t i = 0; i < reports.size(); ++i) {
        SCOPED_TRACE("report " + std::to_string(i));
        if (i > 0) {
          EXPECT_LT(reports[i].at.dense, reports[i - 1].at.dense);
          EXPECT_LE(reports[i].at.experts, reports[i - 1].at.experts);
        }
        const Report& r = reports[i];
        EXPECT_EQ(0, std::memcmp(r.dense.data(), dense.f32() + r.at.dense,
                                 r.dense.size() * sizeof(float)));
        EXPECT_EQ(0, std::memcmp(r.experts.data(), experts.f32() + r.at.experts,
                                 r.experts.size() * sizeof(float)));
      }
      if (!c.moe_layers.empty()) {  // the experts are finished by their block's report
        EXPECT_EQ(reports.front().at.experts, experts.numel());
        EXPECT_LT(reports[1].at.experts, experts.numel());
      }
    }
}

// A split backward adds its weight gradients later, so it cannot report them final.
TEST(GradsFinal, ASplitBackwardRefusesToReport) {
  const GptConfig c = gelu_config();
  Gpt gpt(c, 95);
  auto acts = gpt.make_activations(2, 6, gpt.block_range());
  gpt.forward(*acts, random_batch(c, 2, 6, 96, false).inputs());
  acts->defer_weight_grads = true;
  acts->on_grads_final = [](GradsFinal) {};
  EXPECT_THROW(gpt.backward(*acts, 1.0f), Error);
}

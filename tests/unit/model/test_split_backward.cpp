// The backward split in two (Activations::defer_weight_grads, Gpt::backward_weights), as a ZB-H1
// pipeline stage runs it: the input-gradient halves of several micro-batches first, their
// weight gradients later, against the plain backward of the same micro-batches, bitwise.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "tessel/model/gpt.hpp"
#include "unit/model/model_test_util.hpp"

using namespace tessel;
using namespace tessel::model;
using namespace tessel::model::testing;

namespace {

bool all_zero(const Tensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i)
    if (t.f32()[i] != 0.0f) return false;
  return true;
}

// Three micro-batches in flight sharing their scratch (and under recomputation their block
// cache) in 1F1B's steady-state order, F0 F1 B0 F2 B1 B2; split: F0 F1 B0 F2 B1 W0 B2 W1 W2
// (ZB-H1's W lag, a forward and backwards of others between a B and its W). The split gives the
// plain run's gradients bitwise, with a tied head and embedding (swiglu config) adding into one
// buffer in the plain order. Before its W every matrix, bias and embedding gradient is still
// zero, and the norm weights and MoE routers already hold theirs: the deferral really defers,
// and only what it says. The copies a queued W keeps are counted until it runs.
TEST(SplitBackward, InputThenWeightHalvesGiveThePlainGradientsBitwise) {
  for (const GptConfig& c : {gelu_config(), swiglu_config(), moe_config(gelu_config(), "1")})
    for (Recompute recompute : {Recompute::none, Recompute::blocks}) {
      SCOPED_TRACE(std::string(to_string(recompute)) + (c.moe_layers.empty() ? "" : ", MoE") +
                   (c.tied_head ? ", tied" : ""));
      const int64_t B = 2, T = 6;
      Gpt gpt(c, 81);
      randomize_parameters(gpt, 82, 0.4f);
      const std::vector<Batch> batches = {random_batch(c, B, T, 83, false),
                                          random_batch(c, B, T, 84, true),
                                          random_batch(c, B, T, 85, false)};
      auto run = [&](bool split) {
        std::vector<std::unique_ptr<Activations>> acts;
        for (size_t i = 0; i < batches.size(); ++i)
          acts.push_back(gpt.make_activations(B, T, gpt.block_range(), recompute,
                                              i > 0 ? acts[0].get() : nullptr));
        auto forward = [&](size_t i) {
          gpt.forward(*acts[i], batches[i].inputs());
          acts[i]->defer_weight_grads = split;
        };
        gpt.zero_grads();
        forward(0);
        forward(1);
        gpt.backward(*acts[0], 1.0f);
        if (split) {
          for (const Parameter& p : gpt.parameters()) {
            // MoE layers add in B, but an expert no token reached has no gradient, nor has beta.
            if (p.name.find(".moe.") != std::string::npos && p.tag != ParamTag::router) continue;
            const bool deferred = p.tag != ParamTag::norm && p.tag != ParamTag::router;
            EXPECT_EQ(all_zero(p.grad), deferred) << p.name << " before any W";
          }
          EXPECT_GT(acts[0]->deferred_bytes, 0);
        }
        forward(2);
        gpt.backward(*acts[1], 1.0f);
        if (split) gpt.backward_weights(*acts[0]);
        gpt.backward(*acts[2], 1.0f);
        if (split) {
          gpt.backward_weights(*acts[1]);
          gpt.backward_weights(*acts[2]);
          EXPECT_TRUE(acts[0]->deferred_weight_grads.empty());
          EXPECT_EQ(acts[0]->deferred_bytes, 0);
        }
        return gpt.flat_grads().clone();
      };
      const Tensor plain = run(false);
      const Tensor split = run(true);
      EXPECT_TRUE(bitwise_equal(plain, split));
      EXPECT_FALSE(all_zero(plain));
    }
}

}  // namespace

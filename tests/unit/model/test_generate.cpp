#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "tessel/core/error.hpp"
#include "tessel/model/generate.hpp"
#include "unit/model/model_test_util.hpp"

using namespace tessel;
using namespace tessel::model;
using namespace tessel::model::testing;

namespace {

int32_t argmax(const std::vector<float>& x) {
  return int32_t(std::max_element(x.begin(), x.end()) - x.begin());
}

}  // namespace

// Greedy generation is deterministic and equals step-by-step argmax of the next
// token's logits; it runs past max_seq (8) by keeping the last 8 tokens.
TEST(Generate, GreedyIsDeterministicArgmax) {
  for (const GptConfig& c : {gelu_config(), swiglu_config()}) {
    Gpt gpt(c, 3);
    randomize_parameters(gpt, 4, 0.5f);
    Rng rng_a(1), rng_b(2);
    const std::vector<int32_t> prompt = {1, 2, 3};
    const auto a = generate(gpt, prompt, 12, 0.0f, 0, rng_a);
    const auto b = generate(gpt, prompt, 12, 0.0f, 0, rng_b);
    ASSERT_EQ(a.size(), 15u);
    EXPECT_EQ(a, b);
    EXPECT_TRUE(std::equal(prompt.begin(), prompt.end(), a.begin()));
    std::vector<int32_t> context = prompt;
    for (size_t i = prompt.size(); i < a.size(); ++i) {
      EXPECT_EQ(a[i], argmax(next_token_logits(gpt, context))) << "token " << i;
      context.push_back(a[i]);
    }
    // top_k = 1 at any temperature is greedy too.
    Rng rng_c(3);
    EXPECT_EQ(generate(gpt, prompt, 12, 1.0f, 1, rng_c), a);
  }
}

// A stop token ends greedy generation right after its first draw (kept); a stop token that is
// never drawn changes nothing.
TEST(Generate, AStopTokenEndsGenerationAfterItsFirstDraw) {
  Gpt gpt(swiglu_config(), 3);
  randomize_parameters(gpt, 4, 0.5f);
  Rng rng(1);
  const std::vector<int32_t> prompt = {1, 2, 3};
  const auto full = generate(gpt, prompt, 12, 0.0f, 0, rng);
  const int32_t stop = full[6];  // the fourth new token
  const auto first = size_t(std::find(full.begin() + 3, full.end(), stop) - full.begin());
  std::vector<int32_t> streamed;  // what on_token saw, in order: the new tokens, the stop too
  const auto stopped =
      generate(gpt, prompt, 12, 0.0f, 0, rng, stop, [&](int32_t t) { streamed.push_back(t); });
  EXPECT_EQ(stopped, std::vector<int32_t>(full.begin(), full.begin() + int64_t(first) + 1));
  EXPECT_EQ(streamed, std::vector<int32_t>(stopped.begin() + 3, stopped.end()));
  int32_t never = 0;
  while (std::find(full.begin() + 3, full.end(), never) != full.end()) ++never;
  EXPECT_EQ(generate(gpt, prompt, 12, 0.0f, 0, rng, never), full);
}

TEST(Generate, ContextIsTheLastMaxSeqTokens) {
  const GptConfig c = swiglu_config();
  Gpt gpt(c, 5);
  randomize_parameters(gpt, 6, 0.5f);
  const std::vector<int32_t> long_context = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  const std::vector<int32_t> tail(long_context.end() - 8, long_context.end());
  EXPECT_EQ(next_token_logits(gpt, long_context), next_token_logits(gpt, tail));
  const std::vector<int32_t> shorter(long_context.end() - 7, long_context.end());
  EXPECT_NE(next_token_logits(gpt, long_context), next_token_logits(gpt, shorter));
}

// Logits {0, ln 3, -inf-ish, ...}: with top_k = 2 only ids 0 and 1 are drawn, with
// probabilities 1/4 and 3/4. 8000 seeded draws: standard error 0.005, tolerance 0.02.
TEST(Generate, SamplingFollowsTopKSoftmax) {
  std::vector<float> logits = {0.0f, std::log(3.0f), -1.0f, -2.0f};
  Rng rng(7);
  int counts[4] = {};
  for (int i = 0; i < 8000; ++i) ++counts[sample_token(logits, 1.0f, 2, rng)];
  EXPECT_EQ(counts[2] + counts[3], 0);
  EXPECT_NEAR(counts[1] / 8000.0, 0.75, 0.02);
  // Temperature 2 flattens to weights 1 : sqrt(3).
  int high = 0;
  for (int i = 0; i < 8000; ++i) high += sample_token(logits, 2.0f, 2, rng) == 1;
  EXPECT_NEAR(high / 8000.0, std::sqrt(3.0) / (1.0 + std::sqrt(3.0)), 0.02);
  // Ties go to the lower id when greedy.
  EXPECT_EQ(sample_token({1.0f, 2.0f, 2.0f}, 0.0f, 0, rng), 1);
}

TEST(Generate, BadArgumentsAreInputErrors) {
  Gpt gpt(gelu_config(), 1);
  Rng rng(1);
  EXPECT_THROW(generate(gpt, {}, 3, 0.0f, 0, rng), InputError);
  EXPECT_THROW(generate(gpt, {1}, -1, 0.0f, 0, rng), InputError);
  EXPECT_THROW(generate(gpt, {1}, 3, -0.5f, 0, rng), InputError);
  EXPECT_THROW(generate(gpt, {1}, 3, 1.0f, -1, rng), InputError);
  EXPECT_THROW(generate(gpt, {99}, 3, 0.0f, 0, rng), InputError);
  EXPECT_EQ(generate(gpt, {1, 2}, 0, 0.0f, 0, rng), (std::vector<int32_t>{1, 2}));
}

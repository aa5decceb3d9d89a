#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "tessel/core/error.hpp"
#include "tessel/model/generate.hpp"
#include "tessel/model/kv_cache.hpp"
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

namespace {

// The last position's logits of `tokens` at positions first, first + 1, ..., through `cache`
// (null: the whole sequence's own forward).
std::vector<float> last_logits(const Gpt& gpt, const std::vector<int32_t>& tokens, int32_t first,
                               KvCache* cache) {
  const auto T = int64_t(tokens.size());
  auto acts = gpt.make_activations(1, T, Recompute::blocks);
  std::vector<int32_t> positions(tokens.size());
  for (int64_t t = 0; t < T; ++t) positions[size_t(t)] = first + int32_t(t);
  ModelInputs in{1, T, tokens.data(), positions.data()};
  in.attention = cache;
  if (cache) cache->begin(T);
  gpt.forward(*acts, in);
  const int64_t V = gpt.config().vocab;
  return std::vector<float>(acts->logits.f32() + (T - 1) * V, acts->logits.f32() + T * V);
}

}  // namespace

// A KV cache filled by a 3-token prefill, a 2-token chunk (bottom-right causal over cached and
// new keys) and single tokens up to max_seq gives the logits of the whole prefix's forward,
// within 1e-5 relative (the attention's tiles split the keys differently): GELU / layernorm /
// learned positions, SwiGLU / rmsnorm / rotary / GQA, and MoE blocks (dropless). Past max_seq
// the cache refuses more positions; cleared, it starts over.
TEST(Generate, AKvCacheGivesTheWholePrefixsLogits) {
  GptConfig moe = moe_config(gelu_config(), "1");
  for (const GptConfig& c : {gelu_config(), swiglu_config(), moe}) {
    SCOPED_TRACE(c.moe_layers.empty() ? "dense" : "moe");
    Gpt gpt(c, 11);
    randomize_parameters(gpt, 12, 0.5f);
    const std::vector<int32_t> sequence = {4, 1, 7, 7, 0, 12, 3, 9};  // max_seq = 8
    KvCache cache(gpt);
    size_t cached = 0;
    for (size_t rows : {3, 2, 1, 1, 1}) {
      const std::vector<int32_t> fresh(sequence.begin() + int64_t(cached),
                                       sequence.begin() + int64_t(cached + rows));
      const auto got = last_logits(gpt, fresh, int32_t(cached), &cache);
      cached += rows;
      EXPECT_EQ(cache.length(), int64_t(cached));
      const std::vector<int32_t> prefix(sequence.begin(), sequence.begin() + int64_t(cached));
      const auto want = last_logits(gpt, prefix, 0, nullptr);
      double scale = 0, diff = 0;
      for (size_t i = 0; i < want.size(); ++i) {
        scale = std::max(scale, double(std::abs(want[i])));
        diff = std::max(diff, double(std::abs(got[i] - want[i])));
      }
      EXPECT_LE(diff, 1e-5 * scale) << "after " << cached << " positions";
    }
    EXPECT_THROW(cache.begin(1), Error);  // 8 cached: a ninth position exceeds max_seq
    cache.clear();
    EXPECT_EQ(last_logits(gpt, {sequence[0]}, 0, &cache),
              last_logits(gpt, {sequence[0]}, 0, nullptr));
  }
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

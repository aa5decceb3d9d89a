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

// With an id limit (a tokenizer's ids under a padded vocabulary) greedy generation takes the
// argmax of the logits below it, and sampling draws nothing at or above it.
TEST(Generate, AnIdLimitKeepsDrawsBelowIt) {
  Gpt gpt(gelu_config(), 3);
  randomize_parameters(gpt, 4, 0.5f);
  const std::vector<int32_t> prompt = {1, 2, 3};
  const int64_t limit = gpt.config().vocab / 2;
  Rng rng(1);
  const auto greedy = generate(gpt, prompt, 12, 0.0f, 0, rng, -1, nullptr, limit);
  std::vector<int32_t> context = prompt;
  for (size_t i = prompt.size(); i < greedy.size(); ++i) {
    std::vector<float> logits = next_token_logits(gpt, context);
    logits.resize(size_t(limit));
    EXPECT_EQ(greedy[i], argmax(logits)) << "token " << i;
    context.push_back(greedy[i]);
  }
  const auto sampled = generate(gpt, prompt, 200, 2.0f, 0, rng, -1, nullptr, limit);
  EXPECT_TRUE(std::all_of(sampled.begin(), sampled.end(), [&](int32_t t) { return t < limit; }));
  const auto unlimited = generate(gpt, prompt, 200, 2.0f, 0, rng);
  EXPECT_TRUE(std::any_of(unlimited.begin(), unlimited.end(), [&](int32_t t) {
    return t >= limit;
  })) << "without the limit the same sampling reaches the upper ids";
}

// A model whose weights hold NaN gives NaN logits: generation refuses them (greedy would take
// the lowest id, sampling the last candidate) rather than print a broken model's draws as text.
// A NaN in the head row of an id at or above the id limit is never drawn from: no error.
TEST(Generate, NonFiniteLogitsAreADivergenceError) {
  Gpt gpt(gelu_config(), 3);
  randomize_parameters(gpt, 4, 0.5f);
  const int64_t V = gpt.config().vocab;
  for (const Parameter& p : gpt.parameters())
    if (p.name == "head.weight") {
      Tensor head = p.value;  // a view
      const int64_t width = head.shape()[1];
      std::fill(head.f32() + (V - 1) * width, head.f32() + V * width, std::nanf(""));
    }
  const std::vector<int32_t> prompt = {1, 2, 3};
  Rng rng(1);
  for (const float temperature : {0.0f, 1.0f}) {
    SCOPED_TRACE(temperature);
    try {
      generate(gpt, prompt, 4, temperature, 0, rng);
      ADD_FAILURE() << "no DivergenceError";
    } catch (const DivergenceError& e) {
      EXPECT_NE(std::string(e.what()).find("logits for new token 1 hold NaN (id 12)"),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(generate(gpt, prompt, 4, temperature, 0, rng, -1, nullptr, V - 1).size(), 7u);
  }
}

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

// max |got - want| <= 1e-5 max |want|: the cached and the whole forward differ only in the
// attention's and the GEMMs' row counts (and so their blocking).
void expect_logits_near(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  double scale = 0, diff = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    scale = std::max(scale, double(std::abs(want[i])));
    diff = std::max(diff, double(std::abs(got[i] - want[i])));
  }
  EXPECT_LE(diff, 1e-5 * scale);
}

// A KV cache filled by a 3-token prefill, a 2-token chunk (bottom-right causal over cached and
// new keys) and single tokens up to max_seq gives the logits of the whole prefix's forward:
// GELU / layernorm / learned positions, SwiGLU / rmsnorm / rotary / GQA, and MoE blocks
// (dropless). Past max_seq the cache refuses more positions; cleared, it starts over.
// With model.attention_window = 3 the cache's bottom-right windows give the whole prefix's too.
TEST(Generate, AKvCacheGivesTheWholePrefixsLogits) {
  GptConfig moe = moe_config(gelu_config(), "1");
  GptConfig windowed = swiglu_config();
  windowed.attention_window = 3;
  for (const GptConfig& c : {gelu_config(), swiglu_config(), moe, windowed}) {
    SCOPED_TRACE((c.moe_layers.empty() ? "dense" : "moe") +
                 std::string(c.attention_window ? " windowed" : ""));
    Gpt gpt(c, 11);
    randomize_parameters(gpt, 12, 0.5f);
    const std::vector<int32_t> sequence = {4, 1, 7, 7, 0, 12, 3, 9};  // max_seq = 8
    const std::span<const int32_t> all(sequence);
    KvCache cache(gpt);
    size_t cached = 0;
    for (size_t rows : {3, 2, 1, 1, 1}) {
      const auto got =
          last_position_logits(gpt, all.subspan(cached, rows), int32_t(cached), &cache);
      cached += rows;
      SCOPED_TRACE("after " + std::to_string(cached) + " positions");
      EXPECT_EQ(cache.length(), int64_t(cached));
      expect_logits_near(got, last_position_logits(gpt, all.first(cached), 0, nullptr));
    }
    EXPECT_THROW(cache.begin(1), Error);  // 8 cached: a ninth position exceeds max_seq
    cache.clear();
    EXPECT_EQ(last_position_logits(gpt, all.first(1), 0, &cache),
              last_position_logits(gpt, all.first(1), 0, nullptr));
  }
}

// model.attention_window = 3 on one block: the last position's logits are those of a forward
// over the last 3 tokens alone, at their positions (a window of W keys including the token
// itself), and differ from the whole prefix's once it is longer. Learned positions with GELU,
// and rotary with SwiGLU and GQA.
TEST(Generate, AnAttentionWindowSeesOnlyItsLastTokens) {
  for (GptConfig c : {gelu_config(), swiglu_config()}) {
    SCOPED_TRACE(to_string(c.positions));
    c.layers = 1;  // one block: its receptive field is exactly the window
    Gpt whole(c, 31);
    randomize_parameters(whole, 32, 0.5f);
    c.attention_window = 3;
    Gpt windowed(c, 31);
    randomize_parameters(windowed, 32, 0.5f);
    const std::vector<int32_t> sequence = {4, 1, 7, 7, 0, 12, 3, 9};
    const std::span<const int32_t> all(sequence);
    for (size_t n = 1; n <= sequence.size(); ++n) {
      SCOPED_TRACE("prefix " + std::to_string(n));
      const size_t k = std::min<size_t>(n, 3);
      const auto got = last_position_logits(windowed, all.first(n), 0, nullptr);
      expect_logits_near(
          got, last_position_logits(whole, all.subspan(n - k, k), int32_t(n - k), nullptr));
      if (n <= 3) continue;
      const auto unwindowed = last_position_logits(whole, all.first(n), 0, nullptr);
      double differ = 0;
      for (size_t i = 0; i < got.size(); ++i)
        differ = std::max(differ, double(std::abs(got[i] - unwindowed[i])));
      EXPECT_GT(differ, 1e-3);
    }
  }
}

// Decoding one position at a time across the attention's key tiles (64 keys) and query tiles
// (128) and past its longest GEMM run (512 keys) still gives the whole prefix's logits.
TEST(Generate, AKvCacheAcrossTilesGivesTheWholePrefixsLogits) {
  GptConfig c = swiglu_config();
  c.max_seq = 600;
  Gpt gpt(c, 21);
  randomize_parameters(gpt, 22, 0.5f);
  Rng rng(23);
  std::vector<int32_t> sequence(size_t(c.max_seq));
  for (auto& t : sequence) t = int32_t(rng.below(uint64_t(c.vocab)));
  const std::span<const int32_t> all(sequence);
  KvCache cache(gpt);
  last_position_logits(gpt, all.first(60), 0, &cache);
  for (size_t n = 60; n < sequence.size(); ++n) {
    const auto got = last_position_logits(gpt, all.subspan(n, 1), int32_t(n), &cache);
    if (n % 64 > 1 && n != 511 && n != 512 && n + 1 != sequence.size()) continue;
    SCOPED_TRACE("position " + std::to_string(n));
    expect_logits_near(got, last_position_logits(gpt, all.first(n + 1), 0, nullptr));
  }
}

// generate() caches unless MoE blocks have an expert capacity, and then still draws the
// tokens of the whole windows' logits (greedy: their argmax). Expert choice generates by
// top-k without capacity (a causal routing), so it caches, at any capacity factor.
TEST(Generate, MoeWithCapacityRunsTheWholeWindow) {
  const GptConfig dropless = moe_config(gelu_config(), "1");
  const GptConfig capacity = moe_config(swiglu_config(), "all");  // capacity factor 1
  GptConfig expert_choice = capacity;
  expert_choice.moe.balance = moe::Balance::expert_choice;
  EXPECT_TRUE(kv_cache_applies(gelu_config()));
  EXPECT_TRUE(kv_cache_applies(dropless));
  EXPECT_FALSE(kv_cache_applies(capacity));
  EXPECT_TRUE(kv_cache_applies(expert_choice));
  for (const GptConfig& c : {dropless, capacity, expert_choice}) {
    Gpt gpt(c, 31);
    randomize_parameters(gpt, 32, 0.5f);
    Rng rng(1);
    const std::vector<int32_t> prompt = {1, 2, 3};
    const auto a = generate(gpt, prompt, 10, 0.0f, 0, rng);
    std::vector<int32_t> context = prompt;
    for (size_t i = prompt.size(); i < a.size(); ++i) {
      EXPECT_EQ(a[i], argmax(next_token_logits(gpt, context))) << "token " << i;
      context.push_back(a[i]);
    }
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

#include "tessel/model/generate.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "tessel/core/error.hpp"
#include "tessel/model/kv_cache.hpp"

namespace tessel::model {

namespace {

// The last `max_seq` tokens of `context` (not empty).
std::span<const int32_t> last_window(const std::vector<int32_t>& context, int64_t max_seq) {
  if (context.empty()) input_error("generate: the prompt must hold at least one token");
  const auto T = size_t(std::min<int64_t>(int64_t(context.size()), max_seq));
  return std::span<const int32_t>(context).last(T);
}

// The whole model's next-token logits through a KV cache: a window that extends the cached
// tokens runs only its new positions; any other (the first, or one that slid past max_seq,
// where every position shifts) clears the cache and runs whole.
class CachedLogits {
 public:
  explicit CachedLogits(const Gpt& gpt) : gpt_(gpt), cache_(gpt) {}
  std::vector<float> operator()(std::span<const int32_t> window) {
    if (window.size() <= cached_.size() ||
        !std::equal(cached_.begin(), cached_.end(), window.begin())) {
      cache_.clear();
      cached_.clear();
    }
    const auto fresh = window.subspan(cached_.size());
    auto logits = last_position_logits(gpt_, fresh, int32_t(cached_.size()), &cache_);
    cached_.insert(cached_.end(), fresh.begin(), fresh.end());
    return logits;
  }

 private:
  const Gpt& gpt_;
  KvCache cache_;
  std::vector<int32_t> cached_;  // the tokens whose keys and values the cache holds
};

}  // namespace

std::vector<float> last_position_logits(const Gpt& gpt, std::span<const int32_t> tokens,
                                        int32_t first_position, KvCache* cache) {
  const auto T = int64_t(tokens.size());
  auto acts = gpt.make_activations(1, T, Recompute::blocks);  // no backward: one block's cache
  std::vector<int32_t> positions(tokens.size());
  std::iota(positions.begin(), positions.end(), first_position);
  ModelInputs in;
  in.B = 1;
  in.T = T;
  in.tokens = tokens.data();
  in.positions = positions.data();
  in.attention = cache;
  if (cache) cache->begin(T);
  gpt.forward(*acts, in);
  const int64_t V = gpt.config().vocab;
  const float* last = acts->logits.f32() + (T - 1) * V;
  return std::vector<float>(last, last + V);
}

bool kv_cache_applies(const GptConfig& config) {
  const std::vector<bool> moe = config.moe_mask();
  // Expert choice's forwards without targets route by top-k without capacity (Gpt).
  return config.moe.capacity <= 0 || config.moe.balance == moe::Balance::expert_choice ||
         std::find(moe.begin(), moe.end(), true) == moe.end();
}

std::vector<float> next_token_logits(const Gpt& gpt, const std::vector<int32_t>& context) {
  return last_position_logits(gpt, last_window(context, gpt.config().max_seq), 0, nullptr);
}

void check_temperature_range(double temperature, const std::string& what) {
  if (std::isfinite(temperature) && std::abs(temperature) > std::numeric_limits<float>::max())
    input_error(what, " = ", temperature, " is outside the float range (",
                std::numeric_limits<float>::max(), " at most)");
}

void check_sampling(double temperature, int64_t top_k) {
  if (!(temperature >= 0.0 && std::isfinite(temperature)))
    input_error("generate: temperature = ", temperature, " must be a finite number >= 0");
  if (top_k < 0) input_error("generate: top_k = ", top_k, " must be >= 0 (0 = all tokens)");
}

int32_t sample_token(const std::vector<float>& logits, float temperature, int64_t top_k, Rng& rng) {
  check_sampling(temperature, top_k);
  const int64_t V = int64_t(logits.size());
  TESSEL_CHECK(V > 0, "sampling from empty logits");
  // Candidates by decreasing logit, ties to the lower id.
  const int64_t k = temperature == 0.0f ? 1 : (top_k == 0 ? V : std::min(top_k, V));
  std::vector<int32_t> ids(static_cast<size_t>(V));
  std::iota(ids.begin(), ids.end(), 0);
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  if (k == 1) return ids[0];
  std::vector<double> weight(static_cast<size_t>(k));
  const double top = logits[ids[0]];
  double total = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    weight[i] = std::exp((double(logits[ids[i]]) - top) / temperature);
    total += weight[i];
  }
  double u = double(rng.uniform()) * total;
  for (int64_t i = 0; i < k; ++i) {
    if (u < weight[i]) return ids[i];
    u -= weight[i];
  }
  return ids[k - 1];  // u landed on the rounding error at the end
}

std::vector<int32_t> generate(const NextTokenLogits& next, int64_t max_seq,
                              std::vector<int32_t> prompt, int64_t new_tokens, float temperature,
                              int64_t top_k, Rng& rng, int32_t stop, const OnToken& on_token,
                              int64_t id_limit) {
  if (new_tokens < 0) input_error("generate: new_tokens = ", new_tokens, " must be >= 0");
  check_sampling(temperature, top_k);
  if (prompt.empty()) input_error("generate: the prompt must hold at least one token");
  for (int64_t i = 0; i < new_tokens; ++i) {
    std::vector<float> logits = next(last_window(prompt, max_seq));
    if (id_limit > 0 && id_limit < int64_t(logits.size())) logits.resize(size_t(id_limit));
    // Sampling would still pick an id (greedy the lowest, since NaN compares false): a broken
    // model's output must not pass for text.
    const auto bad =
        std::find_if(logits.begin(), logits.end(), [](float l) { return !std::isfinite(l); });
    if (bad != logits.end())
      throw DivergenceError(detail::concat(
          "generate: the model's logits for new token ", i + 1, " hold ",
          std::isnan(*bad) ? "NaN" : "inf", " (id ", bad - logits.begin(),
          "): its weights are not finite (or its output overflows); nothing to sample from"));
    prompt.push_back(sample_token(logits, temperature, top_k, rng));
    if (on_token) on_token(prompt.back());
    if (prompt.back() == stop) break;
  }
  return prompt;
}

std::vector<int32_t> generate(const Gpt& gpt, std::vector<int32_t> prompt, int64_t new_tokens,
                              float temperature, int64_t top_k, Rng& rng, int32_t stop,
                              const OnToken& on_token, int64_t id_limit) {
  if (!kv_cache_applies(gpt.config()))
    return generate(
        [&gpt](std::span<const int32_t> w) { return last_position_logits(gpt, w, 0, nullptr); },
        gpt.config().max_seq, std::move(prompt), new_tokens, temperature, top_k, rng, stop,
        on_token, id_limit);
  CachedLogits cached(gpt);
  return generate([&cached](std::span<const int32_t> w) { return cached(w); }, gpt.config().max_seq,
                  std::move(prompt), new_tokens, temperature, top_k, rng, stop, on_token, id_limit);
}

}  // namespace tessel::model

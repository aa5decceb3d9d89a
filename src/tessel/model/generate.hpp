#pragma once
// Text generation: each step draws the token after the last model.max_seq tokens. Through the
// whole model, positions already run are kept in a KV cache (kv_cache.hpp), so a step runs
// the new token's forward alone until the context exceeds max_seq; from then on the window
// slides, every position shifts, and each step runs the whole window (as next_token_logits
// does). Models whose MoE blocks have an expert capacity always run the whole window: capacity
// counts a forward's tokens.
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "tessel/core/rng.hpp"
#include "tessel/model/gpt.hpp"
#include "tessel/model/kv_cache.hpp"

namespace tessel::model {

// Logits [V] of the token after `context` (its last model.max_seq tokens are used), from the
// forward of that whole window.
std::vector<float> next_token_logits(const Gpt& gpt, const std::vector<int32_t>& context);

// Logits [V] after the last of `tokens` (one sequence) at positions first_position,
// first_position + 1, ...: through `cache`, which first takes their keys and values (it holds
// exactly the positions before first_position), or with null over `tokens` alone.
std::vector<float> last_position_logits(const Gpt& gpt, std::span<const int32_t> tokens,
                                        int32_t first_position, KvCache* cache);

// Whether generate() through the whole model uses the KV cache: not for MoE blocks with an
// expert capacity, which counts the tokens of one forward (a forward of the new positions
// alone would drop other assignments than the whole window's); expert choice generates
// without one.
bool kv_cache_applies(const GptConfig& config);

// Logits [V] of the token after `window` (1 to max_seq tokens), from some forward: the whole
// model's, or a pipeline's through its stages.
using NextTokenLogits = std::function<std::vector<float>(std::span<const int32_t> window)>;

// The most tokens one generation draws (`generate --tokens`, `train.sample_tokens`): far
// beyond any context, and a bound on a typo's running time.
inline constexpr int64_t kMaxGeneratedTokens = int64_t(1) << 20;

// InputError naming `what` (e.g. "generate: temperature") when a finite `temperature` lies
// outside float's range: sampling takes it as a float, where it would become inf.
void check_temperature_range(double temperature, const std::string& what);

// InputError unless temperature >= 0 and top_k >= 0 (what sample_token accepts). A double, so
// that a setting is checked before it becomes a float (-1e-50 would round to -0).
void check_sampling(double temperature, int64_t top_k);

// A token drawn from softmax(logits / temperature) over the top_k largest logits
// (top_k = 0: all). temperature = 0 is greedy: the largest logit, the lowest id on ties.
int32_t sample_token(const std::vector<float>& logits, float temperature, int64_t top_k, Rng& rng);

// Called with each token as it is drawn (to print it at once).
using OnToken = std::function<void(int32_t token)>;

// prompt followed by new_tokens tokens, each drawn by sample_token from next() of the last
// max_seq tokens and passed to on_token (when set); generation ends early after a drawn
// `stop` token (kept; -1 = no stop token). With id_limit > 0 only ids below it are drawn: a
// tokenizer's ids, when the model's vocabulary is padded beyond them. InputError on an empty
// prompt, a negative temperature, top_k or new_tokens, or (from the forward) a token id
// outside the vocabulary; DivergenceError when a drawn token's logits (below id_limit) are not
// all finite (a model with NaN weights).
std::vector<int32_t> generate(const NextTokenLogits& next, int64_t max_seq,
                              std::vector<int32_t> prompt, int64_t new_tokens, float temperature,
                              int64_t top_k, Rng& rng, int32_t stop = -1,
                              const OnToken& on_token = nullptr, int64_t id_limit = 0);
// The same through the whole model's forward, with a KV cache (see the top of the file).
std::vector<int32_t> generate(const Gpt& gpt, std::vector<int32_t> prompt, int64_t new_tokens,
                              float temperature, int64_t top_k, Rng& rng, int32_t stop = -1,
                              const OnToken& on_token = nullptr, int64_t id_limit = 0);

}  // namespace tessel::model

#pragma once
// Text generation without a KV cache: every step runs the whole forward over the
// last model.max_seq tokens (simple and exactly the training forward).
#include <cstdint>
#include <vector>

#include "tessel/core/rng.hpp"
#include "tessel/model/gpt.hpp"

namespace tessel::model {

// Logits [V] of the token after `context` (its last model.max_seq tokens are used).
std::vector<float> next_token_logits(const Gpt& gpt, const std::vector<int32_t>& context);

// A token drawn from softmax(logits / temperature) over the top_k largest logits
// (top_k = 0: all). temperature = 0 is greedy: the largest logit, the lowest id on ties.
int32_t sample_token(const std::vector<float>& logits, float temperature, int64_t top_k, Rng& rng);

// prompt followed by new_tokens sampled tokens. InputError on an empty prompt, a
// negative temperature, top_k or new_tokens, or a token id outside the vocabulary.
std::vector<int32_t> generate(const Gpt& gpt, std::vector<int32_t> prompt, int64_t new_tokens,
                              float temperature, int64_t top_k, Rng& rng);

}  // namespace tessel::model

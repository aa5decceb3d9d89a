#include "tessel/train/stage_partition.hpp"

#include <algorithm>
#include <limits>

#include "tessel/core/error.hpp"
#include "tessel/core/number_list.hpp"

namespace tessel::train {

namespace {
// Matmul parameters of an MLP of hidden width F (swiglu's fc_in is [2F, C]).
double mlp_params(const model::GptConfig& m, int64_t F) {
  const double in = m.mlp == model::MlpType::swiglu ? 2.0 * double(F) : double(F);
  return (in + double(F)) * double(m.width);
}
}  // namespace

LayerCosts layer_costs(const model::GptConfig& m, int64_t seq_len) {
  const double C = double(m.width), V = double(m.vocab), HD = double(m.heads * m.head_dim());
  const double qkv = (HD + 2.0 * double(m.num_kv_heads() * m.head_dim())) * C;
  const double attn = qkv + HD * C;
  const auto moe = m.moe_mask();
  LayerCosts c;
  for (int64_t l = 0; l < m.layers; ++l) {
    double matmul = attn;
    if (moe[size_t(l)]) {  // router + the top_k experts and the shared one a token runs
      matmul +=
          double(m.moe.experts) * C + double(m.moe.top_k) * mlp_params(m, m.moe_hidden_size());
      if (m.moe.shared > 0) matmul += mlp_params(m, m.moe.shared);
    } else {
      matmul += mlp_params(m, m.mlp_hidden_size());
    }
    c.blocks.push_back(6.0 * matmul + 12.0 * HD * double(seq_len));
  }
  c.embedding = 6.0 * C;
  c.head = 6.0 * C * V + 6.0 * V;
  return c;
}

std::vector<double> stage_costs(const LayerCosts& costs, const std::vector<int64_t>& counts) {
  std::vector<double> out(counts.size(), 0.0);
  size_t block = 0;
  for (size_t s = 0; s < counts.size(); ++s)
    for (int64_t i = 0; i < counts[s]; ++i) out[s] += costs.blocks[block++];
  out.front() += costs.embedding;
  out.back() += costs.head;
  return out;
}

std::vector<int64_t> balanced_layout(const LayerCosts& costs, int64_t stages,
                                     const std::string& stages_key) {
  const int64_t L = int64_t(costs.blocks.size()), P = stages;
  TESSEL_CHECK(P >= 1, "stages = ", P);
  const int64_t needed = P == 1 ? 1 : P - 2;  // blocks the middle stages (or a lone one) need
  if (L < needed)
    input_error("model.layers = ", L, " is too few for ", stages_key, " = ", P,
                ": every middle stage needs a block");
  std::vector<double> prefix(size_t(L) + 1, 0.0);
  for (int64_t i = 0; i < L; ++i)
    prefix[size_t(i) + 1] = prefix[size_t(i)] + costs.blocks[size_t(i)];
  auto cost = [&](int64_t s, int64_t first, int64_t last) {
    return prefix[size_t(last)] - prefix[size_t(first)] + (s == 0 ? costs.embedding : 0.0) +
           (s == P - 1 ? costs.head : 0.0);
  };
  auto min_blocks = [&](int64_t s) { return s == 0 || s == P - 1 ? (P == 1 ? 1 : 0) : 1; };
  // best[s][j]: the smallest slowest-stage cost of stages 0..s holding blocks [0, j).
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(size_t(P), std::vector<double>(size_t(L) + 1, inf));
  std::vector<std::vector<int64_t>> from(size_t(P), std::vector<int64_t>(size_t(L) + 1, -1));
  for (int64_t j = min_blocks(0); j <= L; ++j) best[0][size_t(j)] = cost(0, 0, j);
  for (int64_t s = 1; s < P; ++s)
    for (int64_t j = 0; j <= L; ++j)
      for (int64_t i = 0; i + min_blocks(s) <= j; ++i) {
        if (best[size_t(s) - 1][size_t(i)] == inf) continue;
        const double c = std::max(best[size_t(s) - 1][size_t(i)], cost(s, i, j));
        if (c < best[size_t(s)][size_t(j)])
          best[size_t(s)][size_t(j)] = c, from[size_t(s)][size_t(j)] = i;
      }
  std::vector<int64_t> counts(static_cast<size_t>(P));
  int64_t end = L;
  for (int64_t s = P - 1; s > 0; --s) {
    const int64_t begin = from[size_t(s)][size_t(end)];
    counts[size_t(s)] = end - begin;
    end = begin;
  }
  counts[0] = end;
  return counts;
}

std::vector<int64_t> stage_layout(const std::string& layout, const LayerCosts& costs,
                                  int64_t stages, const std::string& stages_key) {
  if (layout.empty()) return balanced_layout(costs, stages, stages_key);
  const int64_t L = int64_t(costs.blocks.size());
  const std::vector<int64_t> counts = parse_int_list("pipeline.layout", layout, 0);
  if (int64_t(counts.size()) != stages)
    input_error("config key 'pipeline.layout' = \"", layout, "\" has ", counts.size(),
                " stage(s) but ", stages_key, " = ", stages);
  const char* stage = stages_key == "parallel.pp" ? "stage " : "virtual stage ";
  int64_t sum = 0;
  for (size_t s = 0; s < counts.size(); ++s) {
    if (counts[s] > L)  // before the sum, which it could overflow
      input_error("config key 'pipeline.layout' = \"", layout, "\": ", stage, s, " holds ",
                  counts[s], " blocks but model.layers = ", L);
    sum += counts[s];
  }
  if (sum != L)
    input_error("config key 'pipeline.layout' = \"", layout, "\" holds ", sum,
                " blocks but model.layers = ", L);
  for (int64_t s = 0; s < stages; ++s) {
    const bool ends = (s == 0 || s == stages - 1) && stages > 1;
    if (counts[size_t(s)] == 0 && !ends)
      input_error("config key 'pipeline.layout' = \"", layout, "\": ", stage, s,
                  " has no blocks (only the first and last, which hold the embedding "
                  "and the head, may have none)");
  }
  return counts;
}

std::vector<int64_t> stage_boundaries(const std::vector<int64_t>& counts) {
  std::vector<int64_t> b{0};
  for (int64_t n : counts) b.push_back(b.back() + n);
  return b;
}

}  // namespace tessel::train

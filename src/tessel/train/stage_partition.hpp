#pragma once
// How the GPT's blocks are split over the pipeline stages (issue #7): contiguous ranges, the
// embedding on the first stage, the final norm, head and loss on the last. By default the
// split balances compute: it minimizes the cost of the slowest stage, costs per token as
// metrics.hpp counts them (6 x matmul parameters, plus attention's 12 H D T per block), so
// the last stage, which also runs the head, usually gets fewer blocks. `pipeline.layout`
// ("3,2,...", blocks per stage) overrides it.
#include <cstdint>
#include <string>
#include <vector>

#include "tessel/model/gpt_config.hpp"

namespace tessel::train {

// Forward + backward cost of one token: per block, and of the pieces around them.
struct LayerCosts {
  std::vector<double> blocks;  // [layers]
  double embedding = 0;        // lookups: 6 C (a row added forward, scattered backward)
  double head = 0;             // final norm + head matmul + loss: 6 C V + 6 V
};
LayerCosts layer_costs(const model::GptConfig& model, int64_t seq_len);

// Cost per token of each stage of `counts` (blocks per stage, in order).
std::vector<double> stage_costs(const LayerCosts& costs, const std::vector<int64_t>& counts);

// Blocks per stage minimizing the largest stage cost. Every middle stage gets at least one
// block; the first and last may get none (they still hold the embedding / the head).
// InputError when the model has too few blocks for the stages, naming `stages_key` (the
// config keys that set their number).
std::vector<int64_t> balanced_layout(const LayerCosts& costs, int64_t stages,
                                     const std::string& stages_key = "parallel.pp");

// Parses `pipeline.layout` ("2,2"); "" = balanced_layout. InputError naming the key when
// the counts are not integers, are not `stages` of them, do not sum to the layers, or leave
// a middle stage (or the only stage's) without blocks.
std::vector<int64_t> stage_layout(const std::string& layout, const LayerCosts& costs,
                                  int64_t stages, const std::string& stages_key = "parallel.pp");

// The first block of every stage, and one past the last: [stages + 1].
std::vector<int64_t> stage_boundaries(const std::vector<int64_t>& counts);

}  // namespace tessel::train

#pragma once
// A model-like parameter set for optimizer tests: one flat value buffer and one flat
// gradient buffer, parameters as views in registry order.
#include <cstdint>
#include <string>
#include <vector>

#include "tessel/core/parameter.hpp"
#include "tessel/core/rng.hpp"

namespace tessel::fixture {

struct ParamSpec {
  std::string name;
  ParamTag tag;
  Shape shape;
};

struct ParamSet {
  Tensor values, grads;
  ParameterList params;

  ParamSet(const std::vector<ParamSpec>& specs, uint64_t seed, float value_std = 0.1f) {
    int64_t total = 0;
    for (const ParamSpec& s : specs) total += shape_numel(s.shape);
    values = Tensor({total});
    grads = Tensor({total});
    Rng rng(seed);
    rng.fill_normal(values.f32(), total, 0.0f, value_std);
    int64_t offset = 0;
    for (const ParamSpec& s : specs) {
      params.push_back({s.name, s.tag, values.view(offset, s.shape), grads.view(offset, s.shape)});
      offset += shape_numel(s.shape);
    }
  }
  void random_grads(uint64_t seed) {
    Rng rng(seed);
    rng.fill_normal(grads.f32(), grads.numel(), 0.0f, 0.1f);
  }
  std::vector<float> snapshot() const { return {values.f32(), values.f32() + values.numel()}; }
};

// Hidden matrices of several shapes (two of 24x16, so a shape group not divisible by 4
// ranks; 3x16 has empty row shards on 4 ranks; 40x8 is tall) beside embedding, head, norm and
// bias parameters that must go to AdamW.
inline std::vector<ParamSpec> muon_test_specs() {
  return {{"embed", ParamTag::embedding, {30, 16}},
          {"b0.qkv", ParamTag::hidden_matrix, {24, 16}},
          {"b0.bias", ParamTag::bias, {24}},
          {"b0.out", ParamTag::hidden_matrix, {16, 16}},
          {"b0.norm", ParamTag::norm, {16}},
          {"b0.fc", ParamTag::hidden_matrix, {40, 8}},
          {"b1.qkv", ParamTag::hidden_matrix, {24, 16}},
          {"b1.gate", ParamTag::hidden_matrix, {3, 16}},
          {"b1.out", ParamTag::hidden_matrix, {16, 16}},
          {"b2.qkv", ParamTag::hidden_matrix, {24, 16}},
          {"head", ParamTag::head, {30, 16}}};
}

}  // namespace tessel::fixture

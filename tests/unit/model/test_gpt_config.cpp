#include <gtest/gtest.h>

#include <functional>

#include "tessel/core/error.hpp"
#include "tessel/model/gpt.hpp"
#include "tessel/model/gpt_config.hpp"

using namespace tessel;
using namespace tessel::model;

namespace {

// validate(c) after `change` throws InputError whose message contains `text`.
void expect_invalid(const std::function<void(GptConfig&)>& change, const std::string& text) {
  GptConfig c;
  change(c);
  try {
    validate(c);
    ADD_FAILURE() << "accepted; expected: " << text;
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(GptConfig, DefaultsAreValidGpt2Small) {
  GptConfig c;
  EXPECT_NO_THROW(validate(c));
  EXPECT_EQ(c.head_dim(), 64);
  EXPECT_EQ(c.num_kv_heads(), 12);
  EXPECT_EQ(c.mlp_hidden_size(), 3072);
}

TEST(GptConfig, DefaultMlpHidden) {
  EXPECT_EQ(default_mlp_hidden(MlpType::gelu, 100), 400);
  // ceil(8 * width / 3) rounded up to a multiple of 64.
  EXPECT_EQ(default_mlp_hidden(MlpType::swiglu, 768), 2048);  // 2048 exactly
  EXPECT_EQ(default_mlp_hidden(MlpType::swiglu, 64), 192);    // 170.7 -> 171 -> 192
  EXPECT_EQ(default_mlp_hidden(MlpType::swiglu, 24), 64);     // 64 exactly
  EXPECT_EQ(default_mlp_hidden(MlpType::swiglu, 25), 128);    // 66.7 -> 67 -> 128
  GptConfig c;
  c.mlp = MlpType::swiglu;
  c.mlp_hidden = 100;
  EXPECT_EQ(c.mlp_hidden_size(), 100);
}

TEST(GptConfig, ValidationNamesTheField) {
  expect_invalid(
      [](GptConfig& c) {
        c.width = 64;
        c.heads = 5;
      },
      "model.heads = 5 must divide model.width = 64");
  expect_invalid(
      [](GptConfig& c) {
        c.heads = 4;
        c.width = 64;
        c.kv_heads = 3;
      },
      "model.kv_heads = 3 must divide model.heads = 4");
  expect_invalid(
      [](GptConfig& c) {
        c.width = 60;
        c.heads = 4;
        c.positions = PositionType::rotary;
      },
      "model.width / model.heads = 15 (the head dimension) must be even");
  expect_invalid([](GptConfig& c) { c.vocab = 0; }, "model.vocab = 0 must be positive");
  expect_invalid([](GptConfig& c) { c.layers = -1; }, "model.layers = -1 must be positive");
  expect_invalid([](GptConfig& c) { c.width = 0; }, "model.width = 0 must be positive");
  expect_invalid([](GptConfig& c) { c.heads = 0; }, "model.heads = 0 must be positive");
  expect_invalid([](GptConfig& c) { c.kv_heads = -2; }, "model.kv_heads = -2 must be positive");
  expect_invalid([](GptConfig& c) { c.mlp_hidden = -1; }, "model.mlp_hidden = -1");
  expect_invalid([](GptConfig& c) { c.norm_eps = 0.0; }, "model.norm_eps = 0 must be positive");
  expect_invalid(
      [](GptConfig& c) {
        c.positions = PositionType::rotary;
        c.rope_theta = -1.0;
      },
      "model.rope_theta = -1");
  expect_invalid([](GptConfig& c) { c.max_seq = 0; }, "model.max_seq = 0 must be positive");
  expect_invalid([](GptConfig& c) { c.init_std = 0.0; }, "model.init_std = 0 must be positive");
  expect_invalid([](GptConfig& c) { c.vocab = int64_t(1) << 32; }, "model.vocab = 4294967296");
}

TEST(GptConfig, ModelConstructorValidates) {
  GptConfig c;
  c.heads = 5;
  EXPECT_THROW(Gpt(c, 0), InputError);
}

TEST(GptConfig, EnumNames) {
  EXPECT_STREQ(to_string(MlpType::swiglu), "swiglu");
  EXPECT_STREQ(to_string(NormType::rmsnorm), "rmsnorm");
  EXPECT_STREQ(to_string(PositionType::rotary), "rotary");
}

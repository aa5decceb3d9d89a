#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "support/expect_input_error.hpp"
#include "support/param_fixture.hpp"
#include "tessel/core/error.hpp"
#include "tessel/core/rng.hpp"
#include "tessel/optim/adamw.hpp"
#include "tessel/optim/optimizer.hpp"

using namespace tessel;
using namespace tessel::optim;

namespace {

// A model-like layout (tests/support/param_fixture.hpp), one parameter of each tag.
struct Model : fixture::ParamSet {
  explicit Model(uint64_t seed)
      : ParamSet({{"wte", ParamTag::embedding, {11, 4}},
                  {"wpe", ParamTag::position_embedding, {5, 4}},
                  {"h0.attn.w", ParamTag::hidden_matrix, {4, 12}},
                  {"h0.attn.b", ParamTag::bias, {12}},
                  {"h0.ln.w", ParamTag::norm, {4}},
                  {"lm_head", ParamTag::head, {11, 4}}},
                 seed, 1.0f) {}
};

OptimizerConfig config() {
  OptimizerConfig c;
  c.lr = 1e-2;
  c.weight_decay = 0.1;
  return c;
}

// Runs `steps` updates with gradients seeded from `seed0`, returns the parameters after.
std::vector<float> run(Optimizer& opt, Model& model, uint64_t seed0, int steps) {
  for (int s = 0; s < steps; ++s) {
    model.random_grads(seed0 + s);
    opt.step(0.5 + 0.1 * s);
  }
  return model.snapshot();
}

}  // namespace

TEST(AdamW, StateNamesShapesAndStepCounter) {
  Model model(1);
  auto opt = make_optimizer(config(), model.params);
  EXPECT_EQ(opt->name(), "adamw");
  std::vector<StateTensor> st = opt->state();
  ASSERT_EQ(st.size(), 1 + 2 * model.params.size());
  EXPECT_EQ(st[0].name, "adamw.step");
  EXPECT_EQ(st[0].tensor.dtype(), DType::i32);
  EXPECT_EQ(st[0].tensor.shape(), Shape{1});
  for (size_t i = 0; i < model.params.size(); ++i) {
    EXPECT_EQ(st[1 + 2 * i].name, "adamw.m/" + model.params[i].name);
    EXPECT_EQ(st[2 + 2 * i].name, "adamw.v/" + model.params[i].name);
    EXPECT_EQ(st[1 + 2 * i].tensor.shape(), model.params[i].value.shape());
    EXPECT_EQ(st[2 + 2 * i].tensor.dtype(), DType::f32);
  }
  EXPECT_EQ(opt->step_count(), 0);
  run(*opt, model, 10, 3);
  EXPECT_EQ(opt->step_count(), 3);
  EXPECT_EQ(opt->state()[0].tensor.i32()[0], 3);
}

// The optimizer updates the model's buffers through the views and matches the kernel
// applied per parameter with the per-tag decay (bitwise: same f32 code path).
TEST(AdamW, UpdatesParametersLikeTheKernel) {
  Model model(2), ref(2);
  auto opt = make_optimizer(config(), model.params);
  model.random_grads(7);
  ref.random_grads(7);
  opt->step(0.5);
  const OptimizerConfig c = config();
  for (const Parameter& p : ref.params) {
    bool decays =
        p.tag == ParamTag::hidden_matrix || p.tag == ParamTag::embedding || p.tag == ParamTag::head;
    AdamWHyper h{c.lr * 0.5, c.beta1, c.beta2, c.eps, decays ? c.weight_decay : 0.0};
    int64_t n = p.value.numel();
    std::vector<float> m(static_cast<size_t>(n)), v(static_cast<size_t>(n));
    Tensor value = p.value;
    adamw_update(value.f32(), p.grad.f32(), m.data(), v.data(), n, h, 1);
  }
  EXPECT_EQ(model.snapshot(), ref.snapshot());
}

// Save copies of the state and parameters, run on, restore in place into a fresh optimizer
// (the checkpoint-resume path) and into the same one: the following steps repeat bitwise.
TEST(AdamW, StateRoundTripIsBitwise) {
  Model model(3);
  auto opt = make_optimizer(config(), model.params);
  run(*opt, model, 100, 4);
  std::vector<Tensor> saved;
  for (const StateTensor& s : opt->state()) saved.push_back(s.tensor.clone());
  const std::vector<float> params_saved = model.snapshot();

  const std::vector<float> expected = run(*opt, model, 200, 3);
  const int64_t expected_steps = opt->step_count();

  auto restore = [&](Optimizer& target) {
    std::memcpy(model.values.f32(), params_saved.data(), params_saved.size() * sizeof(float));
    std::vector<StateTensor> st = target.state();
    ASSERT_EQ(st.size(), saved.size());
    for (size_t i = 0; i < st.size(); ++i) {
      ASSERT_EQ(st[i].tensor.bytes(), saved[i].bytes());
      std::memcpy(st[i].tensor.raw(), saved[i].raw(), saved[i].bytes());
    }
  };

  auto fresh = make_optimizer(config(), model.params);
  restore(*fresh);
  EXPECT_EQ(fresh->step_count(), 4);
  EXPECT_EQ(run(*fresh, model, 200, 3), expected);
  EXPECT_EQ(fresh->step_count(), expected_steps);

  restore(*opt);
  EXPECT_EQ(run(*opt, model, 200, 3), expected);
}

// With zero gradients m and v stay zero and the Adam step is exactly 0, so each parameter
// moves by decoupled weight decay alone: p * (1 - lr*scale*wd) for decay tags, unchanged
// for the others (exact: one f32 multiply, no other rounding).
TEST(AdamW, WeightDecayRoutesByTag) {
  const double scale = 0.5;
  auto check = [&](const OptimizerConfig& c, const std::vector<ParamTag>& decaying) {
    Model model(4);
    const std::vector<float> before = model.snapshot();
    auto opt = make_optimizer(c, model.params);
    opt->step(scale);
    const float factor = float(1.0 - c.lr * scale * c.weight_decay);
    int64_t offset = 0;
    for (const Parameter& p : model.params) {
      bool decays = std::find(decaying.begin(), decaying.end(), p.tag) != decaying.end();
      for (int64_t i = 0; i < p.value.numel(); ++i) {
        float b = before[size_t(offset + i)];
        ASSERT_EQ(p.value.f32()[i], decays ? b * factor : b) << p.name << " [" << i << "]";
      }
      offset += p.value.numel();
    }
  };
  check(config(), {ParamTag::hidden_matrix, ParamTag::embedding, ParamTag::head});
  OptimizerConfig custom = config();
  custom.decay_tags = " norm , bias";
  check(custom, {ParamTag::norm, ParamTag::bias});
  custom.decay_tags = "";
  check(custom, {});
}

using tessel::fixture::expect_input_error;

TEST(OptimizerFactory, BadConfigNamesTheField) {
  Model model(5);
  auto with = [&](auto mutate) {
    OptimizerConfig c = config();
    mutate(c);
    return [c, &model] { make_optimizer(c, model.params); };
  };
  expect_input_error(with([](OptimizerConfig& c) { c.name = "sgd"; }), {"optim.name"});
  expect_input_error(with([](OptimizerConfig& c) { c.lr = 0; }), {"optim.lr"});
  expect_input_error(with([](OptimizerConfig& c) { c.beta1 = 1; }), {"optim.beta1"});
  expect_input_error(with([](OptimizerConfig& c) { c.beta2 = -0.1; }), {"optim.beta2"});
  expect_input_error(with([](OptimizerConfig& c) { c.eps = 0; }), {"optim.eps"});
  expect_input_error(with([](OptimizerConfig& c) { c.weight_decay = -1; }), {"optim.weight_decay"});
  // 0 in f32: a division by zero, a rate that trains nothing.
  expect_input_error(with([](OptimizerConfig& c) { c.eps = 1e-46; }), {"optim.eps", "float range"});
  expect_input_error(with([](OptimizerConfig& c) { c.lr = 1e-50; }), {"optim.lr", "float range"});
  expect_input_error(with([](OptimizerConfig& c) { c.muon_lr = 1e-50; }),
                     {"optim.muon_lr", "float range"});
  // lr x weight_decay, named by the rate that decays something: under AdamW muon_lr decays
  // nothing; under Muon with only hidden matrices decayed, lr decays nothing.
  expect_input_error(with([](OptimizerConfig& c) { c.lr = 20; }),
                     {"optim.lr * optim.weight_decay = 2 must be < 1"});
  EXPECT_NO_THROW(with([](OptimizerConfig& c) {
    c.lr = 0.01;
    c.weight_decay = 60;
    c.muon_lr = 0.02;
  })());
  expect_input_error(with([](OptimizerConfig& c) {
                       c.name = "muon";
                       c.weight_decay = 60;
                       c.muon_lr = 0.02;
                       c.lr = 0.001;
                     }),
                     {"optim.muon_lr * optim.weight_decay"});
  EXPECT_NO_THROW(with([](OptimizerConfig& c) {
    c.name = "muon";
    c.decay_tags = "hidden_matrix";
    c.lr = 1;
    c.muon_lr = 0.001;
    c.weight_decay = 10;
  })());
  expect_input_error(with([](OptimizerConfig& c) { c.decay_tags = "hidden_matrix,gain"; }),
                     {"optim.decay_tags"});
  expect_input_error(with([](OptimizerConfig& c) { c.decay_tags = "head,,norm"; }),
                     {"optim.decay_tags", "empty item"});
}

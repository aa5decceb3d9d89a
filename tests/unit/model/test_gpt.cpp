#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tessel/core/error.hpp"
#include "tessel/model/gpt.hpp"
#include "unit/model/model_test_util.hpp"

using namespace tessel;
using namespace tessel::model;
using namespace tessel::model::testing;

namespace {

// Loss sum and gradients (loss_scale 1) at the model's current parameters.
double forward_backward(Gpt& gpt, Activations& acts, const Batch& batch, float loss_scale = 1.0f) {
  const double loss = gpt.forward(acts, batch.inputs());
  gpt.backward(acts, loss_scale);
  return loss;
}

// Central differences of the f32 forward's loss sum, eps = 3e-3, at the largest
// analytic gradient of every parameter tensor and 3 random coordinates. The check
// passes when |fd - analytic| <= 0.05 * max(|fd|, |analytic|, 0.05). Measured
// here: the f32 forward's rounding (~2e-6 on the loss sum, / 2 eps ~ 4e-4) and the
// O(eps^2) truncation (~0.2% on the sharpest coordinate) stay well below it, while
// a wrong sign (relative error 2) or a factor 2 (relative error 0.5) exceed it.
// Each tensor must show one |fd| >= 0.05, so no check is vacuous.
void check_gradients(const GptConfig& config, bool packed_positions) {
  Gpt gpt(config, 7);
  randomize_parameters(gpt, 11, 0.4f);
  const Batch batch = random_batch(config, 2, 6, 3, packed_positions);
  auto acts = gpt.make_activations(batch.B, batch.T);
  gpt.zero_grads();
  forward_backward(gpt, *acts, batch);

  constexpr float kEps = 3e-3f;
  constexpr double kRel = 0.05, kFloor = 0.05;
  Rng pick(5);
  for (const Parameter& p : gpt.parameters()) {
    if (p.tag == ParamTag::balance_bias) continue;  // set by the balancing update, no gradient
    Tensor w = p.value;
    const float* g = p.grad.f32();
    const int64_t n = w.numel();
    std::vector<int64_t> coords = {
        std::max_element(g, g + n, [](float a, float b) { return std::fabs(a) < std::fabs(b); }) -
        g};
    for (int i = 0; i < 3; ++i) coords.push_back(int64_t(pick.below(uint64_t(n))));
    double largest = 0.0;
    for (int64_t i : coords) {
      const float saved = w.f32()[i];
      w.f32()[i] = saved + kEps;
      const float up = w.f32()[i];
      const double loss_up = gpt.forward(*acts, batch.inputs());
      w.f32()[i] = saved - kEps;
      const float down = w.f32()[i];
      const double loss_down = gpt.forward(*acts, batch.inputs());
      w.f32()[i] = saved;
      const double fd = (loss_up - loss_down) / (double(up) - double(down));
      const double an = g[i];
      EXPECT_LE(std::fabs(fd - an), kRel * std::max({std::fabs(fd), std::fabs(an), kFloor}))
          << p.name << "[" << i << "]: finite difference " << fd << ", analytic " << an;
      largest = std::max(largest, std::fabs(fd));
    }
    EXPECT_GE(largest, kFloor) << p.name << " shows no gradient to check";
  }
}

// d/dt loss(theta + t u) at t = 0 for one random direction u over all parameters
// (entries normal(0, 1)), central difference with t = +-1e-4, against g . u.
// Tolerance 1% of |g . u| (~ |g| ~ 100 here): the f32 forward's noise is
// ~1e-5 / 2e-4 = 0.05 absolute and the O(t^2) term ~0.02% (at t = 1e-3 the swiglu
// model's curvature already shows at 3%); a wrong gradient in any tensor that
// carries more than a few percent of g . u fails.
void check_directional_derivative(const GptConfig& config, bool packed_positions) {
  Gpt gpt(config, 8);
  randomize_parameters(gpt, 12, 0.4f);
  const Batch batch = random_batch(config, 2, 6, 4, packed_positions);
  auto acts = gpt.make_activations(batch.B, batch.T);
  gpt.zero_grads();
  forward_backward(gpt, *acts, batch);

  Tensor theta = gpt.flat_params();
  const Tensor saved = theta.clone();
  const int64_t P = theta.numel();
  std::vector<float> u(static_cast<size_t>(P));
  Rng rng(10);  // drawn in registry order, whatever the flat layout
  for (const Parameter& p : gpt.parameters())
    rng.fill_normal(u.data() + (p.value.f32() - theta.f32()), p.value.numel(), 0.0f, 1.0f);
  double analytic = 0.0;
  for (int64_t i = 0; i < P; ++i) analytic += double(gpt.flat_grads().f32()[i]) * u[size_t(i)];

  constexpr float kT = 1e-4f;
  auto loss_at = [&](float t) {
    for (int64_t i = 0; i < P; ++i) theta.f32()[i] = saved.f32()[i] + t * u[size_t(i)];
    return gpt.forward(*acts, batch.inputs());
  };
  const double fd = (loss_at(kT) - loss_at(-kT)) / (2.0 * kT);
  std::memcpy(theta.raw(), saved.raw(), saved.bytes());
  EXPECT_GT(std::fabs(analytic), 10.0);
  EXPECT_NEAR(fd, analytic, 1e-2 * std::fabs(analytic));
}

}  // namespace

TEST(GptGradients, GeluLayerNormLearnedUntiedBias) {
  check_gradients(gelu_config(), false);
}

TEST(GptGradients, SwigluRmsNormRotaryTiedGqa) {
  check_gradients(swiglu_config(), true);
}

TEST(GptGradients, DirectionalDerivativeOverAllParameters) {
  check_directional_derivative(gelu_config(), false);
  check_directional_derivative(swiglu_config(), true);
}

TEST(GptGradients, MoeBlocks) {
  check_gradients(moe_config(gelu_config(), "1"), false);
  check_gradients(moe_config(swiglu_config(), "all"), true);
  check_directional_derivative(moe_config(gelu_config(), "all"), false);
}

TEST(GptParameters, RegistryNamesShapesTagsInOrder) {
  GptConfig c = gelu_config();
  c.layers = 1;
  Gpt gpt(c, 1);
  const int64_t V = 13, C = 16, F = 24, T = 8;
  struct Row {
    const char* name;
    Shape shape;
    ParamTag tag;
  };
  const std::vector<Row> expected = {
      {"embed.weight", {V, C}, ParamTag::embedding},
      {"pos_embed.weight", {T, C}, ParamTag::position_embedding},
      {"blocks.0.attn_norm.weight", {C}, ParamTag::norm},
      {"blocks.0.attn_norm.bias", {C}, ParamTag::norm},
      {"blocks.0.attn.qkv.weight", {3 * C, C}, ParamTag::hidden_matrix},
      {"blocks.0.attn.qkv.bias", {3 * C}, ParamTag::bias},
      {"blocks.0.attn.out.weight", {C, C}, ParamTag::hidden_matrix},
      {"blocks.0.attn.out.bias", {C}, ParamTag::bias},
      {"blocks.0.mlp_norm.weight", {C}, ParamTag::norm},
      {"blocks.0.mlp_norm.bias", {C}, ParamTag::norm},
      {"blocks.0.mlp.fc_in.weight", {F, C}, ParamTag::hidden_matrix},
      {"blocks.0.mlp.fc_in.bias", {F}, ParamTag::bias},
      {"blocks.0.mlp.fc_out.weight", {C, F}, ParamTag::hidden_matrix},
      {"blocks.0.mlp.fc_out.bias", {C}, ParamTag::bias},
      {"final_norm.weight", {C}, ParamTag::norm},
      {"final_norm.bias", {C}, ParamTag::norm},
      {"head.weight", {V, C}, ParamTag::head},
  };
  const ParameterList& params = gpt.parameters();
  ASSERT_EQ(params.size(), expected.size());
  int64_t offset = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(params[i].name, expected[i].name);
    EXPECT_EQ(params[i].value.shape(), expected[i].shape) << params[i].name;
    EXPECT_EQ(params[i].grad.shape(), expected[i].shape) << params[i].name;
    EXPECT_EQ(params[i].tag, expected[i].tag) << params[i].name;
    // Packed back to back in registry order in the flat buffers.
    EXPECT_EQ(params[i].value.f32(), gpt.flat_params().f32() + offset) << params[i].name;
    EXPECT_EQ(params[i].grad.f32(), gpt.flat_grads().f32() + offset) << params[i].name;
    offset += params[i].value.numel();
  }
  EXPECT_EQ(gpt.num_parameters(), offset);
  EXPECT_EQ(gpt.flat_grads().numel(), offset);
  // Block matrices 3C*C + C*C + F*C + C*F plus the head V*C.
  EXPECT_EQ(gpt.matmul_parameters(), 3 * C * C + C * C + 2 * F * C + V * C);
  EXPECT_THROW(gpt.parameter("blocks.1.attn.qkv.weight"), Error);
}

TEST(GptParameters, TiedSwigluGqaRegistry) {
  const GptConfig c = swiglu_config();
  Gpt gpt(c, 1);
  const int64_t C = 16, D = 4, F = 64;
  EXPECT_EQ(gpt.parameter("blocks.1.attn.qkv.weight").value.shape(), (Shape{(4 + 2 * 2) * D, C}));
  EXPECT_EQ(gpt.parameter("blocks.1.mlp.fc_in.weight").value.shape(), (Shape{2 * F, C}));
  EXPECT_EQ(gpt.parameter("blocks.1.mlp.fc_out.weight").value.shape(), (Shape{C, F}));
  for (const Parameter& p : gpt.parameters()) {
    EXPECT_FALSE(p.name.ends_with(".bias")) << p.name;  // rmsnorm, bias = false
    EXPECT_NE(p.name, "head.weight");
    EXPECT_NE(p.name, "pos_embed.weight");
  }
  // The tied head still multiplies every token: counted once more.
  const int64_t per_block = 8 * D * C + C * C + 2 * F * C + C * F;
  EXPECT_EQ(gpt.matmul_parameters(), 2 * per_block + 13 * C);
}

TEST(GptParameters, InitRule) {
  GptConfig c;
  c.vocab = 512;
  c.layers = 2;
  c.width = 64;
  c.heads = 4;
  c.max_seq = 64;
  c.tied_head = false;
  c.init_std = 0.05;
  Gpt gpt(c, 3);
  auto stddev = [](const Parameter& p) {
    double s = 0.0, s2 = 0.0;
    const int64_t n = p.value.numel();
    for (int64_t i = 0; i < n; ++i) {
      s += p.value.f32()[i];
      s2 += double(p.value.f32()[i]) * p.value.f32()[i];
    }
    return std::sqrt(s2 / n - (s / n) * (s / n));
  };
  const double scaled = 0.05 / std::sqrt(2.0 * 2);
  for (const Parameter& p : gpt.parameters()) {
    const int64_t n = p.value.numel();
    if (p.tag == ParamTag::norm || p.tag == ParamTag::bias) {
      const float want = p.tag == ParamTag::norm && p.name.ends_with(".weight") ? 1.0f : 0.0f;
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(p.value.f32()[i], want) << p.name;
      continue;
    }
    // Sample std of >= 4096 normals: within 5% (> 4 standard errors).
    const bool output = p.name.ends_with("attn.out.weight") || p.name.ends_with("fc_out.weight");
    EXPECT_NEAR(stddev(p), output ? scaled : 0.05, 0.05 * (output ? scaled : 0.05)) << p.name;
  }
}

TEST(GptLoss, InitialLossIsLogVocab) {
  GptConfig c;
  c.vocab = 64;
  c.layers = 2;
  c.width = 32;
  c.heads = 4;
  c.max_seq = 16;
  Gpt gpt(c, 5);
  const Batch batch = random_batch(c, 4, 16, 6, false);
  auto acts = gpt.make_activations(4, 16);
  const double loss = gpt.forward(*acts, batch.inputs());
  double weight = 0.0;
  for (float w : batch.weight) weight += w;
  EXPECT_NEAR(loss / weight, std::log(64.0), 0.1);
}

TEST(GptLoss, InferenceWithoutTargetsGivesTheSameLogits) {
  const GptConfig c = gelu_config();
  Gpt gpt(c, 5);
  const Batch batch = random_batch(c, 2, 6, 6, false);
  auto with = gpt.make_activations(2, 6);
  auto without = gpt.make_activations(2, 6);
  gpt.forward(*with, batch.inputs());
  ModelInputs in = batch.inputs();
  in.targets = nullptr;
  in.loss_weight = nullptr;
  EXPECT_EQ(gpt.forward(*without, in), 0.0);
  EXPECT_TRUE(bitwise_equal(with->logits, without->logits));
  EXPECT_THROW(gpt.backward(*without, 1.0f), Error);
}

TEST(GptDeterminism, SameSeedSameBits) {
  for (const GptConfig& c : {gelu_config(), swiglu_config()}) {
    Gpt a(c, 42), b(c, 42), other(c, 43);
    EXPECT_TRUE(bitwise_equal(a.flat_params(), b.flat_params()));
    EXPECT_FALSE(bitwise_equal(a.flat_params(), other.flat_params()));
    const Batch batch = random_batch(c, 2, 6, 1, c.positions == PositionType::rotary);
    auto acts_a = a.make_activations(2, 6);
    auto acts_b = b.make_activations(2, 6);
    const double loss_a = forward_backward(a, *acts_a, batch);
    const double loss_b = forward_backward(b, *acts_b, batch);
    EXPECT_EQ(loss_a, loss_b);
    EXPECT_TRUE(bitwise_equal(a.flat_grads(), b.flat_grads()));
    // A second run over zeroed gradients repeats the first exactly.
    const Tensor first = a.flat_grads().clone();
    a.zero_grads();
    EXPECT_EQ(forward_backward(a, *acts_a, batch), loss_a);
    EXPECT_TRUE(bitwise_equal(a.flat_grads(), first));
  }
}

// Two micro-batches of one row each, loss_scale 1/2 each, against one batch of
// both rows with loss_scale 1/2 (itself exactly half of loss_scale 1). Only the summation order
// differs (GEMM over 6 vs 12 rows), so |difference| <= 1e-5 * max |grad| per tensor (f32 rounding
// of sums of a dozen terms is ~1e-6 relative).
TEST(GptGradients, AccumulationOverMicroBatchesMatchesOneBatch) {
  for (const GptConfig& c : {gelu_config(), swiglu_config()}) {
    Gpt gpt(c, 21);
    randomize_parameters(gpt, 22, 0.3f);
    const Batch both = random_batch(c, 2, 6, 23, c.positions == PositionType::rotary);
    auto acts2 = gpt.make_activations(2, 6);
    auto acts1 = gpt.make_activations(1, 6);
    gpt.zero_grads();
    const double loss_both = forward_backward(gpt, *acts2, both, 0.5f);
    const Tensor whole = gpt.flat_grads().clone();
    // loss_scale scales every gradient (by 1/2: exact in binary floating point).
    gpt.zero_grads();
    forward_backward(gpt, *acts2, both, 1.0f);
    for (int64_t i = 0; i < whole.numel(); ++i)
      ASSERT_EQ(whole.f32()[i], 0.5f * gpt.flat_grads().f32()[i]) << i;
    gpt.zero_grads();
    const double loss_parts = forward_backward(gpt, *acts1, both.rows(0, 1), 0.5f) +
                              forward_backward(gpt, *acts1, both.rows(1, 2), 0.5f);
    EXPECT_NEAR(loss_parts, loss_both, 1e-5 * std::fabs(loss_both));
    for (const Parameter& p : gpt.parameters()) {
      const int64_t off = p.grad.f32() - gpt.flat_grads().f32();
      const float* want = whole.f32() + off;
      float scale = 0.0f;
      for (int64_t i = 0; i < p.grad.numel(); ++i) scale = std::max(scale, std::fabs(want[i]));
      ASSERT_GT(scale, 0.0f) << p.name;
      for (int64_t i = 0; i < p.grad.numel(); ++i)
        ASSERT_NEAR(p.grad.f32()[i], want[i], 1e-5f * scale) << p.name << "[" << i << "]";
    }
  }
}

// The pieces run in sequence are the whole forward/backward, bit for bit; so is a
// two-stage split with the residual stream (and its gradient) copied between two
// Activations that hold only their stage's blocks, as pipeline stages do.
TEST(GptPieces, CompositionEqualsWholeModel) {
  for (const GptConfig& c : {gelu_config(), swiglu_config()}) {
    Gpt gpt(c, 31);
    randomize_parameters(gpt, 32, 0.3f);
    const Batch batch = random_batch(c, 2, 6, 33, c.positions == PositionType::rotary);
    const int64_t L = c.layers, k = 1;
    auto whole = gpt.make_activations(2, 6);
    gpt.zero_grads();
    const double loss = forward_backward(gpt, *whole, batch);
    const Tensor grads = gpt.flat_grads().clone();

    auto acts = gpt.make_activations(2, 6);
    gpt.load_inputs(*acts, batch.inputs());
    gpt.forward_embedding(*acts);
    gpt.forward_blocks(*acts, 0, k);
    gpt.forward_blocks(*acts, k, L);
    EXPECT_EQ(gpt.forward_head(*acts), loss);
    EXPECT_TRUE(bitwise_equal(acts->logits, whole->logits));
    gpt.zero_grads();
    gpt.backward_head(*acts, 1.0f);
    gpt.backward_blocks(*acts, k, L);
    gpt.backward_blocks(*acts, 0, k);
    gpt.backward_embedding(*acts);
    EXPECT_TRUE(bitwise_equal(gpt.flat_grads(), grads));

    auto stage0 = gpt.make_activations(2, 6, {0, k, true, false});
    auto stage1 = gpt.make_activations(2, 6, {k, L, false, true});
    EXPECT_EQ(stage0->q.dim(0), k);
    EXPECT_EQ(stage1->q.dim(0), L - k);
    EXPECT_EQ(stage0->stream.dim(0), k + 1);
    EXPECT_FALSE(stage0->logits.defined());  // the head's buffers live on the last stage
    EXPECT_ANY_THROW(stage1->residual(0));
    EXPECT_ANY_THROW(gpt.forward_blocks(*stage0, k, L));
    EXPECT_EQ(run_as_two_stages(gpt, *stage0, *stage1, batch, k), loss);
    EXPECT_TRUE(bitwise_equal(gpt.flat_grads(), grads));
    EXPECT_EQ(stage0->residual(0).shape(), (Shape{2, 6, 16}));
  }
}

// Each parameter `part` holds has the whole model's name and values at its registry
// position; counted into `holders` by name.
void count_held_as_in(const Gpt& whole, const Gpt& part, std::map<std::string, int>& holders) {
  for (size_t i = 0; i < part.parameters().size(); ++i) {
    const Parameter& p = part.parameters()[i];
    const Parameter& q = whole.parameters()[size_t(part.registry_position(i))];
    EXPECT_EQ(p.name, q.name);
    EXPECT_TRUE(bitwise_equal(p.value, q.value)) << p.name;
    ++holders[p.name];
  }
}

// Models holding only a block range (pipeline stages) hold exactly their parameters, with
// the whole model's values, names and registry positions; run in sequence with the residual
// stream (and its gradient) copied between them, they give the whole model's loss and
// gradients bit for bit. A tied embedding's gradient is split between the first and the last
// stage (lookups, head): their sum adds in another order than the whole model accumulates, so
// only rounding may differ there (1e-6 of the largest entry). Pieces not held are errors.
TEST(GptBlockRange, StageModelsComposeTheWholeModel) {
  for (GptConfig c : {gelu_config(), swiglu_config()}) {
    c.layers = 3;
    Gpt whole(c, 31);
    const Batch batch = random_batch(c, 2, 6, 33, c.positions == PositionType::rotary);
    auto whole_acts = whole.make_activations(2, 6);
    whole.zero_grads();
    const double loss = forward_backward(whole, *whole_acts, batch);

    // The first and the last stage without blocks: their neighbours' ranges touch the ends.
    const std::vector<int64_t> bounds = {0, 0, 1, 3, 3};
    const size_t last = bounds.size() - 2;
    std::vector<std::unique_ptr<Gpt>> stages;
    std::vector<std::unique_ptr<Activations>> acts;
    std::map<std::string, int> holders;
    for (size_t s = 0; s <= last; ++s) {
      const BlockRange range{bounds[s], bounds[s + 1], s == 0, s == last};
      stages.push_back(std::make_unique<Gpt>(c, 31, ExpertShard{}, range));
      const Gpt& m = *stages.back();
      EXPECT_EQ(m.total_parameters(), whole.total_parameters());
      EXPECT_EQ(m.matmul_parameters(), whole.matmul_parameters());
      EXPECT_EQ(m.registry_size(), int64_t(whole.parameters().size()));
      count_held_as_in(whole, m, holders);
      acts.push_back(m.make_activations(2, 6));
      EXPECT_EQ(acts.back()->logits.defined(), s == last);
      stages.back()->zero_grads();
    }
    // Every parameter once; a tied embedding also on the last stage, for the head.
    for (const Parameter& p : whole.parameters())
      EXPECT_EQ(holders[p.name], p.name == "embed.weight" && c.tied_head ? 2 : 1) << p.name;

    for (size_t s = 0; s <= last; ++s) {
      stages[s]->load_inputs(*acts[s], batch.inputs());
      if (s == 0)
        stages[s]->forward_embedding(*acts[s]);
      else
        std::memcpy(acts[s]->residual(bounds[s]).raw(), acts[s - 1]->residual(bounds[s]).raw(),
                    acts[s]->residual(bounds[s]).bytes());
      stages[s]->forward_blocks(*acts[s], bounds[s], bounds[s + 1]);
    }
    EXPECT_EQ(stages[last]->forward_head(*acts[last]), loss);
    for (size_t s = last + 1; s-- > 0;) {
      if (s == last)
        stages[s]->backward_head(*acts[s], 1.0f);
      else
        std::memcpy(acts[s]->residual_grad(bounds[s + 1]).raw(),
                    acts[s + 1]->residual_grad(bounds[s + 1]).raw(),
                    acts[s]->residual_grad(bounds[s + 1]).bytes());
      stages[s]->backward_blocks(*acts[s], bounds[s], bounds[s + 1]);
      if (s == 0) stages[s]->backward_embedding(*acts[s]);
    }
    for (const Parameter& q : whole.parameters()) {
      Tensor sum = Tensor(q.grad.shape());
      for (const auto& m : stages)
        for (const Parameter& p : m->parameters())
          if (p.name == q.name)
            for (int64_t i = 0; i < sum.numel(); ++i) sum.f32()[i] += p.grad.f32()[i];
      if (q.name != "embed.weight" || !c.tied_head) {
        EXPECT_TRUE(bitwise_equal(sum, q.grad)) << q.name;
        continue;
      }
      float scale = 0.0f;
      for (int64_t i = 0; i < sum.numel(); ++i) scale = std::max(scale, std::fabs(q.grad.f32()[i]));
      ASSERT_GT(scale, 0.0f);
      for (int64_t i = 0; i < sum.numel(); ++i)
        ASSERT_NEAR(sum.f32()[i], q.grad.f32()[i], 1e-6f * scale) << i;
    }

    EXPECT_ANY_THROW(stages[2]->forward_head(*acts[2]));
    EXPECT_ANY_THROW(stages[1]->forward_embedding(*acts[1]));
    EXPECT_ANY_THROW(stages[2]->forward_blocks(*acts[2], 0, 3));
    EXPECT_ANY_THROW(stages[1]->forward(*acts[1], batch.inputs()));
    EXPECT_ANY_THROW(Gpt(c, 31, ExpertShard{}, BlockRange{2, 1, false, false}));
    EXPECT_ANY_THROW(Gpt(c, 31, ExpertShard{}, BlockRange{1, 3, true, false}));
    EXPECT_ANY_THROW(Gpt(c, 31, ExpertShard{}, BlockRange{0, 2, false, true}));
  }
}

// An interleaved stage's model holds several chunks. Two models of 4 blocks, chunks
// {[0, 1) + embedding, [2, 3)} and {[1, 2), [3, 4) + head}, hold exactly their blocks with the
// whole model's values, and run in the chain 0, 1, 0, 1 they give the whole model's loss and
// gradients bit for bit (untied head: every parameter on one model). Chunks out of order,
// overlapping, or with the ends on the wrong chunk are errors, as are pieces not held.
TEST(GptBlockRange, ChunkedModelsHoldTheirChunksAndComposeTheWholeModel) {
  GptConfig c = gelu_config();
  c.layers = 4;
  c.tied_head = false;
  Gpt whole(c, 31);
  const Batch batch = random_batch(c, 2, 6, 33, false);
  auto whole_acts = whole.make_activations(2, 6);
  whole.zero_grads();
  const double loss = forward_backward(whole, *whole_acts, batch);

  const std::vector<std::vector<BlockRange>> held = {{{0, 1, true, false}, {2, 3, false, false}},
                                                     {{1, 2, false, false}, {3, 4, false, true}}};
  std::vector<std::unique_ptr<Gpt>> models;
  std::map<std::string, int> holders;
  for (const auto& chunks : held) {
    models.push_back(std::make_unique<Gpt>(c, 31, ExpertShard{}, chunks));
    const Gpt& m = *models.back();
    EXPECT_EQ(m.block_ranges().size(), 2u);
    EXPECT_ANY_THROW(m.block_range());
    count_held_as_in(whole, m, holders);
    for (const Parameter& p : m.parameters())
      if (p.name.rfind("blocks.", 0) == 0) {  // block b on model b % 2
        EXPECT_EQ(std::stoll(p.name.substr(7)) % 2, &m == models[1].get()) << p.name;
      }
    models.back()->zero_grads();
  }
  for (const Parameter& p : whole.parameters()) EXPECT_EQ(holders[p.name], 1) << p.name;

  // Virtual stage j = chunk * 2 + model holds block j.
  std::vector<std::unique_ptr<Activations>> acts;
  for (int64_t j = 0; j < 4; ++j) {
    const BlockRange& r = held[size_t(j % 2)][size_t(j / 2)];
    acts.push_back(models[size_t(j % 2)]->make_activations(2, 6, r));
  }
  for (int64_t j = 0; j < 4; ++j) {
    Gpt& m = *models[size_t(j % 2)];
    m.load_inputs(*acts[size_t(j)], batch.inputs());
    if (j == 0)
      m.forward_embedding(*acts[0]);
    else
      std::memcpy(acts[size_t(j)]->residual(j).raw(), acts[size_t(j) - 1]->residual(j).raw(),
                  acts[size_t(j)]->residual(j).bytes());
    m.forward_blocks(*acts[size_t(j)], j, j + 1);
  }
  EXPECT_EQ(models[1]->forward_head(*acts[3]), loss);
  for (int64_t j = 4; j-- > 0;) {
    Gpt& m = *models[size_t(j % 2)];
    if (j == 3)
      m.backward_head(*acts[3], 1.0f);
    else
      std::memcpy(acts[size_t(j)]->residual_grad(j + 1).raw(),
                  acts[size_t(j) + 1]->residual_grad(j + 1).raw(),
                  acts[size_t(j)]->residual_grad(j + 1).bytes());
    m.backward_blocks(*acts[size_t(j)], j, j + 1);
    if (j == 0) m.backward_embedding(*acts[0]);
  }
  for (const auto& m : models)
    for (const Parameter& p : m->parameters())
      EXPECT_TRUE(bitwise_equal(p.grad, whole.parameter(p.name).grad)) << p.name;

  // Chunks of other ranges share the scratch; under recomputation the block cache too, and
  // the logits' gradient only between head chunks (a range without the head has none).
  for (const auto recompute : {Recompute::none, Recompute::blocks}) {
    auto lender = models[1]->make_activations(2, 6, held[1][1], recompute);
    auto other = models[1]->make_activations(2, 6, held[1][0], recompute, lender.get());
    EXPECT_EQ(other->qkv.raw(), lender->qkv.raw());
    EXPECT_EQ(other->d_stream.raw(), lender->d_stream.raw());
    EXPECT_EQ(other->q.raw() == lender->q.raw(), recompute == Recompute::blocks);
    EXPECT_FALSE(other->d_logits.defined());
    auto head = models[1]->make_activations(2, 6, held[1][1], recompute, other.get());
    EXPECT_TRUE(head->d_logits.defined());
    EXPECT_NE(head->d_logits.raw(), lender->d_logits.raw());  // `other` had none to lend
    EXPECT_EQ(head->qkv.raw(), lender->qkv.raw());
  }
  EXPECT_ANY_THROW(models[0]->forward_blocks(*acts[0], 0, 3));  // block 1 is not held
  EXPECT_ANY_THROW(models[0]->forward_head(*acts[2]));
  using Chunks = std::vector<BlockRange>;
  for (const Chunks& bad : {Chunks{}, Chunks{{2, 3, false, false}, {0, 1, false, false}},
                            Chunks{{0, 2, false, false}, {1, 3, false, false}},
                            Chunks{{0, 1, false, true}, {3, 4, false, false}},
                            Chunks{{1, 2, false, false}, {0, 1, true, false}}})
    EXPECT_ANY_THROW(Gpt(c, 31, ExpertShard{}, bad));
}

// Token (0, 3) changes: logits of row 0 before position 3 and all of row 1 must
// not move (causal attention, rows independent). Up to GEMM rounding: 1e-5.
TEST(GptForward, CausalAndRowIndependent) {
  for (const GptConfig& c : {gelu_config(), swiglu_config()}) {
    Gpt gpt(c, 41);
    randomize_parameters(gpt, 42, 0.3f);
    Batch batch = random_batch(c, 2, 6, 43, false);
    auto a = gpt.make_activations(2, 6);
    auto b = gpt.make_activations(2, 6);
    gpt.forward(*a, batch.inputs());
    batch.tokens[3] = (batch.tokens[3] + 1) % int32_t(c.vocab);
    gpt.forward(*b, batch.inputs());
    const int64_t V = c.vocab;
    double unaffected = 0.0, affected = 0.0;
    for (int64_t n = 0; n < 12; ++n)
      for (int64_t j = 0; j < V; ++j) {
        const double d = std::fabs(a->logits.f32()[n * V + j] - b->logits.f32()[n * V + j]);
        double& worst = n < 3 || n >= 6 ? unaffected : affected;
        worst = std::max(worst, d);
      }
    EXPECT_LE(unaffected, 1e-5);
    EXPECT_GT(affected, 1e-3);
  }
}

// Rotary attention sees only relative positions: shifting every position by 2
// leaves the logits unchanged (up to f32 trigonometry, 1e-4). Learned positions
// do change them.
TEST(GptForward, PositionsAreUsed) {
  for (const GptConfig& c : {gelu_config(), swiglu_config()}) {
    Gpt gpt(c, 51);
    randomize_parameters(gpt, 52, 0.3f);
    Batch batch = random_batch(c, 2, 6, 53, true);
    auto a = gpt.make_activations(2, 6);
    auto b = gpt.make_activations(2, 6);
    gpt.forward(*a, batch.inputs());
    for (int32_t& p : batch.positions) p += 2;
    gpt.forward(*b, batch.inputs());
    double diff = 0.0;
    for (int64_t i = 0; i < a->logits.numel(); ++i)
      diff = std::max(diff, double(std::fabs(a->logits.f32()[i] - b->logits.f32()[i])));
    if (c.positions == PositionType::rotary)
      EXPECT_LE(diff, 1e-4);
    else
      EXPECT_GT(diff, 1e-3);
  }
}

TEST(GptInputs, BadInputsAreInputErrors) {
  const GptConfig c = gelu_config();
  Gpt gpt(c, 1);
  auto expect_message = [](auto&& f, const std::string& text) {
    try {
      f();
      ADD_FAILURE() << "no error; expected: " << text;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  expect_message([&] { gpt.make_activations(1, 9); },
                 "sequence length 9 exceeds model.max_seq = 8");
  auto acts = gpt.make_activations(2, 6);
  Batch batch = random_batch(c, 2, 6, 1, true);
  batch.tokens[7] = 13;
  expect_message([&] { gpt.forward(*acts, batch.inputs()); },
                 "token id 13 at [1, 1] is outside [0, model.vocab = 13)");
  batch.tokens[7] = 0;
  batch.positions[2] = 8;
  expect_message([&] { gpt.forward(*acts, batch.inputs()); },
                 "position 8 at [0, 2] is outside [0, model.max_seq = 8)");
  batch.positions[2] = 2;
  batch.targets[4] = -3;
  expect_message([&] { gpt.forward(*acts, batch.inputs()); }, "target id -3 at [0, 4]");
  batch.weight[4] = 0.0f;  // a target out of the loss is never read
  EXPECT_NO_THROW(gpt.forward(*acts, batch.inputs()));
}

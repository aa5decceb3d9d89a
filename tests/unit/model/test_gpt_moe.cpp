// The GPT with MoE blocks: the registry, the active-parameter count, the MoE block against
// the moe layer on the same input, and the balancing update.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "support/expect_input_error.hpp"
#include "tessel/model/gpt.hpp"
#include "unit/model/model_test_util.hpp"

using namespace tessel;
using namespace tessel::model;
using namespace tessel::model::testing;

TEST(GptMoe, RegistryOfAnMoeBlock) {
  const GptConfig c = moe_config(gelu_config(), "1");
  Gpt gpt(c, 1);
  const int64_t C = c.width, E = c.moe.experts, F = c.moe_hidden_size();
  EXPECT_EQ(gpt.moe_blocks(), (std::vector<bool>{false, true}));
  EXPECT_NO_THROW(gpt.parameter("blocks.0.mlp.fc_in.weight"));
  EXPECT_THROW(gpt.parameter("blocks.1.mlp.fc_in.weight"), Error);
  const Parameter& router = gpt.parameter("blocks.1.moe.router.weight");
  EXPECT_EQ(router.value.shape(), (Shape{E, C}));
  EXPECT_EQ(router.tag, ParamTag::router);
  const Parameter& beta = gpt.parameter("blocks.1.moe.router.balance_bias");
  EXPECT_EQ(beta.value.shape(), (Shape{E}));
  EXPECT_EQ(beta.tag, ParamTag::balance_bias);
  EXPECT_EQ(gpt.parameter("blocks.1.moe.experts.2.fc_in.weight").value.shape(), (Shape{F, C}));
  EXPECT_EQ(gpt.parameter("blocks.1.moe.experts.2.fc_out.weight").value.shape(), (Shape{C, F}));
  EXPECT_EQ(gpt.parameter("blocks.1.moe.shared.fc_out.weight").value.shape(),
            (Shape{C, c.moe.shared}));
  // Active matmul weights: the dense model's, with block 1's MLP replaced by the router,
  // top_k experts and the shared expert.
  GptConfig dense = gelu_config();
  Gpt d(dense, 1);
  const int64_t dense_mlp = 2 * C * dense.mlp_hidden_size();
  EXPECT_EQ(gpt.matmul_parameters(), d.matmul_parameters() - dense_mlp + E * C +
                                         c.moe.top_k * 2 * C * F + 2 * C * c.moe.shared);
}

// registry_names(): every parameter's name in registry order, the same list for a model
// that holds nothing (and so allocates no parameters) as the whole model's parameters().
TEST(GptMoe, AModelHoldingNothingKnowsTheWholeRegistry) {
  GptConfig untied = swiglu_config();
  untied.tied_head = false;
  for (const GptConfig& c : {gelu_config(), untied, moe_config(gelu_config(), "1")}) {
    const Gpt whole(c, 1);
    std::vector<std::string> names;
    for (const Parameter& p : whole.parameters()) names.push_back(p.name);
    const Gpt none(c, 1, {}, BlockRange{0, 0, false, false});
    EXPECT_EQ(none.num_parameters(), 0);
    EXPECT_EQ(none.registry_names(), names);
    EXPECT_EQ(whole.registry_names(), names);
    EXPECT_EQ(int64_t(names.size()), whole.registry_size());
  }
}

TEST(GptMoe, BadMoeLayersAreInputErrors) {
  for (const char* bad : {"2", "x", "0,", "-1", "0,1,0"}) {
    GptConfig c = moe_config(gelu_config(), bad);
    fixture::expect_input_error([&] { validate(c); }, {"model.moe_layers", bad});
  }
  EXPECT_EQ(moe_config(gelu_config(), " 1 , 0").moe_mask(), (std::vector<bool>{true, true}));
  GptConfig c = moe_config(gelu_config(), "all");
  c.moe.top_k = 5;
  fixture::expect_input_error([&] { validate(c); }, {"model.moe_top_k = 5"});
}

// What a model computes but would not learn with is refused for training (check_trainable),
// though it validates (an earlier tessel's checkpoint with it still loads): one expert per
// token with normalized gates gives every gate p / p = 1 and the router no gradient, unless
// the gates are p or experts choose (their gates are the scores); qb_avg with every expert per
// token an infinite bias. A dense model is never refused for its MoE keys.
TEST(GptMoe, UntrainableMoeSettingsAreRefusedForTraining) {
  GptConfig c = moe_config(gelu_config(), "all");
  EXPECT_NO_THROW(check_trainable(c));
  c.moe.top_k = 1;
  EXPECT_NO_THROW(validate(c));
  fixture::expect_input_error([&] { check_trainable(c); },
                              {"model.moe_top_k = 1 with model.moe_normalize_gates = true",
                               "no gradient", "set model.moe_normalize_gates = false"});
  c.moe.normalize_gates = false;
  EXPECT_NO_THROW(check_trainable(c));
  c.moe.normalize_gates = true;
  c.moe.balance = moe::Balance::expert_choice;
  EXPECT_NO_THROW(check_trainable(c));
  c.moe.balance = moe::Balance::qb_avg;
  c.moe.top_k = c.moe.experts;
  EXPECT_NO_THROW(validate(c));
  fixture::expect_input_error([&] { check_trainable(c); },
                              {"\"qb_avg\" needs model.moe_top_k < model.moe_experts"});
  c.moe_layers = "";
  c.moe.top_k = 1;
  EXPECT_NO_THROW(check_trainable(c));
}

// seq_aux: each row of the micro-batch is one sequence; every block's balancing value is the
// mean over the rows of alpha E sum_e f_e P_e over that row's tokens, recomputed here from
// the block's routing.
TEST(GptMoe, SeqAuxTakesEachRowAsASequence) {
  GptConfig c = moe_config(gelu_config(), "all");
  c.moe.balance = moe::Balance::seq_aux;
  c.moe.aux_coeff = 0.1;
  Gpt gpt(c, 3);
  randomize_parameters(gpt, 4, 0.4f);
  const int64_t B = 3, T = 8, E = c.moe.experts, k = c.moe.top_k;
  const Batch batch = random_batch(c, B, T, 5, false);
  auto acts = gpt.make_activations(B, T);
  gpt.forward(*acts, batch.inputs());
  for (int64_t l = 0; l < c.layers; ++l) {
    const moe::LayerCache& m = acts->moe[size_t(acts->slot(l))];
    double want = 0, batch_aux = 0;
    std::vector<double> F(size_t(E), 0.0), PB(size_t(E), 0.0);
    for (int64_t b = 0; b < B; ++b) {
      std::vector<double> f(size_t(E), 0.0), P(size_t(E), 0.0);
      for (int64_t n = b * T; n < (b + 1) * T; ++n) {
        for (int64_t j = 0; j < k; ++j)
          f[size_t(m.choice[size_t(n * k + j)])] += 1.0 / double(k * T);
        for (int64_t e = 0; e < E; ++e) P[size_t(e)] += m.probs[size_t(n * E + e)] / double(T);
      }
      for (int64_t e = 0; e < E; ++e) {
        want += 0.1 * double(E) * f[size_t(e)] * P[size_t(e)] / double(B);
        F[size_t(e)] += f[size_t(e)] / double(B);
        PB[size_t(e)] += P[size_t(e)] / double(B);
      }
    }
    for (int64_t e = 0; e < E; ++e) batch_aux += 0.1 * double(E) * F[size_t(e)] * PB[size_t(e)];
    EXPECT_NEAR(m.balance_loss, want, 1e-12) << "block " << l;
    EXPECT_GT(std::abs(want - batch_aux), 1e-6) << "rows routed alike: the test shows nothing";
  }
}

// The model of `c` routes forwards with targets (training, validation) otherwise than that of
// `plain`, and forwards without (generation) exactly as it: the same choices and logits.
static void expect_only_forwards_with_targets_differ(const GptConfig& c, const GptConfig& plain) {
  Gpt model(c, 3), twin(plain, 3);
  randomize_parameters(model, 4, 0.4f);
  randomize_parameters(twin, 4, 0.4f);
  const Batch batch = random_batch(c, 2, 8, 5, false);
  auto choices = [&](const Gpt& gpt, const ModelInputs& in) {
    auto acts = gpt.make_activations(batch.B, batch.T);
    gpt.forward(*acts, in);
    std::vector<int32_t> all;
    for (int64_t l = 0; l < c.layers; ++l) {
      const auto& ch = acts->moe[size_t(acts->slot(l))].choice;
      all.insert(all.end(), ch.begin(), ch.end());
    }
    const float* logits = acts->logits.f32();
    return std::pair(all, std::vector<float>(logits, logits + acts->logits.numel()));
  };
  EXPECT_NE(choices(model, batch.inputs()).first, choices(twin, batch.inputs()).first);
  ModelInputs generate = batch.inputs();
  generate.targets = nullptr;
  generate.loss_weight = nullptr;
  EXPECT_EQ(choices(model, generate), choices(twin, generate));
}

// sinkhorn: forwards with targets select from the balanced scores; forwards without by the
// plain top-k, so they equal a model without balancing.
TEST(GptMoe, SinkhornBalancesOnlyForwardsWithTargets) {
  GptConfig c = moe_config(gelu_config(), "all");
  c.moe.balance = moe::Balance::sinkhorn;
  GptConfig plain = c;
  plain.moe.balance = moe::Balance::none;
  expect_only_forwards_with_targets_differ(c, plain);
}

// expert_choice: forwards with targets let each expert take its top-C tokens of the
// micro-batch; forwards without (generation, not causal otherwise) route each token to its
// top-k experts with the scores as gates and no capacity: a model without balancing, gates
// unnormalized and dropless.
TEST(GptMoe, ExpertChoiceRoutesForwardsWithoutTargetsByTopK) {
  GptConfig c = moe_config(swiglu_config(), "all");  // sigmoid scores, capacity 1
  c.moe.balance = moe::Balance::expert_choice;
  GptConfig plain = c;
  plain.moe.balance = moe::Balance::none;
  plain.moe.normalize_gates = false;
  plain.moe.capacity = 0;
  expect_only_forwards_with_targets_differ(c, plain);
}

TEST(GptMoe, UpdateBalanceMovesBetaOnlyForQuantileAndBiasMethods) {
  for (auto balance :
       {moe::Balance::none, moe::Balance::aux, moe::Balance::seq_aux, moe::Balance::bias,
        moe::Balance::qb_avg, moe::Balance::eqb, moe::Balance::qb_hist, moe::Balance::eqb_lei,
        moe::Balance::sinkhorn, moe::Balance::expert_choice}) {
    SCOPED_TRACE(moe::to_string(balance));
    GptConfig c = moe_config(gelu_config(), "all");
    c.moe.balance = balance;
    Gpt gpt(c, 3);
    randomize_parameters(gpt, 4, 0.4f);
    Tensor beta = gpt.parameter("blocks.0.moe.router.balance_bias").value;
    std::fill(beta.f32(), beta.f32() + beta.numel(), 0.0f);
    const Batch batch = random_batch(c, 2, 8, 5, false);
    auto acts = gpt.make_activations(batch.B, batch.T);
    gpt.forward(*acts, batch.inputs());
    gpt.backward(*acts, 1.0f);
    gpt.update_balance();
    bool moved = false;
    for (int64_t e = 0; e < beta.numel(); ++e) moved |= beta.f32()[e] != 0.0f;
    const bool expected = balance == moe::Balance::bias || balance == moe::Balance::qb_avg ||
                          balance == moe::Balance::eqb || balance == moe::Balance::qb_hist ||
                          balance == moe::Balance::eqb_lei;
    EXPECT_EQ(moved, expected);
    // With one micro-batch on one process the averaged and the exact quantile coincide.
    if (balance == moe::Balance::qb_avg || balance == moe::Balance::eqb) {
      GptConfig other = c;
      other.moe.balance = balance == moe::Balance::eqb ? moe::Balance::qb_avg : moe::Balance::eqb;
      Gpt twin(other, 3);
      std::memcpy(twin.flat_params().raw(), gpt.flat_params().raw(), gpt.flat_params().bytes());
      Tensor tb = twin.parameter("blocks.0.moe.router.balance_bias").value;
      std::fill(tb.f32(), tb.f32() + tb.numel(), 0.0f);
      auto a2 = twin.make_activations(batch.B, batch.T);
      twin.forward(*a2, batch.inputs());
      twin.backward(*a2, 1.0f);
      twin.update_balance();
      EXPECT_EQ(std::memcmp(tb.raw(), beta.raw(), beta.bytes()), 0);
    }
  }
}

// Expert sharding: shard r of n allocates exactly the experts r*E/n .. (r+1)*E/n - 1 of every
// MoE block under their global names, with the values of the unsharded model (init streams
// keyed by the whole-model registry), the same dense parameters, and 1/n of the expert bytes.
TEST(GptMoe, ExpertShardHoldsOnlyItsExpertsWithTheWholeModelsValues) {
  GptConfig c = moe_config(gelu_config(), "all");
  c.moe.experts = 4;
  const Gpt full(c, 7);
  const int64_t E = c.moe.experts;
  ASSERT_EQ(full.total_parameters(), full.num_parameters());
  for (int64_t count : {1, 2, 4}) {
    int64_t expert_numel = 0;
    for (int64_t index = 0; index < count; ++index) {
      SCOPED_TRACE("shard " + std::to_string(index) + " of " + std::to_string(count));
      const Gpt shard(c, 7, {index, count});
      EXPECT_EQ(shard.total_parameters(), full.num_parameters());
      EXPECT_EQ(shard.dense_grads().numel(), full.dense_grads().numel());
      EXPECT_EQ(shard.expert_grads().numel() * count, full.expert_grads().numel());
      expert_numel += shard.expert_grads().numel();
      ASSERT_EQ(shard.dense_parameters().size(), full.dense_parameters().size());
      for (const Parameter& p : shard.dense_parameters())
        EXPECT_TRUE(bitwise_equal(p.value, full.parameter(p.name).value)) << p.name;
      int64_t held = 0;
      for (const Parameter& p : shard.expert_parameters()) {
        const size_t at = p.name.find("moe.experts.") + 12;
        const int64_t e = std::stoll(p.name.substr(at));
        EXPECT_EQ(e / (E / count), index) << p.name;
        EXPECT_TRUE(bitwise_equal(p.value, full.parameter(p.name).value)) << p.name;
        held += p.value.numel();
      }
      EXPECT_EQ(held, shard.expert_grads().numel());
      for (int64_t e = 0; e < E; ++e) {
        if (e / (E / count) == index) continue;
        EXPECT_THROW(shard.parameter("blocks.0.moe.experts." + std::to_string(e) + ".fc_in.weight"),
                     Error);
      }
    }
    EXPECT_EQ(expert_numel, full.expert_grads().numel());
  }
  // A shard runs only through an ep group of its size: not alone.
  Gpt half(c, 7, {1, 2});
  const Batch batch = random_batch(c, 1, 4, 2, false);
  auto acts = half.make_activations(batch.B, batch.T);
  EXPECT_THROW(half.forward(*acts, batch.inputs()), Error);
}

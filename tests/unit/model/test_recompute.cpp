// Activation recomputation (Recompute::blocks) against keeping every block's cache: the same
// losses, logits, gradients, MoE statistics and balancing updates, bit for bit, with a
// fraction of the activation memory.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "tessel/attention/flash_attention.hpp"
#include "tessel/model/gpt.hpp"
#include "unit/model/model_test_util.hpp"

using namespace tessel;
using namespace tessel::model;
using namespace tessel::model::testing;

namespace {

// What a model computes over two micro-batches, accumulated, then one balancing update.
struct Result {
  std::vector<double> losses;
  Tensor logits, grads, d_input, params_after_update;
  std::vector<moe::LayerCache> moe;  // the last micro-batch's MoE caches
  bool moe_buffers_released = true;  // every MoE cache's routing and expert buffers freed
};

// An attention hook (as context parallelism installs) that runs the causal FlashMask kernel
// and counts its calls.
struct CountingHook final : attention::AttentionHook {
  attention::AttentionShape shape;
  attention::TiledMask mask;
  int forwards = 0, backwards = 0;
  CountingHook(const GptConfig& c, int64_t B, int64_t T)
      : shape{B, T, T, c.heads, c.num_kv_heads(), c.head_dim()},
        mask(attention::ColumnMask::causal_only(B, T, T)) {}
  void forward(float* o, float* lse, const float* q, const float* k, const float* v) override {
    ++forwards;
    attention::flash_attention_forward(o, lse, q, k, v, shape, mask);
  }
  void backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                const float* v, const float* o, const float* lse) override {
    ++backwards;
    attention::flash_attention_backward(dq, dk, dv, dout, q, k, v, o, lse, shape, mask);
  }
};

Result run(Gpt& gpt, Recompute recompute, const std::vector<Batch>& batches,
           const std::vector<uint8_t>& padding, attention::AttentionHook* hook = nullptr) {
  const Tensor start = gpt.flat_params().clone();
  Result r;
  auto acts = gpt.make_activations(batches[0].B, batches[0].T, recompute);
  gpt.zero_grads();
  for (const Batch& b : batches) {
    ModelInputs in = b.inputs();
    in.padding = padding.empty() ? nullptr : padding.data();
    in.attention = hook;
    r.losses.push_back(gpt.forward(*acts, in));
    r.logits = acts->logits.clone();
    gpt.backward(*acts, 0.5f);
  }
  r.grads = gpt.flat_grads().clone();
  r.d_input = acts->residual_grad(0).clone();
  for (size_t l = 0; l < acts->moe.size(); ++l) {
    if (!gpt.moe_blocks()[l]) continue;
    r.moe.push_back(acts->moe[l]);
    r.moe_buffers_released = r.moe_buffers_released && acts->moe[l].probs.capacity() == 0 &&
                             acts->moe[l].expert_in.capacity() == 0;
  }
  gpt.update_balance();
  r.params_after_update = gpt.flat_params().clone();
  std::memcpy(gpt.flat_params().raw(), start.raw(), start.bytes());
  return r;
}

void expect_same(const GptConfig& config, bool with_padding) {
  SCOPED_TRACE(::testing::Message() << "moe_layers '" << config.moe_layers << "', balance "
                                    << int(config.moe.balance) << ", padding " << with_padding);
  Gpt gpt(config, 41);
  randomize_parameters(gpt, 42, 0.3f);
  const bool packed = config.positions == PositionType::rotary;
  const std::vector<Batch> batches = {random_batch(config, 2, 6, 43, packed),
                                      random_batch(config, 2, 6, 44, packed)};
  std::vector<uint8_t> padding;
  if (with_padding) {  // the last two positions of row 1
    padding.assign(12, 0);
    padding[10] = padding[11] = 1;
  }
  const Result kept = run(gpt, Recompute::none, batches, padding);
  const Result recomputed = run(gpt, Recompute::blocks, batches, padding);
  EXPECT_EQ(kept.losses, recomputed.losses);
  EXPECT_TRUE(bitwise_equal(kept.logits, recomputed.logits));
  EXPECT_TRUE(bitwise_equal(kept.grads, recomputed.grads));
  EXPECT_TRUE(bitwise_equal(kept.d_input, recomputed.d_input));
  EXPECT_TRUE(bitwise_equal(kept.params_after_update, recomputed.params_after_update));
  ASSERT_EQ(kept.moe.size(), recomputed.moe.size());
  for (size_t i = 0; i < kept.moe.size(); ++i) {
    EXPECT_EQ(kept.moe[i].N, recomputed.moe[i].N);
    EXPECT_EQ(kept.moe[i].loads, recomputed.moe[i].loads);
    EXPECT_EQ(kept.moe[i].batch_group_loads, recomputed.moe[i].batch_group_loads);
    EXPECT_EQ(kept.moe[i].batch_f, recomputed.moe[i].batch_f);
    EXPECT_EQ(kept.moe[i].dropped, recomputed.moe[i].dropped);
    EXPECT_EQ(kept.moe[i].unserved_cf1_25, recomputed.moe[i].unserved_cf1_25);
    EXPECT_EQ(kept.moe[i].received_rows, recomputed.moe[i].received_rows);
    EXPECT_EQ(kept.moe[i].balance_loss, recomputed.moe[i].balance_loss);
  }
  if (!kept.moe.empty()) {
    EXPECT_FALSE(kept.moe_buffers_released);  // the check sees buffers where they are kept
    EXPECT_TRUE(recomputed.moe_buffers_released);
  }
}

}  // namespace

TEST(Recompute, DenseBlocksGiveTheSameLossesAndGradientsBitwise) {
  for (GptConfig c : {gelu_config(), swiglu_config()}) {
    c.layers = 3;
    expect_same(c, false);
  }
}

// MoE blocks: EQB and qb_hist (beta updated from what backward recorded), the aux losses and
// LEI (loss terms with gradients), Sinkhorn and expert-choice selection, capacity drops (the
// swiglu config), and padding rows left out of the MoE.
TEST(Recompute, MoeBlocksGiveTheSameLossesGradientsStatisticsAndBalanceBitwise) {
  for (const GptConfig& base : {moe_config(gelu_config(), "1"), moe_config(swiglu_config(), "all")})
    for (moe::Balance balance :
         {moe::Balance::eqb, moe::Balance::qb_hist, moe::Balance::aux, moe::Balance::aux_global,
          moe::Balance::seq_aux, moe::Balance::bias, moe::Balance::qb_avg, moe::Balance::lei,
          moe::Balance::eqb_lei, moe::Balance::sinkhorn, moe::Balance::expert_choice})
      for (bool padding : {false, true}) {
        // seq_aux takes softmax scores only
        if (balance == moe::Balance::seq_aux && base.moe.score != moe::ScoreFn::softmax) continue;
        GptConfig c = base;
        c.layers = 3;
        c.moe.balance = balance;
        c.moe.z_coeff = 1e-2;  // the router z-loss adds its gradient too
        expect_same(c, padding);
      }
}

// Through an attention hook: the same results, and the hook sees each block's forward twice
// (the forward and its rebuild) and its backward once, in pairs.
TEST(Recompute, AnAttentionHookIsCalledAgainAndGivesTheSameResults) {
  GptConfig c = swiglu_config();
  c.layers = 3;
  Gpt gpt(c, 71);
  randomize_parameters(gpt, 72, 0.3f);
  const std::vector<Batch> batches = {random_batch(c, 2, 6, 73, false)};
  CountingHook kept_hook(c, 2, 6), recomputed_hook(c, 2, 6);
  const Result kept = run(gpt, Recompute::none, batches, {}, &kept_hook);
  const Result recomputed = run(gpt, Recompute::blocks, batches, {}, &recomputed_hook);
  EXPECT_EQ(kept.losses, recomputed.losses);
  EXPECT_TRUE(bitwise_equal(kept.grads, recomputed.grads));
  EXPECT_EQ(kept_hook.forwards, 3);
  EXPECT_EQ(recomputed_hook.forwards, 6);
  EXPECT_EQ(kept_hook.backwards, 3);
  EXPECT_EQ(recomputed_hook.backwards, 3);
}

// Pipeline stages recompute within their own block ranges and still compose the whole
// model's gradients bit for bit: split after block 1, and a first stage with no block.
TEST(Recompute, StageRangesComposeTheWholeModel) {
  GptConfig c = gelu_config();
  c.layers = 3;
  Gpt gpt(c, 51);
  randomize_parameters(gpt, 52, 0.3f);
  const Batch batch = random_batch(c, 2, 6, 53, false);
  auto whole = gpt.make_activations(2, 6);
  gpt.zero_grads();
  const double loss = gpt.forward(*whole, batch.inputs());
  gpt.backward(*whole, 1.0f);
  const Tensor grads = gpt.flat_grads().clone();

  const int64_t L = c.layers;
  for (int64_t k : {int64_t(1), int64_t(0)}) {
    SCOPED_TRACE(k);
    auto stage0 = gpt.make_activations(2, 6, {0, k, true, false}, Recompute::blocks);
    auto stage1 = gpt.make_activations(2, 6, {k, L, false, true}, Recompute::blocks);
    EXPECT_EQ(run_as_two_stages(gpt, *stage0, *stage1, batch, k), loss);
    EXPECT_TRUE(bitwise_equal(gpt.flat_grads(), grads));
  }
}

// The activations keep one block cache instead of L: the bytes saved are (L - 1) block caches,
// counted here from the shapes in gpt.hpp. The stream keeps every boundary, its gradient two.
TEST(Recompute, KeepsOneBlockCache) {
  GptConfig c = gelu_config();  // layernorm: the norm means are cached too
  c.layers = 4;
  const Gpt gpt(c, 61);
  const int64_t B = 2, T = 6, N = B * T, C = c.width, H = c.heads, Hkv = c.num_kv_heads();
  const int64_t D = c.head_dim(), F = c.mlp_hidden_size(), Fi = F;  // gelu: Fi = F
  // attn_norm, its mean and rstd, q, k, v, attention output, its lse, mid, mlp_norm, its mean
  // and rstd, fc, act.
  const int64_t block_floats = N * (C + 2 + H * D + 2 * Hkv * D + H * D + H + C + C + 2 + Fi + F);
  const auto kept = gpt.make_activations(B, T, Recompute::none);
  const auto recomputed = gpt.make_activations(B, T, Recompute::blocks);
  EXPECT_EQ(kept->tensor_bytes - recomputed->tensor_bytes,
            (c.layers - 1) * block_floats * int64_t(sizeof(float)));
  EXPECT_EQ(recomputed->q.dim(0), 1);
  EXPECT_EQ(recomputed->stream.dim(0), c.layers + 1);
  EXPECT_EQ(recomputed->d_stream.dim(0), 2);
  EXPECT_EQ(kept->d_stream.dim(0), 2);
}

// Micro-batches in flight at once (a pipeline stage's) may share their scratch, and under
// recomputation their block cache: forwards and backwards interleaved as 1F1B (F0 F1 B0 F2 B1
// B2) and GPipe (F0 F1 F2 B0 B1 B2) run them give the losses and gradients of separate
// activations bitwise, with MoE padding rows in one micro-batch and an attention hook in
// another. The sharing activations own only what a backward reads: without recomputation all
// but the scratch, with it just the inputs, the residual stream and the head's buffers.
TEST(Recompute, MicroBatchesInFlightShareTheirScratch) {
  for (const GptConfig& c : {gelu_config(), moe_config(swiglu_config(), "1")}) {
    const int64_t B = 2, T = 6, N = B * T, C = c.width, V = c.vocab, H = c.heads;
    const int64_t Hkv = c.num_kv_heads(), D = c.head_dim(), F = c.mlp_hidden_size();
    const int64_t Fi = c.mlp == MlpType::swiglu ? 2 * F : F, QKV = (H + 2 * Hkv) * D;
    const bool rotary = c.positions == PositionType::rotary;
    const bool ln = c.norm == NormType::layernorm;
    for (Recompute recompute : {Recompute::none, Recompute::blocks})
      for (const std::vector<int>& order :
           {std::vector<int>{0, 1, -1, 2, -2, -3}, std::vector<int>{0, 1, 2, -1, -2, -3}}) {
        SCOPED_TRACE(std::string(to_string(recompute)) + (c.moe_layers.empty() ? "" : ", MoE") +
                     (order[2] < 0 ? ", 1F1B" : ", GPipe"));
        Gpt gpt(c, 71);
        randomize_parameters(gpt, 72, 0.5f);
        const std::vector<Batch> batches = {random_batch(c, B, T, 73, false),
                                            random_batch(c, B, T, 74, true),
                                            random_batch(c, B, T, 75, false)};
        std::vector<uint8_t> padding(size_t(N), 0);
        padding[size_t(T - 2)] = padding[size_t(T - 1)] = 1;  // row 0's tail
        CountingHook hook(c, B, T);
        auto interleaved = [&](bool share) {
          std::vector<std::unique_ptr<Activations>> acts;
          for (size_t i = 0; i < batches.size(); ++i)
            acts.push_back(gpt.make_activations(B, T, gpt.block_range(), recompute,
                                                share && i > 0 ? acts[0].get() : nullptr));
          std::vector<double> losses;
          gpt.zero_grads();
          for (int op : order) {
            if (op >= 0) {
              ModelInputs in = batches[size_t(op)].inputs();
              if (op == 1) in.padding = padding.data();
              if (op == 2) in.attention = &hook;
              losses.push_back(gpt.forward(*acts[size_t(op)], in));
            } else {
              gpt.backward(*acts[size_t(-op - 1)], 0.5f);
            }
          }
          return std::make_tuple(losses, gpt.flat_grads().clone(), std::move(acts));
        };
        const auto [separate_losses, separate_grads, separate] = interleaved(false);
        const auto [shared_losses, shared_grads, shared] = interleaved(true);
        EXPECT_EQ(shared_losses, separate_losses);
        EXPECT_TRUE(bitwise_equal(shared_grads, separate_grads));
        const Activations& lender = *shared[0];
        const Activations& sharer = *shared[1];
        EXPECT_TRUE(sharer.qkv.shares_storage(lender.qkv));
        EXPECT_TRUE(sharer.d_stream.shares_storage(lender.d_stream));
        EXPECT_FALSE(sharer.stream.shares_storage(lender.stream));
        EXPECT_FALSE(sharer.logits.shares_storage(lender.logits));
        EXPECT_EQ(sharer.q.shares_storage(lender.q), recompute == Recompute::blocks);
        if (recompute == Recompute::none) {
          // qkv and its gradient, the unrotated gradient (rotary), d_attn, d_norm, d_act,
          // d_fc, the two stream-gradient slots, d_logits.
          const int64_t scratch = 2 * N * QKV + (rotary ? N * (H + Hkv) * D : 0) + N * H * D +
                                  N * C + N * F + N * Fi + 2 * N * C + N * V;
          EXPECT_EQ(lender.tensor_bytes - sharer.tensor_bytes, scratch * int64_t(sizeof(float)));
        } else {
          // tokens, positions, targets, loss weights; the stream; final norm (mean), rstd,
          // logits, lse.
          const int64_t floats =
              4 * N + (c.layers + 1) * N * C + N * (C + (ln ? 1 : 0) + 1 + V + 1);
          EXPECT_EQ(sharer.tensor_bytes, floats * int64_t(sizeof(float)));
        }
      }
  }
}

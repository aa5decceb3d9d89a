#pragma once
// A decoder-only transformer (GPT) built from a GptConfig, with explicit
// forward/backward over caller-owned Activations. The model knows nothing about
// parallelism: a pipeline stage calls the pieces it owns (embedding, a range of
// blocks, the head) and moves the residual stream at block boundaries itself.
//
//   x_0 = embed[tokens] (+ pos_embed[positions] when positions = learned)
//   block i: m = x_i + attn(attn_norm(x_i));  x_{i+1} = m + mlp(mlp_norm(m))
//   logits = final_norm(x_L) head^T;  loss = sum_n weight[n] * CE(logits[n], targets[n])
//
// Gradient convention: backward functions ADD into parameter gradients (zero them
// once per step with zero_grads(), so micro-batches accumulate) and OVERWRITE the
// residual-stream gradients in Activations.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tessel/attention/attention_hook.hpp"
#include "tessel/attention/flash_attention.hpp"
#include "tessel/core/parameter.hpp"
#include "tessel/core/tensor.hpp"
#include "tessel/model/gpt_config.hpp"
#include "tessel/moe/expert_comm.hpp"
#include "tessel/moe/layer.hpp"

namespace tessel::model {

// One micro-batch of token data, row-major [B, T]; the pointers need only live
// through load_inputs (which copies them into the Activations).
struct ModelInputs {
  int64_t B = 0, T = 0;
  const int32_t* tokens = nullptr;     // ids in [0, vocab); null only for stages without embedding
  const int32_t* positions = nullptr;  // in [0, max_seq); null = 0..T-1 in every row
  const int32_t* targets = nullptr;    // next-token ids; null = inference (no loss, no backward)
  const float* loss_weight = nullptr;  // per-token loss weight; null = 1 for every token
  // Attention mask [B, Hm, T, T] (Hm = 1, heads or kv_heads); null = causal. A forward
  // restricts it to model.attention_window when that is set (attention_mask below).
  const attention::ColumnMask* mask = nullptr;
  // Replaces every layer's attention kernel (then `mask` is not used by attention); must live
  // through the micro-batch's backward. null = the FlashMask kernel.
  attention::AttentionHook* attention = nullptr;
  // Padding positions [B*T], 1 = no token (the tail of a packed SFT row); null = none. MoE
  // layers leave them out: they are not routed, take no expert capacity, count in no load or
  // balancing loss, and their MoE output is 0.
  const uint8_t* padding = nullptr;
  // Index of each row in its whole micro-batch [B*T] when these rows are a part of it
  // (context parallelism: one cp rank's chunks); null = the whole micro-batch, in order. MoE
  // expert capacity counts the whole micro-batch's assignments in that order.
  const int32_t* token_index = nullptr;
};

// Where a backward stands in the flat gradient buffers: every gradient at offset >= dense of
// Gpt::dense_grads() and at offset >= experts of Gpt::expert_grads() holds its final value for
// this backward (the registry lays parameters out in forward order, which a backward visits in
// reverse).
struct GradsFinal {
  int64_t dense = 0, experts = 0;
};

// Everything one micro-batch's forward keeps for its backward, plus backward
// scratch, allocated once by Gpt::make_activations. Shapes, with N = B*T tokens,
// L blocks held (last_layer - first_layer), Lc = L (Recompute::none) or min(L, 1) (blocks)
// block caches, C width, H query heads, Hkv key/value heads, D head dim, F MLP hidden width,
// Fi = F (gelu) or 2F (swiglu), QKV = (H + 2 Hkv) D, V vocab:
struct Activations {
  int64_t B = 0, T = 0;
  bool has_tokens = false, has_targets = false;
  Recompute recompute = Recompute::none;

  // Inputs, copied by load_inputs.
  Tensor tokens;              // i32 [N]
  Tensor positions;           // i32 [N]
  Tensor targets;             // i32 [N]
  Tensor loss_weight;         // f32 [N]
  attention::TiledMask mask;  // the attention mask with its tile summaries, shared by all layers
  attention::AttentionHook* attention = nullptr;  // ModelInputs::attention

  // Forward cache. Per-layer buffers stack the block caches along dimension 0 (block
  // `layer` at cache_slot(layer)). The norm means exist only for layernorm.
  Tensor stream;           // [L+1, N, C] residual stream x_i at block boundary i
  Tensor attn_norm;        // [Lc, N, C] attn_norm(x_i)
  Tensor attn_norm_mean;   // [Lc, N]
  Tensor attn_norm_rstd;   // [Lc, N]
  Tensor q;                // [Lc, N, H, D] queries (rotated when rotary)
  Tensor k;                // [Lc, N, Hkv, D] keys (rotated when rotary)
  Tensor v;                // [Lc, N, Hkv, D] values
  Tensor attn;             // [Lc, N, H, D] attention output
  Tensor attn_lse;         // [Lc, B, H, T] log-sum-exp of each attention row
  Tensor mid;              // [Lc, N, C] residual after attention, m_i
  Tensor mlp_norm;         // [Lc, N, C] mlp_norm(m_i)
  Tensor mlp_norm_mean;    // [Lc, N]
  Tensor mlp_norm_rstd;    // [Lc, N]
  Tensor fc;               // [Lc, N, Fi] fc_in output (swiglu: [gate | up] per row)
  Tensor act;              // [Lc, N, F] gelu(fc) or silu(gate) * up
  Tensor final_norm;       // [N, C] final_norm(x_L)
  Tensor final_norm_mean;  // [N]
  Tensor final_norm_rstd;  // [N]
  Tensor logits;           // [N, V]
  Tensor lse;              // [N] log-sum-exp of each logits row (cross-entropy)

  // Gradients of the residual stream and the logits. Backward needs only the two boundaries
  // of the block it is in, so boundary i lives in slot (i - first_layer) % 2.
  Tensor d_stream;  // [min(L+1, 2), N, C] d loss / d x_i
  Tensor d_logits;  // [N, V]

  // Scratch shared by all layers.
  Tensor qkv;      // [N, QKV] fused projection output; in backward its gradient
  Tensor d_split;  // [N*QKV] planar [dq (N*H*D) | dk (N*Hkv*D) | dv (N*Hkv*D)]
  Tensor d_unrot;  // rotary only: [N*(H+Hkv)*D] planar [dq | dk] before the rotation
  Tensor d_attn;   // [N, H*D]
  Tensor d_norm;   // [N, C] gradient of a norm output
  Tensor d_act;    // [N, F]
  Tensor d_fc;     // [N, Fi]

  // MoE blocks: each one's routing, dispatch and expert caches (moe/layer.hpp); [L], empty
  // for dense blocks. backward_head stores its loss_scale here for the balancing
  // gradients (a pipeline stage without the head sets it itself).
  std::vector<moe::LayerCache> moe;
  float loss_scale = 1.0f;
  // MoE with ModelInputs::padding: the rows routed (the others left out), ascending, and
  // their inputs, outputs and input gradients gathered ([routed, C]). routed_all: no padding.
  bool routed_all = true;
  std::vector<int64_t> routed;
  // ModelInputs::token_index of the routed rows (with it, also when no row is routed).
  std::optional<std::vector<int32_t>> routed_index;
  // model.moe_balance = seq_aux: the sequence (row of B) of each routed row; empty otherwise.
  std::vector<int32_t> routed_sequence;
  std::vector<float> moe_x, moe_y, moe_dx;

  // A backward split in two (ZB-H1's B and W): with defer_weight_grads set, backward computes
  // the input gradients and queues the weight gradients of the matrices (with their biases)
  // and of the embeddings for Gpt::backward_weights. A queued gradient reads this set's own
  // forward cache and inputs (which must live until it runs), the head's d_logits from
  // `logits` (no longer needed), and its own copies of the rest: the other gradients (shared
  // scratch) and, under recomputation, the blocks' matrix inputs (the one shared block cache);
  // deferred_bytes counts those copies. Norm weights and MoE layers (router and experts) still
  // add theirs in backward: a small share of the work, or interleaved with the input gradient.
  bool defer_weight_grads = false;
  std::vector<std::function<void()>> deferred_weight_grads;
  int64_t deferred_bytes = 0;

  // Called by the backward pieces as they finish parameters (after the head, after each block,
  // after the embedding; offsets non-increasing): the data-parallel all-reduce starts each
  // bucket then, overlapping the rest of the backward. A tied head's gradient is final only
  // after the embedding's. Not with defer_weight_grads (the weight gradients come later) or a
  // model of several chunks (one backward does not finish a chunk's range). null: not called.
  std::function<void(GradsFinal)> on_grads_final;

  // The blocks [first_layer, last_layer) these buffers hold (a pipeline stage's; the whole
  // model by default): per-layer buffers stack only those, and the head's (final norm,
  // logits) exist only for a range with the head.
  int64_t first_layer = 0, last_layer = 0;
  // Index of block `layer` among the blocks held (checked to be held): its MoE cache.
  int64_t slot(int64_t layer) const;
  // Index of block `layer`'s cache in the per-layer forward-cache buffers.
  int64_t cache_slot(int64_t layer) const;

  // Residual stream x_i at block boundary i in [first_layer, last_layer] and its gradient,
  // [B, T, C] views: boundary 0 is the embedding output, boundary L the last block's output.
  // A gradient boundary shares its slot with every second boundary: residual_grad(i) holds
  // d x_i from when backward (or the caller, for the last boundary) writes it until backward
  // reaches block i - 2, and activations sharing their scratch (make_activations'
  // scratch_from) hold it only until the next backward of any of them.
  Tensor residual(int64_t boundary) const;
  Tensor residual_grad(int64_t boundary) const;
  // Bytes of the tensors above this set owns (not those lent by make_activations'
  // scratch_from; the MoE caches, which grow with the routing, not counted).
  int64_t tensor_bytes = 0;

 private:
  Tensor boundary_view(const Tensor& stack, int64_t boundary) const;
};

// Which experts of every MoE block a model holds: shard `index` of `count` equal shards
// (expert e is in shard e / (E / count)), as an expert-parallel group of `count` ranks
// places them. Placement is data: the model never sees the group itself.
struct ExpertShard {
  int64_t index = 0, count = 1;
};

// Which parts of the model a Gpt holds, as a pipeline stage places them: the blocks
// [first, last) (last < 0: through the last block), the embeddings (`embedding`, needs
// first = 0) and the final norm with the head (`head`, needs last = the last block); a tied
// head's weight is the embedding, so `head` holds it too. Explicit flags, because the first
// or last stage of a split may hold no blocks while its neighbour's range touches the same
// end. Placement is data, like ExpertShard: the model allocates only what it holds and never
// sees the pipeline. An interleaved pipeline stage holds several such chunks (the Gpt
// constructor taking a list).
struct BlockRange {
  int64_t first = 0, last = -1;
  bool embedding = true, head = true;
};

// The mask a forward of a model with `config` attends with over Sq queries and Sk keys
// (bottom-right aligned): `given` (null = plain causal) restricted to the causal sliding
// window of model.attention_window keys when that is set. Every attention path builds its
// mask here (the forward, context-parallel attention, the KV cache), so none can miss it.
attention::ColumnMask attention_mask(const GptConfig& config, const attention::ColumnMask* given,
                                     int64_t B, int64_t Sq, int64_t Sk);

class Gpt {
 public:
  // Validates the config (InputError) and initializes the parameters from `seed`. Only the
  // experts of `shard` and the parameters of `blocks` are allocated; each parameter's values
  // do not depend on the shard or the range.
  Gpt(const GptConfig& config, uint64_t seed, ExpertShard shard = {}, BlockRange blocks = {});
  // Several chunks of blocks (an interleaved pipeline stage's), in block order and disjoint;
  // the embedding only with a chunk from block 0, the head only with one through the last.
  Gpt(const GptConfig& config, uint64_t seed, ExpertShard shard, std::vector<BlockRange> chunks);
  Gpt(const Gpt&) = delete;
  Gpt& operator=(const Gpt&) = delete;
  Gpt(Gpt&&) = default;
  Gpt& operator=(Gpt&&) = default;

  const GptConfig& config() const { return config_; }
  const ExpertShard& expert_shard() const { return shard_; }
  // The one chunk of a model built with one BlockRange (checked), resolved: last >= 0.
  const BlockRange& block_range() const;
  const std::vector<BlockRange>& block_ranges() const { return chunks_; }  // resolved
  bool holds_embedding() const { return chunks_.front().embedding; }
  bool holds_head() const { return chunks_.back().head; }
  // Registry order, names, shapes and tags: docs/model.md. Experts outside the shard and
  // parameters outside the block range are left out; the others keep their global names
  // (blocks.{i}.moe.experts.{e}.*).
  const ParameterList& parameters() const { return parameters_; }
  // Where parameters()[i] stands in the whole model's registry (every expert, every block),
  // and that registry's length: what a held subset needs to add per-parameter sums in the
  // whole model's order.
  int64_t registry_position(size_t i) const { return positions_.at(i); }
  int64_t registry_size() const { return registry_size_; }
  // The whole model's registry, every parameter's name in order, whatever this model holds:
  // a model that holds nothing (BlockRange{0, 0, false, false}) allocates no parameters, so
  // this is how a checkpoint's tensors are put in model order without building the model.
  const std::vector<std::string>& registry_names() const { return registry_names_; }
  // The same split in two, each in registry order: the parameters every shard holds
  // (replicated over an ep group) and this shard's experts.
  const ParameterList& dense_parameters() const { return dense_params_; }
  const ParameterList& expert_parameters() const { return expert_params_; }
  // The parameter called `name`; throws tessel::Error when there is none.
  const Parameter& parameter(const std::string& name) const;
  // All values / gradients, flat [num_parameters()], no padding: the dense parameters in
  // registry order, then the experts' in registry order (each group one range, reduced
  // over its own process group).
  Tensor flat_params() const { return flat_params_; }
  Tensor flat_grads() const { return flat_grads_; }
  Tensor dense_grads() const;   // the dense range of flat_grads()
  Tensor expert_grads() const;  // the experts' range of flat_grads() (may be empty)
  void zero_grads();
  int64_t num_parameters() const { return flat_params_.numel(); }  // held by this model
  // Of the whole model, every expert counted once, whatever this model holds.
  int64_t total_parameters() const { return total_numel_; }
  // Weights of the whole model that multiply each token's activations: every block matrix
  // (in an MoE block the router, top_k experts and the shared expert) plus the head matrix
  // (counted also when tied); no biases, norms or embedding lookups.
  // MFU counts 6 * matmul_parameters() + 12 * L * H * D * T flops per token.
  int64_t matmul_parameters() const { return matmul_numel_; }
  // matmul_parameters() without the head: what train.recompute = blocks runs again (HFU).
  int64_t block_matmul_parameters() const { return matmul_numel_ - config_.vocab * C_; }

  // Buffers for one micro-batch of B sequences of T tokens (InputError when
  // T > max_seq), for the parts `range` names (the head's buffers only with `head`); by
  // default those this model holds.
  std::unique_ptr<Activations> make_activations(int64_t B, int64_t T,
                                                Recompute recompute = Recompute::none) const {
    return make_activations(B, T, block_range(), recompute);
  }
  // With `scratch_from` (activations of this model with the same B, T and recompute, of any
  // range), the new ones share those of its buffers that no forward leaves for a backward to
  // read and that have the same shape: the scratch and the residual-stream gradients, under
  // Recompute::blocks also the block cache (a backward rebuilds it; the same shape when both
  // ranges hold blocks), and the logits' gradient when both hold the head. A pipeline stage's
  // micro-batches in flight share them, over all its chunks: each forward or backward runs
  // whole before the next starts (a split backward's weight gradients, which run later, copy
  // what they read of them). tensor_bytes counts only its own buffers.
  std::unique_ptr<Activations> make_activations(int64_t B, int64_t T, BlockRange range,
                                                Recompute recompute = Recompute::none,
                                                const Activations* scratch_from = nullptr) const;

  // Whole model: load_inputs, then every forward piece; returns the SUM of the
  // weighted token losses (0 without targets); the caller divides by its count.
  double forward(Activations& acts, const ModelInputs& inputs) const;
  // Adds d(loss_sum * loss_scale) / d(parameters) into the gradients.
  void backward(Activations& acts, float loss_scale);

  // The pieces, for pipeline stages. Each forward reads the previous boundary of
  // acts and writes the next; each backward reads residual_grad(last) (after
  // backward_head or from the next stage) and writes residual_grad(first). A piece the
  // block range does not hold is an error (forward / backward need the whole model).
  // Validates and copies the inputs (InputError on ids or positions out of range).
  void load_inputs(Activations& acts, const ModelInputs& inputs) const;
  void forward_embedding(Activations& acts) const;                            // -> residual(0)
  void forward_blocks(Activations& acts, int64_t first, int64_t last) const;  // [first, last)
  double forward_head(Activations& acts) const;             // residual(L) -> logits, loss sum
  void backward_head(Activations& acts, float loss_scale);  // -> residual_grad(L)
  void backward_blocks(Activations& acts, int64_t first, int64_t last);
  void backward_embedding(Activations& acts);  // residual_grad(0) -> embedding grads
  // Adds the weight gradients a backward with acts.defer_weight_grads queued, in the order it
  // queued them (so a tied head and embedding add as in the plain backward), and empties the
  // queue: backward then backward_weights adds bitwise what the plain backward adds.
  void backward_weights(Activations& acts);

  // Mixture of experts (docs/model.md). The token exchange and the balancing sums go
  // through `comm` (null: every expert local, one process); the caller owns it and keeps
  // it alive while set. Its ep group must match the shard (size count, rank index): a
  // model holding a shard of the experts runs only through its ep group.
  void set_expert_comm(moe::ExpertComm* comm);
  // After each optimizer step: the balancing methods' beta update of every MoE block from
  // the micro-batches backward saw since the last call (collective over the comm's
  // balancing group).
  void update_balance();
  // Instead of update_balance, for a step that takes no update (a skipped gradient spike):
  // forgets what backward saw since the last call; beta stays.
  void discard_balance();
  const std::vector<bool>& moe_blocks() const { return moe_mask_; }

 private:
  // Indices into parameters_; -1 where the config has no such parameter.
  struct BlockParams {
    int attn_norm_w = -1, attn_norm_b = -1, qkv_w = -1, qkv_b = -1, out_w = -1, out_b = -1;
    int mlp_norm_w = -1, mlp_norm_b = -1, fc_in_w = -1, fc_in_b = -1, fc_out_w = -1, fc_out_b = -1;
  };
  const float* value(int index) const;
  float* grad(int index);
  void norm_forward(float* y, float* mean, float* rstd, const float* x, int w, int b,
                    int64_t N) const;
  void norm_backward(float* dx, int w, int b, const float* dy, const float* x, const float* mean,
                     const float* rstd, int64_t N);
  // Parameter w's (and bias b's, -1: none) linear backward: dx now; the weight gradients now
  // or queued (Activations::defer_weight_grads). A queued one copies x unless `x_kept` (x is
  // the micro-batch's own until its W) and keeps dy in `dy_home` (null: a copy of its own).
  struct DeferredReads {
    bool x_kept = false;
    float* dy_home = nullptr;
  };
  void linear_backward(Activations& acts, float* dx, int w, int b, const float* dy, const float* x,
                       int64_t N, int64_t in, int64_t out, DeferredReads reads);
  attention::AttentionShape attention_shape(const Activations& acts) const {
    return {acts.B, acts.T, acts.T, H_, Hkv_, D_};
  }
  // `rebuild`: backward's recomputation of the block's cache (Recompute::blocks), which
  // leaves the block's output in the stream as the forward wrote it.
  void block_forward(Activations& acts, int64_t layer, bool rebuild = false) const;
  void block_backward(Activations& acts, int64_t layer);
  // An MoE block's parameter indices and their views.
  struct MlpParams {
    int fc_in_w = -1, fc_in_b = -1, fc_out_w = -1, fc_out_b = -1;
  };
  struct MoeParams {
    int router = -1, beta = -1;
    std::vector<MlpParams> experts;
    MlpParams shared;
  };
  template <class P, class Get>
  moe::LayerWeightsT<P> moe_views(const MoeParams& m, Get get) const;

  // Checks that the blocks [first, last) are held.
  void check_blocks(int64_t first, int64_t last) const;
  // Tells acts.on_grads_final (if set) that the parameters of blocks >= `block` are final
  // (block L: the final norm and an untied head; -1: everything).
  void report_grads_final(Activations& acts, int64_t block) const;

  GptConfig config_;
  ExpertShard shard_;
  std::vector<BlockRange> chunks_;
  std::vector<int64_t> positions_;  // [parameters_] whole-registry positions
  std::vector<std::string> registry_names_;
  int64_t registry_size_ = 0, total_numel_ = 0, matmul_numel_ = 0;
  int64_t C_, H_, Hkv_, D_, F_, Fi_, QKV_;
  Tensor flat_params_, flat_grads_;
  int64_t dense_numel_ = 0;  // the dense range of the flat buffers: [0, dense_numel_)
  // [L + 1]: the GradsFinal of the parameters of blocks >= b (b = L: final norm and untied head)
  std::vector<GradsFinal> final_from_block_;
  ParameterList parameters_, dense_params_, expert_params_;
  int embed_ = -1, pos_embed_ = -1, final_norm_w_ = -1, final_norm_b_ = -1, head_ = -1;
  std::vector<BlockParams> blocks_;
  std::vector<bool> moe_mask_;                  // [L]
  std::vector<MoeParams> moe_params_;           // [L], used where moe_mask_
  std::optional<moe::MoeLayer> moe_;            // the MoE blocks' layer (one config for all)
  std::optional<moe::MoeLayer> moe_inference_;  // the same for forwards without targets
  std::vector<moe::BalanceState> balance_;      // [L]
  std::unique_ptr<moe::LocalExpertComm> local_comm_ = std::make_unique<moe::LocalExpertComm>();
  moe::ExpertComm* expert_comm_ = local_comm_.get();
};

}  // namespace tessel::model

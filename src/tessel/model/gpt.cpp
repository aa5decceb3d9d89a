#include "tessel/model/gpt.hpp"

#include <algorithm>
#include <cmath>

#include "tessel/attention/mask_builders.hpp"
#include "tessel/core/error.hpp"
#include "tessel/core/rng.hpp"
#include "tessel/kernels/cpu/activations.hpp"
#include "tessel/kernels/cpu/cross_entropy.hpp"
#include "tessel/kernels/cpu/embedding.hpp"
#include "tessel/kernels/cpu/gemm.hpp"
#include "tessel/kernels/cpu/norms.hpp"
#include "tessel/kernels/cpu/rope.hpp"

namespace tessel::model {

namespace kn = tessel::kernels;

namespace {

enum class Init { normal, scaled_normal, ones, zeros };

// out [rows, C] = in's rows `rows` ([N, C]).
void gather_rows(std::vector<float>& out, const float* in, const std::vector<int64_t>& rows,
                 int64_t C) {
  out.resize(rows.size() * size_t(C));
  for (size_t r = 0; r < rows.size(); ++r)
    std::copy_n(in + rows[r] * C, C, out.begin() + int64_t(r) * C);
}

// out's rows `rows` ([N, C]) = in [rows, C]; the other rows of out are left as they are.
void scatter_rows(float* out, const std::vector<float>& in, const std::vector<int64_t>& rows,
                  int64_t C) {
  for (size_t r = 0; r < rows.size(); ++r)
    std::copy_n(in.begin() + int64_t(r) * C, C, out + rows[r] * C);
}

struct Spec {
  std::string name;
  ParamTag tag;
  Shape shape;
  Init init;
  bool expert;        // an MoE expert's (in the experts' range of the flat buffers)
  uint64_t position;  // in the whole model's registry: keys the init stream
  int64_t block;      // its block; -1 the embeddings (and a tied head), L the final norm and head
};

// Normal draws come in chunks, each from its own stream keyed by (parameter,
// chunk), so initialization is parallel and identical for any thread count.
constexpr int64_t kInitChunk = int64_t(1) << 16;

// Rows of qkv [N, Q + 2 KV] are [q | k | v]; q [N, Q], k and v [N, KV].
void split_qkv(float* q, float* k, float* v, const float* qkv, int64_t N, int64_t Q, int64_t KV) {
  const int64_t row = Q + 2 * KV;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* r = qkv + n * row;
    std::copy(r, r + Q, q + n * Q);
    std::copy(r + Q, r + Q + KV, k + n * KV);
    std::copy(r + Q + KV, r + row, v + n * KV);
  }
}

void merge_qkv(float* qkv, const float* q, const float* k, const float* v, int64_t N, int64_t Q,
               int64_t KV) {
  const int64_t row = Q + 2 * KV;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    float* r = qkv + n * row;
    std::copy(q + n * Q, q + (n + 1) * Q, r);
    std::copy(k + n * KV, k + (n + 1) * KV, r + Q);
    std::copy(v + n * KV, v + (n + 1) * KV, r + Q + KV);
  }
}

// y[i] += x[i] for i < n (residual connections).
void add_into(float* y, const float* x, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

// Element `offset` of t, or null when t is not allocated (norm means under rmsnorm).
float* at(Tensor& t, int64_t offset) {
  return t.defined() ? t.f32() + offset : nullptr;
}

}  // namespace

int64_t Activations::slot(int64_t layer) const {
  TESSEL_CHECK(first_layer <= layer && layer < last_layer, "block ", layer,
               " is not held by activations of blocks [", first_layer, ", ", last_layer, ")");
  return layer - first_layer;
}

int64_t Activations::cache_slot(int64_t layer) const {
  const int64_t s = slot(layer);  // checks that the block is held
  return recompute == Recompute::blocks ? 0 : s;
}

// Boundary `boundary` of a [slots, N, C] stack, as a [B, T, C] view: slot boundary -
// first_layer of the stream, cyclically over the gradient's two.
Tensor Activations::boundary_view(const Tensor& stack, int64_t boundary) const {
  TESSEL_CHECK(first_layer <= boundary && boundary <= last_layer, "boundary ", boundary,
               " is not held by activations of blocks [", first_layer, ", ", last_layer, ")");
  const int64_t C = stack.dim(-1), slot = (boundary - first_layer) % stack.dim(0);
  return stack.view(slot * B * T * C, {B, T, C});
}

Tensor Activations::residual(int64_t boundary) const {
  return boundary_view(stream, boundary);
}

Tensor Activations::residual_grad(int64_t boundary) const {
  return boundary_view(d_stream, boundary);
}

Gpt::Gpt(const GptConfig& config, uint64_t seed, ExpertShard shard, BlockRange blocks)
    : Gpt(config, seed, shard, std::vector<BlockRange>{blocks}) {}

Gpt::Gpt(const GptConfig& config, uint64_t seed, ExpertShard shard, std::vector<BlockRange> chunks)
    : config_(config), shard_(shard), chunks_(std::move(chunks)) {
  validate(config_);
  C_ = config_.width;
  H_ = config_.heads;
  Hkv_ = config_.num_kv_heads();
  D_ = config_.head_dim();
  F_ = config_.mlp_hidden_size();
  Fi_ = config_.mlp == MlpType::swiglu ? 2 * F_ : F_;
  QKV_ = (H_ + 2 * Hkv_) * D_;
  const int64_t V = config_.vocab, L = config_.layers;
  const bool layernorm = config_.norm == NormType::layernorm;
  TESSEL_CHECK(!chunks_.empty(), "a model of no chunks");
  for (size_t c = 0; c < chunks_.size(); ++c) {
    BlockRange& r = chunks_[c];
    if (r.last < 0) r.last = L;
    TESSEL_CHECK(
        0 <= r.first && r.first <= r.last && r.last <= L &&
            (!r.embedding || (r.first == 0 && c == 0)) &&
            (!r.head || (r.last == L && c + 1 == chunks_.size())) &&
            (c == 0 || chunks_[c - 1].last <= r.first),
        "blocks [", r.first, ", ", r.last, ") of ", L, r.embedding ? " with the embedding" : "",
        r.head ? " with the head" : "",
        c > 0 ? " after a chunk ending at block " + std::to_string(chunks_[c - 1].last) : "");
  }

  // The registry, in order (docs/model.md), less the experts outside the shard and the
  // parameters outside the block range (whose indices stay -1); every parameter keeps its
  // whole-model position for its init stream. Sizes count the whole model.
  std::vector<Spec> specs;
  uint64_t position = 0;
  bool expert = false, held = true;  // adding an expert's parameters; one this model holds
  int64_t block = -1;                // the block being added
  auto add = [&](std::string name, ParamTag tag, Shape shape, Init init) {
    const uint64_t at = position++;
    registry_names_.push_back(name);
    total_numel_ += shape_numel(shape);
    if (!held) return -1;
    specs.push_back({std::move(name), tag, std::move(shape), init, expert, at, block});
    return int(specs.size() - 1);
  };
  auto add_norm = [&](const std::string& prefix, int& w, int& b) {
    w = add(prefix + ".weight", ParamTag::norm, {C_}, Init::ones);
    if (layernorm) b = add(prefix + ".bias", ParamTag::norm, {C_}, Init::zeros);
  };
  auto add_linear = [&](const std::string& prefix, int64_t out, int64_t in, Init init, int& w,
                        int& b) {
    if (!expert) matmul_numel_ += out * in;  // an expert's count once per token: below
    w = add(prefix + ".weight", ParamTag::hidden_matrix, {out, in}, init);
    if (config_.bias) b = add(prefix + ".bias", ParamTag::bias, {out}, Init::zeros);
  };
  matmul_numel_ = V * C_;  // the head, tied or not
  held = holds_embedding() || (config_.tied_head && holds_head());
  embed_ = add("embed.weight", ParamTag::embedding, {V, C_}, Init::normal);
  held = holds_embedding();
  if (config_.positions == PositionType::learned)
    pos_embed_ =
        add("pos_embed.weight", ParamTag::position_embedding, {config_.max_seq, C_}, Init::normal);
  // MoE blocks: router, selection bias, then each expert's MLP, then the shared expert.
  const moe::LayerShape moe_shape{
      C_, config_.moe_hidden_size(), config_.moe.shared,
      config_.mlp == MlpType::gelu ? moe::ExpertMlp::gelu : moe::ExpertMlp::swiglu};
  auto add_mlp = [&](const std::string& prefix, int64_t hidden, MlpParams& m) {
    add_linear(prefix + ".fc_in", moe_shape.fc_in_rows(hidden), C_, Init::normal, m.fc_in_w,
               m.fc_in_b);
    add_linear(prefix + ".fc_out", C_, hidden, Init::scaled_normal, m.fc_out_w, m.fc_out_b);
  };
  moe_mask_ = config_.moe_mask();
  // A model without MoE blocks holds everything whatever the shard (dense runs with ep > 1).
  const bool has_moe = std::find(moe_mask_.begin(), moe_mask_.end(), true) != moe_mask_.end();
  TESSEL_CHECK(shard_.count >= 1 && shard_.index >= 0 && shard_.index < shard_.count &&
                   (!has_moe || config_.moe.experts % shard_.count == 0),
               "expert shard ", shard_.index, " of ", shard_.count, " for ", config_.moe.experts,
               " experts");
  moe_params_.resize(size_t(L));
  balance_.resize(size_t(L));
  blocks_.resize(size_t(L));
  for (int64_t i = 0; i < L; ++i) {
    block = i;
    const std::string p = "blocks." + std::to_string(i) + ".";
    const bool in_range = std::any_of(chunks_.begin(), chunks_.end(), [i](const BlockRange& r) {
      return r.first <= i && i < r.last;
    });
    held = in_range;
    BlockParams& b = blocks_[size_t(i)];
    add_norm(p + "attn_norm", b.attn_norm_w, b.attn_norm_b);
    add_linear(p + "attn.qkv", QKV_, C_, Init::normal, b.qkv_w, b.qkv_b);
    add_linear(p + "attn.out", C_, H_ * D_, Init::scaled_normal, b.out_w, b.out_b);
    add_norm(p + "mlp_norm", b.mlp_norm_w, b.mlp_norm_b);
    if (moe_mask_[size_t(i)]) {
      MoeParams& m = moe_params_[size_t(i)];
      const int64_t E = config_.moe.experts;
      matmul_numel_ +=
          E * C_ + config_.moe.top_k * (moe_shape.fc_in_rows(moe_shape.F) * C_ + C_ * moe_shape.F);
      m.router = add(p + "moe.router.weight", ParamTag::router, {E, C_}, Init::normal);
      m.beta = add(p + "moe.router.balance_bias", ParamTag::balance_bias, {E}, Init::zeros);
      m.experts.resize(size_t(E));
      const int64_t per_shard = E / shard_.count;
      expert = true;
      for (int64_t e = 0; e < E; ++e) {
        held = in_range && e / per_shard == shard_.index;
        add_mlp(p + "moe.experts." + std::to_string(e), moe_shape.F, m.experts[size_t(e)]);
      }
      expert = false;
      held = in_range;
      if (moe_shape.Fs > 0) add_mlp(p + "moe.shared", moe_shape.Fs, m.shared);
      if (!moe_) {
        moe_.emplace(config_.moe, moe_shape);
        // Inference (no targets) selects by plain top-k under sinkhorn, as Megatron-LM's
        // router: Sinkhorn balances a batch, and a generated token has none. Expert choice
        // is not causal either: each token takes its top-k experts, with expert choice's
        // gates (the scores, unnormalized) and no capacity (dropless).
        moe::MoeConfig plain = config_.moe;
        if (plain.balance == moe::Balance::sinkhorn) plain.balance = moe::Balance::none;
        if (plain.balance == moe::Balance::expert_choice) {
          plain.balance = moe::Balance::none;
          plain.normalize_gates = false;
          plain.capacity = 0;
        }
        moe_inference_.emplace(plain, moe_shape);
      }
      continue;
    }
    add_linear(p + "mlp.fc_in", Fi_, C_, Init::normal, b.fc_in_w, b.fc_in_b);
    add_linear(p + "mlp.fc_out", C_, F_, Init::scaled_normal, b.fc_out_w, b.fc_out_b);
  }
  held = holds_head();
  block = L;
  add_norm("final_norm", final_norm_w_, final_norm_b_);
  head_ = config_.tied_head ? embed_ : add("head.weight", ParamTag::head, {V, C_}, Init::normal);
  registry_size_ = int64_t(position);

  // Flat layout: the dense parameters, then the experts (registry order within each).
  std::vector<int64_t> offset(specs.size());
  int64_t total = 0;
  for (bool experts : {false, true}) {
    if (experts) dense_numel_ = total;
    for (size_t i = 0; i < specs.size(); ++i)
      if (specs[i].expert == experts) offset[i] = total, total += shape_numel(specs[i].shape);
  }
  flat_params_ = Tensor({total});
  flat_grads_ = Tensor({total});
  final_from_block_.assign(size_t(L + 1), {dense_numel_, total - dense_numel_});
  for (size_t i = 0; i < specs.size(); ++i)
    for (int64_t b = 0; b <= std::min(specs[i].block, L); ++b) {
      GradsFinal& f = final_from_block_[size_t(b)];
      if (specs[i].expert)
        f.experts = std::min(f.experts, offset[i] - dense_numel_);
      else
        f.dense = std::min(f.dense, offset[i]);
    }
  for (size_t i = 0; i < specs.size(); ++i) {
    const Spec& s = specs[i];
    parameters_.push_back({s.name, s.tag, flat_params_.view(offset[i], s.shape),
                           flat_grads_.view(offset[i], s.shape)});
    positions_.push_back(int64_t(s.position));
    (s.expert ? expert_params_ : dense_params_).push_back(parameters_.back());
  }

  // normal(0, init_std); output projections scaled by 1/sqrt(2 L) (GPT-2); norm gains 1;
  // biases 0 (the buffer starts zeroed).
  const uint64_t key = Rng(seed).next_u64();
  for (size_t i = 0; i < specs.size(); ++i) {
    float* w = parameters_[i].value.f32();
    const int64_t n = parameters_[i].value.numel();
    if (specs[i].init == Init::ones) std::fill(w, w + n, 1.0f);
    if (specs[i].init != Init::normal && specs[i].init != Init::scaled_normal) continue;
    const double scale = specs[i].init == Init::scaled_normal ? 1.0 / std::sqrt(2.0 * L) : 1.0;
    const float stddev = float(config_.init_std * scale);
    const int64_t chunks = (n + kInitChunk - 1) / kInitChunk;
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
      Rng rng(key + (specs[i].position << 32) + uint64_t(c));
      const int64_t begin = c * kInitChunk;
      rng.fill_normal(w + begin, std::min(kInitChunk, n - begin), 0.0f, stddev);
    }
  }
}

const Parameter& Gpt::parameter(const std::string& name) const {
  for (const Parameter& p : parameters_)
    if (p.name == name) return p;
  TESSEL_CHECK(false, "the model has no parameter named ", name);
}

void Gpt::zero_grads() {
  flat_grads_.fill_zero();
}

Tensor Gpt::dense_grads() const {
  return flat_grads_.view(0, {dense_numel_});
}

Tensor Gpt::expert_grads() const {
  return flat_grads_.view(dense_numel_, {num_parameters() - dense_numel_});
}

const BlockRange& Gpt::block_range() const {
  TESSEL_CHECK(chunks_.size() == 1, "block_range() of a model of ", chunks_.size(), " chunks");
  return chunks_.front();
}

void Gpt::check_blocks(int64_t first, int64_t last) const {
  const bool held =
      first <= last && std::any_of(chunks_.begin(), chunks_.end(), [&](const BlockRange& r) {
        return r.first <= first && last <= r.last;
      });
  if (held) return;
  std::string chunks;
  for (const BlockRange& r : chunks_)
    chunks += detail::concat(chunks.empty() ? "" : ", ", "[", r.first, ", ", r.last, ")");
  TESSEL_CHECK(false, "blocks [", first, ", ", last, ") are not held by a model of blocks ",
               chunks);
}

const float* Gpt::value(int index) const {
  return index < 0 ? nullptr : parameters_[size_t(index)].value.f32();
}

float* Gpt::grad(int index) {
  return index < 0 ? nullptr : parameters_[size_t(index)].grad.f32();
}

std::unique_ptr<Activations> Gpt::make_activations(int64_t B, int64_t T, BlockRange range,
                                                   Recompute recompute,
                                                   const Activations* scratch_from) const {
  if (B <= 0 || T <= 0)
    input_error("micro-batch of ", B, " x ", T, " tokens: sizes must be positive");
  if (T > config_.max_seq)
    input_error("sequence length ", T, " exceeds model.max_seq = ", config_.max_seq);
  const int64_t first = range.first, last = range.last < 0 ? config_.layers : range.last;
  TESSEL_CHECK(0 <= first && first <= last && last <= config_.layers &&
                   (!range.head || last == config_.layers),
               "blocks [", first, ", ", last, ") of ", config_.layers);
  // L: the blocks held; Lc: the block caches kept; the head's buffers only with the head.
  const int64_t N = B * T, L = last - first, C = C_;
  const int64_t Lc = recompute == Recompute::blocks ? std::min<int64_t>(L, 1) : L;
  const int64_t V = range.head ? config_.vocab : 0;
  const bool layernorm = config_.norm == NormType::layernorm;
  auto a = std::make_unique<Activations>();
  a->B = B;
  a->T = T;
  a->first_layer = first;
  a->last_layer = last;
  a->recompute = recompute;
  TESSEL_CHECK(!scratch_from || (scratch_from->B == B && scratch_from->T == T &&
                                 scratch_from->recompute == recompute),
               "scratch shared between activations of different shapes");
  // Every tensor this set owns is allocated here, so that tensor_bytes counts them all.
  auto make = [&a](Shape shape, DType dtype = DType::f32) {
    Tensor t(std::move(shape), dtype);
    a->tensor_bytes += int64_t(t.bytes());
    return t;
  };
  // A buffer `scratch_from` may lend: its own (the same storage) when it has one of this
  // shape (another range may hold no blocks, or no head), else a new one.
  auto lend = [&](Tensor Activations::*field, bool shareable, Shape shape) {
    if (!scratch_from || !shareable) return make(std::move(shape));
    const Tensor& lent = scratch_from->*field;
    return lent.defined() && lent.shape() == shape ? lent : make(std::move(shape));
  };
  const bool rebuilt = recompute == Recompute::blocks;  // the block cache
  a->tokens = make({N}, DType::i32);
  a->positions = make({N}, DType::i32);
  a->targets = make({N}, DType::i32);
  a->loss_weight = make({N});
  using A = Activations;
  auto cache = [&](Tensor A::*field, Shape shape) { return lend(field, rebuilt, shape); };
  auto mean = [&](Tensor A::*field) { return layernorm ? cache(field, {Lc, N}) : Tensor(); };
  a->stream = make({L + 1, N, C});
  a->attn_norm = cache(&A::attn_norm, {Lc, N, C});
  a->attn_norm_mean = mean(&A::attn_norm_mean);
  a->attn_norm_rstd = cache(&A::attn_norm_rstd, {Lc, N});
  a->q = cache(&A::q, {Lc, N, H_, D_});
  a->k = cache(&A::k, {Lc, N, Hkv_, D_});
  a->v = cache(&A::v, {Lc, N, Hkv_, D_});
  a->attn = cache(&A::attn, {Lc, N, H_, D_});
  a->attn_lse = cache(&A::attn_lse, {Lc, B, H_, T});
  a->mid = cache(&A::mid, {Lc, N, C});
  a->mlp_norm = cache(&A::mlp_norm, {Lc, N, C});
  a->mlp_norm_mean = mean(&A::mlp_norm_mean);
  a->mlp_norm_rstd = cache(&A::mlp_norm_rstd, {Lc, N});
  a->fc = cache(&A::fc, {Lc, N, Fi_});
  a->act = cache(&A::act, {Lc, N, F_});
  if (V > 0) {
    a->final_norm = make({N, C});
    a->final_norm_mean = layernorm ? make({N}) : Tensor();
    a->final_norm_rstd = make({N});
    a->logits = make({N, V});
    a->lse = make({N});
    a->d_logits = lend(&A::d_logits, true, {N, V});
  }
  a->d_stream = lend(&A::d_stream, true, {std::min<int64_t>(L + 1, 2), N, C});
  a->qkv = lend(&A::qkv, true, {N, QKV_});
  a->d_split = lend(&A::d_split, true, {N * QKV_});
  if (config_.positions == PositionType::rotary)
    a->d_unrot = lend(&A::d_unrot, true, {N * (H_ + Hkv_) * D_});
  a->d_attn = lend(&A::d_attn, true, {N, H_ * D_});
  a->d_norm = lend(&A::d_norm, true, {N, C});
  a->d_act = lend(&A::d_act, true, {N, F_});
  a->d_fc = lend(&A::d_fc, true, {N, Fi_});
  a->moe.resize(size_t(L));
  return a;
}

attention::ColumnMask attention_mask(const GptConfig& config, const attention::ColumnMask* given,
                                     int64_t B, int64_t Sq, int64_t Sk) {
  attention::ColumnMask mask = given ? *given : attention::ColumnMask::causal_only(B, Sq, Sk);
  if (config.attention_window == 0) return mask;
  return attention::restrict_to_window(mask, config.attention_window);
}

void Gpt::load_inputs(Activations& acts, const ModelInputs& in) const {
  TESSEL_CHECK(in.B == acts.B && in.T == acts.T, "inputs of ", in.B, " x ", in.T,
               " tokens given to activations for ", acts.B, " x ", acts.T);
  const int64_t N = acts.B * acts.T, T = acts.T, V = config_.vocab;
  auto where = [T](int64_t n) { return detail::concat("[", n / T, ", ", n % T, "]"); };
  // The mask is copied with its tile summaries, computed once for all layers.
  acts.mask = attention::TiledMask(attention_mask(config_, in.mask, acts.B, T, T));
  attention::check_mask_fits(acts.mask, attention_shape(acts));
  acts.attention = in.attention;
  acts.routed.clear();
  if (in.padding)
    for (int64_t n = 0; n < N; ++n)
      if (!in.padding[n]) acts.routed.push_back(n);
  acts.routed_all = int64_t(acts.routed.size()) == N || !in.padding;
  acts.routed_index.reset();
  if (in.token_index) {
    acts.routed_index.emplace();
    if (acts.routed_all)
      acts.routed_index->assign(in.token_index, in.token_index + N);
    else
      for (int64_t n : acts.routed) acts.routed_index->push_back(in.token_index[n]);
  }
  acts.routed_sequence.clear();
  if (moe_ && config_.moe.balance == moe::Balance::seq_aux) {  // a dense model has no balance
    TESSEL_CHECK(!in.token_index, "seq_aux needs whole sequences (no context parallelism)");
    for (int64_t n = 0; n < N; ++n)
      if (acts.routed_all || !in.padding[n]) acts.routed_sequence.push_back(int32_t(n / T));
  }
  acts.has_tokens = in.tokens != nullptr;
  acts.has_targets = in.targets != nullptr;
  int32_t* tokens = acts.tokens.i32();
  int32_t* positions = acts.positions.i32();
  int32_t* targets = acts.targets.i32();
  float* weight = acts.loss_weight.f32();
  for (int64_t n = 0; n < N; ++n) {
    if (in.tokens) {
      tokens[n] = in.tokens[n];
      if (tokens[n] < 0 || tokens[n] >= V)
        input_error("token id ", tokens[n], " at ", where(n), " is outside [0, model.vocab = ", V,
                    ")");
    }
    positions[n] = in.positions ? in.positions[n] : int32_t(n % T);
    if (positions[n] < 0 || positions[n] >= config_.max_seq)
      input_error("position ", positions[n], " at ", where(n),
                  " is outside [0, model.max_seq = ", config_.max_seq, ")");
    if (in.targets) {
      targets[n] = in.targets[n];
      weight[n] = in.loss_weight ? in.loss_weight[n] : 1.0f;
      if (weight[n] != 0.0f && (targets[n] < 0 || targets[n] >= V))
        input_error("target id ", targets[n], " at ", where(n), " is outside [0, model.vocab = ", V,
                    ")");
    }
  }
}

double Gpt::forward(Activations& acts, const ModelInputs& inputs) const {
  load_inputs(acts, inputs);
  forward_embedding(acts);
  forward_blocks(acts, 0, config_.layers);
  return forward_head(acts);
}

void Gpt::backward(Activations& acts, float loss_scale) {
  backward_head(acts, loss_scale);
  backward_blocks(acts, 0, config_.layers);
  backward_embedding(acts);
}

void Gpt::norm_forward(float* y, float* mean, float* rstd, const float* x, int w, int b,
                       int64_t N) const {
  const float eps = float(config_.norm_eps);
  if (config_.norm == NormType::layernorm)
    kn::layernorm_forward(y, mean, rstd, x, value(w), value(b), N, C_, eps);
  else
    kn::rmsnorm_forward(y, rstd, x, value(w), N, C_, eps);
}

void Gpt::norm_backward(float* dx, int w, int b, const float* dy, const float* x, const float* mean,
                        const float* rstd, int64_t N) {
  if (config_.norm == NormType::layernorm)
    kn::layernorm_backward(dx, grad(w), grad(b), dy, x, value(w), mean, rstd, N, C_);
  else
    kn::rmsnorm_backward(dx, grad(w), dy, x, value(w), rstd, N, C_);
}

// x_0 [N, C] = embed[tokens] (+ pos_embed[positions]).
void Gpt::forward_embedding(Activations& acts) const {
  TESSEL_CHECK(holds_embedding(), "forward_embedding: the model does not hold the embedding");
  TESSEL_CHECK(acts.has_tokens, "forward_embedding needs inputs.tokens");
  const int64_t N = acts.B * acts.T, C = C_;
  float* x = acts.residual(0).f32();
  kn::embedding_forward(x, acts.tokens.i32(), value(embed_), N, config_.vocab, C);
  if (pos_embed_ < 0) return;
  const float* table = value(pos_embed_);
  const int32_t* pos = acts.positions.i32();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* row = table + int64_t(pos[n]) * C;
    for (int64_t c = 0; c < C; ++c) x[n * C + c] += row[c];
  }
}

void Gpt::forward_blocks(Activations& acts, int64_t first, int64_t last) const {
  check_blocks(first, last);
  for (int64_t l = first; l < last; ++l) block_forward(acts, l);
}

// x_l [N, C] -> x_{l+1} [N, C], caching what block_backward needs. Stream slot s, cache
// slot c (the same unless the activations recompute).
void Gpt::block_forward(Activations& acts, int64_t l, bool rebuild) const {
  const BlockParams& p = blocks_[size_t(l)];
  const int64_t N = acts.B * acts.T, C = C_, Q = H_ * D_, KV = Hkv_ * D_, s = acts.slot(l);
  const int64_t c = acts.cache_slot(l);
  const float* x = acts.stream.f32() + s * N * C;
  float* y = acts.stream.f32() + (s + 1) * N * C;
  float* m = acts.mid.f32() + c * N * C;
  float* ln1 = acts.attn_norm.f32() + c * N * C;
  float* ln2 = acts.mlp_norm.f32() + c * N * C;
  float* q = acts.q.f32() + c * N * Q;
  float* k = acts.k.f32() + c * N * KV;
  float* v = acts.v.f32() + c * N * KV;
  float* o = acts.attn.f32() + c * N * Q;
  float* fc = acts.fc.f32() + c * N * Fi_;
  float* act = acts.act.f32() + c * N * F_;

  norm_forward(ln1, at(acts.attn_norm_mean, c * N), acts.attn_norm_rstd.f32() + c * N, x,
               p.attn_norm_w, p.attn_norm_b, N);
  kn::linear_forward(acts.qkv.f32(), ln1, value(p.qkv_w), value(p.qkv_b), N, C, QKV_);
  split_qkv(q, k, v, acts.qkv.f32(), N, Q, KV);
  if (config_.positions == PositionType::rotary) {
    const int32_t* pos = acts.positions.i32();
    const float theta = float(config_.rope_theta);
    kn::rope_forward(q, q, pos, N, H_, D_, theta);
    kn::rope_forward(k, k, pos, N, Hkv_, D_, theta);
  }
  float* lse = acts.attn_lse.f32() + c * N * H_;
  if (acts.attention)
    acts.attention->forward(o, lse, q, k, v);
  else
    attention::flash_attention_forward(o, lse, q, k, v, attention_shape(acts), acts.mask);
  kn::linear_forward(m, o, value(p.out_w), value(p.out_b), N, Q, C);
  add_into(m, x, N * C);

  norm_forward(ln2, at(acts.mlp_norm_mean, c * N), acts.mlp_norm_rstd.f32() + c * N, m,
               p.mlp_norm_w, p.mlp_norm_b, N);
  if (moe_mask_[size_t(l)]) {
    // A rebuild runs the whole MoE layer (backward needs its expert outputs) and writes the
    // same x_{l+1} again.
    TESSEL_CHECK(expert_comm_->ep_size() == shard_.count && expert_comm_->ep_rank() == shard_.index,
                 "this model holds expert shard ", shard_.index, " of ", shard_.count,
                 " but runs with ep rank ", expert_comm_->ep_rank(), " of ",
                 expert_comm_->ep_size(), ": set the expert comm of its ep group");
    const MoeParams& mp = moe_params_[size_t(l)];
    const auto w = moe_views<const float>(mp, [this](int i) { return value(i); });
    std::optional<std::span<const int32_t>> index;
    if (acts.routed_index) index = *acts.routed_index;
    const moe::MoeLayer& layer = acts.has_targets ? *moe_ : *moe_inference_;
    if (acts.routed_all) {
      layer.forward(acts.moe[size_t(s)], y, ln2, N, w, value(mp.beta), *expert_comm_, index,
                    acts.routed_sequence);
    } else {  // padding rows are not routed: their MoE output is 0
      gather_rows(acts.moe_x, ln2, acts.routed, C);
      acts.moe_y.resize(acts.moe_x.size());
      layer.forward(acts.moe[size_t(s)], acts.moe_y.data(), acts.moe_x.data(),
                    int64_t(acts.routed.size()), w, value(mp.beta), *expert_comm_, index,
                    acts.routed_sequence);
      std::fill_n(y, N * C, 0.0f);
      scatter_rows(y, acts.moe_y, acts.routed, C);
    }
    // With recomputation the expert buffers live from here only to the block's backward.
    if (acts.recompute == Recompute::blocks && !rebuild) acts.moe[size_t(s)].release_buffers();
  } else {
    kn::linear_forward(fc, ln2, value(p.fc_in_w), value(p.fc_in_b), N, C, Fi_);
    if (config_.mlp == MlpType::gelu)
      kn::gelu_forward(act, fc, N * F_);
    else
      kn::swiglu_forward(act, fc, N, F_);
    if (rebuild) return;  // backward reads act, not the MLP's output
    kn::linear_forward(y, act, value(p.fc_out_w), value(p.fc_out_b), N, F_, C);
  }
  add_into(y, m, N * C);
}

// x_L [N, C] -> final_norm [N, C] -> logits [N, V] -> loss sum (0 without targets).
double Gpt::forward_head(Activations& acts) const {
  TESSEL_CHECK(holds_head() && acts.logits.defined(),
               "forward_head: the model or the activations do not hold the head");
  const int64_t N = acts.B * acts.T, V = config_.vocab;
  const float* x = acts.residual(config_.layers).f32();
  norm_forward(acts.final_norm.f32(), at(acts.final_norm_mean, 0), acts.final_norm_rstd.f32(), x,
               final_norm_w_, final_norm_b_, N);
  kn::linear_forward(acts.logits.f32(), acts.final_norm.f32(), value(head_), nullptr, N, C_, V);
  if (!acts.has_targets) return 0.0;
  return kn::cross_entropy_forward(acts.lse.f32(), acts.logits.f32(), acts.targets.i32(),
                                   acts.loss_weight.f32(), N, V);
}

void Gpt::backward_head(Activations& acts, float loss_scale) {
  TESSEL_CHECK(holds_head() && acts.logits.defined(),
               "backward_head: the model or the activations do not hold the head");
  TESSEL_CHECK(acts.has_targets, "backward needs a forward with targets");
  const int64_t N = acts.B * acts.T, V = config_.vocab, L = config_.layers;
  acts.loss_scale = loss_scale;
  acts.d_logits.fill_zero();
  kn::cross_entropy_backward(acts.d_logits.f32(), acts.logits.f32(), acts.lse.f32(),
                             acts.targets.i32(), acts.loss_weight.f32(), loss_scale, N, V);
  acts.d_norm.fill_zero();
  // A deferred head gradient keeps d_logits in this micro-batch's logits, which B no longer
  // needs (the largest copy a W reads), and reads final_norm, this micro-batch's own.
  linear_backward(acts, acts.d_norm.f32(), head_, -1, acts.d_logits.f32(), acts.final_norm.f32(), N,
                  C_, V, {true, acts.logits.f32()});
  float* dx = acts.residual_grad(L).f32();
  std::fill(dx, dx + N * C_, 0.0f);
  norm_backward(dx, final_norm_w_, final_norm_b_, acts.d_norm.f32(), acts.residual(L).f32(),
                at(acts.final_norm_mean, 0), acts.final_norm_rstd.f32(), N);
  report_grads_final(acts, L);
}

void Gpt::report_grads_final(Activations& acts, int64_t block) const {
  if (!acts.on_grads_final) return;
  TESSEL_CHECK(!acts.defer_weight_grads && chunks_.size() == 1,
               "on_grads_final needs a backward that adds its weight gradients, of one chunk");
  acts.on_grads_final(block < 0 ? GradsFinal{} : final_from_block_[size_t(block)]);
}

void Gpt::backward_blocks(Activations& acts, int64_t first, int64_t last) {
  check_blocks(first, last);
  const bool recompute = acts.recompute == Recompute::blocks;
  for (int64_t l = last - 1; l >= first; --l) {
    if (recompute) block_forward(acts, l, true);
    block_backward(acts, l);
    if (recompute && moe_mask_[size_t(l)]) acts.moe[size_t(acts.slot(l))].release_buffers();
    report_grads_final(acts, l);
  }
}

// d x_{l+1} [N, C] -> d x_l [N, C], adding the block's parameter gradients.
void Gpt::block_backward(Activations& acts, int64_t l) {
  const BlockParams& p = blocks_[size_t(l)];
  const int64_t N = acts.B * acts.T, C = C_, Q = H_ * D_, KV = Hkv_ * D_, s = acts.slot(l);
  const int64_t c = acts.cache_slot(l);
  const float* dy = acts.residual_grad(l + 1).f32();
  float* dx = acts.residual_grad(l).f32();
  const float* x = acts.stream.f32() + s * N * C;
  const float* m = acts.mid.f32() + c * N * C;
  const float* q = acts.q.f32() + c * N * Q;
  const float* k = acts.k.f32() + c * N * KV;
  const float* v = acts.v.f32() + c * N * KV;
  const float* o = acts.attn.f32() + c * N * Q;
  float* d_norm = acts.d_norm.f32();
  // Whether the block's forward cache is this micro-batch's own until its W (deferred weight
  // gradients read it then); under recomputation it is the one cache the next block rebuilds.
  const bool own_cache = acts.recompute == Recompute::none;

  // MLP branch; dx first carries the residual path, then becomes d m.
  std::copy(dy, dy + N * C, dx);
  if (moe_mask_[size_t(l)]) {
    const MoeParams& mp = moe_params_[size_t(l)];
    auto g = moe_views<float>(mp, [this](int i) { return grad(i); });
    const auto w = moe_views<const float>(mp, [this](int i) { return value(i); });
    const float* x_norm = acts.mlp_norm.f32() + c * N * C;
    acts.d_norm.fill_zero();
    if (acts.routed_all) {
      moe_->backward(acts.moe[size_t(s)], d_norm, g, dy, x_norm, w, acts.loss_scale,
                     balance_[size_t(l)], *expert_comm_);
    } else {  // only the routed rows, gathered as in forward
      gather_rows(acts.moe_x, x_norm, acts.routed, C);
      gather_rows(acts.moe_y, dy, acts.routed, C);
      acts.moe_dx.assign(acts.moe_x.size(), 0.0f);
      moe_->backward(acts.moe[size_t(s)], acts.moe_dx.data(), g, acts.moe_y.data(),
                     acts.moe_x.data(), w, acts.loss_scale, balance_[size_t(l)], *expert_comm_);
      scatter_rows(d_norm, acts.moe_dx, acts.routed, C);
    }
  } else {
    acts.d_act.fill_zero();
    linear_backward(acts, acts.d_act.f32(), p.fc_out_w, p.fc_out_b, dy, acts.act.f32() + c * N * F_,
                    N, F_, C, {own_cache});
    const float* fc = acts.fc.f32() + c * N * Fi_;
    acts.d_fc.fill_zero();
    if (config_.mlp == MlpType::gelu)
      kn::gelu_backward(acts.d_fc.f32(), acts.d_act.f32(), fc, N * F_);
    else
      kn::swiglu_backward(acts.d_fc.f32(), acts.d_act.f32(), fc, N, F_);
    acts.d_norm.fill_zero();
    linear_backward(acts, d_norm, p.fc_in_w, p.fc_in_b, acts.d_fc.f32(),
                    acts.mlp_norm.f32() + c * N * C, N, C, Fi_, {own_cache});
  }
  norm_backward(dx, p.mlp_norm_w, p.mlp_norm_b, d_norm, m, at(acts.mlp_norm_mean, c * N),
                acts.mlp_norm_rstd.f32() + c * N, N);

  // Attention branch; dx gains the path through attn_norm and becomes d x_l.
  acts.d_attn.fill_zero();
  linear_backward(acts, acts.d_attn.f32(), p.out_w, p.out_b, dx, o, N, Q, C, {own_cache});
  acts.d_split.fill_zero();
  float* dq = acts.d_split.f32();
  float* dk = dq + N * Q;
  float* dv = dk + N * KV;
  const float* lse = acts.attn_lse.f32() + c * N * H_;
  if (acts.attention)
    acts.attention->backward(dq, dk, dv, acts.d_attn.f32(), q, k, v, o, lse);
  else
    attention::flash_attention_backward(dq, dk, dv, acts.d_attn.f32(), q, k, v, o, lse,
                                        attention_shape(acts), acts.mask);
  if (config_.positions == PositionType::rotary) {
    const int32_t* pos = acts.positions.i32();
    const float theta = float(config_.rope_theta);
    acts.d_unrot.fill_zero();
    float* dq0 = acts.d_unrot.f32();
    float* dk0 = dq0 + N * Q;
    kn::rope_backward(dq0, dq, pos, N, H_, D_, theta);
    kn::rope_backward(dk0, dk, pos, N, Hkv_, D_, theta);
    dq = dq0;
    dk = dk0;
  }
  float* d_qkv = acts.qkv.f32();
  merge_qkv(d_qkv, dq, dk, dv, N, Q, KV);
  acts.d_norm.fill_zero();
  linear_backward(acts, d_norm, p.qkv_w, p.qkv_b, d_qkv, acts.attn_norm.f32() + c * N * C, N, C,
                  QKV_, {own_cache});
  norm_backward(dx, p.attn_norm_w, p.attn_norm_b, d_norm, x, at(acts.attn_norm_mean, c * N),
                acts.attn_norm_rstd.f32() + c * N, N);
}

template <class P, class Get>
moe::LayerWeightsT<P> Gpt::moe_views(const MoeParams& m, Get get) const {
  auto mlp = [&](const MlpParams& p) {
    return moe::MlpWeightsT<P>{get(p.fc_in_w), get(p.fc_in_b), get(p.fc_out_w), get(p.fc_out_b)};
  };
  moe::LayerWeightsT<P> w;
  w.router = get(m.router);
  for (const MlpParams& e : m.experts) w.experts.push_back(mlp(e));
  if (m.shared.fc_in_w >= 0) w.shared = mlp(m.shared);
  return w;
}

void Gpt::set_expert_comm(moe::ExpertComm* comm) {
  expert_comm_ = comm ? comm : local_comm_.get();
}

void Gpt::update_balance() {
  for (const BlockRange& r : chunks_)
    for (int64_t l = r.first; l < r.last; ++l)
      if (moe_mask_[size_t(l)])
        moe_->update(balance_[size_t(l)],
                     parameters_[size_t(moe_params_[size_t(l)].beta)].value.f32(), *expert_comm_);
}

void Gpt::discard_balance() {
  for (moe::BalanceState& state : balance_) state = moe::BalanceState{};
}

void Gpt::backward_embedding(Activations& acts) {
  TESSEL_CHECK(holds_embedding(), "backward_embedding: the model does not hold the embedding");
  TESSEL_CHECK(acts.has_tokens, "backward_embedding needs inputs.tokens");
  const int64_t N = acts.B * acts.T;
  // A queued W reads the micro-batch's token and position ids, which live until its W.
  auto add_grads = [this, &acts, N](const float* dx) {
    kn::embedding_backward(grad(embed_), dx, acts.tokens.i32(), N, config_.vocab, C_);
    if (pos_embed_ >= 0)
      kn::embedding_backward(grad(pos_embed_), dx, acts.positions.i32(), N, config_.max_seq, C_);
  };
  const float* dx = acts.residual_grad(0).f32();
  if (!acts.defer_weight_grads) {
    add_grads(dx);
    return report_grads_final(acts, -1);
  }
  // residual_grad(0) is shared scratch: the queued gradient reads its own copy.
  acts.deferred_bytes += N * C_ * int64_t(sizeof(float));
  acts.deferred_weight_grads.push_back(
      [add_grads, d = std::vector<float>(dx, dx + N * C_)] { add_grads(d.data()); });
}

void Gpt::linear_backward(Activations& acts, float* dx, int w, int b, const float* dy,
                          const float* x, int64_t N, int64_t in, int64_t out, DeferredReads reads) {
  kn::linear_backward_input(dx, dy, value(w), N, in, out);
  if (!acts.defer_weight_grads)
    return kn::linear_backward_weights(grad(w), grad(b), dy, x, N, in, out);
  // dy is scratch or a residual-stream gradient, which later backwards overwrite: the queued
  // gradient keeps it in reads.dy_home or a copy of its own; x it copies unless kept.
  std::vector<float> dy_copy, x_copy;
  if (reads.dy_home)
    std::copy(dy, dy + N * out, reads.dy_home);
  else
    dy_copy.assign(dy, dy + N * out);
  if (!reads.x_kept) x_copy.assign(x, x + N * in);
  acts.deferred_bytes += int64_t((dy_copy.size() + x_copy.size()) * sizeof(float));
  acts.deferred_weight_grads.push_back([this, w, b, N, in, out, x, dy = reads.dy_home,
                                        dy_copy = std::move(dy_copy), x_copy = std::move(x_copy)] {
    kn::linear_backward_weights(grad(w), grad(b), dy ? dy : dy_copy.data(),
                                x_copy.empty() ? x : x_copy.data(), N, in, out);
  });
}

void Gpt::backward_weights(Activations& acts) {
  for (auto& queued : acts.deferred_weight_grads) queued();
  acts.deferred_weight_grads.clear();
  acts.deferred_bytes = 0;
}

}  // namespace tessel::model

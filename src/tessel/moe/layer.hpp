#pragma once
// A mixture-of-experts MLP with explicit forward/backward (spec moe_balancing.md; the
// formulas are in docs/model.md, "Mixture of experts").
//
//   logits = x Wr^T [N, E];  p = softmax(logits) or sigmoid(logits)
//   selection: the top-k experts of logits - beta per token (ties: lowest expert); beta
//              never enters a gate (sinkhorn: logits + log c, c the micro-batch's Sinkhorn
//              column scale, sinkhorn_log_scale)
//   gates g_j = p[e_j] (divided by sum_j p[e_j] when normalize_gates)
//   capacity (cf > 0): each expert keeps ceil(k N cf / E) of the micro-batch's assignments, by
//              gate or by token position; the rest are dropped (gate 0, no renormalization)
//   y[n] = sum over kept j of g_j * expert_{e_j}(x[n])  (+ shared(x[n]))
// expert_choice (Zhou et al. 2022): every token offers all E experts a slot (E slots per token
// instead of k) with gate p[n, e] (never normalized, beta unused), and each expert keeps the
// ceil(k N cf / E) slots of highest gate (cf = 1 when the capacity is 0; ties: lowest token),
// i.e. takes the top-C tokens of the micro-batch by score; a token is taken by 0..E experts.
//
// Dispatch: kept assignments are permuted into expert order, counts then rows are exchanged
// with the ep group through ExpertComm (expert e lives on ep rank e / (E / ep)), each local
// expert runs as one GEMM call sequence over its rows, and the outputs return by the
// reverse exchange and are unpermuted with the gates. Backward runs the same exchanges for
// the row gradients. Expert MLPs are fc_out(act(fc_in(x))), act = gelu or swiglu as the
// dense MLP. Backward ADDS into dx and every parameter gradient.
//
// Balancing gradients are added in backward, scaled by loss_scale * N (the layer's losses
// are per-token means and the model's loss is a sum over tokens); see Balance.
//
// LEI (lei, eqb_lei; spec 3): coeff L(f) with the micro-batch's load fractions f_e taken
// straight through f~_e = sum_n phi(m[n, e]) / (N k), so dL/ds[n, e] = dL/df_e phi'(m[n, e]) /
// (N k), s = logits - beta the selection scores. The margin m[n, e] = s[n, e] - b_n is held
// fixed at the forward's boundary b_n (model.moe_lei_margin): the midpoint of the token's k-th
// and (k+1)-th largest scores, the k-th (topk) or the (k+1)-th (topk_plus_one); none when
// k = E (m far outside every kernel). exact_margin replaces the kernel's support by a window
// per expert: with C = N k / E (the micro-batch's N tokens), an expert whose load exceeds
// ceil(C) gets the load - ceil(C) tokens that chose it closest to dropping it (smallest
// s[n, e] - the token's (k+1)-th largest score), one whose load is below floor(C) the
// floor(C) - load tokens that did not choose it closest to taking it (smallest k-th largest
// score - s[n, e]); ties by the lower token. So with N k divisible by E every expert's window
// holds |load - C| tokens, and an expert whose load lies in [floor(C), ceil(C)] has none.
// Window tokens get phi'(0) (rectangle and triangle 1/w, tanh 1/(2w): w sets the height, not
// the extent), the others 0. The ranking needs the whole micro-batch on one rank (no context
// parallelism). The identity kernel acts on p and ignores the margins. Losses
// (model.moe_lei_loss): centered_fsq 1 + E sum_e (f_e - 1/E)^2, fsq E sum_e f_e^2, maxvio
// 1 + (max_e f_e - 1/E) / (1/E) (tied maxima share the subgradient equally), totalvio
// 1 + E/2 sum_e |f_e - 1/E| (sign(0) = 0).
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "tessel/core/error.hpp"
#include "tessel/moe/config.hpp"
#include "tessel/moe/expert_comm.hpp"

namespace tessel::moe {

// Pointers into a model's parameter buffers; biases null when the model has none.
template <class P>
struct MlpWeightsT {
  P* fc_in_w = nullptr;   // [Fi, C], Fi = F (gelu) or 2F (swiglu, rows [gate | up])
  P* fc_in_b = nullptr;   // [Fi]
  P* fc_out_w = nullptr;  // [C, F]
  P* fc_out_b = nullptr;  // [C]
};
template <class P>
struct LayerWeightsT {
  P* router = nullptr;                  // [E, C]
  std::vector<MlpWeightsT<P>> experts;  // [E]
  MlpWeightsT<P> shared;                // fc_in_w null: no shared expert
};
using LayerWeights = LayerWeightsT<const float>;
using LayerGrads = LayerWeightsT<float>;

struct LayerShape {
  int64_t C = 0;   // width
  int64_t F = 0;   // expert hidden width
  int64_t Fs = 0;  // shared expert hidden width (0 = none)
  ExpertMlp mlp = ExpertMlp::gelu;
  int64_t fc_in_rows(int64_t hidden) const {
    return mlp == ExpertMlp::swiglu ? 2 * hidden : hidden;
  }
};

// What one forward keeps for its backward, plus the statistics the metrics read.
struct LayerCache {
  int64_t N = 0;
  std::vector<float> logits, probs;  // [N, E]
  // Slots: k per token, E under expert_choice (slot n E + e offers token n to expert e).
  std::vector<int32_t> choice;       // [N, slots] selected experts, best first
  std::vector<float> gate;           // [N, slots] gates before drops
  std::vector<int32_t> position;     // [N, slots] row of the slot in the permuted order; -1 dropped
  std::vector<float> lei_margin;     // [N, E] (lei): selection score minus the token's boundary
                                     // (exact_margin: 0 in the window, else 1e30 chosen, -1e30 not)
  std::vector<float> qb_margin;      // [N, E] (qb_avg, eqb, qb_hist): logits minus alpha_t
  std::vector<int32_t> sequence;     // [N] (seq_aux): each token's sequence
  std::vector<double> seq_aux_grad;  // [S, E] (seq_aux): N dL/dp[n, e] for sequence s's tokens
  // Dispatch: this rank's kept assignments in expert order, then what the ep group sent.
  std::vector<int32_t> order;                // [A] slot of each permuted row
  std::vector<int64_t> counts;               // [E] kept assignments per expert (this rank's tokens)
  std::vector<int64_t> recv_counts;          // [ep, E/ep] rows from ep rank s for local expert l
  std::vector<float> expert_in;              // [R, C] rows of the local experts, expert-major
  std::vector<float> expert_fc;              // [R, Fi]
  std::vector<float> expert_act;             // [R, F]
  std::vector<float> combined;               // [A, C] expert outputs in the permuted order
  std::vector<float> shared_fc, shared_act;  // [N, Fsi], [N, Fs]
  // Statistics.
  std::vector<int64_t> loads;  // [E] this rank's assignments before drops (expert_choice: kept)
  int64_t dropped = 0;         // this rank's dropped assignments (expert_choice: tokens no expert
                               // took)
  // expert_choice: this rank's tokens no expert would take at capacity factors 1.0 and 1.25.
  int64_t unserved_cf1 = 0, unserved_cf1_25 = 0;
  double balance_loss = 0;  // value of the aux, z and LEI terms (per-token means)
  // For the EP step-time skew: seconds this rank's expert MLPs ran (forward, then backward
  // adds its own; a recomputing forward starts over) and the rows they received in forward's
  // dispatch (from every ep rank, this one included).
  double expert_seconds = 0;
  int64_t received_rows = 0;
  // The whole micro-batch's (summed over the micro-batch group):
  std::vector<double> batch_loads;        // [E] assignments before drops
  std::vector<double> batch_group_loads;  // [E] the ep groups' assignments before drops
  std::vector<double> batch_f;            // [E] load fractions f_e = assignments / (tokens k)
  int64_t batch_tokens = 0;               // tokens

  // Frees the buffers only backward reads (every [N, *] and [rows, *] one), keeping the
  // statistics: activation recomputation runs the forward again before the backward.
  void release_buffers();
};

// Router logits that overflowed under quantile balancing (their margins are NaN): a divergence
// met in one micro-batch's backward, on the rank that saw it. The trainer adds the step and the
// newest checkpoint, as for a non-finite gradient norm.
class RouterOverflow : public DivergenceError {
 public:
  using DivergenceError::DivergenceError;
};

// Per-step accumulators of the balancing methods that update beta once per optimizer step;
// filled by backward (training micro-batches only), consumed by MoeLayer::update.
struct BalanceState {
  std::vector<double> loads;                // [E] bias: assignments this step (this rank)
  std::vector<int32_t> global_counts;       // [E] aux_global: group-wide counts this step
  std::vector<double> beta_sum;             // [E] qb_avg: sum of per-micro-batch quantiles
  int64_t micro_batches = 0;                // qb_avg
  std::vector<std::vector<uint16_t>> keys;  // [E][tokens] eqb, qb_hist: the margins' order keys
};

class MoeLayer {
 public:
  MoeLayer(const MoeConfig& config, const LayerShape& shape);
  const MoeConfig& config() const { return config_; }
  const LayerShape& shape() const { return shape_; }

  // x [N, C] -> y [N, C] (overwritten). beta [E] is the selection bias. Collective over the
  // ep group (the token exchange) and the micro-batch group (one sum of the micro-batch's
  // statistics), also with N = 0.
  // token_index [N]: each token's index in its whole micro-batch when this rank holds only a
  // part of it (context parallelism; also when that part has no token), so that expert
  // capacity counts the whole micro-batch's assignments in its token order (one more
  // micro-batch-group collective, with capacity only); none: these tokens are the micro-batch,
  // in order.
  // sequence [N] (seq_aux): each token's sequence in the micro-batch, numbered from 0; empty:
  // the tokens are one sequence.
  void forward(LayerCache& cache, float* y, const float* x, int64_t N, const LayerWeights& w,
               const float* beta, ExpertComm& comm,
               std::optional<std::span<const int32_t>> token_index = std::nullopt,
               std::span<const int32_t> sequence = {}) const;
  // Adds d(loss)/d(x) into dx [N, C] and the parameter gradients into g; dy [N, C]. Records
  // this micro-batch into `state`. Collective over the ep group, over the balancing group
  // with aux_global and over the micro-batch group with qb_avg (unless the whole micro-batch
  // has no token).
  void backward(LayerCache& cache, float* dx, LayerGrads& g, const float* dy, const float* x,
                const LayerWeights& w, float loss_scale, BalanceState& state,
                ExpertComm& comm) const;
  // End of an optimizer step: the beta update of the balancing method (bias, qb_avg, eqb,
  // eqb_lei, qb_hist; a no-op otherwise), collective over the balancing group; resets `state`.
  void update(BalanceState& state, float* beta, ExpertComm& comm) const;

 private:
  // k, or E under expert_choice: the assignment slots per token.
  int64_t slots() const;
  // capacity_ranks over the whole micro-batch (forward's token_index): fills rank[N * slots()]
  // with this rank's slots' places; returns the micro-batch's token count.
  int64_t micro_batch_ranks(const LayerCache& c, std::span<const int32_t> token_index,
                            ExpertComm& comm, int32_t* rank) const;
  // Runs local expert l (global first + l) on rows [off[l], off[l+1]) of c.expert_in into out.
  void run_experts(LayerCache& c, float* out, const LayerWeights& w,
                   const std::vector<int64_t>& off, int64_t first) const;
  MoeConfig config_;
  LayerShape shape_;
};

// ---- definitions shared by the layer and its naive twin ----

// Assignments each expert keeps at capacity factor cf: min(N, ceil(k N cf / E)).
int64_t expert_capacity(int64_t N, int64_t k, int64_t E, double cf);
// The capacity factor the layer applies: model.moe_capacity, but 1 for expert_choice at 0.
double capacity_factor(const MoeConfig& config);

// ---- the layer's selection pieces, declared for the tests (the naive twin has its own
// top-k, capacity order, Sinkhorn scaling and LEI kernels, so comparing them can catch a bug
// here) ----

// The k largest of sel[E] (ties: lowest expert first), best first, into out[k]; returns
// the (k+1)-th largest value (-inf when k = E) through kplus1 and the k-th through kth.
void select_top_k(const float* sel, int64_t E, int64_t k, int32_t* out, float* kth, float* kplus1);
// Sinkhorn balancing of a micro-batch's router logits [N, E] (this rank's part of it; `sum`
// adds values over the micro-batch's parts, in place): K = exp(logits) is scaled to
// Q = diag(r) K diag(c) with row sums 1 / Nb (Nb the micro-batch's tokens) and column sums
// 1 / E by alternating row and column normalization (Megatron-LM's `sinkhorn`, 1e-8 added to
// each denominator), until no c_e changes by more than kSinkhornTolerance relative or after
// kSinkhornIterations column updates. Returns log c [E]: since r_n > 0, the top-k of Q's row n
// are the top-k of logits[n] + log c (zeros when the micro-batch has no token).
inline constexpr double kSinkhornTolerance = 1e-4;
inline constexpr int kSinkhornIterations = 100;
using SumValues = std::function<void(double* data, size_t n)>;
std::vector<double> sinkhorn_log_scale(const float* logits, int64_t N, int64_t E,
                                       const SumValues& sum);

namespace naive {
// Per-token loops in T, all experts local, no permutation: the twin of MoeLayer's forward
// and of its backward (including the aux, seq_aux, z and LEI gradients; aux_global counts as
// aux; expert_choice's selection by a per-expert scan of the tokens); sequence as
// MoeLayer::forward's.
template <class T>
void moe_forward(T* y, const T* x, int64_t N, const LayerWeightsT<const T>& w, const T* beta,
                 const MoeConfig& config, const LayerShape& shape);
template <class T>
void moe_backward(T* dx, LayerWeightsT<T>& g, const T* dy, const T* x, int64_t N,
                  const LayerWeightsT<const T>& w, const T* beta, T loss_scale,
                  const MoeConfig& config, const LayerShape& shape,
                  std::span<const int32_t> sequence = {});
}  // namespace naive

}  // namespace tessel::moe

#pragma once
// The shape and the balancing method of one mixture-of-experts layer, as data. Field
// names match the config keys `model.moe_<field>`; docs/model.md describes them.
#include <cstdint>
#include <string>

namespace tessel::moe {

enum class ExpertMlp { gelu, swiglu };            // the expert MLPs (= model.mlp)
enum class ScoreFn { softmax, sigmoid };          // router probabilities from the logits
enum class DropPolicy { probability, position };  // which assignments over capacity go
// How the layer keeps the experts' loads even (docs/model.md, "Balancing").
enum class Balance {
  none,
  aux,
  aux_global,
  seq_aux,
  bias,
  qb_avg,
  eqb,
  qb_hist,
  lei,
  eqb_lei,
  sinkhorn,
  expert_choice
};
enum class LeiKernel { rectangle, triangle, tanh, identity };
// Where a token's LEI margin is measured from (docs/model.md, "Balancing"): the midpoint of
// its k-th and (k+1)-th largest selection scores, the k-th, the (k+1)-th, or exact_margin's
// per-expert window of the tokens that balance the expert (MoeLayer, layer.hpp).
enum class LeiMargin { midpoint, topk, topk_plus_one, exact_margin };
// The LEI loss of the load fractions f_e (spec 3.2; docs/model.md).
enum class LeiLoss { centered_fsq, fsq, maxvio, totalvio };

struct MoeConfig {
  int64_t experts = 8;  // E
  int64_t top_k = 2;    // k
  int64_t hidden = 0;   // expert hidden width F; 0 = the dense MLP's
  int64_t shared = 0;   // hidden width of the shared expert; 0 = none
  ScoreFn score = ScoreFn::softmax;
  bool normalize_gates = true;  // gates of a token's k experts sum to 1
  double capacity = 0.0;        // capacity factor cf; 0 = dropless (expert_choice: cf = 1)
  DropPolicy drop = DropPolicy::probability;
  Balance balance = Balance::none;
  double aux_coeff = 1e-2;  // Switch aux loss alpha (aux, aux_global, seq_aux)
  double z_coeff = 0.0;     // router z-loss coefficient (any balance)
  double bias_rate = 1e-3;  // gamma of the sign bias update (bias)
  // eta in (0, 1] of the EQB step beta += eta (quantile - beta) (eqb, eqb_lei, qb_hist); 1 =
  // the spec's rule beta = quantile, < 1 averages the batches' sampling noise out of beta.
  double eqb_step = 1.0;
  int64_t hist_bins = 1000;  // uniform bins B of qb_hist's quantile estimate, in [2, 2^20]
  double lei_coeff = 1e-2;   // LEI loss coefficient (lei, eqb_lei)
  LeiKernel lei_kernel = LeiKernel::rectangle;
  double lei_width = 1.0;  // kernel width w (tanh: 1 / slope)
  LeiMargin lei_margin = LeiMargin::midpoint;
  LeiLoss lei_loss = LeiLoss::centered_fsq;
};

// Throws tessel::InputError naming the first bad model.moe_<field>.
void validate(const MoeConfig& config);

// eqb, eqb_lei, qb_hist: beta steps at the step's end toward a quantile of the global
// batch's margins (exact, or qb_hist's estimate).
bool uses_global_quantile(Balance b);
bool uses_lei(Balance b);  // lei, eqb_lei

// The name config files use: "none", "aux", "aux_global", "seq_aux", "bias", "qb_avg", "eqb",
// "qb_hist", "lei", "eqb_lei", "sinkhorn", "expert_choice".
const char* to_string(Balance v);

}  // namespace tessel::moe

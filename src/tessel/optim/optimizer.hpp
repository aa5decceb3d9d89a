#pragma once
// The optimizer interface the trainer, the checkpoint and the parallel layer see.
//
// An optimizer updates a ParameterList (views into the model's flat value and gradient
// buffers) from its gradients. Its state is a list of named tensors that view the
// optimizer's own buffers: the checkpoint saves them and loads them back in place
// (bitwise), so a resumed run continues exactly. State split over a group (ZeRO-1) is listed
// as each rank's row shards, so saving it never gathers it whole. Several optimizers over disjoint
// tag groups (Muon for hidden matrices, AdamW for the rest: issue #4) keep state names unique by
// prefixing them with their own name ("adamw.m/<param>").
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tessel/comm/communicator.hpp"
#include "tessel/core/parameter.hpp"
#include "tessel/core/tensor.hpp"
#include "tessel/optim/lr_schedule.hpp"

namespace tessel::optim {

// One named state tensor, a view of optimizer-owned memory: writing into `tensor`
// restores that state in place. rows == 0: `tensor` is the whole state tensor, alike on every
// rank of the optimizer's group. rows > 0: a row shard held by this rank (no other rank of
// the group lists these rows): `tensor` holds rows [row0, row0 + tensor.shape()[0]) of the
// state tensor `name`, which has `rows` rows in all; over the group, the shards of a name
// cover its rows once.
struct StateTensor {
  std::string name;
  Tensor tensor;
  int64_t row0 = 0, rows = 0;
  bool is_shard() const { return rows > 0; }
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // Applies one update to every parameter from its gradient. Each optimizer's learning
  // rate is its configured base lr times `lr_scale` (LrSchedule::scale of this step), so
  // optimizers with different base lrs share one schedule.
  virtual void step(double lr_scale) = 0;
  // All state this rank holds, in a fixed order: the step counter first, then per-parameter
  // buffers (whole or this rank's row shards) in parameter order. Not collective.
  virtual std::vector<StateTensor> state() = 0;
  virtual std::string name() const = 0;
  // Updates taken so far (restored with the state).
  virtual int64_t step_count() const = 0;
};

// The `optim` table of the run config. Field names match the config keys; errors name them.
struct OptimizerConfig {
  std::string name = "adamw";  // "adamw", "muon", "dion2", "dion3" (muon.hpp)
  double lr = 3e-3;            // peak learning rate (base lr of AdamW)
  double min_lr = 3e-4;        // learning rate at the end of the decay
  int64_t warmup_steps = 50;
  // The learning rate's shape after the warm-up (lr_schedule.hpp).
  LrScheduleKind schedule = LrScheduleKind::cosine;
  double decay_fraction = 0.2;  // wsd: share of train.steps in the final decay
  LrDecayShape decay_shape = LrDecayShape::linear;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  // Comma-separated parameter tags that get weight decay (core/parameter.hpp names).
  std::string decay_tags = "hidden_matrix,embedding,head";
  // The Muon family (muon, dion2, dion3) for hidden matrices; the other tags use AdamW above.
  double muon_lr = 0.02;              // base lr of the hidden matrices
  double momentum = 0.95;             // muon momentum mu
  std::string momentum_form = "sum";  // sum | lerp
  bool nesterov = false;
  std::string lr_rule = "spectral_norm";   // spectral_norm | rms_norm | keller
  std::string ns_coefficients = "keller";  // keller | polar_express | you
  int64_t ns_steps = 5;
  std::string ns_normalize = "frobenius";  // frobenius | aol (Turbo-Muon; newton_schulz.hpp)
  bool ns_gram = true;                     // Gram Newton-Schulz where it pays (newton_schulz.hpp)
  // Comma-separated 0-based steps before which Gram NS restarts; "auto": before steps 2, 5,
  // 8, ... below ns_steps (the spec's one restart for 5 steps; ns_restart_steps).
  std::string ns_restarts = "auto";
  int64_t ns_gram_min = 64;  // smallest short side that uses Gram NS
  double fraction = 0.25;    // dion2/dion3: fraction of rows orthogonalized per step
  // dion2/dion3: momentum decay of the selected rows. 0.7, not dion2.py's 0.95: a row that keeps
  // 95 % of its momentum tends to be selected again; 0.7 trained better on the demo
  // (docs/benchmarks.md).
  double ef_decay = 0.7;
  std::string selection_scope = "local";  // local | global
  double normuon_beta2 = 0.95;            // dion3
  std::string muon_mode = "sharded";      // sharded | replicated | allgather
  std::string qkv_split = "none";         // none | blocks | heads (fused QKV row blocks)
};

// The names each OptimizerConfig string field takes, in one place: the config's choice keys
// offer them, validate checks a config built in code, make_optimizer maps them by index, so
// each list is in its enum's order (muon.hpp; kOptimizerNames: adamw, then MuonVariant's).
inline const std::vector<std::string> kOptimizerNames = {"adamw", "muon", "dion2", "dion3"};
inline const std::vector<std::string> kMomentumForms = {"sum", "lerp"};
inline const std::vector<std::string> kLrRules = {"spectral_norm", "rms_norm", "keller"};
inline const std::vector<std::string> kNsCoefficientSets = {"keller", "polar_express", "you"};
inline const std::vector<std::string> kNsNormalizations = {"frobenius", "aol"};
inline const std::vector<std::string> kSelectionScopes = {"local", "global"};
inline const std::vector<std::string> kMuonModes = {"sharded", "replicated", "allgather"};
inline const std::vector<std::string> kQkvSplits = {"none", "blocks", "heads"};

// Checks every field's range; throws InputError naming the field (`optim.beta1`, ...).
// The schedule's fields (min_lr, warmup_steps, decay_fraction) are checked with `train.steps`
// by LrSchedule.
void validate(const OptimizerConfig& config);

// The learning-rate schedule of `config` over `total_steps` updates (train.steps).
LrSchedule lr_schedule(const OptimizerConfig& config, int64_t total_steps);

// The 0-based Newton-Schulz steps before which Gram NS restarts: `optim.ns_restarts` parsed, or
// for "auto" steps 2, 5, 8, ... below ns_steps (the spec's one restart before the third of five
// steps, then one every 3; none for 1 or 2 steps).
std::vector<int64_t> ns_restart_steps(const OptimizerConfig& config);

// Parses `optim.decay_tags` ("a,b"; empty = no decay); throws InputError on an unknown tag or
// an empty item.
std::vector<ParamTag> parse_decay_tags(const std::string& text);

// Row blocks of a fused QKV weight for `optim.qkv_split`: none -> {} (one matrix), blocks ->
// {q_rows, kv_rows, kv_rows}, heads -> head_dim rows per head.
std::vector<int64_t> qkv_row_blocks(const std::string& split, int64_t q_rows, int64_t kv_rows,
                                    int64_t head_dim);

// The optimizer named by `config.name` over `params` (validated first); throws InputError
// naming `optim.name` for an unknown name. `group`: the data-parallel group the Muon family
// shards over (nullptr: one process); `row_blocks`: per parameter name, row blocks that the
// Muon family orthogonalizes separately.
std::unique_ptr<Optimizer> make_optimizer(
    const OptimizerConfig& config, ParameterList params, comm::Communicator* group = nullptr,
    const std::map<std::string, std::vector<int64_t>>& row_blocks = {});

}  // namespace tessel::optim

#include "tessel/optim/optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <tuple>

#include "tessel/core/error.hpp"
#include "tessel/core/number_list.hpp"
#include "tessel/optim/adamw.hpp"
#include "tessel/optim/muon.hpp"

namespace tessel::optim {

namespace {
constexpr ParamTag kAllTags[] = {ParamTag::embedding, ParamTag::position_embedding,
                                 ParamTag::head,      ParamTag::hidden_matrix,
                                 ParamTag::norm,      ParamTag::bias};

// An integer key's value is printed as an integer (1000000, not 1e+06).
template <class T>
void check_range(bool ok, const char* field, T value, const char* expected) {
  if (!ok) input_error(field, " = ", value, " is out of range (expected ", expected, ")");
}

// Positive, and a positive finite float: the updates compute in f32, where 1e-50 is 0 (a rate
// that trains nothing, an eps that divides by zero).
void check_positive_float(const char* field, double value) {
  check_range(std::isfinite(value) && value > 0, field, value, "> 0");
  check_positive_float_range(field, value, "the optimizer");
}

// Decoupled weight decay multiplies a decayed weight by 1 - lr * weight_decay each step: at 1
// or more it would vanish or flip sign.
void check_decay_product(const char* lr_field, double lr, double weight_decay) {
  if (!(lr * weight_decay < 1))
    input_error(lr_field, " * optim.weight_decay = ", lr * weight_decay, " must be < 1 (", lr_field,
                " = ", lr, ", optim.weight_decay = ", weight_decay,
                "): each step multiplies a decayed weight by 1 - lr * weight_decay");
}

// The index of `value` in `choices`; InputError naming `field` otherwise (a config read from
// TOML was checked by its choice key; this guards one built in code).
size_t check_choice(const std::string& value, const char* field,
                    const std::vector<std::string>& choices) {
  const auto it = std::find(choices.begin(), choices.end(), value);
  if (it != choices.end()) return size_t(it - choices.begin());
  std::string list;
  for (const auto& c : choices) list += (list.empty() ? "" : ", ") + c;
  input_error(field, " = '", value, "' is not one of ", list);
}

}  // namespace

LrSchedule lr_schedule(const OptimizerConfig& c, int64_t total_steps) {
  return LrSchedule(c.lr, c.min_lr, c.warmup_steps, total_steps,
                    {c.schedule, c.decay_fraction, c.decay_shape});
}

std::vector<int64_t> ns_restart_steps(const OptimizerConfig& c) {
  if (c.ns_restarts == "auto") {
    // The spec's one restart for 5 steps (before step 2), then one every 3 steps, so that no
    // run of f32 Gram steps is longer than the default's last (a single restart drifts to
    // NaN from about 12 steps).
    std::vector<int64_t> steps;
    for (int64_t t = 2; t < c.ns_steps; t += 3) steps.push_back(t);
    return steps;
  }
  return parse_int_list("optim.ns_restarts", c.ns_restarts, 1);
}

void validate(const OptimizerConfig& c) {
  const std::tuple<const std::string&, const char*, const std::vector<std::string>&> names[] = {
      {c.name, "optim.name", kOptimizerNames},
      {c.momentum_form, "optim.momentum_form", kMomentumForms},
      {c.lr_rule, "optim.lr_rule", kLrRules},
      {c.ns_coefficients, "optim.ns_coefficients", kNsCoefficientSets},
      {c.ns_normalize, "optim.ns_normalize", kNsNormalizations},
      {c.selection_scope, "optim.selection_scope", kSelectionScopes},
      {c.muon_mode, "optim.muon_mode", kMuonModes},
      {c.qkv_split, "optim.qkv_split", kQkvSplits}};
  for (const auto& [value, field, choices] : names) check_choice(value, field, choices);
  check_positive_float("optim.lr", c.lr);
  check_range(c.beta1 >= 0 && c.beta1 < 1, "optim.beta1", c.beta1, "0 <= beta1 < 1");
  check_range(c.beta2 >= 0 && c.beta2 < 1, "optim.beta2", c.beta2, "0 <= beta2 < 1");
  check_positive_float("optim.eps", c.eps);
  check_range(std::isfinite(c.weight_decay) && c.weight_decay >= 0, "optim.weight_decay",
              c.weight_decay, ">= 0");
  check_positive_float("optim.muon_lr", c.muon_lr);
  // The Muon family steps hidden matrices with muon_lr, everything else (and AdamW all) with lr:
  // each product is checked where it decays something.
  const std::vector<ParamTag> decayed = parse_decay_tags(c.decay_tags);
  const bool muon_family = c.name != "adamw";
  const auto is_hidden = [](ParamTag t) { return t == ParamTag::hidden_matrix; };
  const bool hidden = std::any_of(decayed.begin(), decayed.end(), is_hidden);
  if (muon_family ? !std::all_of(decayed.begin(), decayed.end(), is_hidden) : !decayed.empty())
    check_decay_product("optim.lr", c.lr, c.weight_decay);
  if (muon_family && hidden) check_decay_product("optim.muon_lr", c.muon_lr, c.weight_decay);
  check_range(c.momentum >= 0 && c.momentum < 1, "optim.momentum", c.momentum, "0 <= momentum < 1");
  check_range(c.ns_steps >= 1 && c.ns_steps <= 100, "optim.ns_steps", c.ns_steps,
              "1 <= ns_steps <= 100");
  if (c.ns_coefficients == "you")
    check_range(c.ns_steps <= 5, "optim.ns_steps", c.ns_steps,
                "<= 5 with optim.ns_coefficients = you (its table has 5 steps)");
  // Polar Express's table is tuned as a whole: its early triples overshoot on purpose (the
  // scalar map reaches 1.97 after 2 steps, 1.58 after 4) and only the later ones bring every
  // singular value back into [0.86, 1.14].
  if (c.ns_coefficients == "polar_express")
    check_range(c.ns_steps >= 5, "optim.ns_steps", c.ns_steps,
                ">= 5 with optim.ns_coefficients = polar_express (its 5-step table is tuned as a "
                "whole: fewer steps leave singular values up to 1.97; use keller or you for fewer "
                "steps)");
  // A restart comes before a step: steps 1 .. ns_steps - 1 can have one, listed in order.
  const std::vector<int64_t> restarts = ns_restart_steps(c);
  for (size_t i = 1; i < restarts.size(); ++i)
    if (restarts[i] <= restarts[i - 1])
      input_error("optim.ns_restarts = \"", c.ns_restarts,
                  "\": steps must be listed once each, in increasing order");
  for (int64_t t : restarts)
    if (t >= c.ns_steps)
      input_error("optim.ns_restarts = \"", c.ns_restarts, "\": ", t,
                  " is no step of optim.ns_steps = ", c.ns_steps,
                  " (a restart precedes a step in [1, ns_steps); \"\" = none)");
  check_range(c.ns_gram_min >= 1, "optim.ns_gram_min", c.ns_gram_min, ">= 1");
  check_range(c.fraction > 0 && c.fraction <= 1, "optim.fraction", c.fraction, "0 < fraction <= 1");
  check_range(c.ef_decay >= 0 && c.ef_decay <= 1, "optim.ef_decay", c.ef_decay,
              "0 <= ef_decay <= 1");
  check_range(c.normuon_beta2 >= 0 && c.normuon_beta2 < 1, "optim.normuon_beta2", c.normuon_beta2,
              "0 <= normuon_beta2 < 1");
}

std::vector<ParamTag> parse_decay_tags(const std::string& text) {
  std::vector<ParamTag> tags;
  for (const std::string& item : split_list("optim.decay_tags", text)) {
    const auto tag = std::find_if(std::begin(kAllTags), std::end(kAllTags),
                                  [&](ParamTag t) { return item == param_tag_name(t); });
    if (tag == std::end(kAllTags))
      input_error("optim.decay_tags: unknown tag '", item,
                  "' (expected a comma-separated list of embedding, position_embedding, head, "
                  "hidden_matrix, norm, bias)");
    tags.push_back(*tag);
  }
  return tags;
}

std::vector<int64_t> qkv_row_blocks(const std::string& split, int64_t q_rows, int64_t kv_rows,
                                    int64_t head_dim) {
  if (split == "blocks") return {q_rows, kv_rows, kv_rows};
  if (split == "heads")
    return std::vector<int64_t>(size_t((q_rows + 2 * kv_rows) / head_dim), head_dim);
  return {};
}

std::unique_ptr<Optimizer> make_optimizer(
    const OptimizerConfig& config, ParameterList params, comm::Communicator* group,
    const std::map<std::string, std::vector<int64_t>>& row_blocks) {
  validate(config);
  AdamWHyper base{config.lr, config.beta1, config.beta2, config.eps, config.weight_decay};
  std::vector<ParamTag> decay = parse_decay_tags(config.decay_tags);
  if (config.name == "adamw") return std::make_unique<AdamW>(std::move(params), base, decay);
  MuonHyper h;
  h.variant = MuonVariant(check_choice(config.name, "optim.name", kOptimizerNames) - 1);  // adamw
  h.lr = config.muon_lr;
  h.momentum = config.momentum;
  h.lerp = config.momentum_form == "lerp";
  h.nesterov = config.nesterov;
  const bool decays = std::find(decay.begin(), decay.end(), ParamTag::hidden_matrix) != decay.end();
  h.weight_decay = decays ? config.weight_decay : 0.0;
  h.lr_rule = LrRule(check_choice(config.lr_rule, "optim.lr_rule", kLrRules));
  h.ns.coefficients = ns_coefficients(config.ns_coefficients, int(config.ns_steps));
  h.ns.gram = config.ns_gram;
  const auto restarts = ns_restart_steps(config);
  h.ns.restarts.assign(restarts.begin(), restarts.end());
  h.ns.gram_min = config.ns_gram_min;
  h.ns.aol = config.ns_normalize == "aol";
  h.fraction = config.fraction;
  h.ef_decay = config.ef_decay;
  h.local_scope = config.selection_scope == "local";
  h.normuon_beta2 = config.normuon_beta2;
  h.mode = MuonMode(check_choice(config.muon_mode, "optim.muon_mode", kMuonModes));
  return std::make_unique<Muon>(std::move(params), h, base, decay, group, row_blocks);
}

}  // namespace tessel::optim

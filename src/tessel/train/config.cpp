#include "tessel/train/config.hpp"

#include <toml++/toml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>

#include "tessel/core/error.hpp"
#include "tessel/core/number_list.hpp"
#include "tessel/core/toml_value.hpp"
#include "tessel/data/corpus.hpp"
#include "tessel/data/mixture.hpp"
#include "tessel/data/prepare.hpp"
#include "tessel/model/generate.hpp"
#include "tessel/optim/lr_schedule.hpp"
#include "tessel/optim/spike_filter.hpp"
#include "tessel/train/pipeline_trainer.hpp"

namespace tessel::train {

namespace {

// A TOML string literal with every character that needs it escaped (toml++ does it). One
// holding a control character (a newline, a tab) is a basic string with escapes: toml++
// would make it a multi-line string, and TOML drops a newline right after the opening
// quotes ("\n" read back as ""). Other strings keep toml++'s form, which checkpoints'
// compatibility records hold as text.
std::string quote(const std::string& s) {
  const bool control = std::any_of(s.begin(), s.end(), [](char ch) {
    return static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f;
  });
  auto flags = toml::toml_formatter::default_flags;
  if (control)
    flags &=
        ~(toml::format_flags::allow_multi_line_strings | toml::format_flags::allow_literal_strings |
          toml::format_flags::allow_real_tabs_in_strings);
  std::ostringstream os;
  os << toml::toml_formatter(toml::value<std::string>(s), flags);
  return os.str();
}

// The shortest text that reads back as v (0.003, not 0.0030000000000000001).
std::string float_text(double v) {
  char buf[32];
  std::string s(buf, std::to_chars(buf, buf + sizeof buf, v).ptr);
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";  // keep TOML float type
  return s;
}

// Builders for schema entries bound to a member of Config. A setter gets a value of its key's
// type (set_value checks it).
template <class Get>
ConfigKey int_key(std::string name, std::string help, Get member) {
  return {name, std::move(help), "int",
          [member](Config& c, const ConfigValue& v) { member(c) = std::get<int64_t>(v); },
          [member](const Config& c) { return std::to_string(member(const_cast<Config&>(c))); }};
}
template <class Get>
ConfigKey float_key(std::string name, std::string help, Get member) {
  return {name, std::move(help), "float",
          [member](Config& c, const ConfigValue& v) { member(c) = std::get<double>(v); },
          [member](const Config& c) { return float_text(member(const_cast<Config&>(c))); }};
}
template <class Get>
ConfigKey bool_key(std::string name, std::string help, Get member) {
  return {name, std::move(help), "bool",
          [member](Config& c, const ConfigValue& v) { member(c) = std::get<bool>(v); },
          [member](const Config& c) { return member(const_cast<Config&>(c)) ? "true" : "false"; }};
}
template <class Get>
ConfigKey string_key(std::string name, std::string help, Get member) {
  return {name, std::move(help), "string",
          [member](Config& c, const ConfigValue& v) { member(c) = std::get<std::string>(v); },
          [member](const Config& c) { return quote(member(const_cast<Config&>(c))); }};
}
// An enum stored as one of a fixed set of names.
template <class E, class Get>
ConfigKey choice_key(std::string name, std::string help,
                     std::vector<std::pair<std::string, E>> choices, Get member) {
  std::string type;
  for (auto& [n, e] : choices) type += (type.empty() ? "" : "|") + n;
  return {name, std::move(help), type,
          [member, name, choices, type](Config& c, const ConfigValue& v) {
            const auto& t = std::get<std::string>(v);
            for (auto& [n, e] : choices)
              if (n == t) {
                member(c) = e;
                return;
              }
            input_error("config key '", name, "': expected one of ", type, ", got '", t, "'");
          },
          [member, choices](const Config& c) {
            for (auto& [n, e] : choices)
              if (member(const_cast<Config&>(c)) == e) return quote(n);
            return std::string("\"?\"");
          }};
}

// A string that names one of `names` (kept as the string).
template <class Get>
ConfigKey name_key(std::string name, std::string help, const std::vector<std::string>& names,
                   Get member) {
  std::vector<std::pair<std::string, std::string>> choices;
  for (const auto& n : names) choices.emplace_back(n, n);
  return choice_key<std::string>(std::move(name), std::move(help), std::move(choices), member);
}

#define FIELD(path)         \
  [](Config & c) -> auto& { \
    return c.path;          \
  }

std::vector<ConfigKey> build_schema() {
  using model::MlpType;
  using model::NormType;
  using model::PositionType;
  using moe::Balance;
  using moe::DropPolicy;
  using moe::LeiKernel;
  using moe::LeiLoss;
  using moe::LeiMargin;
  using moe::ScoreFn;
  return {
      string_key("run.dir", "run directory (config, metrics, checkpoints)", FIELD(run.dir)),
      int_key("run.seed", "seed of initialization and data order", FIELD(run.seed)),
      int_key("run.threads",
              "threads per rank; 0 = OMP_NUM_THREADS where set, else cores / ranks on this node",
              FIELD(run.threads)),
      bool_key("run.quiet", "suppress progress lines", FIELD(run.quiet)),
      string_key("data.path",
                 "directory holding train.tok and val.tok (an SFT data set: with their "
                 "*.loss_mask.tok; docs/sft.md); several, comma-separated, blend them in the "
                 "shares data.weights gives (a mixture; docs/training.md)",
                 FIELD(data.path)),
      string_key("data.weights",
                 "a mixture's shares of the training sequences, comma-separated, one per "
                 "data.path directory (\"3,1\" = 75 % and 25 %); \"\" = one data set",
                 FIELD(data.weights)),
      bool_key("data.shuffle", "shuffle training windows each epoch", FIELD(data.shuffle)),
      choice_key<AttentionMaskKind>(
          "data.attention_mask",
          "attention of packed rows: causal_document = within each document (positions restart "
          "at each document), causal = across the whole row (refused for an SFT data set)",
          {{"causal_document", AttentionMaskKind::causal_document},
           {"causal", AttentionMaskKind::causal}},
          FIELD(data.attention_mask)),
      choice_key<data::Overlong>(
          "data.overlong",
          "SFT samples longer than train.seq_len + 1 tokens (a sample's last token is only a "
          "target): drop = leave them out, cut = train on their first seq_len + 1 (docs/sft.md)",
          {{"drop", data::Overlong::drop}, {"cut", data::Overlong::cut}}, FIELD(data.overlong)),
      int_key("model.vocab", "vocabulary size", FIELD(model.vocab)),
      int_key("model.layers", "transformer blocks", FIELD(model.layers)),
      int_key("model.width", "residual width", FIELD(model.width)),
      int_key("model.heads", "query heads", FIELD(model.heads)),
      int_key("model.kv_heads", "key/value heads (grouped-query attention); 0 = model.heads",
              FIELD(model.kv_heads)),
      choice_key<MlpType>("model.mlp", "MLP type",
                          {{"gelu", MlpType::gelu}, {"swiglu", MlpType::swiglu}}, FIELD(model.mlp)),
      int_key("model.mlp_hidden", "MLP hidden width; 0 = default for the MLP type",
              FIELD(model.mlp_hidden)),
      choice_key<NormType>("model.norm", "norm type",
                           {{"layernorm", NormType::layernorm}, {"rmsnorm", NormType::rmsnorm}},
                           FIELD(model.norm)),
      float_key("model.norm_eps", "norm epsilon", FIELD(model.norm_eps)),
      choice_key<PositionType>(
          "model.positions", "position encoding",
          {{"learned", PositionType::learned}, {"rotary", PositionType::rotary}},
          FIELD(model.positions)),
      float_key("model.rope_theta", "rotary base", FIELD(model.rope_theta)),
      bool_key("model.tied_head", "output head shares the embedding", FIELD(model.tied_head)),
      bool_key("model.bias", "biases in linear layers", FIELD(model.bias)),
      int_key("model.max_seq", "longest sequence the model accepts", FIELD(model.max_seq)),
      int_key("model.attention_window",
              "causal sliding window: a token attends to itself and the W - 1 tokens before it; "
              "0 = none",
              FIELD(model.attention_window)),
      float_key("model.init_std", "standard deviation of initial weights", FIELD(model.init_std)),
      string_key("model.moe_layers",
                 "blocks whose MLP is a mixture of experts: \"\" = none, \"all\", or indices "
                 "\"0,2\"",
                 FIELD(model.moe_layers)),
      int_key("model.moe_experts", "experts per MoE block", FIELD(model.moe.experts)),
      int_key("model.moe_top_k", "experts each token is routed to", FIELD(model.moe.top_k)),
      int_key("model.moe_hidden", "expert hidden width; 0 = the dense MLP's",
              FIELD(model.moe.hidden)),
      int_key("model.moe_shared", "hidden width of the shared expert; 0 = none",
              FIELD(model.moe.shared)),
      choice_key<ScoreFn>("model.moe_score", "router probabilities from the logits",
                          {{"softmax", ScoreFn::softmax}, {"sigmoid", ScoreFn::sigmoid}},
                          FIELD(model.moe.score)),
      bool_key("model.moe_normalize_gates",
               "a token's k gates are divided by their sum (not under expert_choice)",
               FIELD(model.moe.normalize_gates)),
      float_key("model.moe_capacity",
                "capacity factor per expert and micro-batch; 0 = dropless (expert_choice: 1)",
                FIELD(model.moe.capacity)),
      choice_key<DropPolicy>(
          "model.moe_drop", "over capacity, drop the lowest gates or the latest tokens",
          {{"probability", DropPolicy::probability}, {"position", DropPolicy::position}},
          FIELD(model.moe.drop)),
      choice_key<Balance>("model.moe_balance",
                          "load balancing: Switch aux loss per micro-batch, with global-batch "
                          "counts or per sequence (DeepSeek-V3), sign bias update, averaged "
                          "per-micro-batch quantile, exact global quantile (EQB), its "
                          "histogram estimate (B uniform bins, within one bin width), load-error "
                          "injection (LEI), EQB + LEI, Sinkhorn-balanced selection per "
                          "micro-batch, expert choice (each expert takes its top-C tokens of the "
                          "micro-batch, C = ceil(k N cf / E), cf = 1 at capacity 0; not causal: "
                          "generation routes by top-k)",
                          {{"none", Balance::none},
                           {"aux", Balance::aux},
                           {"aux_global", Balance::aux_global},
                           {"seq_aux", Balance::seq_aux},
                           {"bias", Balance::bias},
                           {"qb_avg", Balance::qb_avg},
                           {"eqb", Balance::eqb},
                           {"qb_hist", Balance::qb_hist},
                           {"lei", Balance::lei},
                           {"eqb_lei", Balance::eqb_lei},
                           {"sinkhorn", Balance::sinkhorn},
                           {"expert_choice", Balance::expert_choice}},
                          FIELD(model.moe.balance)),
      float_key("model.moe_aux_coeff", "aux loss coefficient alpha (aux, aux_global, seq_aux)",
                FIELD(model.moe.aux_coeff)),
      float_key("model.moe_z_coeff", "router z-loss coefficient; 0 = off (any balance)",
                FIELD(model.moe.z_coeff)),
      float_key("model.moe_bias_rate", "bias update step gamma (bias)", FIELD(model.moe.bias_rate)),
      float_key("model.moe_eqb_step",
                "EQB step eta in (0, 1]: beta += eta (quantile - beta); 1 = beta = quantile "
                "(eqb, eqb_lei, qb_hist)",
                FIELD(model.moe.eqb_step)),
      int_key("model.moe_hist_bins",
              "uniform bins over each expert's margin range, in [2, 2^20]; the quantile "
              "estimate lies within one bin width above the exact one (qb_hist)",
              FIELD(model.moe.hist_bins)),
      float_key("model.moe_lei_coeff", "LEI loss coefficient (lei, eqb_lei)",
                FIELD(model.moe.lei_coeff)),
      choice_key<LeiKernel>("model.moe_lei_kernel", "LEI surrogate kernel phi'",
                            {{"rectangle", LeiKernel::rectangle},
                             {"triangle", LeiKernel::triangle},
                             {"tanh", LeiKernel::tanh},
                             {"identity", LeiKernel::identity}},
                            FIELD(model.moe.lei_kernel)),
      float_key("model.moe_lei_width", "LEI kernel width w in (0, 1e6] (tanh: 1 / slope)",
                FIELD(model.moe.lei_width)),
      choice_key<LeiMargin>(
          "model.moe_lei_margin",
          "where LEI measures a token's margin from: the midpoint of its k-th and (k+1)-th "
          "largest scores, the k-th, the (k+1)-th, or exact_margin (each expert's window is the "
          "|load - C| tokens closest to flipping it, C = N k / E; needs parallel.cp = 1)",
          {{"midpoint", LeiMargin::midpoint},
           {"topk", LeiMargin::topk},
           {"topk_plus_one", LeiMargin::topk_plus_one},
           {"exact_margin", LeiMargin::exact_margin}},
          FIELD(model.moe.lei_margin)),
      choice_key<LeiLoss>("model.moe_lei_loss",
                          "LEI loss of the load fractions f: 1 + E sum (f_e - 1/E)^2, E sum f_e^2, "
                          "1 + (max f - 1/E) E, 1 + E/2 sum |f_e - 1/E|",
                          {{"centered_fsq", LeiLoss::centered_fsq},
                           {"fsq", LeiLoss::fsq},
                           {"maxvio", LeiLoss::maxvio},
                           {"totalvio", LeiLoss::totalvio}},
                          FIELD(model.moe.lei_loss)),
      int_key("train.steps", "optimizer steps", FIELD(train.steps)),
      int_key("train.seq_len", "tokens per sequence", FIELD(train.seq_len)),
      int_key("train.micro_batch", "sequences per micro-batch per rank", FIELD(train.micro_batch)),
      int_key("train.accum", "micro-batches per step per rank", FIELD(train.accum)),
      float_key("train.grad_clip", "global gradient-norm clip; <= 0 disables",
                FIELD(train.grad_clip)),
      float_key("train.spike_factor",
                "skip the update of a step whose gradient norm exceeds this many times the median "
                "of the last train.spike_window steps' norms; 0 = never",
                FIELD(train.spike_factor)),
      int_key("train.spike_window", "steps whose gradient norms train.spike_factor compares with",
              FIELD(train.spike_window)),
      choice_key<model::Recompute>(
          "train.recompute",
          "activation recomputation: none, or blocks (keep only the residual stream between "
          "blocks and run each block's forward again in backward: far less activation memory "
          "for about a quarter more block compute, MoE blocks rerunning their whole layer; "
          "same results bitwise)",
          {{to_string(model::Recompute::none), model::Recompute::none},
           {to_string(model::Recompute::blocks), model::Recompute::blocks}},
          FIELD(train.recompute)),
      int_key("train.log_every", "steps between progress lines", FIELD(train.log_every)),
      int_key("train.eval_every", "steps between validation; 0 = only at the end",
              FIELD(train.eval_every)),
      int_key("train.eval_sequences",
              "validation sequences: the first windows of val.tok, or packed rows of an SFT data "
              "set (all it holds, when fewer)",
              FIELD(train.eval_sequences)),
      int_key("train.checkpoint_every", "steps between checkpoints; 0 = none but the final one",
              FIELD(train.checkpoint_every)),
      bool_key("train.save_final", "checkpoint after the last step", FIELD(train.save_final)),
      int_key("train.keep_checkpoints", "checkpoints kept (newest first); 0 = keep all",
              FIELD(train.keep_checkpoints)),
      bool_key("train.checkpoint_async",
               "write checkpoints in the background (training waits only for the copy)",
               FIELD(train.checkpoint_async)),
      choice_key<std::string>(
          "train.checkpoint_policy",
          "checkpoint interval: fixed (checkpoint_every), young or daly (from the measured "
          "blocking time and the MTBF; checkpoint_every is the first interval)",
          {{"fixed", "fixed"}, {"young", "young"}, {"daly", "daly"}},
          FIELD(train.checkpoint_policy)),
      float_key("train.mtbf_seconds",
                "mean time between failures for young/daly until the run has seen a failure "
                "(other than a stop signal)",
                FIELD(train.mtbf_seconds)),
      bool_key("train.fast_start",
               "warm up on a synthetic batch while the data loads; reuse the run's GEMM peak",
               FIELD(train.fast_start)),
      bool_key("train.resume", "resume from the run directory's latest checkpoint",
               FIELD(train.resume)),
      string_key("train.init_from",
                 "fine-tuning: a run or checkpoint directory whose model weights start this run "
                 "(fresh optimizer and data order; the model config must match); unused when "
                 "the run resumes from its own checkpoint. Empty = random initialization",
                 FIELD(train.init_from)),
      int_key("train.sample_tokens", "tokens of the final text sample; 0 = none; at most 2^20",
              FIELD(train.sample_tokens)),
      string_key("train.sample_prompt", "prompt of the final text sample",
                 FIELD(train.sample_prompt)),
      string_key("train.sample_stop",
                 "text of one token (a byte with the byte tokenizer) that ends the final sample "
                 "once drawn, e.g. \"\\n\" after a fine-tuned reply; \"\" = none",
                 FIELD(train.sample_stop)),
      float_key("train.sample_temperature", "sampling temperature; 0 = greedy",
                FIELD(train.sample_temperature)),
      int_key("train.sample_top_k", "sample among the k likeliest tokens; 0 = all",
              FIELD(train.sample_top_k)),
      name_key("optim.name",
               "optimizer: adamw, or muon / dion2 / dion3 for hidden matrices (AdamW for the "
               "other parameters)",
               optim::kOptimizerNames, FIELD(optim.name)),
      float_key("optim.lr", "peak learning rate", FIELD(optim.lr)),
      float_key("optim.min_lr", "learning rate at the end of the decay", FIELD(optim.min_lr)),
      int_key("optim.warmup_steps", "linear warm-up steps", FIELD(optim.warmup_steps)),
      choice_key<optim::LrScheduleKind>(
          "optim.schedule",
          "learning rate after the warm-up: cosine decay to optim.min_lr, wsd (stable at optim.lr, "
          "then the last optim.decay_fraction of the steps decay to optim.min_lr) or constant",
          {{"cosine", optim::LrScheduleKind::cosine},
           {"wsd", optim::LrScheduleKind::wsd},
           {"constant", optim::LrScheduleKind::constant}},
          FIELD(optim.schedule)),
      float_key("optim.decay_fraction", "wsd: share of train.steps in the final decay",
                FIELD(optim.decay_fraction)),
      choice_key<optim::LrDecayShape>(
          "optim.decay_shape", "wsd: the decay's shape, linear or sqrt (1 - sqrt of the progress)",
          {{"linear", optim::LrDecayShape::linear}, {"sqrt", optim::LrDecayShape::sqrt}},
          FIELD(optim.decay_shape)),
      float_key("optim.beta1", "AdamW beta1", FIELD(optim.beta1)),
      float_key("optim.beta2", "AdamW beta2", FIELD(optim.beta2)),
      float_key("optim.eps", "AdamW epsilon", FIELD(optim.eps)),
      float_key("optim.weight_decay", "decoupled weight decay", FIELD(optim.weight_decay)),
      string_key("optim.decay_tags", "comma-separated parameter tags that get weight decay",
                 FIELD(optim.decay_tags)),
      float_key("optim.muon_lr", "muon/dion2/dion3: peak learning rate of hidden matrices",
                FIELD(optim.muon_lr)),
      float_key("optim.momentum", "muon: momentum", FIELD(optim.momentum)),
      name_key("optim.momentum_form", "muon: sum (B = mu B + G) or lerp (B = mu B + (1-mu) G)",
               optim::kMomentumForms, FIELD(optim.momentum_form)),
      bool_key("optim.nesterov", "muon: Nesterov momentum", FIELD(optim.nesterov)),
      name_key("optim.lr_rule", "muon family lr shape rule: spectral_norm, rms_norm or keller",
               optim::kLrRules, FIELD(optim.lr_rule)),
      name_key("optim.ns_coefficients",
               "Newton-Schulz coefficients: keller, polar_express (at least 5 steps: its table, "
               "then the limit triple) or you (at most 5 steps; fewer take its last ones)",
               optim::kNsCoefficientSets, FIELD(optim.ns_coefficients)),
      int_key("optim.ns_steps", "Newton-Schulz steps", FIELD(optim.ns_steps)),
      name_key("optim.ns_normalize",
               "scaling before Newton-Schulz: frobenius (divide by the Frobenius norm) or aol "
               "(Turbo-Muon: each row of the short side scaled by its row sum of |X X^T|^-1/2, "
               "so one step fewer gets most of the way)",
               optim::kNsNormalizations, FIELD(optim.ns_normalize)),
      bool_key("optim.ns_gram", "Gram Newton-Schulz for non-square matrices", FIELD(optim.ns_gram)),
      string_key("optim.ns_restarts",
                 "comma-separated 0-based steps before which Gram NS restarts; auto: 2, 5, 8, "
                 "... below ns_steps (one restart for the default 5 steps)",
                 FIELD(optim.ns_restarts)),
      int_key("optim.ns_gram_min", "smallest short side that uses Gram Newton-Schulz",
              FIELD(optim.ns_gram_min)),
      float_key("optim.fraction", "dion2/dion3: fraction of rows orthogonalized per step",
                FIELD(optim.fraction)),
      float_key("optim.ef_decay", "dion2/dion3: error-feedback decay of the selected rows",
                FIELD(optim.ef_decay)),
      name_key("optim.selection_scope",
               "dion2/dion3 row selection: local (per shard; muon_mode = sharded only) or global "
               "(whole matrix)",
               optim::kSelectionScopes, FIELD(optim.selection_scope)),
      float_key("optim.normuon_beta2", "dion3: NorMuon second-moment decay",
                FIELD(optim.normuon_beta2)),
      name_key("optim.muon_mode",
               "muon family over dp: sharded (ZeRO-1 megabatch), replicated or allgather",
               optim::kMuonModes, FIELD(optim.muon_mode)),
      name_key("optim.qkv_split",
               "muon family: orthogonalize fused QKV as one matrix (none), per q/k/v block "
               "(blocks) or per head (heads)",
               optim::kQkvSplits, FIELD(optim.qkv_split)),
      int_key("parallel.dp", "data-parallel degree; 0 = world / (pp * cp)", FIELD(parallel.dp)),
      int_key("parallel.pp", "pipeline stages", FIELD(parallel.pp)),
      int_key("parallel.cp",
              "context-parallel degree: each sequence split over cp ranks (parallel.cp_layout)",
              FIELD(parallel.cp)),
      choice_key<CpLayoutKind>(
          "parallel.cp_layout",
          "chunks of a sequence under cp > 1: zigzag = 2 * cp chunks, rank r holds r and "
          "2 cp - 1 - r (seq_len divisible by 2 * cp); contiguous = cp_chunks consecutive chunks "
          "per rank; balanced = cp_chunks chunks per rank placed by attention work under each "
          "micro-batch's mask (both: seq_len divisible by cp_chunks * cp)",
          {{"zigzag", CpLayoutKind::zigzag},
           {"contiguous", CpLayoutKind::contiguous},
           {"balanced", CpLayoutKind::balanced}},
          FIELD(parallel.cp_layout)),
      int_key("parallel.cp_chunks", "chunks per cp rank of the contiguous and balanced layouts",
              FIELD(parallel.cp_chunks)),
      int_key("parallel.ep", "expert-parallel degree (inside dp)", FIELD(parallel.ep)),
      float_key("parallel.bucket_mb",
                "gradient all-reduce bucket size in MiB (one f32 gradient, 4 bytes, to 1 TiB)",
                FIELD(parallel.bucket_mb)),
      bool_key("parallel.overlap_grad_reduce",
               "start each gradient bucket's data-parallel all-reduce as soon as the step's "
               "last backward has finished it, overlapping the rest of that backward (the "
               "results are bitwise the same either way; ignored with a pipeline)",
               FIELD(parallel.overlap_grad_reduce)),
      string_key("pipeline.schedule",
                 "pipeline schedule: gpipe, 1f1b, interleaved (1f1b over pipeline.chunks "
                 "model chunks per stage, a 1/chunks flush bubble for chunks x the messages), "
                 "zb-h1 (1f1b with each backward's weight gradients run later, filling the "
                 "flush bubble) or paci (no flush: a local step every paci_k backwards); \"\" = "
                 "1f1b when parallel.pp > 1, the plain loop at pp = 1",
                 FIELD(pipeline.schedule)),
      int_key("pipeline.chunks",
              "interleaved: model chunks per stage; stage s holds virtual stages s, s + pp, "
              "s + 2 pp, ...; 0 = 2",
              FIELD(pipeline.chunks)),
      int_key("pipeline.paci_k",
              "paci: micro-batches per local step (and per logged step); 0 = train.accum",
              FIELD(pipeline.paci_k)),
      bool_key("pipeline.paci_stash",
               "paci: keep each stage's previous weights (one extra copy) and run a backward "
               "whose forward saw them against them, as PipeDream-2BW; needs paci_k >= pp - 1",
               FIELD(pipeline.paci_stash)),
      float_key("pipeline.paci_predict",
                "paci: run a forward whose backward will see g newer weight versions on the "
                "weights moved g x this share of the last step further (two extra copies), as "
                "SpecTrain / PipeMare; 0 = off, at most 4; excludes paci_stash",
                FIELD(pipeline.paci_predict)),
      string_key("pipeline.layout",
                 "blocks per stage, comma-separated (\"3,2\"; interleaved: per virtual "
                 "stage, pp x chunks counts in chain order); \"\" = balanced by compute",
                 FIELD(pipeline.layout)),
      float_key("mfu.peak_gflops",
                "per-rank peak GFLOP/s (>= 1e-6); 0 = measure GEMM peak at start",
                FIELD(mfu.peak_gflops)),
      int_key("fault.kill_rank", "rank that the fault injector kills (or hangs)",
              FIELD(fault.kill_rank)),
      string_key("fault.kill_steps",
                 "comma-separated steps, the k-th for attempt k: SIGKILL after that step's "
                 "update (0 or empty = none)",
                 FIELD(fault.kill_steps)),
      string_key("fault.kill_seconds",
                 "comma-separated seconds, the k-th for attempt k: SIGKILL that long after "
                 "the attempt's process started (armed once the trainer is built; 0 = none)",
                 FIELD(fault.kill_seconds)),
      string_key("fault.hang_steps",
                 "comma-separated steps, the k-th for attempt k: fault.kill_rank blocks forever "
                 "after that step's update (0 or empty = none; tessel run --hang-timeout ends it)",
                 FIELD(fault.hang_steps)),
      choice_key<std::string>("fault.kill_in",
                              "where a kill_steps fault strikes: step (after the update) or "
                              "checkpoint_write (that step's checkpoint, before its manifest)",
                              {{"step", "step"}, {"checkpoint_write", "checkpoint_write"}},
                              FIELD(fault.kill_in)),
      int_key("fault.corrupt_step",
              "flip a byte of the committed checkpoint of this step (0 = none)",
              FIELD(fault.corrupt_step)),
      int_key("fault.spike_step",
              "multiply this step's gradients by 1000, a synthetic spike for train.spike_factor "
              "(0 = none; not under PACI)",
              FIELD(fault.spike_step)),
      float_key("fault.init_delay_seconds",
                "synthetic slow start: every attempt sleeps this long while building the "
                "model (tests the ETT ledger's restart cost)",
                FIELD(fault.init_delay_seconds)),
  };
}
#undef FIELD

const ConfigKey* find_key(const std::string& name) {
  for (const auto& k : config_schema())
    if (k.name == name) return &k;
  return nullptr;
}

// An unknown key, or an unknown table (`[trian]`, also without keys).
[[noreturn]] void unknown_key(const std::string& where, const std::string& name,
                              bool table = false) {
  input_error(where, "unknown config ", table ? "table [" : "key '", name, table ? "]" : "'",
              " (see `tessel train --help-config`)");
}

// Whether `name` is a table of the schema ("train", not "train.sub").
bool is_table(const std::string& name) {
  const auto& schema = config_schema();
  return std::any_of(schema.begin(), schema.end(),
                     [&](const ConfigKey& k) { return k.name.rfind(name + ".", 0) == 0; });
}

// Whether the key takes a TOML string (a string or a choice), not a number or bool.
bool takes_string(const ConfigKey& key) {
  return key.type == "string" || key.type.find('|') != std::string::npos;
}

// What a key's value must be, in words.
std::string expected_value(const ConfigKey& key) {
  if (key.type == "int") return "an integer";
  if (key.type == "float") return "a number";
  if (key.type == "bool") return "true or false";
  if (key.type == "string") return "a string";
  std::string names;  // a choice: "a|b" as "a", "b"
  for (size_t at = 0; at <= key.type.size();) {
    const size_t bar = std::min(key.type.find('|', at), key.type.size());
    names += (names.empty() ? "\"" : ", \"") + key.type.substr(at, bar - at) + "\"";
    at = bar + 1;
  }
  return "one of " + names + " (a string)";
}

[[noreturn]] void wrong_type(const std::string& where, const ConfigKey& key,
                             const std::string& given, bool array = false) {
  input_error(
      where, "config key '", key.name, "' expects ", expected_value(key), ", got ", given,
      array && takes_string(key) ? " (a list is one comma-separated string, as \"0,1\")" : "");
}

std::string toml_type_name(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::string:
      return "a string";
    case toml::node_type::integer:
      return "an integer";
    case toml::node_type::floating_point:
      return "a float";
    case toml::node_type::boolean:
      return "a boolean";
    case toml::node_type::array:
      return "an array";
    case toml::node_type::table:
      return "a table";
    default:
      return "a date or time";
  }
}

// The text of a value as it stands in `source`, the TOML text it was parsed from (toml++ keeps
// no literal, and counts columns in code points).
std::string literal(std::string_view source, const toml::source_region& region) {
  if (source.starts_with("\xEF\xBB\xBF")) source.remove_prefix(3);  // no column to toml++
  size_t at = 0;
  for (auto line = region.begin.line; line > 1 && at < source.size(); --line)
    at = source.find('\n', at) + 1;
  // Moves `at` on by `n` code points (a UTF-8 continuation byte is 10xxxxxx); returns where
  // it began.
  auto skip = [&](toml::source_index n) {
    const size_t from = at;
    for (; n > 0 && at < source.size(); --n) {
      ++at;
      while (at < source.size() && (static_cast<unsigned char>(source[at]) & 0xC0) == 0x80) ++at;
    }
    return from;
  };
  skip(region.begin.column - 1);
  const size_t begin = skip(region.end.column - region.begin.column);
  return std::string(source.substr(begin, at - begin));
}

[[noreturn]] void outside_double_range_error(const std::string& where, const ConfigKey& key,
                                             const std::string& text) {
  input_error(where, "config key '", key.name, "' = ", text, " is outside a double's range");
}

// Sets `key` from a TOML value `node` parsed from `source`, with TOML's types checked against
// the key's, in one way for a config file and for --set; errors start with `where`.
void set_value(Config& config, const ConfigKey& key, const toml::node& node,
               std::string_view source, const std::string& where) {
  // An integer is a float key's value too; a float is no integer key's.
  const bool fits = takes_string(key)    ? node.is_string()
                    : key.type == "bool" ? node.is_boolean()
                    : key.type == "int"  ? node.is_integer()
                                         : node.is_number();
  if (!fits) wrong_type(where, key, toml_type_name(node), node.is_array());
  ConfigValue value;
  if (auto s = node.as_string()) value = s->get();
  if (auto b = node.as_boolean()) value = b->get();
  if (auto i = node.as_integer())
    value = key.type == "float" ? ConfigValue(double(i->get())) : ConfigValue(i->get());
  if (auto f = node.as_floating_point()) {
    const std::string text = literal(source, node.source());
    if (outside_double_range(text)) outside_double_range_error(where, key, text);
    if (!std::isfinite(f->get()))
      input_error(where, "config key '", key.name, "': expected a number, got '", text, "'");
    value = f->get();
  }
  try {
    key.set(config, value);
  } catch (const InputError& e) {
    input_error(where, e.what());
  }
}

void apply_table(Config& config, const toml::table& table, const std::string& prefix,
                 const std::string& file, std::string_view source) {
  for (const auto& [k, node] : table) {
    std::string name = prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    const std::string where = file + ":" + std::to_string(node.source().begin.line) + ": ";
    const ConfigKey* key = find_key(name);
    if (!key) {
      // An unknown table with keys names its first key, as written (`trian.steps = 5` or
      // `[trian]` then `steps = 5`); one without keys names itself.
      const toml::table* sub = node.as_table();
      if (!sub || (sub->empty() && !is_table(name))) unknown_key(where, name, sub != nullptr);
      apply_table(config, *sub, name, file, source);
      continue;
    }
    set_value(config, *key, node, source, where);
  }
}

}  // namespace

std::optional<std::string> config_string_value(const std::string& text) {
  const auto table = value_document(text);
  return table ? (*table)["v"].value<std::string>() : std::nullopt;
}

model::GptConfig default_model() {
  model::GptConfig m;
  m.vocab = 256;
  m.layers = 6;
  m.width = 256;
  m.heads = 8;
  m.max_seq = 256;
  m.mlp = model::MlpType::gelu;
  m.norm = model::NormType::layernorm;
  m.positions = model::PositionType::learned;
  return m;
}

const std::vector<ConfigKey>& config_schema() {
  static const std::vector<ConfigKey> schema = build_schema();
  return schema;
}

void apply_override(Config& config, const std::string& assignment) {
  auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0)
    input_error("--set '", assignment, "': expected key=value");
  std::string name = assignment.substr(0, eq);
  const ConfigKey* key = find_key(name);
  if (!key) unknown_key("--set: ", name);
  std::string value = assignment.substr(eq + 1);
  // As in a config file, whose parser refuses such bytes: config.toml must read back the same.
  if (const size_t bad = data::first_invalid_utf8(value); bad != std::string::npos)
    input_error("--set ", name, ": the value is not valid UTF-8 (at byte ", bad, ")");
  const bool quoted = !value.empty() && (value.front() == '"' || value.front() == '\'');
  // A string key's value is taken as written unless it starts with a quote.
  if (takes_string(*key) && !quoted) {
    set_value(config, *key, toml::value<std::string>(value), "", "--set: ");
    return;
  }
  // A string where a number or bool is expected is a type error, as in a file.
  if (quoted && !takes_string(*key)) wrong_type("--set: ", *key, "a quoted string");
  // Any other value is read as TOML, by a file's rules ("..." with escapes such as \n, '...'
  // literally, 1_000, 0x10, 5e-324).
  const auto document = value_document(value);
  if (!document && quoted)
    input_error("--set ", name,
                ": the value starts with a quote but is not one TOML string (\"...\" with escapes "
                "such as \\n, or '...')");
  if (!document && key->type == "float" && outside_double_range(value))
    outside_double_range_error("--set: ", *key, value);
  // TOML's numbers are stricter than C's: no ".95", "1." or "007".
  const char* how = key->type == "float" ? " as TOML writes one (0.95, 1e-3, 1_000.5)"
                    : key->type == "int" ? " as TOML writes one (1000, 1_000, 0x10)"
                                         : "";
  if (!document)
    input_error("--set: config key '", name, "': expected ", expected_value(*key), how, ", got '",
                value, "'");
  set_value(config, *key, *document->get("v"), std::string(kValueDocument) + value, "--set: ");
}

namespace {
Config config_from(const std::string& text, const std::string& source,
                   const std::vector<std::string>& overrides) {
  Config config;
  try {
    apply_table(config, toml::parse(text, source), "", source, text);
  } catch (const toml::parse_error& e) {
    const auto& where = e.source().begin;
    input_error(source, ":", where.line, ":", where.column, ": ", e.description());
  }
  for (const auto& o : overrides) apply_override(config, o);
  return config;
}
}  // namespace

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  if (path.empty()) return parse_config("", "", overrides);
  if (std::filesystem::is_directory(path))
    input_error(path, ": is a directory; --config takes a TOML file");
  if (!std::filesystem::is_regular_file(path)) input_error(path, ": config file not found");
  std::ifstream in(path, std::ios::binary);
  if (!in) input_error(path, ": cannot open the config file");
  const std::string text(std::istreambuf_iterator<char>(in), {});
  return parse_config(text, path, overrides);
}

Config parse_config(const std::string& text, const std::string& source,
                    const std::vector<std::string>& overrides) {
  Config config = config_from(text, source, overrides);
  validate(config);
  return config;
}

Config parse_stored_config(const std::string& text, const std::string& source) {
  Config config = config_from(text, source, {});
  model::validate(config.model);
  return config;
}

void check_run_dir(const std::string& dir) {
  if (dir.empty()) input_error("config key 'run.dir' must not be empty");
  // Found now, not when the run's first save fails after all its steps.
  const std::filesystem::path checkpoints = std::filesystem::path(dir) / "checkpoints";
  std::error_code ignored;
  if (std::filesystem::exists(checkpoints, ignored) &&
      !std::filesystem::is_directory(checkpoints, ignored))
    input_error("config key 'run.dir' = \"", dir, "\": ", checkpoints.string(),
                " exists and is not a directory (the run saves its checkpoints there)");
  for (std::filesystem::path p = dir; !p.empty(); p = p.parent_path()) {
    std::error_code ec;
    const auto status = std::filesystem::status(p, ec);
    if (std::filesystem::exists(status)) {
      if (!std::filesystem::is_directory(status))
        input_error("config key 'run.dir' = \"", dir, "\": ", p.string(),
                    " exists and is not a directory");
      return;
    }
    if (p == p.parent_path()) return;
  }
}

std::vector<std::string> data_paths(const DataConfig& data) {
  auto paths = split_list("data.path", data.path);
  if (paths.empty()) input_error("config key 'data.path' is empty");
  // The same directory twice would only double its share: data.weights says that. An existing
  // one is compared resolved, so that another spelling (absolute, through a link) is caught.
  std::vector<std::filesystem::path> seen;
  for (const auto& p : paths) {
    std::error_code ec;
    auto same = std::filesystem::canonical(p, ec);
    if (ec) same = (std::filesystem::path(p) / "").lexically_normal();
    if (std::find(seen.begin(), seen.end(), same) != seen.end())
      input_error("config key 'data.path' = \"", data.path, "\" lists ", p,
                  " twice; give a data set a larger share in data.weights instead");
    seen.push_back(same);
  }
  return paths;
}

std::vector<double> data_weights(const DataConfig& data) {
  const size_t n = data_paths(data).size();
  // A zero share would leave its data set unread: leaving it out of data.path does that.
  auto weights = parse_real_list("data.weights", data.weights, 0, /*min_excluded=*/true);
  if (n == 1) {
    if (!weights.empty())
      input_error("config key 'data.weights' = \"", data.weights,
                  "\" needs several data sets in data.path (one has all the sequences); "
                  "leave it \"\"");
    return {1.0};
  }
  if (weights.size() != n)
    input_error("config key 'data.weights' = \"", data.weights, "\" gives ", weights.size(),
                " weights for the ", n, " data set", n == 1 ? "" : "s", " of data.path",
                n == 1 ? "" : " (a mixture needs one weight per data set)");
  double sum = 0;
  for (double w : weights) sum += w;
  if (!std::isfinite(sum))
    input_error("config key 'data.weights' = \"", data.weights, "\": the weights' sum overflows");
  const std::vector<double> shares = data::normalized_weights(weights);
  for (size_t d = 0; d < n; ++d)
    if (shares[d] < data::kMinShare)
      input_error("config key 'data.weights' = \"", data.weights, "\": data set ",
                  data_names(data)[d], "'s share is ", shares[d], ", below the smallest, ",
                  data::kMinShare,
                  " (fewer than one sequence in a million, it would all but never "
                  "be read): leave it out of data.path, or give it a larger weight");
  return weights;
}

std::unique_ptr<data::Tokenizer> data_tokenizer(const Config& c) {
  return data::load_tokenizer(data_paths(c.data)[0], c.model.vocab);
}

void check_data_shard(const data::ShardReader& shard, int64_t model_vocab) {
  data::check_described_shard(shard);
  if (shard.vocab_size() > model_vocab)
    input_error(shard.path(), ": token vocabulary ", shard.vocab_size(),
                " exceeds model.vocab = ", model_vocab);
}

std::string run_tokenizer_dir(const std::string& run_dir) {
  return run_dir + "/tokenizer";
}

std::string checkpoint_tokenizer_dir(const std::string& checkpoint_dir) {
  namespace fs = std::filesystem;
  fs::path p = fs::absolute(checkpoint_dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();               // "step-5/"
  if (p.parent_path().filename() != "checkpoints") return "";  // a checkpoint outside a run
  return run_tokenizer_dir(p.parent_path().parent_path().string());
}

std::vector<std::string> data_names(const DataConfig& data) {
  const auto paths = data_paths(data);
  std::vector<std::string> names;
  for (const auto& p : paths) {
    const std::string trimmed = p.substr(0, p.find_last_not_of('/') + 1);
    const std::string last = std::filesystem::path(trimmed).filename().string();
    names.push_back(last.empty() ? p : last);
  }
  std::vector<std::string> unique = names;
  for (size_t i = 0; i < names.size(); ++i)
    if (std::count(names.begin(), names.end(), names[i]) > 1) unique[i] = paths[i];
  return unique;
}

namespace {
// A fault that can never fire would let the run pass as if it had survived it: one at a step
// beyond train.steps, and, under the fixed checkpoint policy (its saves are known), one that
// strikes a checkpoint (fault.kill_in = "checkpoint_write", fault.corrupt_step) at a step
// that saves none.
void check_faults_can_strike(const Config& c) {
  auto beyond = [&](const std::string& key, int64_t step) {
    if (step > c.train.steps)
      input_error("config key '", key, "' names step ", step,
                  ", beyond train.steps = ", c.train.steps, ": the fault would never strike");
  };
  const std::pair<const char*, const std::string*> lists[] = {
      {"fault.kill_steps", &c.fault.kill_steps}, {"fault.hang_steps", &c.fault.hang_steps}};
  for (const auto& [key, text] : lists)
    for (const int64_t step : parse_int_list(key, *text, 0)) beyond(key, step);
  beyond("fault.corrupt_step", c.fault.corrupt_step);
  beyond("fault.spike_step", c.fault.spike_step);
  if (c.train.checkpoint_policy != "fixed") return;
  auto refuse = [&](const std::string& key, int64_t step) {
    input_error("config key '", key, "' names step ", step, ", which saves no checkpoint (train.",
                "checkpoint_every = ", c.train.checkpoint_every, ", train.steps = ", c.train.steps,
                "): the fault would never strike");
  };
  if (c.fault.kill_in == "checkpoint_write")
    for (const int64_t step : parse_int_list("fault.kill_steps", c.fault.kill_steps, 0))
      if (step > 0 && !fixed_policy_saves(c.train, step)) refuse("fault.kill_steps", step);
  if (c.fault.corrupt_step > 0 && !fixed_policy_saves(c.train, c.fault.corrupt_step))
    refuse("fault.corrupt_step", c.fault.corrupt_step);
}
}  // namespace

bool fixed_policy_saves(const TrainLoopConfig& train, int64_t step) {
  if (step < 1 || step > train.steps) return false;
  return (train.checkpoint_every > 0 && step % train.checkpoint_every == 0) ||
         (step == train.steps && train.save_final);
}

void validate(const Config& c) {
  auto positive = [](const char* name, int64_t v) {
    if (v < 1) input_error("config key '", name, "' must be at least 1, got ", v);
  };
  auto non_negative = [](const char* name, auto v) {  // an integer printed as one
    if (v < 0) input_error("config key '", name, "' must not be negative, got ", v);
  };
  model::validate(c.model);
  data_weights(c.data);
  positive("train.steps", c.train.steps);
  if (c.train.steps > kMaxSteps)
    input_error("config key 'train.steps' = ", c.train.steps, " is larger than tessel supports (",
                kMaxSteps, ")");
  positive("train.seq_len", c.train.seq_len);
  positive("train.micro_batch", c.train.micro_batch);
  positive("train.accum", c.train.accum);
  positive("train.log_every", c.train.log_every);
  positive("train.eval_sequences", c.train.eval_sequences);
  // Far beyond a real batch or mesh, and small enough that buffer sizes cannot overflow, that
  // each count fits an int and that a product of two of them fits 64 bits (longer products
  // are bounded where they arise: train.steps below, the tokens of a run in job_mesh).
  for (auto [name, v] :
       {std::pair{"train.micro_batch", c.train.micro_batch},
        std::pair{"train.accum", c.train.accum},
        std::pair{"train.eval_sequences", c.train.eval_sequences},
        std::pair{"pipeline.paci_k", c.pipeline.paci_k},
        std::pair{"pipeline.chunks", c.pipeline.chunks}, std::pair{"parallel.pp", c.parallel.pp},
        std::pair{"parallel.dp", c.parallel.dp}, std::pair{"parallel.cp", c.parallel.cp},
        std::pair{"parallel.cp_chunks", c.parallel.cp_chunks},
        std::pair{"parallel.ep", c.parallel.ep}})
    if (v > (int64_t(1) << 24))
      input_error("config key '", name, "' = ", v, " is larger than tessel supports (",
                  int64_t(1) << 24, ")");
  non_negative("train.eval_every", c.train.eval_every);
  non_negative("train.checkpoint_every", c.train.checkpoint_every);
  non_negative("train.sample_tokens", c.train.sample_tokens);
  if (c.train.sample_tokens > 0 && c.train.sample_prompt.empty())
    input_error("config key 'train.sample_prompt' is empty; the final sample needs a prompt ",
                "(or train.sample_tokens = 0)");
  non_negative("train.sample_top_k", c.train.sample_top_k);
  non_negative("train.sample_temperature", c.train.sample_temperature);
  model::check_temperature_range(c.train.sample_temperature,
                                 "config key 'train.sample_temperature'");
  if (c.train.sample_tokens > model::kMaxGeneratedTokens)
    input_error("config key 'train.sample_tokens' = ", c.train.sample_tokens,
                " is larger than generation supports (", model::kMaxGeneratedTokens, ")");
  if (c.train.keep_checkpoints != 0 && c.train.keep_checkpoints < 2)
    input_error(
        "config key 'train.keep_checkpoints' must be 0 (keep all) or at least 2 (the newest "
        "may be incomplete when a job dies), got ",
        c.train.keep_checkpoints);
  if (c.train.seq_len > c.model.max_seq)
    input_error("config key 'train.seq_len' = ", c.train.seq_len,
                " exceeds model.max_seq = ", c.model.max_seq);
  optim::validate(c.optim);
  optim::lr_schedule(c.optim, c.train.steps);
  optim::SpikeFilter(c.train.spike_factor, c.train.spike_window);
  non_negative("parallel.dp", c.parallel.dp);
  positive("parallel.pp", c.parallel.pp);
  positive("parallel.cp", c.parallel.cp);
  positive("parallel.ep", c.parallel.ep);
  validate_pipeline(c);
  // Each count is at most 2^24 and train.steps 2^40, so their product could wrap int64
  // (validate_pipeline allows pipeline.paci_k > 0 only under PACI, where it is per step).
  if (const int64_t per_step = micro_batches_per_step(c), chunks = pipeline_chunks(c);
      c.train.steps > kMaxMicroBatchOps / per_step / chunks) {
    const std::string times_chunks =
        chunks > 1 ? " times 'pipeline.chunks' = " + std::to_string(chunks) : "";
    input_error("config key 'train.steps' = ", c.train.steps, " times '",
                c.pipeline.paci_k > 0 ? "pipeline.paci_k" : "train.accum", "' = ", per_step,
                times_chunks, " is larger than tessel supports (", kMaxMicroBatchOps,
                " micro-batch ops); lower train.steps");
  }
  const bool paci = pipeline_enabled(c) && pipeline_schedule(c) == pipeline::ScheduleKind::paci;
  if (c.fault.spike_step > 0 && paci)
    input_error(
        "fault.spike_step = ", c.fault.spike_step,
        " scales the gradients of a whole step, which PACI's stages do not share; use it "
        "with a flush schedule (pipeline.schedule = \"gpipe\", \"1f1b\", \"interleaved\" or "
        "\"zb-h1\") or none");
  if (c.train.spike_factor > 0 && paci)
    input_error("train.spike_factor = ", c.train.spike_factor,
                " skips whole updates, which PACI's stages step on their own, each with its own "
                "gradient norm; use it with a flush schedule (pipeline.schedule = \"gpipe\", "
                "\"1f1b\", \"interleaved\" or \"zb-h1\") or none");
  positive("parallel.cp_chunks", c.parallel.cp_chunks);
  // Set beside zigzag it means nothing, an error rather than ignored (as pipeline.chunks is).
  // At cp = 1 the layout keys are ignored: a cp config's one-rank reference is --set
  // parallel.cp=1.
  if (c.parallel.cp_chunks != ParallelConfig{}.cp_chunks && c.parallel.cp > 1 &&
      c.parallel.cp_layout == CpLayoutKind::zigzag)
    input_error("config key 'parallel.cp_chunks' = ", c.parallel.cp_chunks,
                " has no effect with parallel.cp_layout = \"zigzag\" (2 chunks per rank); it "
                "sets the chunks of the contiguous and balanced layouts");
  if (c.parallel.cp > 1 && c.parallel.cp_layout == CpLayoutKind::zigzag &&
      c.train.seq_len % (2 * c.parallel.cp) != 0)
    input_error("config key 'parallel.cp' = ", c.parallel.cp,
                " needs train.seq_len divisible by 2 * cp (zigzag chunks), got seq_len = ",
                c.train.seq_len);
  if (c.parallel.cp > 1 && c.parallel.cp_layout != CpLayoutKind::zigzag &&
      c.train.seq_len % (c.parallel.cp_chunks * c.parallel.cp) != 0)
    input_error(
        "config key 'parallel.cp_chunks' = ", c.parallel.cp_chunks,
        " with parallel.cp = ", c.parallel.cp,
        " needs train.seq_len divisible by cp_chunks * cp, got seq_len = ", c.train.seq_len);
  const std::vector<bool> moe_blocks = c.model.moe_mask();
  const bool moe = std::find(moe_blocks.begin(), moe_blocks.end(), true) != moe_blocks.end();
  // The MoE keys' own ranges, also without MoE blocks (model::validate checks them with),
  // so that config.toml holds no setting that fails as soon as model.moe_layers names one.
  if (!moe) moe::validate(c.model.moe);
  if (moe && c.model.moe.experts % c.parallel.ep != 0)
    input_error("config key 'parallel.ep' = ", c.parallel.ep,
                " must divide model.moe_experts = ", c.model.moe.experts);
  if (moe && c.model.moe.balance == moe::Balance::seq_aux && c.parallel.cp > 1)
    input_error("config key 'parallel.cp' = ", c.parallel.cp,
                " needs a model.moe_balance other than \"seq_aux\" (its per-sequence sums "
                "are local to the rank that holds the whole sequence)");
  if (moe && moe::uses_lei(c.model.moe.balance) &&
      c.model.moe.lei_margin == moe::LeiMargin::exact_margin && c.parallel.cp > 1)
    input_error("config key 'parallel.cp' = ", c.parallel.cp,
                " needs a model.moe_lei_margin other than \"exact_margin\" (its windows rank "
                "the micro-batch's tokens, which context parallelism spreads over ranks)");
  // The identity kernel sends LEI's gradient to the scores, with no margin: a margin set
  // beside it would be silently ignored.
  if (moe && moe::uses_lei(c.model.moe.balance) &&
      c.model.moe.lei_kernel == moe::LeiKernel::identity &&
      c.model.moe.lei_margin != moe::LeiMargin::midpoint)
    input_error(
        "config key 'model.moe_lei_margin' has no effect with model.moe_lei_kernel = "
        "\"identity\" (it uses no margin); leave the margin at its default midpoint");
  // At least one f32 gradient, at most 1 TiB (its byte count must fit 64 bits).
  constexpr double kMiB = ParallelConfig::kBytesPerMiB;
  if (!(c.parallel.bucket_mb * kMiB >= 4 && c.parallel.bucket_mb <= 1048576))
    input_error("config key 'parallel.bucket_mb' = ", c.parallel.bucket_mb,
                " must lie in [4 bytes = ", 4.0 / kMiB, ", 1048576] MiB");
  if (c.train.checkpoint_policy != "fixed" && c.train.checkpoint_every < 1)
    input_error("config key 'train.checkpoint_policy' = ", c.train.checkpoint_policy,
                " needs train.checkpoint_every >= 1 (the first interval, which measures the "
                "blocking time)");
  if (c.train.mtbf_seconds <= 0)
    input_error("config key 'train.mtbf_seconds' must be positive, got ", c.train.mtbf_seconds);
  validate(c.fault);
  check_faults_can_strike(c);
  non_negative("run.threads", c.run.threads);
  if (c.run.threads > kMaxThreads)
    input_error("config key 'run.threads' = ", c.run.threads, " is more than ", kMaxThreads);
  if (!(c.mfu.peak_gflops == 0 || c.mfu.peak_gflops >= kMinPeakGflops))
    input_error("config key 'mfu.peak_gflops' = ", c.mfu.peak_gflops,
                " must be 0 (measure) or >= ", kMinPeakGflops,
                " GFLOP/s per rank (a smaller peak makes the MFU infinite)");
}

bool same_config_text(const std::string& key, const std::string& a, const std::string& b) {
  if (a == b) return true;
  const ConfigKey* k = find_key(key);
  if (k && takes_string(*k)) {  // 'gelu' and "gelu" alike: the writer's quoting may change
    const auto x = config_string_value(a), y = config_string_value(b);
    return x && y && *x == *y;
  }
  if (!k || k->type != "float") return false;
  double x = 0, y = 0;
  const auto [xe, xc] = std::from_chars(a.data(), a.data() + a.size(), x);
  const auto [ye, yc] = std::from_chars(b.data(), b.data() + b.size(), y);
  return xc == std::errc() && yc == std::errc() && xe == a.data() + a.size() &&
         ye == b.data() + b.size() && x == y;
}

std::string to_toml(const Config& config) {
  std::ostringstream os;
  os << "# resolved tessel configuration: every key, with defaults filled in\n";
  std::string table;
  for (const auto& k : config_schema()) {
    std::string t = k.name.substr(0, k.name.find('.'));
    if (t != table) {
      os << (table.empty() ? "" : "\n") << "[" << t << "]\n";
      table = t;
    }
    os << k.name.substr(t.size() + 1) << " = " << k.get(config) << "\n";
  }
  return os.str();
}

}  // namespace tessel::train

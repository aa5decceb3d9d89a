#!/usr/bin/env bash
# MoE load balancing A/B (docs/benchmarks.md, "MoE balancing"): configs/moe.toml trained
# once per balancing method at equal tokens, on 2 ranks x 1 thread, then one table of
# MaxVio global (validation set), MaxVio micro (per micro-batch and ep group), MaxVio of the
# global batch, the fractions capacity factors 1.0 and 1.25 would drop (expert_choice: of the
# tokens, no expert would take), the normalized load entropy of the validation set, the final
# validation loss and the EP step-time skew (max / median over the ep group of the expert MLP
# seconds and of the dispatch bytes received; 1 at ep = 1); then tokens/s with parallel.ep = 2
# against ep = 1 (eqb_lei), with the parameters rank 0 holds (experts sharded) and the skew.
#   [SEEDS="1234 2 3"] [EP=1] bench/moe_balance.sh [STEPS] [THROUGHPUT_STEPS] [METHODS...]
# Defaults: 300 steps (30 or fewer: the warm-up takes all but the last), 60 throughput steps
# (0 = no throughput runs, else at least 6), methods aux bias eqb_lei, seed 1234, the methods run at parallel.ep = EP = 1 (EP=2 splits the experts over
# the two ranks, where the skew columns measure something). A method METHOD:RATE also sets
# model.moe_bias_rate (bias:1e-2);
# METHOD:KEY=VALUE[,KEY=VALUE...] sets model.moe_KEY (eqb_lei:eqb_step=0.2,lei_coeff=0.03).
# Every method runs once per seed in SEEDS (run.seed: initialization and data order). Needs
# `tessel prepare` and jq. Metrics of the last 50 steps are averaged.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
steps=${1:-300}
tsteps=${2:-60}
shift $(($# > 2 ? 2 : $#))
methods=("$@")
((${#methods[@]})) || methods=(aux bias eqb_lei)
if ! [[ $steps =~ ^[1-9][0-9]*$ && $tsteps =~ ^[0-9]+$ ]] || ((tsteps > 0 && tsteps < 6)); then
  echo "usage: bench/moe_balance.sh [STEPS] [THROUGHPUT_STEPS: 0 or >= 6] [METHODS...]" >&2
  exit 2
fi
# moe.toml warms up over 30 steps; shorter runs warm up over all but their last step.
short=()
if ((steps <= 30)); then short=(--set optim.warmup_steps=$((steps - 1))); fi
source "$here/bench/temp_dirs.sh"
temp_dir runs tessel-moe-bench
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
train() {  # run.dir, then --set overrides
  local dir=$1
  shift
  scripts/launch.sh 2 train --config configs/moe.toml --set run.dir="$dir" --set run.quiet=true \
    --set run.threads=1 --set mfu.peak_gflops=1 "$@" >/dev/null
}
# Mean over the MoE blocks of a per-block field, averaged over the last 50 step records.
summary() {
  jq -s -r --argjson last 50 '
    def blockmean(f): (map(f) | add / length);
    (map(select(.moe and .tokens_per_s)) | .[-$last:]) as $s
    | (map(select(.val_loss)) | last) as $v
    | [($v.moe | blockmean(.maxvio_global)),
       ($s | map(.moe | blockmean(.maxvio_micro)) | add / length),
       ($s | map(.moe | blockmean(.maxvio_batch)) | add / length),
       ($s | map(.moe | blockmean(.dropped_cf1)) | add / length),
       ($s | map(.moe | blockmean(.dropped_cf1_25)) | add / length),
       ($v.moe | blockmean(.entropy_global)),
       $v.val_loss,
       ($s | map(.ep_skew.expert_time | select(. != null)) | add / length),
       ($s | map(.ep_skew.recv_bytes | select(. != null)) | add / length)]
    | map(. * 10000 | round / 10000) | @tsv' "$1/metrics.jsonl"
}
read -r -a seeds <<<"${SEEDS:-1234}"
printf "method\tseed\tmaxvio_global\tmaxvio_micro\tmaxvio_batch\tdropped_cf1\tdropped_cf1_25\tentropy_global\tval_loss\tskew_time\tskew_bytes\n"
for m in "${methods[@]}"; do
  method=${m%%:*}
  sets=()
  if [[ $m == *:*=* ]]; then
    IFS=, read -r -a pairs <<<"${m#*:}"
    for p in "${pairs[@]}"; do sets+=(--set "model.moe_$p"); done
  elif [[ $m == *:* ]]; then
    sets=(--set model.moe_bias_rate="${m#*:}")
  fi
  for seed in "${seeds[@]}"; do
    dir="$runs/${m//[:=,]/_}-$seed"
    train "$dir" --set model.moe_balance="$method" "${sets[@]}" --set run.seed="$seed" \
      --set train.steps="$steps" "${short[@]}" --set parallel.ep="${EP:-1}"
    printf "%s\t%s\t%s\n" "$m" "$seed" "$(summary "$dir")"
  done
done
# Throughput: median tokens/s over steps 6 onwards, no validation or checkpoint in between.
if ((tsteps > 0)); then
  for ep in 1 2; do
    train "$runs/ep$ep" --set parallel.ep="$ep" --set train.steps="$tsteps" \
      --set train.eval_every=0 --set train.save_final=false --set optim.warmup_steps=5
    jq -s -r --arg ep "$ep" '
      (map(select(.event == "start")) | first | .rank_parameters) as $p
      | map(select(.tokens_per_s and .step > 5)) | (map(.tokens_per_s) | sort | .[length / 2 | floor])
        as $t | (map(.all_to_all_bytes) | add / length) as $b
      | (map(.ep_skew.expert_time) | add / length * 1000 | round / 1000) as $st
      | (map(.ep_skew.recv_bytes) | add / length * 1000 | round / 1000) as $sb
      | "ep=\($ep)\tmedian tokens/s \($t | round)\tall-to-all bytes/step \($b | round)\tparameters on rank 0 \($p)\tskew time \($st) bytes \($sb)"' \
      "$runs/ep$ep/metrics.jsonl"
  done
fi

#!/usr/bin/env bash
# Training quality of optimizers on the README demo (configs/default.toml, 2 ranks x 1 thread):
# the validation loss at equal steps for each setting given.
#   bench/optim_quality.sh STEPS LABEL='--set k=v ...' [LABEL='...' ...]
# e.g. bench/optim_quality.sh 150 adamw='--set optim.name=adamw --set optim.lr=3e-3' \
#        muon='--set optim.name=muon --set optim.muon_lr=0.06'   (the config's optimizer is Muon)
# Needs `tessel prepare --corpus bible --out data/bible`. Prints one line per setting:
# label, validation loss after STEPS (nats/byte), wall seconds. The schedule's total is STEPS;
# its warmup is the config's 30 steps, or STEPS - 1 for runs of 30 steps or fewer (a label's
# own --set optim.warmup_steps=N wins). A setting that fails is reported, the others still
# run, and the script then exits 1.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"  # the config's data.path is relative to the repository root
if [ $# -lt 2 ] || ! [[ $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: bench/optim_quality.sh STEPS LABEL='--set k=v ...' [LABEL='...' ...]" >&2
  exit 2
fi
source "$here/bench/temp_dirs.sh"
steps=$1
shift
short=()
if [ "$steps" -le 30 ]; then short=(--set optim.warmup_steps=$((steps - 1))); fi
failed=0
for item in "$@"; do
  label=${item%%=*}
  sets=${item#*=}
  temp_dir run tessel-optim-quality
  start=$(date +%s)
  # shellcheck disable=SC2086  # $sets is a list of --set arguments
  if ! OMP_NUM_THREADS=1 "$here/scripts/launch.sh" 2 train --config configs/default.toml \
    --set run.dir="$run" --set run.quiet=true --set train.steps="$steps" "${short[@]}" \
    --set train.eval_every=0 --set train.sample_tokens=0 --set train.save_final=false $sets; then
    echo "$label steps=$steps failed (its error is above)"
    failed=1
    rm -rf "$run"
    continue
  fi
  val=$( (grep '"val_loss"' "$run/metrics.jsonl" || echo '"val_loss":missing') | tail -1 |
    sed 's/.*"val_loss":\([0-9a-z.e+-]*\).*/\1/')
  echo "$label steps=$steps val_loss=$val wall_s=$(( $(date +%s) - start ))"
  rm -rf "$run"
done
exit "$failed"

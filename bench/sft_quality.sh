#!/usr/bin/env bash
# Fine-tuning quality of configs/sft.toml (2 ranks x 1 thread): the validation loss on the
# replies of data/bible-quotes for the base model before fine-tuning, after fine-tuning from it
# (train.init_from = runs/default), and after the same steps from random weights.
#   bench/sft_quality.sh [--set k=v ...]      (the --sets apply to all three runs)
# Needs `tessel prepare --corpus bible-quotes --out data/bible-quotes` and the README demo's run
# in runs/default. Prints one line per run: label, validation losses by step (nats/byte), the
# training seconds (sum of step_seconds) and the final sample of the two fine-tuning runs.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"  # the config's paths are relative to the repository root
source "$here/bench/temp_dirs.sh"
run_sft() {  # LABEL EXTRA_SETS...
  local label=$1
  shift
  local run
  temp_dir run tessel-sft-quality
  OMP_NUM_THREADS=1 "$here/scripts/launch.sh" 2 train --config configs/sft.toml \
    --set run.dir="$run" --set train.save_final=false "$@" > "$run/out.txt"
  local vals secs
  vals=$(grep '"val_loss"' "$run/metrics.jsonl" |
    sed 's/.*"step":\([0-9]*\).*"val_loss":\([0-9.e+-]*\).*/\1:\2/' | tr '\n' ' ')
  secs=$(grep -o '"step_seconds":[0-9.e+-]*' "$run/metrics.jsonl" | cut -d: -f2 | awk '{s += $1} END {print s}')
  echo "$label val_loss(step:loss)= $vals train_s=$secs"
  sed -n '/^sample:/,/^done/p' "$run/out.txt" | sed '1d;$d' | sed "s/^/  $label sample: /"
  rm -rf "$run"
}
# The base model: one update at learning rate 0 (the schedule's end, min_lr 0), then the
# validation; its settings come after the caller's, so they win.
run_sft base "$@" --set train.steps=1 --set optim.warmup_steps=0 --set optim.lr=1e-9 \
  --set optim.muon_lr=1e-9 --set optim.min_lr=0 --set train.sample_tokens=0
run_sft fine_tuned "$@"
run_sft from_scratch --set train.init_from= "$@"

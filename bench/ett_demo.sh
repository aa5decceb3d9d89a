#!/usr/bin/env bash
# ETT% of the README demo job (configs/default.toml, 2 ranks) with two injected failures,
# before and after the fast-start and asynchronous-checkpoint work:
#   before  train.fast_start=false train.checkpoint_async=false
#   after   the defaults (fast start, asynchronous checkpoints)
# Both runs: `tessel run --np 2`, rank 1 killed with SIGKILL after steps KILL1 and KILL2,
# checkpoints every CKPT steps, STEPS steps. Prints each run's ETT summary; the reports
# (ett.json, ett.html, ett_trace.json) stay in OUT/before and OUT/after.
#   bench/ett_demo.sh [OUT] [STEPS] [CKPT] [KILL1] [KILL2]   (needs `tessel prepare`)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"  # configs/default.toml reads data/bible
bin=${TESSEL_BIN:-$here/build/release/tessel}
out=${1:-$(mktemp -d)}
steps=${2:-200}
ckpt=${3:-50}
kill1=${4:-80}
kill2=${5:-160}
# configs/default.toml warms up for 30 steps, which must stay below train.steps.
warmup=$(( steps > 30 ? 30 : steps - 1 ))
for variant in before after; do
  extra=()
  [ "$variant" = before ] && extra=(--set train.fast_start=false --set train.checkpoint_async=false)
  rm -rf "$out/$variant"
  "$bin" run --np 2 --threads 1 --max-restarts 3 --config "$here/configs/default.toml" \
    --set run.dir="$out/$variant" --set run.quiet=true --set train.steps="$steps" \
    --set train.checkpoint_every="$ckpt" --set train.eval_every=100 --set train.sample_tokens=0 \
    --set optim.warmup_steps="$warmup" \
    --set fault.kill_rank=1 --set fault.kill_steps="$kill1,$kill2" "${extra[@]}" 2>/dev/null |
    head -1 | sed "s/^/$variant: /"
done

#!/bin/bash
# AdamW sharded (ZeRO-1) against replicated on dp = 2 ranks x 1 thread: the largest rank's peak
# resident memory while training (VmHWM, read every 0.1 s until step 7 is logged, so before
# the final checkpoint), peak resident memory over the whole run (final checkpoint included),
# and the
# median step time of steps 3-8. Interleaved repetitions. Usage: bench/adamw_zero1.sh [REPS]
# (from the repository root, after a release build and `tessel prepare`).
set -euo pipefail
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
reps=${1:-2}
for rep in $(seq "$reps"); do
  for mode in replicated sharded; do
    dir=$(mktemp -d)
    mpirun --oversubscribe --bind-to none -np 2 -x OMP_NUM_THREADS=1 build/release/tessel train \
      --config configs/default.toml --set run.dir="$dir" --set optim.name=adamw \
      --set optim.adamw_mode=$mode --set model.width=768 --set model.heads=12 \
      --set model.layers=8 --set train.steps=8 --set train.micro_batch=2 --set train.log_every=1 \
      --set train.eval_sequences=4 --set train.sample_tokens=0 --set optim.warmup_steps=1 \
      --set mfu.peak_gflops=1 >"$dir/log.txt" 2>&1 &
    launcher=$!
    max_kib=0
    while kill -0 $launcher 2>/dev/null; do
      # Until step 7 is logged: the steps, not the final checkpoint's gather.
      if [ -f "$dir/metrics.jsonl" ] && grep -q '"step":7,' "$dir/metrics.jsonl"; then break; fi
      for pid in $(pgrep -f "tessel train --config configs/default.toml --set run.dir=$dir" || true); do
        kib=$(awk '/VmHWM/ {print $2}' /proc/"$pid"/status 2>/dev/null || echo 0)
        [ "${kib:-0}" -gt "$max_kib" ] && max_kib=$kib
      done
      sleep 0.1
    done
    wait $launcher
    median=$(python3 -c "
import json, statistics
r = [json.loads(l) for l in open('$dir/metrics.jsonl')]
print('%.3f' % statistics.median([x['step_seconds'] for x in r if 'step_seconds' in x][2:]))")
    peak=$(grep -o 'peak resident memory [0-9]* MiB' "$dir/log.txt" | grep -o '[0-9]*')
    echo "rep $rep $mode: training peak $((max_kib / 1024)) MiB/rank, run peak $peak MiB," \
      "median step $median s"
    rm -rf "$dir"
  done
done

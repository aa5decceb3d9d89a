#!/usr/bin/env bash
# The Muon family's ZeRO-1 momentum (optim.muon_mode = sharded) against replicated momentum on
# dp = 2 ranks x 1 thread, with a checkpoint every 2 of 8 steps, then a resume from the step-8
# checkpoint for 2 more steps: each rank's peak resident memory (VmHWM, read every 0.1 s)
# before the first checkpoint (until step 2 is logged), over the whole run (4 checkpoints) and
# over the resumed run (its checkpoint load included). `configs/default.toml` at width 768,
# 12 heads, 8 layers (56.6 M matmul parameters), micro-batch 2 x 128.
#   [TESSEL_BIN=...] [MODES="replicated sharded"] bench/zero1_checkpoint_memory.sh [REPS]
# from the repository root, after a release build and `tessel prepare`; TESSEL_BIN picks the
# binary (default build/release/tessel), e.g. one built from an older commit.
set -euo pipefail
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
bin=${TESSEL_BIN:-build/release/tessel}
reps=${1:-1}
source "$(dirname "$0")/temp_dirs.sh"

# Trains in run directory $1 until train.steps = $2 (muon_mode $mode), polling each rank's
# VmHWM in MiB into whole[rank], and into before[rank] until step 2 is logged.
watch_run() {
  local dir=$1 steps=$2
  mpirun --oversubscribe --bind-to none -np 2 -x OMP_NUM_THREADS=1 "$bin" train \
    --config configs/default.toml --set run.dir="$dir" --set optim.muon_mode="$mode" \
    --set model.width=768 --set model.heads=12 --set model.layers=8 --set train.steps="$steps" \
    --set train.micro_batch=2 --set train.log_every=1 --set train.checkpoint_every=2 \
    --set train.eval_every=8 --set train.eval_sequences=4 --set train.sample_tokens=0 \
    --set optim.warmup_steps=1 --set mfu.peak_gflops=1 >>"$dir/log.txt" 2>&1 &
  local launcher=$! first_saved pid rank kib
  unset before whole
  declare -gA before=() whole=()
  while kill -0 $launcher 2>/dev/null; do
    first_saved=$(grep -c '"step":2,' "$dir/metrics.jsonl" 2>/dev/null || true)
    for pid in $(pgrep -f -- "--set run.dir=$dir " || true); do
      # mpirun matches too; only the ranks have a rank in their environment.
      rank=$({ tr '\0' '\n' <"/proc/$pid/environ"; } 2>/dev/null |
        sed -n 's/^OMPI_COMM_WORLD_RANK=//p' || true)
      kib=$({ awk '/VmHWM/ {print $2}' "/proc/$pid/status"; } 2>/dev/null || true)
      [ -n "$rank" ] && [ -n "$kib" ] || continue
      whole[$rank]=$((kib / 1024))
      [ "${first_saved:-0}" -gt 0 ] || before[$rank]=$((kib / 1024))
    done
    sleep 0.1
  done
  wait $launcher
}

for rep in $(seq "$reps"); do
  for mode in ${MODES:-replicated sharded}; do
    temp_dir dir tessel-zero1
    watch_run "$dir" 8
    line="rep $rep $mode (MiB, rank 0 / 1): before the first checkpoint ${before[0]} / ${before[1]}"
    line+=", whole run ${whole[0]} / ${whole[1]}"
    watch_run "$dir" 10
    echo "$line, resumed run ${whole[0]} / ${whole[1]}"
    rm -rf "$dir"
  done
done

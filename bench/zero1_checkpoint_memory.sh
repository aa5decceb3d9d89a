#!/usr/bin/env bash
# The Muon family's ZeRO-1 momentum (optim.muon_mode = sharded) against replicated momentum on
# dp = 2 ranks x 1 thread, with a checkpoint every 2 of 8 steps: each rank's peak resident
# memory (VmHWM, read every 0.1 s) before the first checkpoint (until step 2 is logged) and
# over the whole run (4 checkpoints), and the trainer's own peak line (the larger rank's).
# `configs/default.toml` at width 768, 12 heads, 8 layers (56.6 M matmul parameters),
# micro-batch 2 x 128. Modes interleaved per repetition.
#   bench/zero1_checkpoint_memory.sh [REPS]
# from the repository root, after a release build and `tessel prepare`; TESSEL_BIN picks the
# binary (default build/release/tessel), e.g. one built from an older commit.
set -euo pipefail
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
bin=${TESSEL_BIN:-build/release/tessel}
reps=${1:-1}
for rep in $(seq "$reps"); do
  for mode in replicated sharded; do
    dir=$(mktemp -d /tmp/tessel-zero1-XXXXXX)
    mpirun --oversubscribe --bind-to none -np 2 -x OMP_NUM_THREADS=1 "$bin" train \
      --config configs/default.toml --set run.dir="$dir" --set optim.muon_mode=$mode \
      --set model.width=768 --set model.heads=12 --set model.layers=8 --set train.steps=8 \
      --set train.micro_batch=2 --set train.log_every=1 --set train.checkpoint_every=2 \
      --set train.eval_every=8 --set train.eval_sequences=4 --set train.sample_tokens=0 \
      --set optim.warmup_steps=1 --set mfu.peak_gflops=1 >"$dir/log.txt" 2>&1 &
    launcher=$!
    unset before whole
    declare -A before=() whole=()
    while kill -0 $launcher 2>/dev/null; do
      first_saved=$(grep -c '"step":2,' "$dir/metrics.jsonl" 2>/dev/null || true)
      for pid in $(pgrep -f -- "--set run.dir=$dir " || true); do
        # mpirun matches too; only the ranks have a rank in their environment.
        rank=$({ tr '\0' '\n' <"/proc/$pid/environ"; } 2>/dev/null |
          sed -n 's/^OMPI_COMM_WORLD_RANK=//p' || true)
        kib=$(awk '/VmHWM/ {print $2}' "/proc/$pid/status" 2>/dev/null || true)
        [ -n "$rank" ] && [ -n "$kib" ] || continue
        whole[$rank]=$kib
        [ "${first_saved:-0}" -gt 0 ] || before[$rank]=$kib
      done
      sleep 0.1
    done
    wait $launcher
    peak=$(grep -o 'peak resident memory [0-9]* MiB' "$dir/log.txt" | grep -o '[0-9]*')
    echo "rep $rep $mode: before the first checkpoint $((before[0] / 1024)) / " \
      "$((before[1] / 1024)) MiB (rank 0 / 1), whole run $((whole[0] / 1024)) / " \
      "$((whole[1] / 1024)) MiB, trainer's peak $peak MiB"
    rm -rf "$dir"
  done
done

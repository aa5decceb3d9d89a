#!/usr/bin/env bash
# Activation recomputation (train.recompute = blocks) against keeping every block's cache:
# activation bytes per micro-batch, peak resident memory and step time, alternating runs of
# one config on 2 ranks x 1 thread.
#   bench/recompute.sh CONFIG [REPEATS] [--set k=v ...]
# e.g. bench/recompute.sh configs/default.toml 2 --set model.layers=8 --set model.max_seq=512 \
#        --set train.seq_len=512 --set train.micro_batch=8
# Needs `tessel prepare`. Each run trains 16 steps; prints, per run, the activation MiB of the
# start line, the peak resident MiB of the done line (the largest rank's), the mean
# step_seconds of steps 5-16 and the final validation loss (equal for both), then the ratios.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"  # the config's data.path is relative to the repository root
config=$1
shift
repeats=2
if [[ ${1:-} =~ ^[1-9][0-9]*$ ]]; then
  repeats=$1
  shift
fi
declare -A step_total=([none]=0 [blocks]=0) memory_total=([none]=0 [blocks]=0)
for ((r = 0; r < repeats; ++r)); do
  for mode in none blocks; do
    run=$(mktemp -d /tmp/tessel-recompute-XXXXXX)
    log=$("$here/scripts/launch.sh" 2 train --config "$config" --set run.dir="$run" \
      --set run.threads=1 --set train.steps=16 --set optim.warmup_steps=2 \
      --set train.eval_every=16 --set train.log_every=1 --set train.eval_sequences=8 \
      --set train.sample_tokens=0 --set train.save_final=false "$@" \
      --set train.recompute=$mode)
    activations=$(sed -n 's/.*activations \([0-9.]*\) MiB per micro-batch.*/\1/p' <<<"$log")
    memory=$(sed -n 's/.*peak resident memory \([0-9]*\) MiB.*/\1/p' <<<"$log")
    read -r step val < <(python3 - "$run/metrics.jsonl" <<'PY'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1])]
steps = [r["step_seconds"] for r in records if "step_seconds" in r and r["step"] > 4]
print(sum(steps) / len(steps), [r["val_loss"] for r in records if "val_loss" in r][-1])
PY
)
    echo "repeat $r $mode activations_mib=$activations peak_resident_mib=$memory step_s=$step val_loss=$val"
    step_total[$mode]=$(python3 -c "print(${step_total[$mode]} + $step)")
    memory_total[$mode]=$(python3 -c "print(${memory_total[$mode]} + $memory)")
    rm -rf "$run"
  done
done
python3 -c "print('blocks / none step time: %.3f, peak resident memory: %.3f' % \
  (${step_total[blocks]} / ${step_total[none]}, ${memory_total[blocks]} / ${memory_total[none]}))"

#!/usr/bin/env bash
# One config key at two values: activation bytes per micro-batch, peak resident memory, step
# time and the final validation loss, alternating runs of one config on 2 ranks x 1 thread.
#   bench/train_ab.sh KEY A B CONFIG [REPEATS] [--set k=v ...]
# e.g. bench/train_ab.sh model.attention_window 0 256 configs/default.toml 2 \
#        --set model.max_seq=2048 --set train.seq_len=2048 --set train.micro_batch=2
# Needs `tessel prepare`. Each run trains 16 steps; prints, per run, the activation MiB of the
# start line (empty for pipeline runs, whose start line has none), the peak resident MiB of the
# done line (the largest rank's), the mean step_seconds of steps 5-16 and the final validation
# loss (and with several dp ranks and no pipeline the means of grad_wait_seconds and
# grad_start_seconds over steps 5-16: the gradient all-reduce after and during the last
# backward), then the B / A ratios.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"  # the config's data.path is relative to the repository root
if [ $# -lt 4 ]; then
  echo "usage: bench/train_ab.sh KEY A B CONFIG [REPEATS] [--set k=v ...]" >&2
  exit 2
fi
source "$here/bench/temp_dirs.sh"
key=$1 a=$2 b=$3 config=$4
shift 4
repeats=2
if [[ ${1:-} =~ ^[1-9][0-9]*$ ]]; then
  repeats=$1
  shift
fi
declare -A step_total=([$a]=0 [$b]=0) memory_total=([$a]=0 [$b]=0)
for ((r = 0; r < repeats; ++r)); do
  for value in "$a" "$b"; do
    temp_dir run tessel-train-ab
    log=$("$here/scripts/launch.sh" 2 train --config "$config" --set run.dir="$run" \
      --set run.threads=1 --set train.steps=16 --set optim.warmup_steps=2 \
      --set train.eval_every=16 --set train.log_every=1 --set train.eval_sequences=8 \
      --set train.sample_tokens=0 --set train.save_final=false "$@" \
      --set "$key=$value")
    activations=$(sed -n 's/.*activations \([0-9.]*\) MiB per micro-batch.*/\1/p' <<<"$log")
    memory=$(sed -n 's/.*peak resident memory \([0-9]*\) MiB.*/\1/p' <<<"$log")
    read -r step val wait start < <(python3 - "$run/metrics.jsonl" <<'PY'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1])]
timed = [r for r in records if "step_seconds" in r and r["step"] > 4]
def mean(key):
    values = [r[key] for r in timed if key in r]
    return sum(values) / len(values) if values else "n/a"
print(mean("step_seconds"), [r["val_loss"] for r in records if "val_loss" in r][-1],
      mean("grad_wait_seconds"), mean("grad_start_seconds"))
PY
)
    echo "repeat $r $key=$value activations_mib=$activations peak_resident_mib=$memory step_s=$step val_loss=$val grad_wait_s=$wait grad_start_s=$start"
    step_total[$value]=$(python3 -c "print(${step_total[$value]} + $step)")
    memory_total[$value]=$(python3 -c "print(${memory_total[$value]} + $memory)")
    rm -rf "$run"
  done
done
python3 -c "print('$key $b / $a step time: %.3f, peak resident memory: %.3f' % \
  (${step_total[$b]} / ${step_total[$a]}, ${memory_total[$b]} / ${memory_total[$a]}))"

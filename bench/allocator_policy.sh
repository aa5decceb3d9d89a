#!/usr/bin/env bash
# Training step time with tessel's allocator policy (core/memory.hpp) against glibc's
# defaults (TESSEL_RETAIN_FREED_MEMORY=0), alternating runs of one config on 2 ranks x 1 thread.
#   bench/allocator_policy.sh CONFIG [REPEATS] [--set k=v ...]
# e.g. bench/allocator_policy.sh configs/default.toml 2
# Needs `tessel prepare`. Each run trains 60 steps; prints the mean step_seconds of steps
# 11-60 and the final validation loss of each run (equal for both policies), then the ratio.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"  # the config's data.path is relative to the repository root
if [ $# -lt 1 ]; then
  echo "usage: bench/allocator_policy.sh CONFIG [REPEATS] [--set k=v ...]" >&2
  exit 2
fi
source "$here/bench/temp_dirs.sh"
config=$1
shift
repeats=2
if [[ ${1:-} =~ ^[1-9][0-9]*$ ]]; then
  repeats=$1
  shift
fi
declare -A total=([glibc]=0 [retain]=0)
for ((r = 0; r < repeats; ++r)); do
  for policy in glibc retain; do
    temp_dir run tessel-allocator
    TESSEL_RETAIN_FREED_MEMORY=$([ $policy = glibc ] && echo 0 || echo 1) \
      "$here/scripts/launch.sh" 2 train --config "$config" --set run.dir="$run" \
      --set run.quiet=true --set run.threads=1 --set train.steps=60 --set train.eval_every=60 \
      --set train.log_every=1 --set train.eval_sequences=16 --set train.sample_tokens=0 \
      --set train.save_final=false "$@"
    read -r step val < <(python3 - "$run/metrics.jsonl" <<'PY'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1])]
steps = [r["step_seconds"] for r in records if "step_seconds" in r and r["step"] > 10]
if not steps:
    sys.exit("allocator_policy.sh: no step after step 10 to time (keep train.steps > 10)")
print(sum(steps) / len(steps), [r["val_loss"] for r in records if "val_loss" in r][-1])
PY
)
    echo "repeat $r $policy step_s=$step val_loss=$val"
    total[$policy]=$(python3 -c "print(${total[$policy]} + $step)")
    rm -rf "$run"
  done
done
python3 -c "print('glibc / retain step time: %.3f' % (${total[glibc]} / ${total[retain]}))"

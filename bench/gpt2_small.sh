#!/usr/bin/env bash
# End-to-end training throughput on the GPT-2-small shape (configs/gpt2_small_bench.toml):
# tokens/s and MFU, against the GEMM peak measured in the same run.
#   bench/gpt2_small.sh [THREADS] [STEPS]
# Needs `tessel prepare` (the Bible shard supplies token ids). Steps 1-2 are warm-up
# and excluded (so STEPS >= 3); the median over the rest is reported.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"  # the config's data.path is relative to the repository root
bin=${TESSEL_BIN:-$here/build/release/tessel}
threads=${1:-$(nproc)}
steps=${2:-12}
if ! [[ $threads =~ ^[1-9][0-9]*$ && $steps =~ ^[0-9]+$ ]] || ((steps < 3)); then
  echo "usage: bench/gpt2_small.sh [THREADS] [STEPS >= 3] (steps 1-2 are warm-up)" >&2
  exit 2
fi
source "$here/bench/temp_dirs.sh"
temp_dir run tessel-gpt2-bench
export OMP_NUM_THREADS=$threads
peak=$("$bin" bench-gemm --size 1024 --seconds 2 --threads "$threads" --json)
echo "bench-gemm: $peak"
"$bin" train --config "$here/configs/gpt2_small_bench.toml" --set run.dir="$run" \
  --set train.steps="$steps" --set run.threads="$threads" --set run.quiet=true
awk -v peak="$peak" '
  BEGIN { n = 0 }  # a numeric index from the first step on (mawk would key it "")
  /"event":"start"/ {
    match($0, /"flops_per_token":[0-9.e+-]+/); flops = substr($0, RSTART + 18, RLENGTH - 18) + 0
    match($0, /"peak_gflops":[0-9.e+-]+/); tpeak = substr($0, RSTART + 14, RLENGTH - 14) + 0
  }
  /"tokens_per_s"/ {
    match($0, /"step":[0-9]+/); step = substr($0, RSTART + 7, RLENGTH - 7) + 0
    if (step <= 2) next
    match($0, /"tokens_per_s":[0-9.e+-]+/); tps[n] = substr($0, RSTART + 15, RLENGTH - 15) + 0
    match($0, /"mfu":[0-9.e+-]+/); mfu[n] = substr($0, RSTART + 6, RLENGTH - 6) + 0
    n++
  }
  END {
    # median by insertion sort (n is small)
    for (i = 1; i < n; i++) for (j = i; j > 0 && tps[j-1] > tps[j]; j--) { t = tps[j]; tps[j] = tps[j-1]; tps[j-1] = t }
    for (i = 1; i < n; i++) for (j = i; j > 0 && mfu[j-1] > mfu[j]; j--) { t = mfu[j]; mfu[j] = mfu[j-1]; mfu[j-1] = t }
    match(peak, /"gflops":[0-9.e+-]+/); g = substr(peak, RSTART + 9, RLENGTH - 9) + 0
    printf "steps measured: %d\nmedian tokens/s: %.1f\n", n, tps[int(n/2)]
    printf "median MFU against the trainer'"'"'s own peak (%.1f GFLOP/s): %.1f%%\n", tpeak, 100 * mfu[int(n/2)]
    printf "median MFU against bench-gemm (%.1f GFLOP/s): %.1f%%\n", g, 100 * tps[int(n/2)] * flops / (g * 1e9)
  }' "$run/metrics.jsonl"

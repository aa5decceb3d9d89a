#!/usr/bin/env bash
# The README demo (configs/default.toml) on byte-level data against byte-level BPE
# vocabularies: docs/benchmarks.md, "Byte-level BPE against bytes on the README demo".
#   TESSEL_BIN=build/wt/tessel bench/bpe_demo.sh [VOCABS...]     # default: 256 1024 4096
# 256 is the byte-level baseline (data/bible); N > 256 learns data/bpeN with train-bpe,
# prepares data/bible-bpeN with it and trains on that. One run after another on
# 2 ranks x nproc/2 threads (scripts/launch.sh); each run's log in runs/bpe-vN/train.log
# with the load average before and after.
set -euo pipefail
cd "$(dirname "$0")/.."
export TESSEL_BIN=${TESSEL_BIN:-$PWD/build/release/tessel}
vocabs=${*:-256 1024 4096}
[ -f data/bible/dataset.json ] || "$TESSEL_BIN" prepare
for v in $vocabs; do
  if [ "$v" = 256 ]; then
    data=data/bible
  else
    data=data/bible-bpe$v
    if [ ! -f "$data/dataset.json" ]; then
      "$TESSEL_BIN" train-bpe --corpus bible --vocab-size "$v" --out "data/bpe$v"
      "$TESSEL_BIN" prepare --corpus bible --tokenizer "bpe:data/bpe$v" --out "$data"
    fi
  fi
  dir=runs/bpe-v$v
  rm -rf "$dir"; mkdir -p "$dir"
  {
    echo "loadavg start: $(cat /proc/loadavg)  $(date -u +%FT%TZ)"
    start=$(date +%s.%N)
    scripts/launch.sh 2 train --config configs/default.toml --set run.dir="$dir" \
      --set data.path="$data" --set model.vocab="$v"
    end=$(date +%s.%N)
    echo "wall seconds: $(echo "$end - $start" | bc)"
    echo "loadavg end: $(cat /proc/loadavg)  $(date -u +%FT%TZ)"
  } 2>&1 | tee "$dir.log"
  mv "$dir.log" "$dir/train.log"
done

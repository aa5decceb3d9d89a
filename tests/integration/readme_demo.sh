#!/usr/bin/env bash
# The README demo as a test: prepare the Bible corpus, train configs/default.toml on
# 2 MPI ranks, and require a final validation loss below 2.0 nats per byte and a
# printed text sample. Usage: readme_demo.sh TESSEL_BINARY SOURCE_DIR
set -euo pipefail
bin=$1
src=$2
work=$(mktemp -d /tmp/tessel-demo-XXXXXX)
trap 'rm -rf "$work"' EXIT
"$bin" prepare --corpus bible --out "$work/data"
start=$(date +%s)
TESSEL_BIN="$bin" "$src/scripts/launch.sh" 2 train --config "$src/configs/default.toml" \
  --set data.path="$work/data" --set run.dir="$work/run" | tee "$work/log"
echo "demo wall time: $(( $(date +%s) - start )) s"
grep -q '^sample:' "$work/log" || { echo "FAIL: no text sample printed"; exit 1; }
val=$(grep '"val_loss"' "$work/run/metrics.jsonl" | tail -1 | sed 's/.*"val_loss":\([0-9.e+-]*\).*/\1/')
echo "final validation loss: $val nats/byte"
[[ $val =~ ^[0-9.eE+-]+$ ]] || { echo "FAIL: validation loss is not a number: '$val'"; exit 1; }
awk -v v="$val" 'BEGIN { exit !(v < 2.0) }' || { echo "FAIL: validation loss $val >= 2.0"; exit 1; }

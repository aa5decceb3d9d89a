#!/usr/bin/env bash
# Runs `tessel` on N local MPI ranks with cores/N threads each.
#   scripts/launch.sh 2 train --config configs/default.toml
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: scripts/launch.sh NRANKS tessel-subcommand [args...]" >&2
  exit 2
fi
ranks=$1
shift
if ! [[ $ranks =~ ^[1-9][0-9]*$ ]]; then
  echo "launch.sh: NRANKS must be a positive integer, got '$ranks'" >&2
  exit 2
fi
here=$(cd "$(dirname "$0")/.." && pwd)
binary=${TESSEL_BIN:-$here/build/release/tessel}
if [ -n "${TESSEL_BIN:-}" ]; then
  [ -x "$binary" ] || { echo "launch.sh: TESSEL_BIN=$binary is not an executable file" >&2; exit 2; }
else
  [ -x "$binary" ] || { echo "launch.sh: $binary not built (cmake --preset release && cmake --build build/release)" >&2; exit 2; }
fi
# The machine's cores: nproc alone would answer OMP_NUM_THREADS (or OMP_THREAD_LIMIT) if set.
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
threads=$(( cores / ranks ))
(( threads >= 1 )) || threads=1
# Root is allowed (containers, CI); more ranks than cores need --oversubscribe.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# --quiet: no mpirun banner after a failed rank; tessel prints its own one-line error.
exec mpirun --quiet --oversubscribe --bind-to none -np "$ranks" -x OMP_NUM_THREADS="$threads" \
  "$binary" "$@"

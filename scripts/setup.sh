#!/usr/bin/env bash
# Installs every Debian package tessel needs to build, test and run its demo.
# Idempotent: re-running only installs what is missing.
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config clang-format
  libopenblas-openmp-dev
  openmpi-bin libopenmpi-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev libtomlplusplus-dev nlohmann-json3-dev
  zlib1g-dev libicu-dev
  bible-kjv fortunes
  jq
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

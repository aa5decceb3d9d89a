#!/usr/bin/env bash
# Activation recomputation (train.recompute = blocks) against keeping every block's cache:
# bench/train_ab.sh over train.recompute none / blocks (the validation losses must be equal).
#   bench/recompute.sh CONFIG [REPEATS] [--set k=v ...]
# e.g. bench/recompute.sh configs/default.toml 2 --set model.layers=8 --set model.max_seq=512 \
#        --set train.seq_len=512 --set train.micro_batch=8
exec "$(dirname "$0")/train_ab.sh" train.recompute none blocks "$@"

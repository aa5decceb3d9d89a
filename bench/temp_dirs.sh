# Sourced by the bench scripts: temporary run directories removed however the script ends
# (success, a failed run under set -e, Ctrl-C, kill). bash runs a trap between commands, so a
# TERM sent to the script alone ends it when its current run ends; Ctrl-C (the whole
# foreground process group) and `kill -- -PGID` stop the run too.
#   source "$here/bench/temp_dirs.sh"; temp_dir run tessel-my-bench   # sets $run
temp_dirs=()
trap 'rm -rf "${temp_dirs[@]}"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP
# temp_dir VAR PREFIX: a new directory /tmp/PREFIX-XXXXXX in $VAR, removed at exit.
temp_dir() {
  local dir
  dir=$(mktemp -d "/tmp/$2-XXXXXX")
  temp_dirs+=("$dir")
  printf -v "$1" '%s' "$dir"
}

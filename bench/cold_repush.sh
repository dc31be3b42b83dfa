#!/usr/bin/env bash
# cold_repush.sh - an unchanged re-push after the page cache has had time
# to let go of the home's inodes, for two roost builds interleaved.
#
# Usage: bench/cold_repush.sh HOME_DIR NEW_BIN OLD_BIN [ROUNDS] [IDLE_S]
#   HOME_DIR  a home to push (e.g. one made by bench/gen_home.py)
#   ROUNDS    runs of each build (default 4); IDLE_S idle before each (25)
# Pushes once to a scratch store, then alternates NEW and OLD re-pushes
# (same store, same index), each after IDLE_S seconds idle; prints
# "NAME ROUND SECONDS". Only meaningful on a machine that reclaims page
# cache on its own (a VM with free page reporting, or memory pressure).
set -euo pipefail
[ $# -ge 3 ] || { sed -n 2,11p "$0"; exit 2; }
home=$1 new=$2 old=$3 rounds=${4:-4} idle=${5:-25}
scratch=$(mktemp -d /tmp/roost-cold-repush.XXXXXX)
trap 'rm -rf "$scratch"' EXIT
export ROOST_HOME_EXCLUDES= ROOST_STATE_DIR=$scratch/state
push() { "$1" home push "$home" --store "$scratch/store" --org o --home h --json >/dev/null; }
push "$new"
for round in $(seq 1 "$rounds"); do
  for name in new old; do
    sleep "$idle"
    bin=$new; [ "$name" = old ] && bin=$old
    start=$(date +%s.%N); push "$bin"; end=$(date +%s.%N)
    echo "$name $round $(python3 -c "print(round($end - $start, 3))")"
  done
done

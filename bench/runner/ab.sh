#!/usr/bin/env bash
# Interleaved A/B of two roost binaries on the runner bench: before, after,
# before, after, ... with one client, so that the machine's drift falls on
# both alike. Each run's report is saved as run.sh saves it, named
# `-runner-before1`, `-runner-after1`, ...
#
# Usage: bench/runner/ab.sh BEFORE_ROOST AFTER_ROOST [ROUNDS]   (as root)
#   BEFORE_ROOST, AFTER_ROOST  two `roost` binaries (release builds; copy
#                  them out of target/ first, e.g. after `git worktree add`
#                  of the earlier commit and a build there)
#   ROUNDS         pairs to run (default 3)
#   env BENCH_BIN  the client (default target/release/examples/runner_bench)
# run.sh's other variables (AT_ONCE_ROUNDS, ALONE_EXECS, BENCH_DIR, ...) pass
# through.
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,/^set -e/p' "$0" | sed '$d' >&2; exit 2; }
HERE=$(cd "$(dirname "$0")" && pwd)
BEFORE=$(realpath "$1") AFTER=$(realpath "$2") ROUNDS=${3:-3}
for b in "$BEFORE" "$AFTER"; do
  [ -x "$b" ] || { echo "ab.sh: not an executable: $b" >&2; exit 2; }
done
for round in $(seq 1 "$ROUNDS"); do
  for side in before after; do
    bin=$BEFORE
    [ "$side" = after ] && bin=$AFTER
    echo "== round $round, $side ($bin), load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
    ROOST_BIN=$bin BENCH_LABEL=$side$round "$HERE/run.sh" --no-build
  done
done

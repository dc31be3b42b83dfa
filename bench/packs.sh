#!/usr/bin/env bash
# packs.sh - issue 18: the home store with packs against restic and `tar x`,
# same-run ratios, on the generated home (bench/gen_home.py) and a real tree
# (a copy of this machine's Python installation).
#
# Per data set, every timing including its own `sync` (as the issue's
# measurements did), everything warm in the page cache: each timed step's
# input (the tree, the store, the repository, the tar file) is read just
# before it (`warm`), because some machines (this VM) hand cached pages
# back to the host within seconds, and whichever tool ran first would
# otherwise read a cold disk:
#   push     roost home push into an empty local store | restic's first backup
#   repush   the same, nothing changed
#   pull     roost home pull into an empty dir | restic restore | tar x
#            (in an order that turns each round; nothing is deleted until
#            every timing is taken: see `trash`)
#   (old)    the same push and pull with ROOST_OLD_BIN, a build from before
#            packs, when given
# Then S3 (the moto server of scripts/test.sh, through bench/s3_count_proxy.py):
# requests of a first push and of a pull on an empty machine, by method.
# Peak RSS from /usr/bin/time. Prints a markdown report.
#
# Usage: bench/packs.sh [--quick] [--rounds N]
#   env ROOST_BIN      (default target/release/roost of this checkout)
#   env ROOST_OLD_BIN  a roost from before packs (optional)
#   env BENCH_DIR      scratch (default /tmp/roost-packs-bench), wiped
#   env AWS_*          the S3 server (source /work/testenv/env or scripts/test.sh's)
#   env S3_ONLY=1      only the S3 phase, on the data an earlier run left
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOST_BIN=${ROOST_BIN:-$HERE/../target/release/roost}
ROOST_OLD_BIN=${ROOST_OLD_BIN:-}
BENCH_DIR=${BENCH_DIR:-/tmp/roost-packs-bench}
FILES=100000 SIZE=2G ROUNDS=1
while [ $# -gt 0 ]; do
  case $1 in
    --quick) FILES=5000 SIZE=200M ;;
    --rounds) ROUNDS=$2; shift ;;
    *) echo "packs.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
for t in restic tar /usr/bin/time python3; do
  command -v "$t" >/dev/null || { echo "packs.sh: missing $t" >&2; exit 1; }
done
# An earlier run's files are moved aside and deleted at the end, not now
# (see `trash`: their inodes would slow the first round's writers).
EARLIER=
if [ -z "${S3_ONLY:-}" ] && [ -e "$BENCH_DIR" ]; then
  EARLIER=$(mktemp -d "$BENCH_DIR.earlier.XXXXXX")
  mv "$BENCH_DIR" "$EARLIER/"
fi
mkdir -p "$BENCH_DIR"
RES=$BENCH_DIR/results.txt; [ -n "${S3_ONLY:-}" ] || : >"$RES"
export RESTIC_PASSWORD=bench ROOST_HOME_EXCLUDES= ROOST_STATE_DIR=$BENCH_DIR/state
log() { echo "[$(date +%T)] $*" >&2; }

# timed NAME CMD...: runs CMD then sync, records "NAME seconds rss_kb".
timed() {
  local name=$1; shift
  /usr/bin/time -f '%e %M' -o "$BENCH_DIR/t" sh -c '"$@" >/dev/null 2>"$0.err" && sync' "$BENCH_DIR/$name" "$@" \
    || { echo "packs.sh: $name failed:" >&2; tail -3 "$BENCH_DIR/$name.err" >&2; exit 1; }
  echo "$name $(cat "$BENCH_DIR/t")" | tee -a "$RES" >&2
}

# warm PATH...: every file under PATH read once, so the step after it
# starts from the page cache, as its peer's did.
warm() {
  find "$@" -type f -print0 | xargs -0 -r cat >/dev/null
}

# trash PATH...: moved aside, deleted only once every timing is taken.
# ext4 does not reuse an inode within a minute of its deletion (five if
# its inode table block is still dirty): each file created then scans
# past every such inode in its group, so a step run after a round's
# 100k files were deleted spent seconds of system time there (seen with
# `perf`: `recently_deleted` under `ext4_create`) and whichever tool ran
# first paid for the others.
trash() {
  mkdir -p "$BENCH_DIR/trash"
  local path
  for path in "$@"; do
    [ -e "$path" ] && mv "$path" "$(mktemp -d "$BENCH_DIR/trash/XXXXXX")/"
  done
  return 0
}

# pull_step NAME DS ROUND P: one of the three timed pulls.
pull_step() {
  local name=$1 ds=$2 round=$3 p=$4
  case $name in
    tar)
      warm "$p.tar"
      timed "$ds.$round.tar.pull" tar -C "$p.out/tar" -xf "$p.tar" ;;
    roost)
      warm "$p.r"
      timed "$ds.$round.roost.pull" "$ROOST_BIN" home pull "$p.out/roost" --store "$p.r" --org o --home h --json ;;
    restic)
      warm "$p.restic"
      timed "$ds.$round.restic.pull" restic --repo "$p.restic" restore latest --target "$p.out/restic" ;;
  esac
}

dataset() {
  local ds=$1 src=$2 round=$3 p=$BENCH_DIR/$ds
  trash "$p.r" "$p.restic" "$p.old" "$p.out" "$p.tar"; mkdir -p "$p.out"
  sync
  warm "$src"
  timed "$ds.$round.roost.push" "$ROOST_BIN" home push "$src" --store "$p.r" --org o --home h --json
  restic init --repo "$p.restic" >/dev/null 2>&1
  warm "$src"
  timed "$ds.$round.restic.push" restic --repo "$p.restic" backup --quiet "$src"
  warm "$src" "$p.r"
  timed "$ds.$round.roost.repush" "$ROOST_BIN" home push "$src" --store "$p.r" --org o --home h --json
  warm "$src" "$p.restic"
  timed "$ds.$round.restic.repush" restic --repo "$p.restic" backup --quiet "$src"
  tar -C "$src" -cf "$p.tar" .
  mkdir -p "$p.out/tar"; sync
  # Each round in another order, so that none always goes first.
  local order=(tar roost restic) i
  for i in 0 1 2; do
    pull_step "${order[$(( (i + round - 1) % 3 ))]}" "$ds" "$round" "$p"
  done
  if [ -n "$ROOST_OLD_BIN" ]; then
    timed "$ds.$round.old.push" "$ROOST_OLD_BIN" home push "$src" --store "$p.old" --org o --home h --json
    timed "$ds.$round.old.pull" "$ROOST_OLD_BIN" home pull "$p.out/old" --store "$p.old" --org o --home h --json
  fi
  echo "$ds.$round.files.store $(find "$p.r" -type f | wc -l) $(du -sk "$p.r" | cut -f1)" | tee -a "$RES" >&2
  echo "$ds.$round.files.restic $(find "$p.restic" -type f | wc -l) $(du -sk "$p.restic" | cut -f1)" | tee -a "$RES" >&2
  trash "$p.out" "$p.tar" "$p.restic" "$p.old"
}

s3() {
  local ds=$1 src=$2 port=39177
  python3 "$HERE/s3_count_proxy.py" $port "${AWS_ENDPOINT_URL#http://}" &
  local proxy=$!
  for _ in $(seq 50); do curl -s "http://127.0.0.1:$port/__counts" >/dev/null && break; sleep 0.2; done
  local url="s3://${ROOST_TEST_S3_BUCKET:-roost-test}/packs-bench-$ds-$$"
  curl -s -X POST "http://127.0.0.1:$port/__reset" >/dev/null
  AWS_ENDPOINT_URL=http://127.0.0.1:$port AWS_ALLOW_HTTP=true \
    timed "$ds.s3.push" "$ROOST_BIN" home push "$src" --store "$url" --org o --home h --json
  echo "$ds.s3.push.requests $(curl -s "http://127.0.0.1:$port/__counts")" | tee -a "$RES" >&2
  curl -s -X POST "http://127.0.0.1:$port/__reset" >/dev/null
  AWS_ENDPOINT_URL=http://127.0.0.1:$port AWS_ALLOW_HTTP=true ROOST_STATE_DIR=$BENCH_DIR/fresh-state \
    timed "$ds.s3.pull" "$ROOST_BIN" home pull "$BENCH_DIR/$ds.s3out" --store "$url" --org o --home h --json
  echo "$ds.s3.pull.requests $(curl -s "http://127.0.0.1:$port/__counts")" | tee -a "$RES" >&2
  kill $proxy; rm -rf "$BENCH_DIR/$ds.s3out" "$BENCH_DIR/fresh-state"
}

if [ -n "${S3_ONLY:-}" ]; then
  # env S3_ONLY=1: only the S3 phase, on the data sets an earlier run left.
  for ds in python gen; do s3 "$ds" "$BENCH_DIR/$ds"; done
  exit 0
fi
log "generating the home ($FILES files, $SIZE)"
python3 "$HERE/gen_home.py" "$BENCH_DIR/gen" --files "$FILES" --size "$SIZE" --seed 1 >/dev/null
mkdir -p "$BENCH_DIR/python"
cp -a /usr/lib/python3 /usr/lib/python3.* "$BENCH_DIR/python/" 2>/dev/null || true
for round in $(seq 1 "$ROUNDS"); do
  for ds in python gen; do
    log "round $round: $ds"
    dataset "$ds" "$BENCH_DIR/$ds" "$round"
  done
done
if [ -n "${AWS_ENDPOINT_URL:-}" ]; then
  for ds in python gen; do s3 "$ds" "$BENCH_DIR/$ds"; done
fi
echo "== $RES"; cat "$RES"
log "deleting what the timings left"
rm -rf "$BENCH_DIR/trash" ${EARLIER:+"$EARLIER"}

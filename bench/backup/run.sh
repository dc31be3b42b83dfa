#!/usr/bin/env bash
# bench/backup/run.sh - issue 22: backups of the home store.
#
#   copy.full          roost store copy of the generated home's store into
#                      an empty one | rsync -a of the store directory
#   copy.incremental   the same after 1% of the home changed (gen_home.py
#                      --mutate 1) and was pushed again
#   check / check.deep roost admin check of the records' roots in the copy:
#                      every tree read and verified, every block present
#                      (--deep: every block read and verified too)
# Every timing includes its own `sync`, same run, page cache warm. The
# records are a SQLite database made by `roost server` with one image row
# naming the home's root (what `check` walks like a sandbox's save).
#
# Usage: bench/backup/run.sh [--quick]
#   env ROOST_BIN   (default target/release/roost of this checkout)
#   env BENCH_DIR   scratch (default /tmp/roost-backup-bench), wiped
#   env FRESH_HOME=1 the home at BENCH_DIR/home was just generated (and not
#                   mutated): keep it rather than generate it again
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOST_BIN=${ROOST_BIN:-$HERE/../../target/release/roost}
BENCH_DIR=${BENCH_DIR:-/tmp/roost-backup-bench}
FILES=100000 SIZE=2G
[ "${1:-}" = --quick ] && FILES=5000 SIZE=200M
for t in rsync sqlite3 /usr/bin/time python3; do
  command -v "$t" >/dev/null || { echo "run.sh: missing $t (apt-get install -y rsync sqlite3 time)" >&2; exit 1; }
done
if [ -n "${FRESH_HOME:-}" ]; then
  find "$BENCH_DIR" -mindepth 1 -maxdepth 1 ! -name home -exec rm -rf {} +
else
  rm -rf "$BENCH_DIR"
fi
mkdir -p "$BENCH_DIR"
RES=$BENCH_DIR/results.txt; : >"$RES"
export ROOST_HOME_EXCLUDES= ROOST_STATE_DIR=$BENCH_DIR/state
log() { echo "[$(date +%T)] $*" >&2; }

# timed NAME CMD...: runs CMD then sync, records "NAME seconds rss_kb".
timed() {
  local name=$1; shift
  /usr/bin/time -f '%e %M' -o "$BENCH_DIR/t" sh -c '"$@" >"$0.out" 2>"$0.err" && sync' "$BENCH_DIR/$name" "$@" \
    || { echo "run.sh: $name failed:" >&2; tail -3 "$BENCH_DIR/$name.err" >&2; exit 1; }
  echo "$name $(cat "$BENCH_DIR/t")" | tee -a "$RES" >&2
}

B=$BENCH_DIR
if [ -z "${FRESH_HOME:-}" ]; then
  log "generating $FILES files, $SIZE"
  python3 "$HERE/../gen_home.py" --files "$FILES" --size "$SIZE" "$B/home" >/dev/null
fi
"$ROOST_BIN" home push "$B/home" --store "$B/src" --org o --home h --json >/dev/null
sync

timed copy.full.roost "$ROOST_BIN" store copy --from "$B/src" --to "$B/dst" --json
timed copy.full.rsync rsync -a "$B/src/" "$B/rsync/"
cp "$B/copy.full.roost.out" "$B/copy.full.json"

log "changing 1% of the home"
python3 "$HERE/../gen_home.py" --mutate 1 "$B/home" >/dev/null
"$ROOST_BIN" home push "$B/home" --store "$B/src" --org o --home h --json >"$B/repush.json"
sync
timed copy.incremental.roost "$ROOST_BIN" store copy --from "$B/src" --to "$B/dst" --json
timed copy.incremental.rsync rsync -a "$B/src/" "$B/rsync/"
cp "$B/copy.incremental.roost.out" "$B/copy.incremental.json"

# Records naming the home's root, as an image row (no runner needed).
"$ROOST_BIN" server --listen 127.0.0.1:0 --data-dir "$B/data" --store "$B/dst" --no-secret-key >"$B/server.out" 2>&1 &
server=$!
for _ in $(seq 1 100); do grep -q listening "$B/server.out" 2>/dev/null && break; sleep 0.1; done
kill "$server"; wait "$server" 2>/dev/null || true
root=$(tr -d '\n' <"$B/dst/orgs/o/homes/h")
sqlite3 "$B/data/roost.db" "INSERT INTO images (org_id, name, root, files, logical_bytes, created_at_ms, updated_at_ms) VALUES ('o', 'bench', '$root', 0, 0, 0, 0)"
timed check "$ROOST_BIN" admin check --data-dir "$B/data" --store "$B/dst" --json
timed check.deep "$ROOST_BIN" admin check --data-dir "$B/data" --store "$B/dst" --deep --json
cp "$B/check.out" "$B/check.json"

echo "objects $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["trees"]+d["blocks"], d["trees"], d["blocks"])' "$B/check.json")" | tee -a "$RES" >&2
echo "store $(find "$B/src" -type f | wc -l) files $(du -sk "$B/src" | cut -f1) KiB" | tee -a "$RES" >&2
echo "--- roost store copy --json (incremental)"; cat "$B/copy.incremental.json"
echo "--- roost home push --json (the 1% change)"; cat "$B/repush.json"
echo "--- roost admin check --json"; cat "$B/check.json"
echo "--- timings: name seconds peak_rss_kb"; cat "$RES"

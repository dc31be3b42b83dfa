#!/usr/bin/env bash
# files.sh - the file API's throughput against the same copy without roost
# (BENCHMARKS.md "The sandbox's agent: files"): builds roost in release
# mode, starts `roost server` (SQLite) and `roost runner` (runc) on
# loopback, makes one sandbox, then, each measurement next to its peer
# (taking turns going first, each timing started after a `sync`, so none
# pays for another's writeback), ROUNDS times:
#
#   upload     `roost files put` of a 1 GiB file into /workspace
#              vs `cp` of the same file into the sandbox's home directory on
#              the runner (the same disks), then `sync FILE` (roost's
#              upload is fsynced before it is renamed into place)
#   download   `roost files get` of that file to the host
#              vs `cp` of it out of the home, then `sync FILE`
#   tar up     10,000 small files: `roost files put DIR` (tar built on the
#              fly), and the same archive as a body (`curl -T` to
#              PUT …/files/tar), vs `tar x` of that archive into the home
#   tar down   `roost files get` of that directory vs `tar c | tar x` of it
#
# Prints a markdown report (medians; ratios = peer time / roost time within
# a round, so 1.0 is as fast as the peer; the median of the rounds' ratios),
# saves it to bench/results/<date>-agent-files.md.
#
# Usage: bench/agent/files.sh [--quick] [--keep] [--no-build]
#   --quick     64 MiB and 1,000 files, one round (a smoke test, not a result)
#   --keep      keep $BENCH_DIR afterwards
#   --no-build  use the binary as it is
#   env BENCH_DIR  scratch dir under /tmp, wiped at start
#                  (default /tmp/roost-files-bench)
#   env ROUNDS     rounds (default 3)
#   env MEMORY     the sandbox's memory limit (default: the runner's, 512 MiB)
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
ROOST_BIN=${ROOST_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/release/roost}
BENCH_DIR=${BENCH_DIR:-/tmp/roost-files-bench}
ROUNDS=${ROUNDS:-3}
BIG_MIB=1024 SMALL_FILES=10000 LABEL=-agent-files BUILD=1 KEEP=
while [ $# -gt 0 ]; do
  case $1 in
    --quick) BIG_MIB=64 SMALL_FILES=1000 ROUNDS=1 LABEL=-agent-files-quick ;;
    --keep) KEEP=1 ;;
    --no-build) BUILD= ;;
    -h|--help) sed -n '2,/^set -e/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "files.sh: unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

log() { echo "[$(date +%T)] $*" >&2; }

[ "$(id -u)" = 0 ] || { echo "files.sh: run as root (the runner drives runc)" >&2; exit 1; }
command -v runc >/dev/null || {
  log "installing runc from Debian"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq runc >/dev/null
}
if [ -n "$BUILD" ]; then
  log "building roost (release)"
  (cd "$ROOT" && cargo build --release -p cli --bin roost)
fi
[ -x "$ROOST_BIN" ] || { echo "files.sh: $ROOST_BIN is missing (run without --no-build)" >&2; exit 1; }

case "$BENCH_DIR" in /tmp/*) ;; *) echo "files.sh: BENCH_DIR must be under /tmp" >&2; exit 1 ;; esac
unmount_scratch() {
  { findmnt -rn -o TARGET | grep "^$BENCH_DIR/" || true; } | sort -r | while read -r mounted; do
    umount -l "$mounted" 2>/dev/null || true
  done
}
unmount_scratch
rm -rf "$BENCH_DIR"
mkdir -p "$BENCH_DIR"
SERVER_PID= RUNNER_PID=
cleanup() {
  [ -z "$RUNNER_PID" ] || kill "$RUNNER_PID" 2>/dev/null || true
  [ -z "$SERVER_PID" ] || kill "$SERVER_PID" 2>/dev/null || true
  wait 2>/dev/null || true
  for c in "$BENCH_DIR"/runner/runtime/*; do
    [ -d "$c" ] && runc --root "$BENCH_DIR/runner/runtime" delete --force "$(basename "$c")" 2>/dev/null || true
  done
  if [ -z "$KEEP" ]; then
    unmount_scratch
    rm -rf "$BENCH_DIR"
  fi
}
trap cleanup EXIT

PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
URL="http://127.0.0.1:$PORT"
log "starting roost server on $URL"
ROOST_LOG=warn "$ROOST_BIN" server --listen "127.0.0.1:$PORT" --data-dir "$BENCH_DIR/server" \
  >"$BENCH_DIR/server.out" 2>"$BENCH_DIR/server.log" &
SERVER_PID=$!
for _ in $(seq 1 100); do
  [ -s "$BENCH_DIR/server/admin-token" ] && curl -fs "$URL/healthz" >/dev/null 2>&1 && break
  sleep 0.1
done
ADMIN=$(cat "$BENCH_DIR/server/admin-token")
json_field() { python3 -c "import json,sys; print(json.load(sys.stdin)[\"$1\"])"; }
ORG_TOKEN=$(ROOST_URL=$URL ROOST_TOKEN=$ADMIN "$ROOST_BIN" admin org create bench --json | json_field token)
RUNNER_TOKEN=$(ROOST_URL=$URL ROOST_TOKEN=$ADMIN "$ROOST_BIN" admin runner-token --json | json_field token)

log "starting roost runner (runc)"
ROOST_LOG=info ROOST_RUNNER_TOKEN=$RUNNER_TOKEN "$ROOST_BIN" runner --server "$URL" \
  --data-dir "$BENCH_DIR/runner" --runtime runc --capacity "sandboxes=8,cpus=64" \
  >"$BENCH_DIR/runner.out" 2>"$BENCH_DIR/runner.log" &
RUNNER_PID=$!
for _ in $(seq 1 100); do
  grep -q registered "$BENCH_DIR/runner.log" 2>/dev/null && break
  sleep 0.1
done
grep -q registered "$BENCH_DIR/runner.log" || { cat "$BENCH_DIR/runner.log" >&2; exit 1; }

export ROOST_URL=$URL ROOST_TOKEN=$ORG_TOKEN
MEMORY_ARGS=()
[ -z "${MEMORY:-}" ] || MEMORY_ARGS=(--memory "$MEMORY")
SID=$("$ROOST_BIN" sandbox create --wait "${MEMORY_ARGS[@]}" --json | json_field id)
HOME_DIR="$BENCH_DIR/runner/volumes/homes/$SID"
[ -d "$HOME_DIR" ] || { echo "files.sh: no home at $HOME_DIR" >&2; exit 1; }
log "sandbox $SID, home $HOME_DIR ($(stat -f -c %T "$HOME_DIR"))"

log "making a ${BIG_MIB} MiB file and ${SMALL_FILES} small files"
head -c "$((BIG_MIB << 20))" /dev/urandom >"$BENCH_DIR/big.bin"
BIG_SUM=$(sha256sum "$BENCH_DIR/big.bin" | cut -d' ' -f1)
python3 - "$BENCH_DIR/small" "$SMALL_FILES" <<'PY'
import os, random, sys
root, count = sys.argv[1], int(sys.argv[2])
rng = random.Random(15)
for i in range(count):
    d = os.path.join(root, f"d{i % 100:02}", f"e{i % 7}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"f{i}.txt"), "wb") as f:
        f.write(rng.randbytes(rng.randint(100, 4096)))
PY
tar cf "$BENCH_DIR/small.tar" -C "$BENCH_DIR/small" .
SMALL_BYTES=$(du -sb "$BENCH_DIR/small" | cut -f1)

# ms a command takes (its output discarded).
ms() {
  local start end
  start=$(date +%s%N)
  "$@" >/dev/null
  end=$(date +%s%N)
  echo $(((end - start) / 1000000))
}
copy_synced() { cp "$1" "$2" && sync "$2"; }
unpack_into() { mkdir -p "$2" && tar xf "$1" -C "$2"; }
copy_tree() { mkdir -p "$2" && tar cf - -C "$1" . | tar xf - -C "$2"; }
put_tar_body() {
  curl -sf -X PUT -H "Authorization: Bearer $ORG_TOKEN" -H 'Content-Type: application/x-tar' \
    --data-binary "@$1" "$URL/v1/sandboxes/$SID/files/tar?path=$2"
}

RESULTS="$BENCH_DIR/results.txt"
: >"$RESULTS"
# Every timing starts from a quiet disk: `sync` first, so no step pays for
# the writeback the one before it left (a step's own `sync FILE` or fsync
# is timed with it).
record() { echo "$1 $2" >>"$RESULTS"; }
timed() { local name=$1; shift; sync; record "$name" "$(ms "$@")"; }
# pair ROUND ROOST_NAME PEER_NAME ROOST_CMD... -- PEER_CMD...: roost and its
# peer, taking turns going first (odd rounds roost first, even the peer).
pair() {
  local round=$1 roost_name=$2 peer_name=$3; shift 3
  local roost_cmd=() peer_cmd=()
  while [ "$1" != -- ]; do roost_cmd+=("$1"); shift; done
  shift; peer_cmd=("$@")
  if [ $((round % 2)) = 1 ]; then
    timed "$roost_name" "${roost_cmd[@]}"; timed "$peer_name" "${peer_cmd[@]}"
  else
    timed "$peer_name" "${peer_cmd[@]}"; timed "$roost_name" "${roost_cmd[@]}"
  fi
}
log "measuring, $ROUNDS round(s)"
for round in $(seq 1 "$ROUNDS"); do
  pair "$round" roost_up cp_up "$ROOST_BIN" files put "$SID" "$BENCH_DIR/big.bin" /workspace/big.bin \
    -- copy_synced "$BENCH_DIR/big.bin" "$HOME_DIR/peer.bin"
  pair "$round" roost_down cp_down "$ROOST_BIN" files get "$SID" /workspace/big.bin "$BENCH_DIR/down.bin" \
    -- copy_synced "$HOME_DIR/big.bin" "$BENCH_DIR/peer-down.bin"
  [ "$(sha256sum "$BENCH_DIR/down.bin" | cut -d' ' -f1)" = "$BIG_SUM" ] || { echo "files.sh: the download differs" >&2; exit 1; }
  rm -f "$HOME_DIR/peer.bin" "$BENCH_DIR/down.bin" "$BENCH_DIR/peer-down.bin"

  timed roost_tar_up "$ROOST_BIN" files put "$SID" "$BENCH_DIR/small" "/workspace/tree-$round"
  pair "$round" curl_tar_up tar_x put_tar_body "$BENCH_DIR/small.tar" "/workspace/body-$round" \
    -- unpack_into "$BENCH_DIR/small.tar" "$HOME_DIR/peer-$round"
  pair "$round" roost_tar_down tar_pipe_down "$ROOST_BIN" files get "$SID" "/workspace/tree-$round" "$BENCH_DIR/got-$round" \
    -- copy_tree "$HOME_DIR/peer-$round" "$BENCH_DIR/peer-got-$round"
  found=$(find "$BENCH_DIR/got-$round" -type f | wc -l)
  [ "$found" = "$SMALL_FILES" ] || { echo "files.sh: $found files came back, not $SMALL_FILES" >&2; exit 1; }
  rm -rf "$HOME_DIR/tree-$round" "$HOME_DIR/body-$round" "$HOME_DIR/peer-$round" \
    "$BENCH_DIR/got-$round" "$BENCH_DIR/peer-got-$round"
done

REPORT="$ROOT/bench/results/$(date +%Y-%m-%d_%H%M)$LABEL.md"
mkdir -p "$ROOT/bench/results"
python3 - "$RESULTS" "$BIG_MIB" "$SMALL_FILES" "$SMALL_BYTES" "$(nproc)" "$(uname -r)" \
  "$(stat -f -c %T "$HOME_DIR")" "$(cut -d' ' -f1-3 /proc/loadavg)" "${MEMORY:-runner default}" \
  "$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)" >"$REPORT" <<'PY'
import statistics, sys
path, big_mib, files, small_bytes, cores, kernel, fs, load, memory, commit = sys.argv[1:]
runs = {}
for line in open(path):
    name, value = line.split()
    runs.setdefault(name, []).append(int(value))
med = {name: statistics.median(values) for name, values in runs.items()}
def mibs(name, mib):
    return f"{mib / (med[name] / 1000):.0f} MiB/s"
def row(what, roost, peer, peer_what, mib=None):
    # Each round's pair ran back to back: their ratio is the least
    # disturbed by load that changes between rounds.
    ratios = [p / r for r, p in zip(runs[roost], runs[peer]) if r]
    ratio = statistics.median(ratios) if ratios else 0
    speed = f" ({mibs(roost, mib)} vs {mibs(peer, mib)})" if mib else ""
    every = ", ".join(f"{r:.2f}" for r in ratios)
    print(f"| {what} | {med[roost]:.0f}{speed and ' (' + mibs(roost, mib) + ')'} | {peer_what}: {med[peer]:.0f}{speed and ' (' + mibs(peer, mib) + ')'} | **{ratio:.2f}** | {every} |")
print(f"# The file API's throughput ({commit})\n")
print(f"{cores} cores, Linux {kernel}; roost server (SQLite) and roost runner (runc) on loopback, release build;")
print(f"the sandbox's home on {fs}; sandbox memory: {memory}; load average at the end: {load}.\n")
print("| measurement | roost ms (median) | peer ms (median) | peer / roost (median of rounds) | each round's peer / roost |")
print("|---|---|---|---|---|")
big = int(big_mib)
row(f"upload of {big} MiB (`roost files put`)", "roost_up", "cp_up", "`cp` + `sync` into the home", big)
row(f"download of {big} MiB (`roost files get`)", "roost_down", "cp_down", "`cp` + `sync` out of the home", big)
small = int(small_bytes) / (1 << 20)
row(f"{files} small files up (`roost files put DIR`)", "roost_tar_up", "tar_x", "`tar x` of the archive into the home")
row(f"{files} small files up (the archive as the body, `curl -T`)", "curl_tar_up", "tar_x", "`tar x` of the archive into the home")
row(f"{files} small files down (`roost files get DIR`)", "roost_tar_down", "tar_pipe_down", "`tar c \\| tar x` out of the home")
print(f"\nSmall files: {files} in 700 directories, {small:.1f} MiB in all.")
PY
cat "$REPORT"
log "saved $REPORT"

#!/usr/bin/env bash
# hops.sh - where one exec round trip's time goes: starts `roost server`
# (SQLite) and `roost runner` (runc) on loopback with debug logs, runs N
# `true` commands one at a time (POST, then the long-poll until `ended`),
# and prints the p50/p90 of each hop, from the logs' timestamps (the
# runner's `hop:` debug events, the server's `answered` lines) and the
# client's own clock. Release build expected (run.sh builds it).
#
# Usage: bench/runner/hops.sh [N]   (default 40)
#   env ROOST_BIN  the roost binary (default target/release/roost)
#   env BENCH_DIR  scratch dir under /tmp, wiped (default /tmp/roost-hops)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
ROOST_BIN=${ROOST_BIN:-$ROOT/target/release/roost}
D=${BENCH_DIR:-/tmp/roost-hops}
N=${1:-40}
case "$D" in /tmp/*) ;; *) echo "hops.sh: BENCH_DIR must be under /tmp" >&2; exit 1 ;; esac
[ "$(id -u)" = 0 ] || { echo "hops.sh: run as root (the runner drives runc)" >&2; exit 1; }
unmount() { { findmnt -rn -o TARGET | grep "^$D/" || true; } | sort -r | while read -r m; do umount -l "$m" || true; done; }
unmount
rm -rf "$D"; mkdir -p "$D"
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
URL=http://127.0.0.1:$PORT
SERVER_PID= RUNNER_PID=
cleanup() {
  [ -z "$RUNNER_PID" ] || kill "$RUNNER_PID" 2>/dev/null || true
  [ -z "$SERVER_PID" ] || kill "$SERVER_PID" 2>/dev/null || true
  wait 2>/dev/null || true
  for c in "$D"/runner/runtime/*; do
    [ -d "$c" ] && runc --root "$D/runner/runtime" delete --force "$(basename "$c")" 2>/dev/null || true
  done
  unmount
}
trap cleanup EXIT
ROOST_LOG=warn,server=debug "$ROOST_BIN" server --listen "127.0.0.1:$PORT" --data-dir "$D/server" >"$D/server.out" 2>"$D/server.log" &
SERVER_PID=$!
for _ in $(seq 1 100); do [ -s "$D/server/admin-token" ] && curl -fs "$URL/healthz" >/dev/null 2>&1 && break; sleep 0.1; done
ADMIN=$(cat "$D/server/admin-token")
token() { python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])'; }
ORG=$(ROOST_URL=$URL ROOST_TOKEN=$ADMIN "$ROOST_BIN" admin org create hops --json | token)
RUNNER_TOKEN=$(ROOST_URL=$URL ROOST_TOKEN=$ADMIN "$ROOST_BIN" admin runner-token --json | token)
ROOST_LOG=info,runner=debug ROOST_RUNNER_TOKEN=$RUNNER_TOKEN "$ROOST_BIN" runner --server "$URL" \
  --data-dir "$D/runner" --runtime runc --capacity "sandboxes=64,cpus=64" >"$D/runner.out" 2>"$D/runner.log" &
RUNNER_PID=$!
for _ in $(seq 1 100); do grep -q registered "$D/runner.log" 2>/dev/null && break; sleep 0.1; done
python3 "$HERE/hops.py" run "$URL" "$ORG" "$N" >"$D/client.json"
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 "$HERE/hops.py" report "$D"

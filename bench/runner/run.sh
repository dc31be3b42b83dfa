#!/usr/bin/env bash
# run.sh - latency benchmark of a warm runner, end to end: builds roost and
# the benchmark client (crates/cli/examples/runner_bench.rs) in release mode,
# starts `roost server` (SQLite) and `roost runner` (runc) on loopback,
# measures, prints a markdown report, saves it to
# bench/results/<date>-runner.md and cleans up.
#
# Measurements (see bench/runner/README.md):
#   create -> running   50 sandboxes one at a time (p50, p99)
#   exec round trip     100 `true` commands one at a time (p50, p99)
#   at once             20 sandboxes created at the same moment, then one
#                       `true` in each at the same moment
#   peer                runc alone on the same config.json in the same run:
#                       create + start, and `runc exec ID true`
#
# Usage: bench/runner/run.sh [--quick] [--keep] [--no-build]
#   --quick     10 sandboxes, 20 execs, 5 at once (a smoke test, not a result)
#   --keep      keep $BENCH_DIR (logs, data dirs, JSON) afterwards
#   --no-build  use the binaries as they are
#   env BENCH_DIR  scratch dir, wiped at start (default /tmp/roost-runner-bench)
#   env AT_ONCE_ROUNDS  warm rounds of `true` in each of the sandboxes at
#                  once, after the first (default 10)
#   env ALONE_EXECS  `true` one at a time after those rounds, for the CPU
#                  each costs by process (default 100)
#   env BENCH_LABEL  appended to the report's name (e.g. base, new in an
#                  interleaved A/B of two binaries)
#   env SERVER_DIR the server's data dir, wiped at start and at the end
#                  (default $BENCH_DIR/server; e.g. /dev/shm/roost-bench-server
#                  puts its SQLite commits in memory, to see what they cost)
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
ROOST_BIN=${ROOST_BIN:-$ROOT/target/release/roost}
BENCH_BIN=${BENCH_BIN:-$ROOT/target/release/examples/runner_bench}
BENCH_DIR=${BENCH_DIR:-/tmp/roost-runner-bench}
SANDBOXES=50 EXECS=100 AT_ONCE=20 LABEL=-runner BUILD=1 KEEP=
while [ $# -gt 0 ]; do
  case $1 in
    --quick) SANDBOXES=10 EXECS=20 AT_ONCE=5 LABEL=-runner-quick ;;
    --keep) KEEP=1 ;;
    --no-build) BUILD= ;;
    -h|--help) sed -n '2,/^set -e/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "run.sh: unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
LABEL="$LABEL${BENCH_LABEL:+-$BENCH_LABEL}"

log() { echo "[$(date +%T)] $*" >&2; }

[ "$(id -u)" = 0 ] || { echo "run.sh: run as root (the runner drives runc)" >&2; exit 1; }
command -v runc >/dev/null || {
  log "installing runc from Debian"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq runc >/dev/null
}
if [ -n "$BUILD" ]; then
  log "building roost and runner_bench (release)"
  (cd "$ROOT" && cargo build --release -p cli --bin roost --example runner_bench)
fi
for b in "$ROOST_BIN" "$BENCH_BIN"; do
  [ -x "$b" ] || { echo "run.sh: $b is missing (run without --no-build)" >&2; exit 1; }
done

case "$BENCH_DIR" in /tmp/*) ;; *) echo "run.sh: BENCH_DIR must be under /tmp" >&2; exit 1 ;; esac
# The runner's volume filesystem stays mounted after it exits (sandboxes
# outlive the runner process): unmount what is under the scratch dir.
unmount_scratch() {
  # `|| true`: no mount under the scratch dir is the usual case, and grep
  # finding nothing must not end the run (pipefail).
  { findmnt -rn -o TARGET | grep "^$BENCH_DIR/" || true; } | sort -r | while read -r mounted; do
    umount -l "$mounted" 2>/dev/null || true
  done
}
unmount_scratch
SERVER_DIR=${SERVER_DIR:-$BENCH_DIR/server}
rm -rf "$BENCH_DIR" "$SERVER_DIR"
mkdir -p "$BENCH_DIR"
SERVER_PID= RUNNER_PID=
cleanup() {
  [ -z "$RUNNER_PID" ] || kill "$RUNNER_PID" 2>/dev/null || true
  [ -z "$SERVER_PID" ] || kill "$SERVER_PID" 2>/dev/null || true
  wait 2>/dev/null || true
  # Whatever the run left in the runtime goes.
  for c in "$BENCH_DIR"/runner/runtime/*; do
    [ -d "$c" ] && runc --root "$BENCH_DIR/runner/runtime" delete --force "$(basename "$c")" 2>/dev/null || true
  done
  if [ -z "$KEEP" ]; then
    unmount_scratch
    rm -rf "$BENCH_DIR" "$SERVER_DIR"
  fi
}
trap cleanup EXIT

PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
URL="http://127.0.0.1:$PORT"
log "starting roost server on $URL"
ROOST_LOG=warn "$ROOST_BIN" server --listen "127.0.0.1:$PORT" --data-dir "$SERVER_DIR" \
  >"$BENCH_DIR/server.out" 2>"$BENCH_DIR/server.log" &
SERVER_PID=$!
for _ in $(seq 1 100); do
  [ -s "$SERVER_DIR/admin-token" ] && curl -fs "$URL/healthz" >/dev/null 2>&1 && break
  sleep 0.1
done
ADMIN=$(cat "$SERVER_DIR/admin-token")
ORG_TOKEN=$(ROOST_URL=$URL ROOST_TOKEN=$ADMIN "$ROOST_BIN" admin org create bench --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])')
RUNNER_TOKEN=$(ROOST_URL=$URL ROOST_TOKEN=$ADMIN "$ROOST_BIN" admin runner-token --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])')

log "starting roost runner (runc)"
ROOST_LOG=info ROOST_RUNNER_TOKEN=$RUNNER_TOKEN "$ROOST_BIN" runner --server "$URL" \
  --data-dir "$BENCH_DIR/runner" --runtime runc --capacity "sandboxes=64,cpus=64" \
  >"$BENCH_DIR/runner.out" 2>"$BENCH_DIR/runner.log" &
RUNNER_PID=$!

for _ in $(seq 1 100); do
  # Admission refuses sandboxes until the runner has registered.
  grep -q registered "$BENCH_DIR/runner.log" 2>/dev/null && break
  sleep 0.1
done
grep -q registered "$BENCH_DIR/runner.log" || { cat "$BENCH_DIR/runner.log" >&2; exit 1; }
log "measuring (this takes about a minute)"
"$BENCH_BIN" --url "$URL" --token "$ORG_TOKEN" --runner-data-dir "$BENCH_DIR/runner" \
  --sandboxes "$SANDBOXES" --execs "$EXECS" --at-once "$AT_ONCE" \
  --at-once-rounds "${AT_ONCE_ROUNDS:-10}" --alone-execs "${ALONE_EXECS:-100}" --server-pid "$SERVER_PID" --runner-pid "$RUNNER_PID" >"$BENCH_DIR/result.json"

REPORT="$ROOT/bench/results/$(date +%Y-%m-%d_%H%M)$LABEL.md"
# Two runs in one minute (an interleaved A/B) keep both reports.
n=2
while [ -e "$REPORT" ]; do
  REPORT="$ROOT/bench/results/$(date +%Y-%m-%d_%H%M)$LABEL-$n.md"
  n=$((n + 1))
done
mkdir -p "$ROOT/bench/results"
BINARY="$ROOST_BIN (sha256 $(sha256sum "$ROOST_BIN" | cut -c1-12))"
python3 - "$BENCH_DIR/result.json" "$(nproc)" "$(runc --version | head -1)" "$(uname -r)" "$BINARY" >"$REPORT" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
cores, runc, kernel, binary = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
c, e, a, p = r["create_to_running"], r["exec_true"], r["at_once"], r["peer"]
pc, pe = p["runc_create_start"], p["runc_exec_true"]
ratio = lambda x, y: f"{x / y:.2f}" if y else "-"
print(f"# Runner benchmark\n\n{cores} cores, Linux {kernel}, {runc}; roost server (SQLite) and roost runner on loopback; roost: {binary}.\n")
print("| measurement | n | p50 ms | p99 ms | peer (runc alone) p50 / p99 ms | roost / peer (p50) |")
print("|---|---|---|---|---|---|")
print(f"| create → running | {c['n']} | {c['p50']} | {c['p99']} | create + start: {pc['p50']} / {pc['p99']} | {ratio(c['p50'], pc['p50'])} |")
print(f"| exec round trip (`true`) | {e['n']} | {e['p50']} | {e['p99']} | `runc exec`: {pe['p50']} / {pe['p99']} | {ratio(e['p50'], pe['p50'])} |")
if "first_byte" in r:
    f = r["first_byte"]
    print(f"| first output byte of `echo` over an attach | {f['n']} | {f['p50']} | {f['p99']} | `runc exec`'s round trip: {pe['p50']} / {pe['p99']} | {ratio(f['p50'], pe['p50'])} |")
ac, ae = a["create_to_running"], a["exec_true"]
print(f"| {a['sandboxes']} at once: create → running, each | {ac['n']} | {ac['p50']} | {ac['p99']} | | |")
print(f"| {a['sandboxes']} at once: `true` in each, each | {ae['n']} | {ae['p50']} | {ae['p99']} | | |")
if "warm_exec_true" in a:
    w = a["warm_exec_true"]
    print(f"| {a['sandboxes']} at once, {a['warm_rounds']} more rounds: `true` in each, each | {w['n']} | {w['p50']} | {w['p99']} | | |")
print(f"| {a['sandboxes']} at once: until all run | 1 | {a['all_running_ms']} | | runc create + start, {a['sandboxes']} at once: {p['runc_at_once_all_running_ms']} | {ratio(a['all_running_ms'], p['runc_at_once_all_running_ms'])} |")
if "idle_agent_rss_kib" in r:
    print(f"\nAn idle sandbox's init (its agent): {r['idle_agent_rss_kib']} KiB resident, of which {r.get('idle_agent_anon_kib', '?')} KiB its own (anonymous); proportional set size {r.get('idle_agent_pss_kib', '?')} KiB.")
print(f"\n{a['sandboxes']} sandboxes at once: all running after {a['all_running_ms']} ms; one `true` in each, all ended after {a['all_executed_ms']} ms (load average then: {a['loadavg']}).")
if "warm_exec_true" in a:
    print(f"\nMachine CPU (every process, from /proc/stat) per `true`: {a['alone_machine_cpu_ms_per_command']} ms one at a time, {a['warm_machine_cpu_ms_per_command']} ms {a['sandboxes']} at once; each warm round's p50 ms: {a['warm_round_p50s']}.")
    if "warm_cpu_ms_per_command_by_part" in a:
        parts = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in a["warm_cpu_ms_per_command_by_part"].items())
        print(f"\nCPU ms per `true` when {a['sandboxes']} at once, by process: {parts}.")
    if "alone_cpu_ms_per_command_by_part" in a:
        parts = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in a["alone_cpu_ms_per_command_by_part"].items())
        print(f"\nCPU ms per `true` one at a time, by process: {parts}.")
print("\n```json\n" + json.dumps(r, indent=2) + "\n```")
PY
cat "$REPORT"
log "saved $REPORT"

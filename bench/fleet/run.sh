#!/usr/bin/env bash
# run.sh - fleet benchmark (issue 21): thousands of protocol-only runners and
# an API load against two `roost server` processes on one PostgreSQL, plus the
# create rate on SQLite and PostgreSQL with 1,000 and 100,000 sandboxes in the
# table. Builds roost and the simulator (crates/cli/examples/fleet.rs) and the
# load generator (crates/cli/examples/loadgen.rs) in release mode, prints a
# markdown report and saves it to bench/results/<date>-fleet.md.
#
# The fleet run: `fleet` registers RUNNERS runners at once (the burst), each
# heartbeating every 3 s and long-polling its assignments, reporting states
# as a real runner would; API clients create, read, long-poll and delete;
# one runner goes silent mid-run (time until declared lost). With --kill,
# server B is killed (SIGKILL) a third into the run and started again 5 s
# later; its runners move to server A. At the end: each server's peak RSS
# (VmHWM), its longest lease watcher pass (/metrics), and `roost admin counts`
# (the kept counts against the records: must be exact).
#
# With --pg-outage, the servers reach PostgreSQL through a TCP proxy
# (tcp_proxy.py) that is killed two thirds into the run and started again 3 s
# later: every database connection drops and none can be made meanwhile.
#
# Usage: bench/fleet/run.sh [--quick] [--kill] [--pg-outage] [--no-build] [--no-creates] [--creates-only]
#   --quick      1,000 runners, 30 s, creates at 1,000/10,000 (a smoke test)
#   env RUNNERS  default 10000;  env SECONDS_RUN default 120;  env KEEP=1 keeps the logs
#   env LOSE_AT_S  when the silent runner stops (default a quarter into the run)
#   env FLEET_ARGS more arguments for the simulator (e.g. --assignments-wait-s 40)
#   env ROOST_TEST_POSTGRES_URL  a PostgreSQL server (default: /work/testenv/env's);
#                the script makes (and drops) its own databases in it
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
RUNNERS=${RUNNERS:-10000} SECONDS_RUN=${SECONDS_RUN:-120} API_CLIENTS=${API_CLIENTS:-8}
BIG=${BIG:-100000} SMALL=1000 CREATE_SECONDS=10
BUILD=1 KILL= CREATES=1 LABEL=-fleet OUTAGE= FLEET=1
while [ $# -gt 0 ]; do
  case $1 in
    --quick) RUNNERS=1000 SECONDS_RUN=30 BIG=10000 CREATE_SECONDS=3 LABEL=-fleet-quick ;;
    --kill) KILL=1 ;;
    --pg-outage) OUTAGE=1 ;;
    --no-build) BUILD= ;;
    --no-creates) CREATES= ;;
    --creates-only) FLEET= LABEL=-creates ;;
    -h|--help) sed -n '2,/^set -e/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "run.sh: unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
log() { echo "[$(date +%T)] $*" >&2; }
if [ -z "${ROOST_TEST_POSTGRES_URL:-}" ] && [ -f /work/testenv/env ]; then
  # shellcheck disable=SC1091
  source /work/testenv/env
fi
PG_BASE=${ROOST_TEST_POSTGRES_URL:?"set ROOST_TEST_POSTGRES_URL to a PostgreSQL server"}

if [ -n "$BUILD" ]; then
  log "building roost, fleet and loadgen (release)"
  (cd "$ROOT" && cargo build --release -p cli --bin roost --example fleet --example loadgen)
fi
DIR=$(mktemp -d /tmp/roost-fleet-bench.XXXXXX)
mkdir -p "$DIR/bin" "$DIR/logs"
for b in roost examples/fleet examples/loadgen; do cp "$TARGET/release/$b" "$DIR/bin/"; done
ROOST=$DIR/bin/roost
ulimit -n 200000 2>/dev/null || ulimit -n "$(ulimit -Hn)"

PIDS=() DBS=()
pg() { psql "$PG_BASE" -qtAc "$1"; }
cleanup() {
  local pid db
  # (TERM for the proxy: a background job of a script ignores SIGINT.)
  [ -z "${PROXY:-}" ] || kill -TERM "$PROXY" 2>/dev/null || true
  for pid in "${PIDS[@]}"; do kill -INT "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  for db in "${DBS[@]}"; do pg "DROP DATABASE IF EXISTS $db" >/dev/null 2>&1 || true; done
  if [ -n "${KEEP:-}" ]; then log "kept $DIR"; else rm -rf "$DIR"; fi
}
trap cleanup EXIT
database() { # database NAME: a fresh database, its URL on stdout
  pg "DROP DATABASE IF EXISTS $1" >/dev/null; pg "CREATE DATABASE $1" >/dev/null
  DBS+=("$1"); echo "${PG_BASE%/*}/$1"
}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# start NAME PORT ARGS...: a server; sets PID
start() {
  local name=$1 port=$2; shift 2
  "${ROOST}" server --listen "127.0.0.1:$port" --data-dir "$DIR/$name" "$@" \
    >>"$DIR/logs/$name.out" 2>>"$DIR/logs/$name.err" &
  PID=$!; PIDS+=("$PID")
  for _ in $(seq 1 300); do
    curl -fs "http://127.0.0.1:$port/healthz" >/dev/null 2>&1 && return 0
    kill -0 "$PID" 2>/dev/null || { tail "$DIR/logs/$name.err" >&2; exit 1; }
    sleep 0.1
  done
}
stop() { kill -INT "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; }
rss() { awk '/VmHWM/ {printf "%.0f", $2/1024}' "/proc/$1/status"; }
metric() { curl -fs -H "Authorization: Bearer $ADMIN" "$1/metrics" | awk -v m="$2" '$1 == m {print $2}'; }
jq_() { python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); exec("print(" + sys.argv[2] + ")")' "$@"; }

REPORT=$DIR/report.md
{
  echo "# Fleet benchmark $(date -u +%F\ %H:%M) UTC"
  echo
  echo "commit $(cd "$ROOT" && git rev-parse --short HEAD); binaries from $TARGET/release; $(nproc) cores; load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo
} >"$REPORT"

# --- creates with SMALL and BIG sandboxes in the table ------------------------------
# The table is filled by SQL: running sandboxes of the bench org on the bench
# runner (what the old code counted for both the org's quotas and the
# runner's usage), the org given limits so quotas are counted; then the kept
# counts rebuilt as migration 0016 does, so `roost admin counts` stays exact;
# then loadgen's creates (16 clients) for CREATE_SECONDS. With ROOST_BEFORE
# naming another build of roost (e.g. main's), the same with it, for the
# before/after table.
fill() { # fill CLI_SQL N ORG RUNNER
  local sql=$1 n=$2 org=$3 runner=$4 series
  if [[ $sql == psql* ]]; then series="generate_series(1, $n) AS g(i)"; else
    series="(WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s WHERE i < $n) SELECT i FROM s) AS g"; fi
  $sql "INSERT INTO sandboxes (id, org_id, image, storage_class, network, placement, env, labels, state, state_reason, desired, epoch, quarantined, created_at_ms, updated_at_ms, mounts, idle_timeout_s, auto_wake)
        SELECT 'sbx_fill' || CAST(g.i AS TEXT), '$org', 'default', 'standard', 'none', 'spot_first', '{}', '{}', 'running', 'running', 'running', 1, 0, 0, 0, '[]', 0, 1 FROM $series" >/dev/null
  $sql "UPDATE sandboxes SET runner_id = '$runner', last_runner_id = '$runner', memory_mib = 1, millicpus = 1, pids = 1 WHERE id LIKE 'sbx_fill%'" >/dev/null
  $sql "UPDATE orgs SET max_running = 10000000, max_total = 10000000 WHERE id = '$org'" >/dev/null
  # Only where the kept counts exist (not with an older build).
  $sql "SELECT 1 FROM sandbox_counts LIMIT 1" >/dev/null 2>&1 || return 0
  $sql "DELETE FROM sandbox_counts" >/dev/null
  $sql "INSERT INTO sandbox_counts (scope, slot, running, held) SELECT 'org:' || org_id, 0, SUM(CASE WHEN desired = 'running' AND state IN ('pending', 'recovering', 'starting', 'running', 'stopping') THEN 1 ELSE 0 END), SUM(CASE WHEN desired <> 'deleted' AND state NOT IN ('deleting', 'deleted') THEN 1 ELSE 0 END) FROM sandboxes GROUP BY org_id" >/dev/null
  $sql "INSERT INTO sandbox_counts (scope, slot, running, held) SELECT 'fleet', 0, COALESCE(SUM(CASE WHEN desired = 'running' AND state IN ('pending', 'recovering', 'starting', 'running', 'stopping') THEN 1 ELSE 0 END), 0), COALESCE(SUM(CASE WHEN desired <> 'deleted' AND state NOT IN ('deleting', 'deleted') THEN 1 ELSE 0 END), 0) FROM sandboxes" >/dev/null
  $sql "DELETE FROM runner_usage" >/dev/null
  $sql "INSERT INTO runner_usage (runner_id, sandboxes, memory_mib, millicpus, pids) SELECT runner_id, COUNT(*), COALESCE(SUM(memory_mib), 0), COALESCE(SUM(millicpus), 0), COALESCE(SUM(pids), 0) FROM sandboxes WHERE runner_id IS NOT NULL AND state IN ('starting', 'running', 'stopping') GROUP BY runner_id" >/dev/null
}
if [ -n "$CREATES" ]; then
  echo "## Creates with sandboxes in the table" >>"$REPORT"
  echo >>"$REPORT"
  echo "| build | engine | sandboxes in the table | creates/s (first → last s) | p50 ms | p99 ms | counts |" >>"$REPORT"
  echo "|---|---|---|---|---|---|---|" >>"$REPORT"
  BUILDS=(this)
  if [ -n "${ROOST_BEFORE:-}" ]; then cp "$ROOST_BEFORE" "$DIR/bin/roost-before"; BUILDS=(before this); fi
  for build in "${BUILDS[@]}"; do
  bin=$ROOST; [ "$build" = this ] || bin=$DIR/bin/roost-before
  for engine in sqlite postgres; do
    for n in $SMALL $BIG; do
      port=$(free_port) name=creates-$build-$engine-$n
      if [ $engine = postgres ]; then
        url=$(database "roost_fleet_creates_${build}_$n"); args=(--database "$url"); sql="psql $url -qtAc"
      else args=(); sql="sqlite3 $DIR/$name/roost.db"; fi
      ROOST=$bin start "$name" "$port" --lease-ttl 1h "${args[@]}"; pid=$PID
      admin=$(cat "$DIR/$name/admin-token")
      "$DIR/bin/loadgen" setup --url "http://127.0.0.1:$port" --admin-token "$admin" >"$DIR/setup.json"
      token=$(jq_ "$DIR/setup.json" 'd["org_token"]') runner=$(jq_ "$DIR/setup.json" 'd["runner_id"]')
      if [ $engine = sqlite ]; then stop "$pid"; fi
      org=$($sql "SELECT id FROM orgs WHERE name = 'bench'")
      fill "$sql" "$n" "$org" "$runner"
      if [ $engine = sqlite ]; then ROOST=$bin start "$name" "$port" --lease-ttl 1h; pid=$PID; fi
      "$DIR/bin/loadgen" creates --url "http://127.0.0.1:$port" --token "$token" --seconds "$CREATE_SECONDS" >"$DIR/creates.json"
      drift=-
      if [ "$build" = this ]; then
        drift=$(ROOST_URL=http://127.0.0.1:$port ROOST_TOKEN=$admin "$ROOST" admin counts --json | python3 -c 'import json,sys; d=json.load(sys.stdin); print("exact" if not d["drift"] else "DRIFT %s" % d["drift"])')
      fi
      jq_ "$DIR/creates.json" '"| '$build' | '$engine' | '$n' | %.0f (%d → %d) | %.1f | %.1f | '"$drift"' |" % (d["per_s"], d["per_second"][0], d["per_second"][-2], d["latency"]["p50_ms"], d["latency"]["p99_ms"])' >>"$REPORT"
      log "creates $build $engine $n: $(cat "$DIR/creates.json")"
      stop "$pid"
    done
  done
  done
  echo >>"$REPORT"
fi

if [ -z "$FLEET" ]; then
  mkdir -p "$ROOT/bench/results"
  OUT=$ROOT/bench/results/$(date -u +%F_%H%M)$LABEL.md
  cp "$REPORT" "$OUT"; cat "$REPORT"; log "saved $OUT"
  exit 0
fi

# --- the fleet run ----------------------------------------------------------------
URL=$(database roost_fleet_run)
if [ -n "$OUTAGE" ]; then
  PROXY_PORT=$(free_port)
  TARGET=$(python3 -c 'import sys; from urllib.parse import urlsplit; u = urlsplit(sys.argv[1]); print(f"{u.hostname}:{u.port or 5432}")' "$URL")
  proxy() { python3 "$HERE/tcp_proxy.py" "$PROXY_PORT" "$TARGET" >>"$DIR/logs/proxy.out" 2>&1 & PROXY=$!; PIDS+=("$PROXY"); sleep 0.5; }
  proxy
  URL=$(python3 -c 'import sys; from urllib.parse import urlsplit, urlunsplit; u = urlsplit(sys.argv[1]); auth = u.netloc.rsplit("@", 1)[0] + "@" if "@" in u.netloc else ""; print(urlunsplit(u._replace(netloc=f"{auth}127.0.0.1:{sys.argv[2]}")))' "$URL" "$PROXY_PORT")
fi
PORT_A=$(free_port) PORT_B=$(free_port)
start a "$PORT_A" --database "$URL"; PID_A=$PID
start b "$PORT_B" --database "$URL"; PID_B=$PID
A=http://127.0.0.1:$PORT_A B=http://127.0.0.1:$PORT_B
ADMIN=$(cat "$DIR/a/admin-token" 2>/dev/null || cat "$DIR/b/admin-token")
log "fleet: $RUNNERS runners, $SECONDS_RUN s, servers $A $B"
"$DIR/bin/fleet" --urls "$A,$B" --admin-token "$ADMIN" --runners "$RUNNERS" --seconds "$SECONDS_RUN" \
  --api-clients "$API_CLIENTS" --lose-at-s "${LOSE_AT_S:-$((SECONDS_RUN / 4))}" ${FLEET_ARGS:-} >"$DIR/fleet.json" 2>"$DIR/logs/fleet.err" &
FLEET=$!
KILLED= T0=
# at S: sleeps until S seconds after every runner registered
at() {
  if [ -z "$T0" ]; then
    while kill -0 $FLEET 2>/dev/null && ! grep -q registered "$DIR/logs/fleet.err"; do sleep 1; done
    T0=$(date +%s)
  fi
  local left=$((T0 + $1 - $(date +%s))); [ $left -le 0 ] || sleep $left
}
if [ -n "$KILL" ]; then
  at $((SECONDS_RUN / 3))
  log "killing server b (pid $PID_B)"; RSS_B_KILLED=$(rss "$PID_B"); kill -KILL "$PID_B"; wait "$PID_B" 2>/dev/null || true
  sleep 5; start b "$PORT_B" --database "$URL"; PID_B=$PID; KILLED=" (server b killed with ${RSS_B_KILLED} MiB peak, restarted 5 s later)"
fi
if [ -n "$OUTAGE" ]; then
  at $((SECONDS_RUN * 2 / 3))
  log "PostgreSQL out of reach for 3 s"; kill -KILL "$PROXY"; wait "$PROXY" 2>/dev/null || true
  sleep 3; proxy; KILLED="$KILLED (PostgreSQL out of reach for 3 s two thirds in)"
fi
wait $FLEET
RSS_A=$(rss "$PID_A") RSS_B=$(rss "$PID_B")
WATCH_A=$(metric "$A" roost_lease_watch_max_seconds) WATCH_B=$(metric "$B" roost_lease_watch_max_seconds)
# served URL ROUTE: the server's own view of a route (request in to answer
# out, its histogram's bucket bounds): count, p50 and p99 upper bounds in ms.
# The simulator's figures add its own queues (it shares the two cores).
served() {
  curl -fs -H "Authorization: Bearer $ADMIN" "$1/metrics" | python3 -c '
import re, sys
route = sys.argv[1]
buckets = []
for line in sys.stdin:
    m = re.match(r"roost_http_request_duration_seconds_bucket\{method=\"POST\",route=\"" + re.escape(route) + r"\",le=\"([^\"]+)\"\} (\d+)", line)
    if m: buckets.append((float("inf") if m[1] == "+Inf" else float(m[1]), int(m[2])))
total = buckets[-1][1] if buckets else 0
def upper(q):
    for bound, count in buckets:
        if total and count >= q * total: return "over 30000" if bound == float("inf") else f"{bound * 1000:g}"
    return "-"
print(f"{total} heartbeats, p50 <= {upper(0.5)} ms, p99 <= {upper(0.99)} ms")
' "$2"
}
SERVED_A=$(served "$A" /v1/runner/heartbeat || true) SERVED_B=$(served "$B" /v1/runner/heartbeat || true)
# Assignment long-polls answered by reading the runner's set, and without.
answers() { echo "$(metric "$1" 'roost_runner_assignments_total{answer="read"}') read, $(metric "$1" 'roost_runner_assignments_total{answer="unchanged"}') unchanged"; }
ANSWERS_A=$(answers "$A" || true) ANSWERS_B=$(answers "$B" || true)
# Placement's reads of every runner (a build before them prints nothing).
VIEW_A=$(metric "$A" roost_runner_view_reads_total || true) VIEW_B=$(metric "$B" roost_runner_view_reads_total || true)
COUNTS=$(ROOST_URL=$A ROOST_TOKEN=$ADMIN "$ROOST" admin counts --json || true)
{
  echo "## Fleet: $RUNNERS runners, two servers on one PostgreSQL, ${SECONDS_RUN} s$KILLED"
  echo
  python3 - "$DIR/fleet.json" <<PY
import json, sys
d = json.load(open(sys.argv[1]))
print("| what | count | per s | p50 ms | p99 ms | max ms |")
print("|---|---|---|---|---|---|")
for k in ["register", "heartbeat", "assignments", "report", "create", "get", "to_running", "delete"]:
    v = d.get(k)
    if v: print(f"| {k} | {v['count']} | {v['per_s']:.1f} | {v['p50_ms']:.1f} | {v['p99_ms']:.1f} | {v['max_ms']:.1f} |")
print()
print(f"- runners registered: {d['runners']} in {d['register_seconds']:.1f} s (the burst)")
print(f"- leases lost that should not be: {d['leases_lost_wrongly']}")
print(f"- silent runner declared lost {d['lost_after_ms']} ms after its last answered heartbeat (lease {d['lease_ttl_ms']} ms)")
print(f"- runner reports: {d['reports']}")
print(f"- errors: {json.dumps(d['errors'])}")
st = d.get("heartbeat_after_10s")
if st:
    print(f"- heartbeats after the first 10 s (the start's storm left out): {st['count']}, p50 {st['p50_ms']:.1f} ms, p99 {st['p99_ms']:.1f} ms")
w = d.get("heartbeat_windows") or []
if w:
    print("- heartbeats by when they were sent (10 s windows from the first): " + ", ".join(
        f"{x['from_s']}–{x['from_s'] + 10} s p50 {x['p50_ms']:.1f} / p99 {x['p99_ms']:.1f} ms" for x in w))
# Which seconds held a tail, and how many long-polls were answered in
# them (a wave of timeouts lines up with one).
slow = [x for x in d.get("by_second") or [] if x["p99_ms"] > 50]
if slow:
    print("- seconds whose heartbeat p99 passed 50 ms (p99 ms, long-polls answered in it): " + ", ".join(
        f"{x['s']} s ({x['p99_ms']:.0f}, {x['polls_answered']})" for x in slow))
PY
  echo "- peak RSS: server a ${RSS_A} MiB, server b ${RSS_B} MiB"
  echo "- longest lease watcher pass: server a ${WATCH_A} s, server b ${WATCH_B} s"
  echo "- assignment answers (b's since its last start): a: ${ANSWERS_A}; b: ${ANSWERS_B}"
  echo "- placement's reads of every runner (b's since its last start): a: ${VIEW_A:--}; b: ${VIEW_B:--}"
  echo "- heartbeats as each server timed them (request in to answer out; b's since its last start): a: ${SERVED_A}; b: ${SERVED_B}"
  echo "- roost admin counts: $COUNTS"
} >>"$REPORT"
mkdir -p "$ROOT/bench/results"
OUT=$ROOT/bench/results/$(date -u +%F_%H%M)$LABEL.md
cp "$REPORT" "$OUT"; echo '```' >>"$OUT"; cat "$DIR/fleet.json" >>"$OUT"; echo '```' >>"$OUT"
cat "$REPORT"
log "saved $OUT"

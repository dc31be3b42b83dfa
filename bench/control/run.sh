#!/usr/bin/env bash
# run.sh - load benchmark of the control plane (`roost server`), on SQLite and
# on PostgreSQL, end to end: builds roost and the load generator
# (crates/cli/examples/loadgen.rs) in release mode, starts everything it needs
# on loopback (servers, a throwaway PostgreSQL cluster, nginx as the peer),
# measures, prints a markdown report, saves it to
# bench/results/<date>-control.md and cleans up.
#
# Measurements, per database:
#   get      wrk: GET /v1/sandboxes/{id} with the org token; peer in the same
#            run: nginx serving a static JSON file of the same size
#   creates  loadgen creates: POST /v1/sandboxes {} from 16 clients
#   waiters  loadgen waiters: 10,000 long-polls (one connection each) over
#            100 sandboxes; server RSS (VmRSS) once roost_long_poll_waiters
#            shows them all; then every sandbox reported running
#   wake     loadgen wake: report `running` -> long-poll answer, 1,000 times;
#            on PostgreSQL also across two servers (waiter on A, report on B)
#
# Usage: bench/control/run.sh [--quick] [--keep] [--no-build]
#   --quick     3 s runs, 2,000 waiters, 200 wake-ups (a smoke test, not a result)
#   --keep      keep $BENCH_DIR (logs, databases, JSON) afterwards
#   --no-build  use the binaries as they are
#   env ROOST_BIN    default target/release/roost of this checkout
#   env LOADGEN_BIN  default target/release/examples/loadgen
#   env BENCH_DIR    scratch dir, wiped at start (default: a new mktemp -d directory)
#   env ENGINES      "sqlite postgres" (default) or one of them
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
ROOST_BIN=${ROOST_BIN:-$ROOT/target/release/roost}
LOADGEN_BIN=${LOADGEN_BIN:-$ROOT/target/release/examples/loadgen}
BENCH_DIR=${BENCH_DIR:-}
ENGINES=${ENGINES:-sqlite postgres}
SECONDS_PER_RUN=10 WARMUP_SECONDS=2 WAITERS=10000 WAITER_SANDBOXES=100 WAKES=1000
WRK_CONNECTIONS=64 CREATE_CLIENTS=16 LABEL=-control BUILD=1 KEEP=
while [ $# -gt 0 ]; do
  case $1 in
    --quick) SECONDS_PER_RUN=3 WARMUP_SECONDS=1 WAITERS=2000 WAITER_SANDBOXES=20 WAKES=200 LABEL=-control-quick ;;
    --keep) KEEP=1 ;;
    --no-build) BUILD= ;;
    -h|--help) sed -n '2,/^set -e/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "run.sh: unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

log() { echo "[$(date +%T)] $*" >&2; }

# --- tools ----------------------------------------------------------------------
PG_BIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1 || true)
missing=()
command -v wrk >/dev/null || missing+=(wrk)
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || missing+=(nginx)
command -v curl >/dev/null || missing+=(curl)
command -v python3 >/dev/null || missing+=(python3)
[[ " $ENGINES " != *" postgres "* ]] || [ -x "$PG_BIN/initdb" ] || missing+=(postgresql)
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]} from Debian"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  PG_BIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1 || true)
fi
NGINX=$(command -v nginx || echo /usr/sbin/nginx)

if [ -n "$BUILD" ]; then
  log "building roost and loadgen (release)"
  (cd "$ROOT" && cargo build --release -p cli --bin roost --example loadgen)
fi
# What was built: the commit, and whether the server's sources differed from it.
SOURCE="commit $(cd "$ROOT" && git rev-parse --short HEAD 2>/dev/null || echo unknown)"
if (cd "$ROOT" && git diff --quiet HEAD -- crates/server crates/api 2>/dev/null); then
  SOURCE="$SOURCE (crates/server and crates/api as committed)"
else
  SOURCE="$SOURCE + uncommitted changes in $(cd "$ROOT" && git diff --name-only HEAD -- crates/server crates/api | tr '\n' ' ' | sed 's/ $//')"
fi
for b in "$ROOST_BIN" "$LOADGEN_BIN"; do
  [ -x "$b" ] || { echo "run.sh: $b is missing (run without --no-build)" >&2; exit 1; }
done

# Every waiter is one socket in the server and one in the load generator.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"
if [ "$(ulimit -n)" != unlimited ] && [ "$(ulimit -n)" -lt $((WAITERS + 1000)) ]; then
  echo "run.sh: the open-files limit is $(ulimit -n); $WAITERS waiters need $((WAITERS + 1000))" >&2
  exit 1
fi

# --- scratch layout (wiped only if it is ours) -----------------------------------
[ -n "$BENCH_DIR" ] || BENCH_DIR=$(mktemp -d /tmp/roost-control-bench.XXXXXX)
if [ -e "$BENCH_DIR" ] && [ ! -e "$BENCH_DIR/.roost-control-bench" ] && [ -n "$(ls -A "$BENCH_DIR")" ]; then
  echo "run.sh: $BENCH_DIR exists and was not made by run.sh; refusing to wipe it" >&2; exit 1
fi
rm -rf "$BENCH_DIR"
mkdir -p "$BENCH_DIR/res" "$BENCH_DIR/logs"
touch "$BENCH_DIR/.roost-control-bench"
RES=$BENCH_DIR/res LOGS=$BENCH_DIR/logs
# Private copies: a build elsewhere in this checkout cannot swap them mid-run.
mkdir -p "$BENCH_DIR/bin"
cp "$ROOST_BIN" "$BENCH_DIR/bin/roost"
cp "$LOADGEN_BIN" "$BENCH_DIR/bin/loadgen"
ROOST_BIN=$BENCH_DIR/bin/roost LOADGEN_BIN=$BENCH_DIR/bin/loadgen

# --- processes we start, stopped on exit ------------------------------------------
PIDS=()
PG_DATA=
cleanup() {
  local pid
  for pid in "${PIDS[@]}"; do kill -INT "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  if [ -n "$PG_DATA" ]; then
    runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$PG_DATA" -m immediate stop >/dev/null 2>&1 || true
  fi
  if [ -z "$KEEP" ]; then rm -rf "$BENCH_DIR"; else log "kept $BENCH_DIR"; fi
}
trap cleanup EXIT

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# jget FILE KEY: a top-level field of a JSON file
jget() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2"; }

# start_server NAME [--database URL]: sets SERVER_URL and SERVER_PID
start_server() {
  local name=$1 port; shift
  port=$(free_port)
  "$ROOST_BIN" server --listen "127.0.0.1:$port" --data-dir "$BENCH_DIR/$name" \
    --lease-ttl 1h "$@" >"$LOGS/$name.out" 2>"$LOGS/$name.err" &
  SERVER_PID=$!
  PIDS+=("$SERVER_PID")
  for _ in $(seq 1 300); do
    grep -q '^roost server listening on' "$LOGS/$name.out" 2>/dev/null && break
    kill -0 "$SERVER_PID" 2>/dev/null || { cat "$LOGS/$name.err" >&2; echo "run.sh: server $name died" >&2; exit 1; }
    sleep 0.1
  done
  SERVER_URL=http://127.0.0.1:$port
  log "server $name on $SERVER_URL (pid $SERVER_PID) $*"
}

stop_pid() {
  kill -INT "$1" 2>/dev/null || true
  wait "$1" 2>/dev/null || true
}

start_postgres() {
  local port
  port=$(free_port)
  mkdir -p "$BENCH_DIR/pg"
  chown postgres "$BENCH_DIR/pg"
  PG_DATA=$BENCH_DIR/pg/data
  runuser -u postgres -- "$PG_BIN/initdb" -D "$PG_DATA" -A trust -U roost >"$LOGS/initdb" 2>&1
  runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$PG_DATA" -l "$BENCH_DIR/pg/log" -w \
    -o "-p $port -k $BENCH_DIR/pg -c listen_addresses=127.0.0.1 -c max_connections=200" start >/dev/null
  PG_URL=postgres://roost@127.0.0.1:$port/postgres
  log "PostgreSQL $("$PG_BIN/postgres" --version | awk '{print $3}') on 127.0.0.1:$port"
}

stop_postgres() {
  runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$PG_DATA" -m fast stop >/dev/null 2>&1 || true
  PG_DATA=
}

# wrk_json NAME URL: warm up, then measure; writes $RES/NAME.json
wrk_json() {
  local name=$1 url=$2 out=$LOGS/$1.wrk
  wrk -t2 -c"$WRK_CONNECTIONS" -d"${WARMUP_SECONDS}s" -H "Authorization: Bearer $ORG_TOKEN" "$url" >/dev/null
  wrk -t2 -c"$WRK_CONNECTIONS" -d"${SECONDS_PER_RUN}s" --latency -H "Authorization: Bearer $ORG_TOKEN" "$url" >"$out"
  python3 - "$out" >"$RES/$name.json" <<'PY'
import json, re, sys
text = open(sys.argv[1]).read()
def grab(pattern, default=0):
    m = re.search(pattern, text, re.M)
    return m.group(1) if m else default
def ms(value):
    m = re.match(r"([\d.]+)(us|ms|s)", value)
    return round(float(m.group(1)) * {"us": 0.001, "ms": 1, "s": 1000}[m.group(2)], 2) if m else None
errors = sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", grab(r"Socket errors: (.*)$", "")))
print(json.dumps({
    "per_s": float(grab(r"^Requests/sec:\s+([\d.]+)")),
    "requests": int(grab(r"^\s+(\d+) requests in")),
    "non_2xx": int(grab(r"Non-2xx or 3xx responses: (\d+)")),
    "socket_errors": errors,
    "p50_ms": ms(grab(r"^\s+50%\s+(\S+)", "")),
    "p99_ms": ms(grab(r"^\s+99%\s+(\S+)", "")),
}))
PY
  log "  $name: $(cat "$RES/$name.json")"
}

# nginx_peer ENGINE BODY_FILE: the same GET load against a static file
nginx_peer() {
  local engine=$1 dir=$BENCH_DIR/nginx-$1 port pid
  port=$(free_port)
  mkdir -p "$dir/www" "$dir/tmp"
  cp "$2" "$dir/www/sandbox.json"
  chmod -R a+rX "$dir"
  cat >"$dir/nginx.conf" <<EOF
worker_processes auto;
pid $dir/nginx.pid;
error_log $dir/error.log;
daemon off;
events { worker_connections 4096; }
http {
    access_log off;
    client_body_temp_path $dir/tmp/body;
    proxy_temp_path $dir/tmp/proxy;
    fastcgi_temp_path $dir/tmp/fastcgi;
    uwsgi_temp_path $dir/tmp/uwsgi;
    scgi_temp_path $dir/tmp/scgi;
    server {
        listen 127.0.0.1:$port;
        location / { root $dir/www; default_type application/json; }
    }
}
EOF
  "$NGINX" -c "$dir/nginx.conf" -p "$dir" >"$LOGS/nginx-$engine.out" 2>&1 &
  pid=$!
  PIDS+=("$pid")
  for _ in $(seq 1 100); do curl -fs "http://127.0.0.1:$port/sandbox.json" >/dev/null && break; sleep 0.1; done
  wrk_json "$engine.nginx" "http://127.0.0.1:$port/sandbox.json"
  kill -QUIT "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

# --- one engine ---------------------------------------------------------------------
bench_engine() {
  local engine=$1 db_args=() url pid runner_token runner_id sandbox_id
  if [ "$engine" = postgres ]; then
    start_postgres
    db_args=(--database "$PG_URL")
  fi
  start_server "$engine-a" "${db_args[@]}"
  url=$SERVER_URL pid=$SERVER_PID
  "$LOADGEN_BIN" setup --url "$url" --admin-token "$(head -n1 "$BENCH_DIR/$engine-a/admin-token")" >"$RES/$engine.setup.json"
  ORG_TOKEN=$(jget "$RES/$engine.setup.json" org_token)
  runner_token=$(jget "$RES/$engine.setup.json" runner_token)
  runner_id=$(jget "$RES/$engine.setup.json" runner_id)
  sandbox_id=$(jget "$RES/$engine.setup.json" sandbox_id)

  log "$engine: GET /v1/sandboxes/{id}, then nginx with a file of the same size"
  curl -fsS -H "Authorization: Bearer $ORG_TOKEN" "$url/v1/sandboxes/$sandbox_id" >"$BENCH_DIR/$engine.body.json"
  wrk_json "$engine.get" "$url/v1/sandboxes/$sandbox_id"
  nginx_peer "$engine" "$BENCH_DIR/$engine.body.json"

  log "$engine: creates"
  "$LOADGEN_BIN" creates --url "$url" --token "$ORG_TOKEN" --concurrency "$CREATE_CLIENTS" \
    --seconds "$SECONDS_PER_RUN" >"$RES/$engine.creates.json" 2>>"$LOGS/loadgen.err"
  log "  $(cat "$RES/$engine.creates.json")"

  log "$engine: $WAITERS waiters"
  ROOST_METRICS_TOKEN="$(head -n1 "$BENCH_DIR/$engine-a/admin-token")" \
  "$LOADGEN_BIN" waiters --url "$url" --token "$ORG_TOKEN" --runner-token "$runner_token" \
    --server-pid "$pid" --waiters "$WAITERS" --sandboxes "$WAITER_SANDBOXES" \
    >"$RES/$engine.waiters.json" 2>>"$LOGS/loadgen.err"
  log "  $(cat "$RES/$engine.waiters.json")"

  log "$engine: wake latency, $WAKES times"
  ROOST_METRICS_TOKEN="$(head -n1 "$BENCH_DIR/$engine-a/admin-token")" \
  "$LOADGEN_BIN" wake --url "$url" --token "$ORG_TOKEN" --runner-token "$runner_token" \
    --runner-id "$runner_id" --count "$WAKES" >"$RES/$engine.wake.json" 2>>"$LOGS/loadgen.err"
  log "  $(cat "$RES/$engine.wake.json")"

  if [ "$engine" = postgres ]; then
    start_server "$engine-b" "${db_args[@]}"
    log "$engine: wake latency across servers (waiter on A, report on B), $WAKES times"
    ROOST_METRICS_TOKEN="$(head -n1 "$BENCH_DIR/$engine-a/admin-token")" \
    "$LOADGEN_BIN" wake --url "$url" --report-url "$SERVER_URL" --token "$ORG_TOKEN" \
      --runner-token "$runner_token" --runner-id "$runner_id" --count "$WAKES" \
      >"$RES/$engine.wake-cross.json" 2>>"$LOGS/loadgen.err"
    log "  $(cat "$RES/$engine.wake-cross.json")"
    stop_pid "$SERVER_PID"
  fi
  stop_pid "$pid"
  [ "$engine" = postgres ] && stop_postgres
  return 0
}

LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
for engine in $ENGINES; do bench_engine "$engine"; done

# --- report ---------------------------------------------------------------------------
DATE=$(date +%Y-%m-%d_%H%M)
mkdir -p "$ROOT/bench/results"
REPORT=$ROOT/bench/results/$DATE$LABEL.md
{
  echo "# roost control plane under load ($DATE$LABEL)"
  echo
  echo "- roost: $("$ROOST_BIN" --version) (release), built from $SOURCE"
  echo "- machine: $(nproc) cores, $(awk '/MemTotal/{printf "%.0f GiB", $2/1048576}' /proc/meminfo) RAM, $(uname -sr); load avg at start: $LOAD_START, at end: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "- peers and tools: $(wrk -v 2>&1 | head -n1 | awk '{print $1, $2}'), nginx $("$NGINX" -v 2>&1 | sed 's/.*nginx\///'), PostgreSQL $([ -x "$PG_BIN/postgres" ] && "$PG_BIN/postgres" --version | awk '{print $3}' || echo -) (\`max_connections=200\`, otherwise defaults)"
  echo "- everything on loopback on this one machine: load generators, servers, database and nginx share the $(nproc) cores"
  echo "- GET: \`wrk -t2 -c$WRK_CONNECTIONS -d${SECONDS_PER_RUN}s\` after a ${WARMUP_SECONDS} s warm-up, one sandbox; nginx: \`worker_processes auto\`, \`access_log off\`, the same body as a static file"
  echo "- creates: $CREATE_CLIENTS clients for ${SECONDS_PER_RUN} s, starting from an almost empty database; waiters: $WAITERS long-polls over $WAITER_SANDBOXES sandboxes, one connection each; wake: $WAKES sequential wake-ups after 20 unmeasured"
  echo
  python3 "$HERE/report.py" "$RES" $ENGINES
} >"$REPORT"
cat "$REPORT"
log "report saved to $REPORT"

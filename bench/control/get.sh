#!/usr/bin/env bash
# The authenticated GET against nginx, for one or more roost binaries in
# turn (interleaved rounds, so a noisy machine treats them alike):
#
#   bench/control/get.sh [--rounds N] [--seconds S] ROOST_BIN [ROOST_BIN...]
#
# For each binary and round: a SQLite server on a fresh data dir, the
# load generator's setup (an org, a runner, a sandbox), `wrk -t2 -c64`
# on GET /v1/sandboxes/{id} after a 2 s warm-up, then nginx serving the
# same body as a static file, the same way; prints one line per run with
# both rates and their ratio. Needs wrk and nginx (bench/control/run.sh
# installs them) and the loadgen example built in release mode.
# DATABASE=postgres://…/DB runs the servers on PostgreSQL instead: each
# run on a database of its own, made beside DB (through psql) and dropped
# after it. SPREAD=N reads N sandboxes in turn instead of one (a wrk
# script picks each path, which costs wrk time: nginx is still measured
# without it, the stricter peer). CONNS=N: wrk's connections (64).
set -euo pipefail
ROUNDS=3 SECS=10 CONNS=${CONNS:-64}
THREADS=$((CONNS < 2 ? 1 : 2))
while [ $# -gt 0 ]; do
  case $1 in
    --rounds) ROUNDS=$2; shift 2 ;;
    --seconds) SECS=$2; shift 2 ;;
    *) break ;;
  esac
done
[ $# -gt 0 ] || { sed -n 2,14p "$0"; exit 2; }
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
LOADGEN=${LOADGEN_BIN:-$ROOT/target/release/examples/loadgen}
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
jget() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2"; }
rate() { awk '/Requests\/sec/{print $2}'; }

one_run() {
  local bin=$1 dir port nport pid token sandbox roost nginx
  dir=$(mktemp -d /tmp/roost-get.XXXXXX)
  port=$(free_port) nport=$(free_port)
  local database=
  if [ -n "${DATABASE:-}" ]; then
    local name="roost_get_$$_${dir##*.}"
    name=$(echo "$name" | tr 'A-Z' 'a-z')
    psql -q "$DATABASE" -c "CREATE DATABASE $name" >/dev/null
    database="${DATABASE%/*}/$name"
  fi
  "$bin" server --listen "127.0.0.1:$port" --data-dir "$dir/server" --lease-ttl 1h ${database:+--database "$database"} >"$dir/out" 2>"$dir/err" &
  pid=$!
  for _ in $(seq 1 300); do grep -q 'listening' "$dir/out" 2>/dev/null && break; sleep 0.1; done
  "$LOADGEN" setup --url "http://127.0.0.1:$port" --admin-token "$(head -n1 "$dir/server/admin-token")" \
    --sandboxes "${SPREAD:-1}" >"$dir/setup.json"
  token=$(jget "$dir/setup.json" org_token)
  sandbox=$(jget "$dir/setup.json" sandbox_id)
  local url=http://127.0.0.1:$port/v1/sandboxes/$sandbox
  curl -fsS -H "Authorization: Bearer $token" "$url" >"$dir/sandbox.json"
  local script=()
  if [ "${SPREAD:-1}" -gt 1 ]; then
    # Each request's path in turn.
    python3 - "$dir" <<'EOP'
import json, sys
d = sys.argv[1]
paths = [f"/v1/sandboxes/{i}" for i in json.load(open(f"{d}/setup.json"))["sandbox_ids"]]
with open(f"{d}/spread.lua", "w") as f:
    f.write("paths = {" + ",".join(json.dumps(p) for p in paths) + "}\n")
    f.write("i = 0\nrequest = function()\n  i = i % #paths + 1\n  return wrk.format(nil, paths[i])\nend\n")
EOP
    script=(-s "$dir/spread.lua")
  fi
  cat >"$dir/nginx.conf" <<EOC
worker_processes auto; pid $dir/nginx.pid; error_log $dir/nginx.err;
events { worker_connections 1024; }
http { access_log off; server { listen 127.0.0.1:$nport; root $dir; } }
EOC
  "$NGINX" -c "$dir/nginx.conf" -p "$dir"
  wrk -t"$THREADS" -c"$CONNS" -d2s "${script[@]}" -H "Authorization: Bearer $token" "$url" >/dev/null
  roost=$(wrk -t"$THREADS" -c"$CONNS" -d"${SECS}s" "${script[@]}" -H "Authorization: Bearer $token" "$url" | rate)
  wrk -t"$THREADS" -c"$CONNS" -d2s "http://127.0.0.1:$nport/sandbox.json" >/dev/null
  nginx=$(wrk -t"$THREADS" -c"$CONNS" -d"${SECS}s" "http://127.0.0.1:$nport/sandbox.json" | rate)
  kill "$(cat "$dir/nginx.pid")"
  kill -INT "$pid"; wait "$pid" 2>/dev/null || true
  rm -rf "$dir"
  if [ -n "$database" ]; then
    psql -q "$DATABASE" -c "DROP DATABASE ${database##*/}" >/dev/null
  fi
  printf '%s\tGET/s %s\tnginx/s %s\tratio %s\tload %s\n' "$bin" "$roost" "$nginx" \
    "$(python3 -c "print(round($roost/$nginx, 3))")" "$(cut -d' ' -f1 /proc/loadavg)"
}

for round in $(seq 1 "$ROUNDS"); do
  for bin in "$@"; do
    printf 'round %s\t' "$round"
    one_run "$bin"
  done
done

#!/usr/bin/env bash
# statements.sh - where PostgreSQL's time goes in a fleet run: runs
# `run.sh --no-build --no-creates` for 50 s and prints pg_stat_statements'
# top 25 statements by total time over 20 s of its steady state (reset 25 s
# in, read 20 s later). The server must load pg_stat_statements
# (shared_preload_libraries) with the extension created in the database of
# ROOST_TEST_POSTGRES_URL.
# Usage: CARGO_TARGET_DIR=DIR bench/fleet/statements.sh   (DIR/release holds the binaries)
#   env RUNNERS  default 10000
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
if [ -z "${ROOST_TEST_POSTGRES_URL:-}" ] && [ -f /work/testenv/env ]; then
  # shellcheck disable=SC1091
  source /work/testenv/env
fi
PG=${ROOST_TEST_POSTGRES_URL:?"set ROOST_TEST_POSTGRES_URL to a PostgreSQL server"}
LOG=$(mktemp /tmp/roost-statements.XXXXXX)
RUNNERS=${RUNNERS:-10000} SECONDS_RUN=50 "$HERE/run.sh" --no-build --no-creates >"$LOG" 2>&1 &
RUN=$!
sleep 25
psql "$PG" -qtAc "SELECT pg_stat_statements_reset()" >/dev/null
sleep 20
psql "$PG" -c "SELECT calls, round(total_exec_time::numeric, 0) AS ms, round(mean_exec_time::numeric, 3) AS mean_ms,
  left(regexp_replace(query, '\s+', ' ', 'g'), 110) AS query
  FROM pg_stat_statements ORDER BY total_exec_time DESC LIMIT 25"
wait "$RUN" || { echo "statements.sh: the fleet run failed; its output: $LOG" >&2; exit 1; }
rm -f "$LOG"

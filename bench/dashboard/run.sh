#!/usr/bin/env bash
# run.sh - the web dashboard's benchmark (BENCHMARKS.md "Dashboard"): a real
# `roost server` with an org of 10,000 sandboxes (ROOST_BENCH_SANDBOXES),
# the page in headless Chromium (Debian's `chromium`, installed if missing):
# the list's first paint after a reload, the page's transfer, and how long
# after the server records an event an open timeline shows it. The driver
# is the ignored test `dashboard::benchmark` in crates/cli/tests/it.
#
# Usage: bench/dashboard/run.sh [--release]
#   --release  build roost and the driver optimised (default: the test
#              profile, as the suite builds them: dependencies optimised,
#              roost's own crates not; a pessimistic figure)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
PROFILE=()
if [ "${1:-}" = "--release" ]; then PROFILE=(--release); fi
if ! command -v chromium >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(uname -sr), $(chromium --version 2>/dev/null | head -n1)"
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
cargo test "${PROFILE[@]}" -p cli --test it -- --ignored --nocapture --exact dashboard::benchmark 2>&1 \
    | grep -E '^(created|list|page|event|test result)'
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"

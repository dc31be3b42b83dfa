#!/usr/bin/env bash
# The one command that runs every check, exactly as CI does: installs what
# the suite needs (as root, from the package registries), starts the
# services the tests use on loopback, then fmt, clippy and every test.
set -euo pipefail
cd "$(dirname "$0")/.."
# A fresh build gains nothing from incremental caches (they cost time and
# disk); a developer's environment may turn them back on.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

log() { printf '\n== %s\n' "$*" >&2; }

install_python_packages() {
    if ! python3 -c 'import moto.server, boto3' 2>/dev/null; then
        log "installing moto (S3-compatible test server) from PyPI"
        python3 -m pip install --quiet 'moto[server]>=5'
    fi
}

# The OCI runtimes the OCI layer's container tests drive (crates/oci): runc
# runs them on any cgroup layout; crun is tested where it works and for its
# refusal where it does not (hybrid cgroup hosts).
install_runtimes() {
    local missing=()
    command -v runc >/dev/null 2>&1 || missing+=(runc)
    command -v crun >/dev/null 2>&1 || missing+=(crun)
    # A static busybox is the image the imported-image tests run: no libc.
    [ -x /bin/busybox ] || missing+=(busybox-static)
    # Durable homes live on btrfs (a loop-mounted image on other filesystems).
    command -v mkfs.btrfs >/dev/null 2>&1 || missing+=(btrfs-progs)
    # `roost shell` is tested as a person uses it: inside tmux.
    command -v tmux >/dev/null 2>&1 || missing+=(tmux)
    if [ ${#missing[@]} -gt 0 ]; then
        log "installing ${missing[*]} from Debian"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
}

# The runner's bridge networking (crates/oci/src/network.rs) drives `ip`
# and `iptables` as a runner host does; its tests need both.
install_network_tools() {
    local missing=()
    command -v ip >/dev/null 2>&1 || missing+=(iproute2)
    command -v iptables-restore >/dev/null 2>&1 || missing+=(iptables)
    if [ ${#missing[@]} -gt 0 ]; then
        log "installing ${missing[*]} from Debian"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
}

# The dashboard's end-to-end test (crates/cli/tests/it/dashboard.rs) drives
# a headless Chromium over the DevTools protocol.
install_browser() {
    if ! command -v chromium >/dev/null 2>&1; then
        log "installing chromium from Debian"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    fi
}

# An S3-compatible server on loopback for the S3 backend tests.
start_s3() {
    local port
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    S3_LOG=$(mktemp)
    python3 -m moto.server -H 127.0.0.1 -p "$port" >"$S3_LOG" 2>&1 &
    S3_PID=$!
    for _ in $(seq 1 100); do
        if python3 - "$port" <<'PY' 2>/dev/null; then break; fi
import sys, urllib.request
urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/", timeout=1)
PY
        sleep 0.1
    done
    export AWS_ENDPOINT_URL="http://127.0.0.1:$port"
    export AWS_ACCESS_KEY_ID=roost-test AWS_SECRET_ACCESS_KEY=roost-test
    export AWS_REGION=us-east-1 AWS_ALLOW_HTTP=true
    export ROOST_TEST_S3_BUCKET=roost-test
    python3 - <<'PY'
import boto3, os
boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"]).create_bucket(Bucket="roost-test")
PY
    log "S3 test server on $AWS_ENDPOINT_URL (pid $S3_PID)"
}

# A throwaway PostgreSQL cluster on loopback for the records tests.
start_postgres() {
    local bin port
    bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1 || true)
    if [ -z "$bin" ] || [ ! -x "$bin/initdb" ]; then
        log "installing PostgreSQL from Debian"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
        bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n1)
    fi
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    PG_DIR=$(mktemp -d)
    chown postgres "$PG_DIR"
    runuser -u postgres -- "$bin/initdb" -D "$PG_DIR/data" -A trust -U roost >/dev/null
    runuser -u postgres -- "$bin/pg_ctl" -D "$PG_DIR/data" -l "$PG_DIR/log" -w \
        -o "-p $port -k $PG_DIR -c listen_addresses=127.0.0.1 -c max_connections=200" start >/dev/null
    PG_BIN=$bin
    export ROOST_TEST_POSTGRES_URL="postgres://roost@127.0.0.1:$port/postgres"
    log "PostgreSQL on 127.0.0.1:$port ($PG_DIR)"
}

cleanup() {
    if [ -n "${S3_PID:-}" ]; then kill "$S3_PID" 2>/dev/null || true; fi
    if [ -n "${PG_DIR:-}" ]; then
        runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$PG_DIR/data" -m immediate stop >/dev/null 2>&1 || true
        rm -rf "$PG_DIR"
    fi
}
trap cleanup EXIT

# The Python SDK (sdk/python): a venv under the target dir (reused when
# present) with its test tools, the SDK installed from the checkout
# without an index (its build backend is in-tree), then `mypy --strict`
# and its tests against a real `roost up` of the binary `cargo test` built.
python_sdk() {
    local target venv
    target=$(cd "${CARGO_TARGET_DIR:-target}" && pwd)
    venv="$target/sdk-venv"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    if ! "$venv/bin/python" -c 'import httpx, pytest, mypy' 2>/dev/null; then
        log "installing httpx, pytest and mypy into $venv from PyPI"
        "$venv/bin/pip" install --quiet 'httpx>=0.24,<1' pytest mypy
    fi
    # E2B's SDK, pinned: sdk/python/tests/test_e2b.py drives roost's
    # E2B-compatible API (`/e2b`) with the real client.
    if ! "$venv/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(m.version("e2b") != "2.63.0")' 2>/dev/null; then
        log "installing e2b==2.63.0 into $venv from PyPI"
        "$venv/bin/pip" install --quiet 'e2b==2.63.0'
    fi
    "$venv/bin/pip" install --quiet --no-index --no-deps --force-reinstall ./sdk/python
    (cd sdk/python && "$venv/bin/mypy" --strict src tests bench)
    (cd sdk/python && ROOST_BIN="$target/debug/roost" "$venv/bin/pytest" -q tests)
}

install_python_packages
install_runtimes
install_network_tools
install_browser
start_s3
start_postgres

log "cargo fmt --check"
cargo fmt --all -- --check
log "cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
log "cargo test"
test_log=$(mktemp)
cargo test --workspace --locked --no-fail-fast 2>&1 | tee "$test_log"
# One closing line over every test binary (cargo prints one per binary).
awk '/^test result:/ { passed += $4; failed += $6 } END { printf "\nall tests: %d passed, %d failed\n", passed, failed }' "$test_log"
rm -f "$test_log"
log "Python SDK: mypy --strict and pytest"
python_sdk

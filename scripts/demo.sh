#!/usr/bin/env bash
# The quick-start demo on embedded defaults: a local directory store.
# Builds roost, makes a small home, pushes it, changes one file, pushes
# again (only that file's block goes up), then pulls it somewhere else.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet
roost=target/release/roost
demo=${ROOST_DEMO_DIR:-/tmp/roost-demo}
rm -rf "$demo" && mkdir -p "$demo/home/notes" "$demo/home/.cache/pip"
export ROOST_STATE_DIR="$demo/state"
echo "remember: the flaky test is in parser.rs" > "$demo/home/notes/todo.md"
printf '#!/bin/sh\necho hello\n' > "$demo/home/run.sh" && chmod +x "$demo/home/run.sh"
head -c 10000000 /dev/urandom > "$demo/home/data.bin"
echo "scrap" > "$demo/home/.cache/pip/wheel.tmp"
run() { echo "+ $*"; "$@"; }
run $roost home push "$demo/home" --store "$demo/store" --org demo --home agent-1
echo "a second line" >> "$demo/home/notes/todo.md"
run $roost home push "$demo/home" --store "$demo/store" --org demo --home agent-1
run $roost home pull "$demo/restored" --store "$demo/store" --org demo --home agent-1
run diff -r "$demo/home/notes" "$demo/restored/notes"
run $roost store stats --store "$demo/store"
run $roost store verify --store "$demo/store"

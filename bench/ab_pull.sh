#!/usr/bin/env bash
# ab_pull.sh - A/B of two roost binaries, interleaved: a first push into an
# empty local store and a fresh pull into a new loop-mounted btrfs (direct
# I/O), each with its sync. Usage: bench/ab_pull.sh HOME ROUNDS BIN... (root)
set -euo pipefail
home=$1 rounds=${2:-2}; shift 2
scratch=$(mktemp -d /var/tmp/roost-ab-pull.XXXXXX)
cleanup() { umount "$scratch/mnt" 2>/dev/null || true; rm -rf "$scratch"; }
trap cleanup EXIT
export ROOST_HOME_EXCLUDES=
now() { date +%s.%N; }
for round in $(seq 1 "$rounds"); do
  for bin in "$@"; do
    rm -rf "$scratch/store" "$scratch/state-push" "$scratch/img" "$scratch/state-pull"
    sync
    start=$(now)
    "$bin" home push "$home" --store "$scratch/store" --org o --home h --state-dir "$scratch/state-push" --json >/dev/null
    sync
    pushed=$(now)
    mkdir -p "$scratch/mnt"
    truncate -s 8G "$scratch/img"
    mkfs.btrfs -q "$scratch/img" >/dev/null 2>&1
    device=$(losetup -f --show --direct-io=on "$scratch/img")
    mount -o nosuid,nodev "$device" "$scratch/mnt"
    losetup -d "$device"
    sync
    start_pull=$(now)
    "$bin" home pull --store "$scratch/store" --org o --home h --state-dir "$scratch/state-pull" "$scratch/mnt/home" >/dev/null
    sync
    end=$(now)
    umount "$scratch/mnt"
    python3 -c "print('$bin', $round, 'push', round($pushed - $start, 2), 'pull', round($end - $start_pull, 2))"
  done
done

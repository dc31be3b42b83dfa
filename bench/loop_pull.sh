#!/usr/bin/env bash
# loop_pull.sh - a fresh `roost home pull` into a new loop-mounted btrfs
# image (what a runner's homes are on a host whose data dir is not
# btrfs), with the loop device buffered and in direct I/O, alternating.
#
# Usage: bench/loop_pull.sh HOME_DIR [ROUNDS]   (root; mkfs.btrfs, losetup)
#   HOME_DIR  a home to pull back (e.g. one made by bench/gen_home.py)
#   ROUNDS    pulls in each mode (default 2)
# ROOST_BIN: the binary (default target/release/roost). Pushes HOME_DIR to
# a scratch store once, then prints "MODE ROUND PULL_S PULL_AND_SYNC_S".
set -euo pipefail
[ $# -ge 1 ] || { sed -n 2,10p "$0"; exit 2; }
home=$1 rounds=${2:-2}
bin=${ROOST_BIN:-$(dirname "$0")/../target/release/roost}
scratch=$(mktemp -d /var/tmp/roost-loop-pull.XXXXXX)
cleanup() { umount "$scratch/mnt" 2>/dev/null || true; rm -rf "$scratch"; }
trap cleanup EXIT
export ROOST_HOME_EXCLUDES=
"$bin" home push "$home" --store "$scratch/store" --org o --home h \
  --state-dir "$scratch/state-push" --json >/dev/null
now() { date +%s.%N; }
for round in $(seq 1 "$rounds"); do
  for mode in direct buffered; do
    rm -rf "$scratch/img" "$scratch/state-pull"
    mkdir -p "$scratch/mnt"
    truncate -s 8G "$scratch/img"
    mkfs.btrfs -q "$scratch/img" >/dev/null 2>&1
    device=$(losetup -f --show --direct-io="$([ $mode = direct ] && echo on || echo off)" "$scratch/img")
    mount -o nosuid,nodev "$device" "$scratch/mnt"
    losetup -d "$device" # freed at unmount
    sync
    start=$(now)
    "$bin" home pull --store "$scratch/store" --org o --home h \
      --state-dir "$scratch/state-pull" "$scratch/mnt/home" >/dev/null
    pulled=$(now)
    sync
    end=$(now)
    umount "$scratch/mnt"
    python3 -c "print('$mode', $round, round($pulled - $start, 2), round($end - $start, 2))"
  done
done

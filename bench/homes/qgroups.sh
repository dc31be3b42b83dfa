#!/bin/bash
# What btrfs quota groups (on for a runner's own homes image since
# 2026-12-07, for `resources.home_mib`) cost a home's writes, its save
# snapshots and their deletion: the same work on a fresh image with quota
# groups off, then on. Needs root and btrfs-progs.
#
# usage: bench/homes/qgroups.sh [WORKDIR]   (default /tmp/roost-qgroups)
set -euo pipefail
D=${1:-/tmp/roost-qgroups}
mkdir -p "$D"
# 20,000 small files (from /usr/share) and one 500 MiB file.
if [ ! -f "$D/small.tar" ]; then
  (cd /usr/share && find . -type f 2>/dev/null | head -20000 | tar cf "$D/small.tar" -T - 2>/dev/null) || true
fi
[ -f "$D/big.bin" ] || head -c $((500 << 20)) /dev/urandom > "$D/big.bin"
now() { date +%s.%N; }
since() { echo "$(now) - $1" | bc; }
for MODE in off on; do
  IMG=$D/bench-$MODE.img; M=$D/mnt-$MODE
  rm -f "$IMG"; truncate -s 4G "$IMG"; mkfs.btrfs -q "$IMG" >/dev/null 2>&1; mkdir -p "$M"
  mount -o loop,nosuid,nodev "$IMG" "$M"
  [ "$MODE" = on ] && btrfs quota enable "$M" && btrfs quota rescan -w "$M" >/dev/null
  mkdir -p "$M/snapshots"
  for i in 1 2 3; do
    btrfs subvolume create "$M/w$i" >/dev/null
    [ "$MODE" = on ] && btrfs qgroup limit 2G "$M/w$i"
    s=$(now); tar xf "$D/small.tar" -C "$M/w$i"; sync
    echo "quotas $MODE: tar x of 20,000 files + sync, run $i: $(since "$s") s"
  done
  btrfs subvolume create "$M/home" >/dev/null
  [ "$MODE" = on ] && btrfs qgroup limit 2G "$M/home"
  tar xf "$D/small.tar" -C "$M/home"; cp "$D/big.bin" "$M/home/"; sync
  for i in 1 2 3; do
    s=$(now); btrfs subvolume snapshot -r "$M/home" "$M/snapshots/s$i" >/dev/null; snap=$(since "$s")
    echo "written since the save $i" > "$M/home/touched$i"; sync
    s=$(now); btrfs subvolume delete "$M/snapshots/s$i" >/dev/null; btrfs filesystem sync "$M"
    while [ -n "$(btrfs subvolume list -d "$M")" ]; do sleep 0.05; done
    echo "quotas $MODE: snapshot -r ${snap} s, its delete until gone $(since "$s") s (run $i)"
  done
  umount "$M"; rm -f "$IMG"; rmdir "$M"
done

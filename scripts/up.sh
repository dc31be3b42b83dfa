#!/usr/bin/env bash
# The one command that runs roost on a fresh Debian machine with Rust:
# installs what `roost up` needs from the package registry where it is
# missing (as root: runc for sandboxes, btrfs-progs for durable homes,
# iproute2 and iptables for bridge networking), builds the CLI, and runs
# `roost up` with any arguments given (e.g. --listen 0.0.0.0:7070).
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v runc >/dev/null 2>&1 || command -v crun >/dev/null 2>&1 || missing+=(runc)
command -v mkfs.btrfs >/dev/null 2>&1 || missing+=(btrfs-progs)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v iptables-restore >/dev/null 2>&1 || missing+=(iptables)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "roost: needs ${missing[*]}; run this as root to install them (apt-get install ${missing[*]})" >&2
        exit 1
    fi
    echo "roost: installing ${missing[*]} from Debian" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

cargo build --release --locked -p cli
exec target/release/roost up "$@"

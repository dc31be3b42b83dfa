#!/usr/bin/env python3
"""bench/failover/bench.py - host loss to running again (issue 6), end to end.

Starts `roost server` (SQLite, a local-directory store, the default lease of
9 s and fence margin of 1 s) and `roost runner` processes (runc, homes on
loop-mounted btrfs) on loopback. For a small and a grown durable home it
saves the home, then destroys the sandbox's host the way a dead machine
goes: kill -9 of the runner, its containers gone, its data dir deleted.
From that instant and the server's own event times it reports:

  detect + fence   host lost -> `recovering` (lease expiry + fence margin,
                   up to one reconcile tick; the epoch bump fences the host)
  place            `recovering` -> `starting` on another runner
  restore + start  `starting` -> `running`: the last completed save's
                   blocks come down (all of them: the new host has none)
                   and the container starts
  total            host lost -> running again
  peer             restic 0.14 restoring the same home from a local
                   repository, in the same run: the transfer alone

Usage: bench/failover/bench.py [--quick] [--keep] [--no-build]
  --quick     grown home of 2,000 files / 40 MB (a smoke test, not a result)
Needs root, runc, btrfs-progs, restic. Prints a markdown report and saves it
to bench/results/<date>-failover.md.
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("durable_bench", ROOT / "bench/durable/bench.py")
durable = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(durable)

BIN, GEN, log, ms = durable.BIN, durable.GEN, durable.log, durable.ms
QUICK = "--quick" in sys.argv
GROWN = (2_000, "40M") if QUICK else (20_000, "500M")
LEASE_S, MARGIN_S = 9, 1


class Bench(durable.Bench):
    def start_server(self):
        super().start_server(lease=("--lease-ttl", f"{LEASE_S}s", "--fence-margin", f"{MARGIN_S}s"))

    def start_host(self, name):
        data = self.work / name
        logf = self.work / f"{name}.log"
        env = dict(self.env, ROOST_LOG="info", ROOST_LOG_FORMAT="json", ROOST_RUNNER_TOKEN=self.runner_token)
        proc = subprocess.Popen(
            [str(BIN), "runner", "--server", self.url, "--data-dir", str(data), "--runtime", "runc",
             "--homes-image-size", "64GiB", "--name", name, "--cgroup-parent", f"roost-bench-{name}"],
            env=env, stdout=subprocess.DEVNULL, stderr=open(logf, "w"))
        self.procs.append(proc)
        deadline = time.time() + 30
        while time.time() < deadline:
            for line in logf.read_text().splitlines():
                if '"registered"' in line:
                    return {"name": name, "proc": proc, "data": data,
                            "id": json.loads(line)["fields"]["runner_id"]}
            time.sleep(0.1)
        raise SystemExit(f"runner {name} did not register")

    def destroy(self, host):
        """The host dies: the runner, its containers, its disk."""
        lost_at = datetime.now(timezone.utc)
        host["proc"].kill()
        host["proc"].wait()
        root = host["data"] / "runtime"
        for entry in (root.iterdir() if root.exists() else []):
            subprocess.run(["runc", f"--root={root}", "delete", "--force", entry.name],
                           stderr=subprocess.DEVNULL)
        subprocess.run(["umount", "-l", str(host["data"] / "volumes")], stderr=subprocess.DEVNULL)
        shutil.rmtree(host["data"], ignore_errors=True)
        return lost_at.isoformat().replace("+00:00", "Z")

    def admin(self, *args):
        subprocess.run([str(BIN), "admin", *args], env=dict(self.env, ROOST_TOKEN=self.admin_token),
                       check=True, stdout=subprocess.DEVNULL)

    def bytes_out(self):
        request = urllib.request.Request(f"{self.url}/metrics",
                                         headers={"Authorization": f"Bearer {self.admin_token}"})
        with urllib.request.urlopen(request) as response:
            metrics = response.read().decode()
        for line in metrics.splitlines():
            if line.startswith('roost_block_bytes_total{direction="out"}'):
                return int(float(line.split()[-1]))
        return 0

    def wait_saved(self, sid, after):
        deadline = time.time() + 1800
        while (self.json("sandbox", "get", sid)["save"].get("last_completed_at") or "") <= after:
            if time.time() > deadline:
                raise SystemExit("no save completed")
            time.sleep(0.2)


def case(bench, label, source, target, fill):
    """A durable sandbox on `source`, filled and saved; `source` destroyed;
    measured until it runs on `target`."""
    # Only `source` may take the new sandbox: the target is drained meanwhile.
    bench.admin("runner", "drain", target["id"])
    sb = bench.json("sandbox", "create", "--storage-class", "durable", "--save-interval", "5s", "--wait")
    bench.admin("runner", "undrain", target["id"])
    sid = sb["id"]
    assert sb["runner_id"] == source["id"], f"{sid} landed on {sb['runner_id']}, not {source['name']}"
    home = source["data"] / "volumes/homes" / sid
    fill(home)
    files = sum(len(f) for _, _, f in os.walk(home))
    size = sum(os.lstat(os.path.join(d, n)).st_size for d, _, fs in os.walk(home) for n in fs)
    written = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
    log(f"{label}: {files} files, {size / 2**20:.1f} MiB; waiting for a save")
    bench.wait_saved(sid, written)
    out_before = bench.bytes_out()
    lost_at = bench.destroy(source)
    log(f"{label}: host {source['name']} destroyed; waiting for {sid} on {target['name']}")
    deadline = time.time() + 600
    while True:
        sb = bench.json("sandbox", "get", sid)
        if sb["state"] == "running" and sb.get("runner_id") == target["id"]:
            break
        if time.time() > deadline:
            raise SystemExit(f"{sid} did not come back: {sb}")
        time.sleep(0.05)
    events = bench.events(sid)
    recovering = next(e for e in events if e["state"] == "recovering")
    starting = next(e for e in events if e["state"] == "starting" and e["seq"] > recovering["seq"])
    running = next(e for e in events if e["state"] == "running" and e["seq"] > starting["seq"])
    result = {
        "label": label, "files": files, "bytes": size, "home": home, "sid": sid,
        "detect": ms(lost_at, recovering["at"]),
        "place": ms(recovering["at"], starting["at"]),
        "restore": ms(starting["at"], running["at"]),
        "total": ms(lost_at, running["at"]),
        "downloaded": bench.bytes_out() - out_before,
    }
    bench.roost("sandbox", "delete", sid)
    return result


def restic_restore(work, label, fill):
    """restic: back up the same kind of home, then time a restore of it."""
    src = work / f"restic-src-{label}"
    src.mkdir()
    fill(src)
    repo = work / f"restic-{label}"
    env = dict(os.environ, RESTIC_PASSWORD="bench")
    subprocess.run(["restic", "-r", str(repo), "init", "-q"], env=env, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["restic", "-r", str(repo), "backup", "-q", str(src)], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    dest = work / f"restic-dest-{label}"
    started = time.monotonic()
    subprocess.run(["restic", "-r", str(repo), "restore", "latest", "-q", "--target", str(dest)], env=env,
                   check=True, stdout=subprocess.DEVNULL)
    return (time.monotonic() - started) * 1000


def main():
    if "--no-build" not in sys.argv:
        log("building roost (release)")
        subprocess.run(["cargo", "build", "--release", "-p", "cli", "--bin", "roost"], cwd=ROOT, check=True)
    work = Path(tempfile.mkdtemp(prefix="roost-failover-bench-", dir="/var/tmp"))
    bench = Bench(work)

    def small(home):
        for i in range(10):
            (home / f"note-{i}.md").write_text(f"note {i}\n" * 100)

    def grown(home):
        subprocess.run([sys.executable, str(GEN), str(home), "--files", str(GROWN[0]), "--size", GROWN[1]],
                       check=True, stdout=subprocess.DEVNULL)

    try:
        bench.start_server()
        a = bench.start_host("a")
        b = bench.start_host("b")
        results = [case(bench, "small", a, b, small)]
        results.append(case(bench, "grown", bench.start_host("c"), b, grown))
        log("restic restores of the same homes")
        for result, fill in zip(results, (small, grown)):
            result["restic"] = restic_restore(work, result["label"], fill)
        rows = "\n".join(
            f"| {r['label']}: {r['files']:,} files, {r['bytes'] / 2**20:.1f} MiB | {r['detect']:.0f} ms | "
            f"{r['place']:.0f} ms | {r['restore']:.0f} ms ({r['downloaded'] / 2**20:.1f} MiB down) | "
            f"**{r['total']:.0f} ms** | {r['restic']:.0f} ms | {r['restore'] / r['restic']:.2f} | "
            f"{(r['total'] - r['restore']) / 1000:.1f} s |"
            for r in results)
        report = f"""### Host loss to running again ({datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M')} UTC{' QUICK' if QUICK else ''})

Lease {LEASE_S} s (heartbeat every {LEASE_S / 3:.0f} s; a runner freezes its sandboxes {LEASE_S * 2 / 3:.0f} s after its last answered heartbeat), fence margin {MARGIN_S} s, reconcile every 1 s. The host is destroyed (runner kill -9, containers gone, data dir deleted); times are from that instant to the server's event times. Store: local directory; runners: runc, homes on loop-mounted btrfs; the new host holds none of the blocks.

| home | detect + fence | place | restore + start | total | restic restore (same home) | restore / restic | total without the transfer (target < 15 s) |
|---|---|---|---|---|---|---|---|
{rows}
"""
        print(report)
        out = ROOT / "bench/results" / f"{datetime.now().strftime('%Y-%m-%d_%H%M')}-failover{'-quick' if QUICK else ''}.md"
        out.write_text(report)
        log(f"saved {out}")
    finally:
        bench.cleanup()
        if "--keep" not in sys.argv:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

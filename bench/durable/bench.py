#!/usr/bin/env python3
"""bench/durable/bench.py - durable homes benchmark (issue 5), end to end.

Starts `roost server` (SQLite, a local-directory store) and two `roost runner`
processes (runc, homes on loop-mounted btrfs) on loopback, grows a durable
sandbox's home with bench/gen_home.py (about 100k files / 2 GB by default),
and measures from the server's own event times:

  securing cold   stop of a home never saved: stopping -> stopped
  wake, last      start on the runner that secured it: starting -> running
  securing warm   1% of the files changed since the last save: stop -> stopped
  wake, fresh     start on another runner (the first one killed): only the
                  blocks missing from its cache come down
  snapshot pause  a second sandbox (from a snapshot of the first) saved every
                  few seconds while 1% of its files change between saves: the
                  read-only btrfs snapshot's duration, p50 / p99, from the
                  runner's "home saved" log lines
  peer            restic 0.14 backing up the same home to a local repository,
                  cold and after the same 1% change, in the same run; and
                  restoring its last snapshot into an empty directory (the
                  peer of a wake on a fresh runner)

Usage: bench/durable/bench.py [--quick] [--keep] [--no-build]
  --quick     2,000 files / 40 MB, 5 saves (a smoke test, not a result)
Needs root, runc, btrfs-progs, restic. Prints a markdown report and saves it
to bench/results/<date>-durable.md.
"""
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# ROOST_BIN: another build (with --no-build), e.g. to compare two in turn.
BIN = Path(os.environ.get("ROOST_BIN", ROOT / "target/release/roost"))
GEN = ROOT / "bench/gen_home.py"
QUICK = "--quick" in sys.argv
FILES, SIZE, SAVES = (2_000, "40M", 5) if QUICK else (100_000, "2G", 20)
SAVE_EVERY = 4


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ms(a, b):
    parse = lambda t: datetime.fromisoformat(t.replace("Z", "+00:00"))
    return (parse(b) - parse(a)).total_seconds() * 1000


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


class Bench:
    def __init__(self, work: Path):
        self.work = work
        self.procs = []
        self.env = dict(os.environ)

    def roost(self, *args, check=True):
        out = subprocess.run([str(BIN), *args], env=self.env, capture_output=True, text=True)
        if check and out.returncode != 0:
            raise SystemExit(f"roost {' '.join(args)} failed: {out.stderr.strip()}")
        return out.stdout

    def json(self, *args):
        return json.loads(self.roost(*args, "--json"))

    def start_server(self, lease=("--lease-ttl", "3s"), extra=()):
        data = self.work / "server"
        proc = subprocess.Popen(
            [str(BIN), "server", "--listen", "127.0.0.1:0", "--data-dir", str(data),
             "--store", str(self.work / "store"), *lease, "--save-interval-min", "1s", *extra],
            stdout=subprocess.PIPE, stderr=open(self.work / "server.log", "w"), text=True)
        self.procs.append(proc)
        url = proc.stdout.readline().split()[-1]
        admin = proc.stdout.readline().split()[-1]
        self.env.update(ROOST_URL=url, ROOST_TOKEN=admin)
        self.admin_token = admin
        org = self.json("admin", "org", "create", "bench")
        runner_token = self.json("admin", "runner-token")["token"]
        self.env["ROOST_TOKEN"] = org["token"]
        self.url, self.runner_token = url, runner_token

    def start_runner(self, name):
        data = self.work / name
        logf = self.work / f"{name}.log"
        env = dict(self.env, ROOST_LOG="info", ROOST_LOG_FORMAT="json", ROOST_RUNNER_TOKEN=self.runner_token)
        proc = subprocess.Popen(
            [str(BIN), "runner", "--server", self.url, "--data-dir", str(data), "--runtime", "runc",
             "--homes-image-size", "64GiB", "--name", name],
            env=env, stdout=subprocess.DEVNULL, stderr=open(logf, "w"))
        self.procs.append(proc)
        deadline = time.time() + 30
        while time.time() < deadline:
            if '"registered"' in logf.read_text():
                return proc, data, logf
            time.sleep(0.1)
        raise SystemExit(f"runner {name} did not register")

    def events(self, sid):
        return self.json("sandbox", "events", sid)["events"]

    def span(self, sid, since_seq, start_state, end_state):
        """ms between the first start_state and the next end_state event after since_seq."""
        events = [e for e in self.events(sid) if e["seq"] > since_seq]
        start = next(e for e in events if e["state"] == start_state)
        end = next(e for e in events if e["state"] == end_state and e["seq"] > start["seq"])
        return ms(start["at"], end["at"]), end["seq"]

    def last_seq(self, sid):
        return max(e["seq"] for e in self.events(sid))

    def stop(self, sid):
        seq = self.last_seq(sid)
        self.roost("sandbox", "stop", sid)
        self.roost("sandbox", "wait", sid, "stopped", "--timeout", "30m")
        total, _ = self.span(sid, seq, "stopping", "stopped")
        securing, _ = self.span(sid, seq, "securing", "stopped")
        return total, securing

    def start(self, sid):
        seq = self.last_seq(sid)
        self.roost("sandbox", "start", sid)
        self.roost("sandbox", "wait", sid, "running", "--timeout", "30m")
        wake, _ = self.span(sid, seq, "starting", "running")
        return wake

    def cleanup(self):
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        subprocess.run(["sh", "-c", f"for r in {self.work}/*/runtime/*; do [ -e \"$r\" ] && runc --root=$(dirname $r) delete --force $(basename $r); done; "
                                    f"for v in {self.work}/*/volumes; do umount -l $v 2>/dev/null; done; true"],
                       stderr=subprocess.DEVNULL)


def restic(repo, path, env):
    started = time.monotonic()
    subprocess.run(["restic", "-r", str(repo), "backup", "-q", str(path)], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return (time.monotonic() - started) * 1000


def main():
    if "--no-build" not in sys.argv:
        log("building roost (release)")
        subprocess.run(["cargo", "build", "--release", "-p", "cli", "--bin", "roost"], cwd=ROOT, check=True)
    work = Path(tempfile.mkdtemp(prefix="roost-durable-bench-", dir="/var/tmp"))
    bench = Bench(work)
    try:
        bench.start_server()
        _, data_a, log_a = bench.start_runner("a")
        sb = bench.json("sandbox", "create", "--storage-class", "durable", "--save-interval", "24h", "--wait")
        sid = sb["id"]
        home = data_a / "volumes/homes" / sid
        log(f"growing {sid}'s home: {FILES} files, {SIZE}")
        subprocess.run([sys.executable, str(GEN), str(home), "--files", str(FILES), "--size", SIZE], check=True,
                       stdout=subprocess.DEVNULL)
        files = sum(len(f) for _, _, f in os.walk(home))
        size = sum(os.lstat(os.path.join(d, n)).st_size for d, _, fs in os.walk(home) for n in fs)
        # The peer first, on the same tree, while nothing else runs.
        repo = work / "restic"
        renv = dict(os.environ, RESTIC_PASSWORD="bench")
        subprocess.run(["restic", "-r", str(repo), "init", "-q"], env=renv, check=True, stdout=subprocess.DEVNULL)
        log("restic cold")
        restic_cold = restic(repo, home, renv)

        log("securing cold")
        stop_cold, secure_cold = bench.stop(sid)
        log("wake on the last runner")
        wake_last = bench.start(sid)
        subprocess.run([sys.executable, str(GEN), str(home), "--mutate", "1", "--seed", "2"], check=True,
                       stdout=subprocess.DEVNULL)
        log("restic warm")
        restic_warm = restic(repo, home, renv)
        log("securing warm")
        stop_warm, secure_warm = bench.stop(sid)

        # A second host; the first goes away, so the start lands there.
        runner_b, data_b, log_b = bench.start_runner("b")
        bench.procs[1].kill()
        bench.procs[1].wait()
        log("waiting for runner a's lease to expire")
        deadline = time.time() + 60
        while bench.json("sandbox", "get", sid).get("runner_id") and time.time() < deadline:
            time.sleep(0.5)
        log("wake on a fresh runner")
        wake_fresh = bench.start(sid)
        log("restic restore")
        # Untimed: the wake's writeback is the wake's, not restic's to wait
        # behind.
        subprocess.run(["sync"], check=True)
        restored = work / "restic-restore"
        started = time.monotonic()
        subprocess.run(["restic", "-r", str(repo), "restore", "latest", "-q", "--target", str(restored)],
                       env=renv, check=True, stdout=subprocess.DEVNULL)
        restic_restore = (time.monotonic() - started) * 1000
        shutil.rmtree(restored, ignore_errors=True)

        # Saves while running: a child of a snapshot, saved every few seconds.
        snap = bench.json("snapshot", "create", sid, "--wait")
        child = bench.json("sandbox", "create", "--storage-class", "durable", "--from-snapshot", snap["id"],
                           "--save-interval", f"{SAVE_EVERY}s", "--wait")
        child_home = data_b / "volumes/homes" / child["id"]
        log(f"{SAVES} running saves, 1% changed between saves")
        seen = 0
        for i in range(SAVES):
            subprocess.run([sys.executable, str(GEN), str(child_home), "--mutate", "1", "--seed", str(10 + i)],
                           check=True, stdout=subprocess.DEVNULL)
            before = bench.json("sandbox", "get", child["id"])["save"].get("last_completed_at") or ""
            deadline = time.time() + 600
            while (bench.json("sandbox", "get", child["id"])["save"].get("last_completed_at") or "") <= before:
                if time.time() > deadline:
                    raise SystemExit("a running save did not complete")
                time.sleep(0.2)
        pauses, save_ms = [], []
        materialised = None  # the fresh wake's own pull, from runner b's log
        for line in log_b.read_text().splitlines():
            entry = json.loads(line) if line.startswith("{") else {}
            fields = entry.get("fields", {})
            if fields.get("message") == "home saved" and "snapshot_ms" in fields:
                pauses.append(float(fields["snapshot_ms"]))
            if fields.get("message") == "home materialised" and materialised is None:
                materialised = fields
        pull_ms = float(materialised["elapsed_ms"]) if materialised else float("nan")
        pulled_blocks = materialised.get("blocks_downloaded", "?") if materialised else "?"
        report = f"""### Durable homes ({datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M')} UTC{' QUICK' if QUICK else ''})

Home: {files:,} files, {size / 2**30:.2f} GiB (bench/gen_home.py); store: local directory; runners: runc, homes on loop-mounted btrfs.

| measurement | roost | restic 0.14 (same tree, local repo) | roost / restic |
|---|---|---|---|
| securing cold (first save; stopping -> stopped {stop_cold:.0f} ms) | {secure_cold:.0f} ms | backup cold {restic_cold:.0f} ms | {secure_cold / restic_cold:.2f} |
| securing warm (1% changed; stopping -> stopped {stop_warm:.0f} ms) | {secure_warm:.0f} ms | backup warm {restic_warm:.0f} ms | {secure_warm / restic_warm:.2f} |
| wake on the last runner (starting -> running) | {wake_last:.0f} ms | | |
| wake on a fresh runner (starting -> running, whole home from the store) | {wake_fresh:.0f} ms | restore into an empty dir {restic_restore:.0f} ms | {wake_fresh / restic_restore:.2f} |
| of which the home's pull through the block service ("home materialised", {pulled_blocks} blocks) | {pull_ms:.0f} ms | | {pull_ms / restic_restore:.2f} |
| snapshot pause during running saves ({len(pauses)} saves) | p50 {pct(pauses, 50):.1f} ms, p99 {pct(pauses, 99):.1f} ms | | |
"""
        print(report)
        out = ROOT / "bench/results" / f"{datetime.now().strftime('%Y-%m-%d_%H%M')}-durable{'-quick' if QUICK else ''}.md"
        out.write_text(report)
        log(f"saved {out}")
    finally:
        bench.cleanup()
        if "--keep" not in sys.argv:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

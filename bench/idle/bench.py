#!/usr/bin/env python3
"""bench/idle/bench.py - sleeping when idle and waking on use (issue 16).

Starts `roost server` (SQLite, a local-directory store, idle timeouts from
1 s allowed) and `roost runner` processes (runc, homes on btrfs) on
loopback, as bench/durable/bench.py does, and measures:

  idle CPU        the server's and the runner's CPU time (utime + stime from
                  /proc) over a window with no sandbox at all, then over the
                  same window with N sandboxes asleep (default 1,000)
  detection       how long after a sandbox's `idle_deadline` the server
                  decided it sleeps (the `idle` event's time), 10 sandboxes
  wake, small     `roost exec ID -- true` on a sleeping durable sandbox with
                  a small home, its last runner live, wall clock, 10 times;
                  peer: the same `roost exec` on it running, same run
  wake, grown     the same on the 100k-file / 2 GiB home (3 times)
  wake, fresh     the same on another runner (the first drained): the exec's
                  wall clock minus the wake itself (starting -> running from
                  the events), i.e. what waking on use adds to a fresh wake

Usage: bench/idle/bench.py [--quick] [--cpu-only] [--no-build]
  --quick     50 asleep, 20 s windows, 2,000 files / 40 MB (a smoke test)
  --cpu-only  only the idle CPU windows (no detection, no wakes)
Needs root, runc, btrfs-progs. Prints a markdown report and saves it to
bench/results/<date>-idle.md.
"""
import importlib.util
import json
import os
import statistics
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
log, ms, pct, BIN, GEN = durable.log, durable.ms, durable.pct, durable.BIN, durable.GEN

QUICK = "--quick" in sys.argv
CPU_ONLY = "--cpu-only" in sys.argv
ASLEEP, WINDOW_S = (50, 20) if QUICK else (1000, 60)
FILES, SIZE = (2_000, "40M") if QUICK else (100_000, "2G")
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def cpu_over(pids, seconds):
    before = [cpu_seconds(p) for p in pids]
    time.sleep(seconds)
    return [cpu_seconds(p) - b for p, b in zip(pids, before)]


def assignment_answers(url, admin_token):
    """The server's assignments long-polls so far, by answer (read, unchanged)."""
    request = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {admin_token}"})
    text = urllib.request.urlopen(request).read().decode()
    counts = {}
    for line in text.splitlines():
        if line.startswith("roost_runner_assignments_total{"):
            answer = line.split('answer="')[1].split('"')[0]
            counts[answer] = int(float(line.rsplit(" ", 1)[1]))
    return counts


def parse(t):
    return datetime.fromisoformat(t.replace("Z", "+00:00"))


class Idle(durable.Bench):
    def post(self, path, body):
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), method="POST",
            headers={"Authorization": f"Bearer {self.env['ROOST_TOKEN']}", "Content-Type": "application/json"})
        with urllib.request.urlopen(request) as answer:
            return json.loads(answer.read())

    def exec_ms(self, sid, *argv):
        started = time.monotonic()
        self.roost("exec", sid, "--", *(argv or ("true",)))
        return (time.monotonic() - started) * 1000

    def asleep(self, sid):
        self.roost("sandbox", "stop", sid)
        self.roost("sandbox", "wait", sid, "stopped", "--timeout", "30m")


def main():
    if "--no-build" not in sys.argv:
        log("building roost (release)")
        subprocess.run(["cargo", "build", "--release", "-p", "cli", "--bin", "roost"], cwd=ROOT, check=True)
    work = Path(tempfile.mkdtemp(prefix="roost-idle-bench-", dir="/var/tmp"))
    bench = Idle(work)
    try:
        # A lease long enough that a loaded machine (1,000 containers
        # starting and stopping) never loses a runner on the way.
        bench.start_server(lease=("--lease-ttl", "30s"), extra=("--idle-timeout-min", "1s"))
        server_pid = bench.procs[0].pid
        runner_a, data_a, _ = bench.start_runner("a")
        # Both runners from the start: the idle windows compare the same
        # processes.
        runner_b, _, _ = bench.start_runner("b")
        pids = [server_pid, runner_a.pid, runner_b.pid]

        log(f"CPU over {WINDOW_S} s with no sandbox")
        cpu_none = cpu_over(pids, WINDOW_S)

        if not CPU_ONLY:
            log("idle detection, 10 sandboxes (idle_timeout_s 2)")
            late = []
            for _ in range(10):
                sb = bench.json("sandbox", "create", "--idle-timeout", "2s", "--wait")
                sid = sb["id"]
                deadline = bench.json("sandbox", "get", sid)["idle_deadline"]
                bench.roost("sandbox", "wait", sid, "stopped", "--timeout", "60s")
                decided = next(e for e in bench.events(sid) if e["reason"] == "idle")
                late.append(ms(deadline, decided["at"]))
                bench.roost("sandbox", "delete", sid)

            log("wake of a small durable home on its last runner")
            sid = bench.json("sandbox", "create", "--storage-class", "durable", "--idle-timeout", "0",
                             "--save-interval", "24h", "--wait")["id"]
            bench.roost("exec", sid, "--", "sh", "-c", "echo hello > /workspace/note.txt")
            warm = [bench.exec_ms(sid) for _ in range(10)]
            small = []
            for _ in range(10):
                bench.asleep(sid)
                small.append(bench.exec_ms(sid))

            log(f"growing a durable home: {FILES} files, {SIZE}")
            gid = bench.json("sandbox", "create", "--storage-class", "durable", "--idle-timeout", "0",
                             "--save-interval", "24h", "--wait")["id"]
            home = data_a / "volumes/homes" / gid
            subprocess.run([sys.executable, str(GEN), str(home), "--files", str(FILES), "--size", SIZE],
                           check=True, stdout=subprocess.DEVNULL)
            log("securing it (cold)")
            bench.asleep(gid)
            grown = []
            for _ in range(3):
                grown.append(bench.exec_ms(gid))
                bench.asleep(gid)

            log("wake on a fresh runner (runner a drained)")
            env = dict(bench.env, ROOST_TOKEN=bench.admin_token)
            runners = json.loads(subprocess.run([str(BIN), "admin", "runner", "list", "--json"], env=env,
                                                capture_output=True, text=True, check=True).stdout)
            a_id = next(r["id"] for r in (runners["runners"] if isinstance(runners, dict) else runners) if r["name"] == "a")
            subprocess.run([str(BIN), "admin", "runner", "drain", a_id], env=env, check=True,
                           stdout=subprocess.DEVNULL)
            seq = bench.last_seq(gid)
            fresh_total = bench.exec_ms(gid)
            fresh_wake, _ = bench.span(gid, seq, "starting", "running")
            subprocess.run([str(BIN), "admin", "runner", "undrain", a_id], env=env, check=True,
                           stdout=subprocess.DEVNULL)
            bench.roost("sandbox", "delete", gid)

        log(f"{ASLEEP} sandboxes going to sleep (idle_timeout_s 1)")
        ids = [bench.post("/v1/sandboxes", {"idle_timeout_s": 1})["id"] for _ in range(ASLEEP)]
        deadline = time.time() + 3600
        for sid_ in ids:
            while bench.json("sandbox", "get", sid_)["state"] != "stopped":
                if time.time() > deadline:
                    raise SystemExit(f"{sid_} did not go to sleep")
                time.sleep(0.5)
        # Their stops' last steps (containers deleted) are not idle cost.
        # Beyond one whole long-poll (25 s) past the last of them: every
        # runner's set is read once more after the last change.
        time.sleep(30)
        log(f"CPU over {WINDOW_S} s with {ASLEEP} asleep")
        answers_before = assignment_answers(bench.url, bench.admin_token)
        cpu_asleep = cpu_over(pids, WINDOW_S)
        answers = {k: v - answers_before.get(k, 0) for k, v in assignment_answers(bench.url, bench.admin_token).items()}

        wake_rows = "" if CPU_ONLY else f"""| idle detection after the deadline, p50 / max | {statistics.median(late):.0f} / {max(late):.0f} ms | | | ≤ 1 s |
| `roost exec -- true` on an asleep small durable home, last runner, p50 / max | {statistics.median(small):.0f} / {max(small):.0f} ms | the same exec on it running: {statistics.median(warm):.0f} ms | {statistics.median(small) / statistics.median(warm):.1f} | ≤ 300 ms |
| the same on the grown home ({FILES} files, {SIZE}), p50 / max | {statistics.median(grown):.0f} / {max(grown):.0f} ms | | | ≤ 1 s |
| the same on a fresh runner: exec wall clock, of which the wake (starting -> running) | {fresh_total:.0f} ms, {fresh_wake:.0f} ms | | exec adds {fresh_total - fresh_wake:.0f} ms | ≤ 200 ms more than the wake |
"""
        when = datetime.now(timezone.utc).strftime("%Y-%m-%d_%H%M")
        machine = f"{os.cpu_count()} cores, {os.uname().release}, load {os.getloadavg()[0]:.1f} at the end"
        report = f"""## Idle sandboxes: sleeping and waking ({when} UTC{', quick' if QUICK else ''})

Machine: {machine}. Command: `bench/idle/bench.py{' --quick' if QUICK else ''}{' --cpu-only' if CPU_ONLY else ''}` (release build).

| measure | roost | peer (same run) | ratio | target |
|---|---|---|---|---|
| CPU over {WINDOW_S} s, no sandbox: server, runner a, runner b | {cpu_none[0]:.2f}, {cpu_none[1]:.2f}, {cpu_none[2]:.2f} s | | | |
| CPU over {WINDOW_S} s, {ASLEEP} asleep: server, runner a, runner b | {cpu_asleep[0]:.2f}, {cpu_asleep[1]:.2f}, {cpu_asleep[2]:.2f} s | the same with none: {sum(cpu_none):.2f} s in all | {sum(cpu_asleep) / max(sum(cpu_none), 0.01):.2f} | nothing per asleep sandbox |
| assignments long-polls in that window, answered by a read / `unchanged` | {answers.get("read", 0)} / {answers.get("unchanged", 0)} | | | |
{wake_rows}"""
        print(report)
        out = ROOT / "bench/results" / f"{when}-idle.md"
        out.write_text(report)
        log(f"saved {out}")
    finally:
        bench.cleanup()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Markdown report of bench/control/run.sh from its JSON results.

Usage: report.py RES_DIR ENGINE... (ENGINE: sqlite, postgres)
Reads RES_DIR/ENGINE.{get,nginx,creates,waiters,wake,wake-cross}.json.
"""
import json
import os
import sys

NAMES = {"sqlite": "SQLite", "postgres": "PostgreSQL"}


def load(res, engine, step):
    path = os.path.join(res, f"{engine}.{step}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def n(value, digits=0):
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def wrk_cell(r):
    if r is None:
        return "-"
    flags = ""
    if r["non_2xx"]:
        flags += f" (**{r['non_2xx']} non-2xx**)"
    if r["socket_errors"]:
        flags += f" (**{r['socket_errors']} socket errors**)"
    return n(r["per_s"]) + flags


def main():
    res, engines = sys.argv[1], sys.argv[2:]
    data = {e: {s: load(res, e, s) for s in ("get", "nginx", "creates", "waiters", "wake", "wake-cross")}
            for e in engines}

    def row(label, fn, target=""):
        cells = []
        for e in engines:
            try:
                cells.append(fn(data[e]))
            except (KeyError, TypeError):
                cells.append("-")
        print(f"| {label} | " + " | ".join(cells) + f" | {target} |")

    print("| measurement | " + " | ".join(NAMES[e] for e in engines) + " | target |")
    print("|---|" + "---|" * len(engines) + "---|")
    row("GET /v1/sandboxes/{id} per s", lambda d: wrk_cell(d["get"]), "≥ 3,000 (SQLite)")
    row("GET p50 / p99 ms", lambda d: f"{d['get']['p50_ms']} / {d['get']['p99_ms']}")
    row("nginx, same body as a static file, per s", lambda d: wrk_cell(d["nginx"]))
    row("roost GET ÷ nginx GET", lambda d: f"{d['get']['per_s'] / d['nginx']['per_s']:.2f}")

    def creates(d):
        c = d["creates"]
        cell = n(c["per_s"])
        if c["failed"]:
            cell += f" (**{c['failed']} failed: {c['failed_statuses']}**)"
        return cell

    row("creates per s (`POST /v1/sandboxes {}`)", creates, "≥ 300 (SQLite)")

    def trend(d):
        full = d["creates"]["per_second"][:-1] or d["creates"]["per_second"]
        return f"{full[0]} → {full[-1]}"

    row("creates in the first → last full second", trend)
    row("create p50 / p99 ms",
        lambda d: f"{d['creates']['latency']['p50_ms']} / {d['creates']['latency']['p99_ms']}")

    def waiting(d):
        w = d["waiters"]
        cell = f"{n(w['gauge_min_while_sampling'])} of {n(w['waiters'])}"
        if not w["all_waiting"] or w["answered_before_wake"]:
            cell += f" (**not all waiting; {w['answered_before_wake']} answered early**)"
        return cell

    row("long-polls waiting (`roost_long_poll_waiters`)", waiting)
    row("server RSS with them waiting, MiB", lambda d: n(d["waiters"]["rss_waiting_mib"], 1), "< 200")
    row("server RSS before / after, MiB",
        lambda d: f"{n(d['waiters']['rss_before_mib'], 1)} / {n(d['waiters']['rss_after_mib'], 1)}")

    def woken(d):
        w = d["waiters"]
        cell = f"{n(w['woken_running'])} in {w['wake_all_seconds']} s"
        if w["errors"] or w["answers_not_running"]:
            cell += f" (**{w['errors']} errors, {w['answers_not_running']} not running**)"
        return cell

    row("waiters answered `running` after every sandbox is reported", woken)

    def wake(step):
        def cell(d):
            w = d[step]
            text = f"{w['wake']['p50_ms']} / {w['wake']['p99_ms']}"
            if w["not_running"]:
                text += f" (**{w['not_running']} not running**)"
            return text
        return cell

    row("wake p50 / p99 ms (report sent → long-poll answered)", wake("wake"), "p99 < 20")
    row("the report call alone, p50 / p99 ms",
        lambda d: f"{d['wake']['report_call']['p50_ms']} / {d['wake']['report_call']['p99_ms']}")
    row("wake across two servers p50 / p99 ms (LISTEN/NOTIFY)", wake("wake-cross"), "p99 < 20")

    print()
    print("Targets:")
    print()
    print("| target | result | |")
    print("|---|---|---|")

    def verdict(ok):
        return "met" if ok else "**missed**"

    s = data.get("sqlite")
    if s and s["get"]:
        print(f"| GET ≥ 3,000/s on SQLite | {n(s['get']['per_s'])}/s | {verdict(s['get']['per_s'] >= 3000 and not s['get']['non_2xx'])} |")
    if s and s["creates"]:
        print(f"| creates ≥ 300/s on SQLite | {n(s['creates']['per_s'])}/s | {verdict(s['creates']['per_s'] >= 300 and not s['creates']['failed'])} |")
    for e in engines:
        d = data[e]
        if d["waiters"]:
            w = d["waiters"]
            ok = w["rss_waiting_mib"] < 200 and w["all_waiting"] and not w["answered_before_wake"]
            print(f"| RSS < 200 MiB with {n(w['waiters'])} waiters ({NAMES[e]}) | {n(w['rss_waiting_mib'], 1)} MiB | {verdict(ok)} |")
        for step, what in (("wake", "wake"), ("wake-cross", "wake across servers")):
            if d[step]:
                p99 = d[step]["wake"]["p99_ms"]
                print(f"| {what} p99 < 20 ms ({NAMES[e]}) | {p99} ms | {verdict(p99 < 20 and not d[step]['not_running'])} |")

    print()
    print("Raw results (loadgen JSON; wrk parsed):")
    print()
    for e in engines:
        for step, value in data[e].items():
            if value is not None:
                print(f"- {e}.{step}: `{json.dumps(value, separators=(',', ':'))}`")


if __name__ == "__main__":
    main()

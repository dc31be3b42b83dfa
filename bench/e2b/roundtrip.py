"""E2B's SDK against roost's own exec, same run (BENCHMARKS.md, "E2B-compatible
API"): `commands.run("true")` through `e2b` (2.63.0) pointed at roost's
`/e2b` surface, against `sandbox.exec(...)` through roost's Python SDK, on
one sandbox, in alternating rounds. E2B's SDK runs every command as
`/bin/bash -l -c CMD`, so roost's exec is timed both for `true` and for the
same `bash -l -c true`, which separates the protocol's cost from bash's.
Needs a running `roost up` (its saved credentials, or ROOST_URL/ROOST_TOKEN)
and a venv with both SDKs.

    python bench/e2b/roundtrip.py [ROUNDS]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Callable, Dict, List

from roost import Roost


def timed(run: Callable[[], object]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    client = Roost()
    os.environ["E2B_API_URL"] = client.url + "/e2b"
    os.environ["E2B_SANDBOX_URL"] = client.url + "/e2b/envd"
    os.environ["E2B_API_KEY"] = client._t._http.headers["Authorization"].split(" ", 1)[1]
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=3600)
    sandbox = client.sandboxes.get(sbx.sandbox_id)
    paths: Dict[str, Callable[[], object]] = {
        "e2b commands.run(\"true\")": lambda: sbx.commands.run("true"),
        "roost exec [true]": lambda: sandbox.exec(["true"]).check(),
        "roost exec [bash -l -c true]": lambda: sandbox.exec(["/bin/bash", "-l", "-c", "true"]).check(),
    }
    samples: Dict[str, List[float]] = {name: [] for name in paths}
    try:
        for run in paths.values():  # warm up
            run()
        for _ in range(rounds):
            for name, run in paths.items():
                samples[name].append(timed(run))
    finally:
        sbx.kill()
    base = statistics.median(samples["roost exec [true]"])
    print(f"{rounds} rounds, alternating, one sandbox")
    for name, values in samples.items():
        values.sort()
        p50 = statistics.median(values)
        p99 = values[min(len(values) - 1, int(len(values) * 0.99))]
        print(f"{name:32} p50 {p50 * 1000:7.2f} ms  p99 {p99 * 1000:7.2f} ms  {p50 / base:4.2f}x roost exec [true]")


if __name__ == "__main__":
    main()

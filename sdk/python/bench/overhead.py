"""The SDK's own cost (BENCHMARKS.md, "Python SDK"): per-call overhead of
`sandbox.exec(["true"])` against the same HTTP calls made with raw httpx in
the same run (alternating rounds, one sandbox), and the import time of
`roost` in fresh interpreters. Needs a running `roost up` (it uses the
credentials it saved, or ROOST_URL/ROOST_TOKEN).

    python sdk/python/bench/overhead.py [ROUNDS]
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
import uuid
from typing import Any, Callable, Dict, List

import httpx

from roost import Roost


def raw_exec(http: httpx.Client, sandbox_id: str) -> None:
    """What exec does, by hand: create the command, long-poll its end."""
    base = f"/v1/sandboxes/{sandbox_id}/commands"
    created = http.post(base, json={"argv": ["true"]}, headers={"Idempotency-Key": uuid.uuid4().hex})
    created.raise_for_status()
    command_id = created.json()["id"]
    while True:
        got = http.get(f"{base}/{command_id}", params={"wait_for": "ended", "timeout": 25}, timeout=40)
        got.raise_for_status()
        record = got.json()
        if record["state"] not in ("queued", "starting", "running"):
            assert record["state"] == "exited" and record["exit_code"] == 0, record
            return


def timed(run: Callable[[], object]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def import_time_ms(samples: int = 15) -> float:
    code = "import time; t = time.perf_counter(); import roost; print(time.perf_counter() - t)"
    runs = [float(subprocess.check_output([sys.executable, "-c", code])) for _ in range(samples)]
    return statistics.median(runs) * 1000


def mock_overhead(calls: int = 2000) -> str:
    """The SDK's client-side work alone, the server replaced by canned
    answers (httpx.MockTransport) for both paths: what a call adds in
    Python (records decoded, idempotency key, generator plumbing)."""
    command: Dict[str, Any] = {
        "id": "cmd_1", "sandbox_id": "sbx_1", "argv": ["true"], "env": {}, "cwd": None, "timeout": None,
        "state": "queued", "state_reason": None, "exit_code": None, "signal": None, "epoch": None,
        "stdout_bytes": 0, "stderr_bytes": 0, "created_at": "t", "started_at": None, "ended_at": None,
    }
    ended = dict(command, state="exited", exit_code=0)
    sandbox = {
        "id": "sbx_1", "org_id": "o", "state": "running", "desired": "running", "epoch": 1, "image": "default",
        "storage_class": "standard", "resources": {}, "network": "none", "placement": "spot_first", "env": {},
        "labels": {}, "quarantined": False, "created_at": "t", "updated_at": "t",
    }

    def handle(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            return httpx.Response(201, json=command)
        if request.url.path.endswith("/sbx_1"):
            return httpx.Response(200, json=sandbox)
        return httpx.Response(200, json=ended)

    transport = httpx.MockTransport(handle)
    http = httpx.Client(base_url="http://mock", transport=transport, headers={"Authorization": "Bearer t"})
    client = Roost("http://mock", "t", http_client=httpx.Client(base_url="http://mock", transport=transport))
    handle_ = client.sandboxes.get("sbx_1")
    for _ in range(100):
        raw_exec(http, "sbx_1")
        handle_.exec(["true"])
    def raw_calls() -> None:
        for _ in range(calls):
            raw_exec(http, "sbx_1")

    def sdk_calls() -> None:
        for _ in range(calls):
            handle_.exec(["true"])

    raw = timed(raw_calls) / calls
    sdk = timed(sdk_calls) / calls
    return (f"client-side only (mock server, {calls} calls): SDK {sdk * 1000:.3f} ms, raw httpx "
            f"{raw * 1000:.3f} ms, overhead {(sdk - raw) * 1000:+.3f} ms per exec")


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    client = Roost()
    token = client._t._http.headers["Authorization"]
    http = httpx.Client(base_url=client.url, headers={"Authorization": token}, timeout=30)
    with client.sandboxes.create(labels={"bench": "sdk-overhead"}) as sandbox:
        for _ in range(5):  # warm both paths (connections, caches)
            sandbox.exec(["true"]).check()
            raw_exec(http, sandbox.id)
        sdk: List[float] = []
        raw: List[float] = []
        for _ in range(rounds):
            raw.append(timed(lambda: raw_exec(http, sandbox.id)))
            sdk.append(timed(lambda: sandbox.exec(["true"]).check()))
    sdk_ms = statistics.median(sdk) * 1000
    raw_ms = statistics.median(raw) * 1000
    print(f"exec true, median of {rounds}: SDK {sdk_ms:.2f} ms, raw httpx {raw_ms:.2f} ms, "
          f"overhead {sdk_ms - raw_ms:+.2f} ms per call")
    print(mock_overhead())
    print(f"import roost: {import_time_ms():.1f} ms (median of 15 fresh interpreters)")


if __name__ == "__main__":
    main()

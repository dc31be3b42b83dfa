"""Retries that just work (issue 19, point 3): one Idempotency-Key per
logical call, reused across its attempts; connection errors, 429 (with
Retry-After), 502/503/504 retried within a budget; other 4xx never."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from typing import Any, Dict, List, Optional, Tuple

import httpx
import pytest

from roost import InvalidRequest, QuotaExceeded, RetryPolicy, Roost, TransportError, Unavailable

from conftest import Deployment


class DroppingProxy:
    """A TCP proxy to the server that, when armed, forwards one request,
    lets the server answer it in full (so it committed) and then cuts the
    client's connection instead of passing the answer on."""

    def __init__(self, upstream: Tuple[str, int]):
        self.upstream = upstream
        self.armed = threading.Event()
        self.dropped = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, answers: bool) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if answers and self.armed.is_set():
                    self.armed.clear()
                    self.dropped += 1
                    break  # the answer is lost: both sockets close below
                sink.sendall(data)
        except OSError:
            pass
        for end in (source, sink):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            end.close()

    def close(self) -> None:
        self.listener.close()


def test_a_create_whose_answer_is_lost_after_commit_returns_the_same_sandbox(
    deployment: Deployment, roost_client: Roost
) -> None:
    host, port = deployment.url.removeprefix("http://").split(":")
    proxy = DroppingProxy((host, int(port)))
    label = uuid.uuid4().hex[:16]
    try:
        with Roost(f"http://127.0.0.1:{proxy.port}", deployment.token) as client:
            client.images.list()  # a connection is open and idle first
            proxy.armed.set()
            sandbox = client.sandboxes.create(labels={"retry": label}, wait=False)
            assert proxy.dropped == 1, "the first answer was cut"
            assert client.stats.retries >= 1
        matching = [s.id for s in roost_client.sandboxes.list(labels={"retry": label})]
        assert matching == [sandbox.id], "one sandbox, the one the retry returned"
    finally:
        proxy.close()
        for found in roost_client.sandboxes.list(labels={"retry": label}):
            roost_client.sandboxes.delete(found.id)


SANDBOX = {
    "id": "sbx_1",
    "org_id": "org_1",
    "state": "pending",
    "desired": "running",
    "epoch": 0,
    "image": "default",
    "storage_class": "standard",
    "resources": {},
    "network": "none",
    "placement": "spot_first",
    "env": {},
    "labels": {},
    "quarantined": False,
    "created_at": "t",
    "updated_at": "t",
}


def _error(status: int, code: str, headers: Optional[Dict[str, str]] = None, **details: Any) -> httpx.Response:
    body = {"error": {"code": code, "message": code, "details": details, "request_id": "req_1"}}
    return httpx.Response(status, json=body, headers=headers)


def _scripted(answers: List[Any]) -> Tuple[Roost, List[httpx.Request]]:
    """A client whose server answers with `answers` in turn (a response, or
    an exception raised as a transport failure)."""
    seen: List[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        assert isinstance(answer, httpx.Response)
        return answer

    http = httpx.Client(base_url="http://roost.test", transport=httpx.MockTransport(handle))
    policy = RetryPolicy(budget_s=5.0, initial_backoff_s=0.01, max_backoff_s=0.05)
    return Roost("http://roost.test", "t", retry=policy, http_client=http), seen


def test_transient_failures_are_retried_with_one_key() -> None:
    client, seen = _scripted(
        [
            httpx.ConnectError("refused"),
            httpx.ReadTimeout("slow"),
            _error(503, "unavailable"),
            httpx.Response(502),
            httpx.Response(504),
            _error(429, "quota_exceeded", {"retry-after": "0.2"}, quota={"metric": "m", "limit": 1, "current": 1}),
            httpx.Response(201, json=SANDBOX),
        ]
    )
    started = time.monotonic()
    sandbox = client.sandboxes.create(wait=False)
    assert sandbox.id == "sbx_1" and len(seen) == 7
    keys = {request.headers["idempotency-key"] for request in seen}
    assert len(keys) == 1, "one key for every attempt of the call"
    assert time.monotonic() - started >= 0.2, "Retry-After was honoured"
    # The next logical call gets a new key.
    client2, seen2 = _scripted([httpx.Response(201, json=SANDBOX)])
    client2.sandboxes.create(wait=False)
    assert seen2[0].headers["idempotency-key"] not in keys


def test_other_4xx_are_never_retried() -> None:
    client, seen = _scripted([_error(400, "invalid_request", field="ttl")])
    with pytest.raises(InvalidRequest) as refused:
        client.sandboxes.create(ttl_s=0, wait=False)
    assert len(seen) == 1 and refused.value.request_id == "req_1"
    assert refused.value.details == {"field": "ttl"}


def test_the_budget_bounds_the_whole_call() -> None:
    client, seen = _scripted([_error(503, "unavailable") for _ in range(100)])
    client._t.retry = RetryPolicy(budget_s=0.3, max_attempts=100, initial_backoff_s=0.05, max_backoff_s=0.1)
    started = time.monotonic()
    with pytest.raises(Unavailable):
        client.sandboxes.get("sbx_1")
    assert time.monotonic() - started < 1.0 and 2 <= len(seen) < 100
    # A Retry-After past the budget ends the call at once with the quota.
    client, seen = _scripted(
        [_error(429, "quota_exceeded", {"retry-after": "30"}, quota={"metric": "sandboxes.running", "limit": 2, "current": 2})]
    )
    with pytest.raises(QuotaExceeded) as quota:
        client.sandboxes.create(wait=False)
    assert (quota.value.metric, quota.value.limit, quota.value.current, quota.value.retry_after) == (
        "sandboxes.running",
        2,
        2,
        30.0,
    )
    client, seen = _scripted([httpx.ConnectError("refused") for _ in range(100)])
    client._t.retry = RetryPolicy(budget_s=0.2, initial_backoff_s=0.05, max_backoff_s=0.05)
    with pytest.raises(TransportError):
        client.images.list()


def test_a_retried_delete_that_went_through_is_success() -> None:
    client, seen = _scripted([httpx.ReadError("cut"), _error(404, "not_found")])
    assert client.sandboxes.delete("sbx_1") is None and len(seen) == 2
    body = json.loads(seen[0].content or b"null")
    assert body is None and seen[0].headers["idempotency-key"] == seen[1].headers["idempotency-key"]

"""What the sync and async clients share: configuration, the retry policy,
and every operation written once as a generator of HTTP calls.

An operation (``Op[T]``) yields :class:`Call` objects and is sent back a
:class:`Reply` for each; its return value is the result. The sync client
drives it with blocking httpx, the async one with ``await``, so waits,
exec and streaming behave the same in both and are written once.
"""

from __future__ import annotations

import json
import math
import os
import random
import shlex
import time
import uuid
from dataclasses import dataclass, field
from typing import (
    Any,
    Dict,
    Generator,
    List,
    Mapping,
    Optional,
    Sequence,
    Set,
    Tuple,
    Type,
    TypeVar,
    Union,
)

from . import _wire as wire
from ._errors import (
    ApiError,
    NotFound,
    RoostError,
    UnexpectedState,
    WaitTimeout,
    from_response,
)

__all__ = ["RetryPolicy", "Call", "Reply", "OutputChunk", "CommandResult", "Page"]

DEFAULT_URL = "http://127.0.0.1:7070"
VERSION = "0.1.0"

T = TypeVar("T")
M = TypeVar("M")


class ConfigError(RoostError):
    """No token could be found (argument, ``ROOST_TOKEN``, or ``roost up``'s file)."""


def credentials_path() -> Optional[str]:
    """Where ``roost up`` saves ``{url, token}`` (as crates/cli/src/credentials.rs)."""
    for name, suffix in (("XDG_CONFIG_HOME", ()), ("HOME", (".config",))):
        base = os.environ.get(name, "")
        if os.path.isabs(base):
            return os.path.join(base, *suffix, "roost", "credentials.json")
    return None


def resolve_credentials(url: Optional[str], token: Optional[str]) -> Tuple[str, str]:
    """The URL and token to use: arguments, then ``ROOST_URL``/``ROOST_TOKEN``,
    then what ``roost up`` saved. A saved token is sent only to the saved URL."""
    url = url or os.environ.get("ROOST_URL") or None
    token = token or os.environ.get("ROOST_TOKEN") or None
    saved: Optional[Dict[str, Any]] = None
    path = credentials_path()
    if (url is None or token is None) and path is not None and os.path.exists(path):
        with open(path, encoding="utf-8") as file:
            loaded = json.load(file)
        if not isinstance(loaded, dict) or not isinstance(loaded.get("url"), str) or not isinstance(
            loaded.get("token"), str
        ):
            raise ConfigError(f"{path} has no string url and token")
        saved = loaded
    if url is None:
        url = saved["url"] if saved is not None else DEFAULT_URL
    if token is None:
        if saved is not None and saved["url"] == url:
            token = saved["token"]
        else:
            raise ConfigError(
                f"no token for {url}: pass token=… or set ROOST_TOKEN (or run `roost up`, which saves them in {path})"
            )
    assert url is not None and token is not None
    return url.rstrip("/"), token


@dataclass(frozen=True)
class RetryPolicy:
    """When a call is tried again, and for how long in all.

    Retried: connection errors and timeouts, 429 (waiting at least its
    ``Retry-After``), 502/503/504 and 409 ``idempotency_in_progress``;
    never another 4xx. Every mutation carries one ``Idempotency-Key`` for
    all its attempts, so a retry never makes a second sandbox or command.
    Backoff: ``initial_backoff_s`` doubling up to ``max_backoff_s``, with
    full jitter over its upper half; the whole call (every attempt and
    pause) gives up once ``budget_s`` would be passed, raising the last
    error. ``RetryPolicy(budget_s=0)`` never retries.
    """

    budget_s: float = 60.0
    max_attempts: int = 10
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0

    def delay(self, attempt: int, started: float, retry_after: Optional[float]) -> Optional[float]:
        """The pause before attempt ``attempt + 1``, or ``None`` to give up."""
        if attempt >= self.max_attempts:
            return None
        backoff = min(self.max_backoff_s, self.initial_backoff_s * 2.0 ** (attempt - 1))
        pause = backoff * (0.5 + random.random() / 2)
        if retry_after is not None:
            pause = max(pause, retry_after)
        if time.monotonic() - started + pause > self.budget_s:
            return None
        return pause


RETRIED_STATUSES = frozenset([429, 502, 503, 504])


@dataclass(frozen=True)
class Call:
    """One HTTP request of an operation (retried as a unit, same key)."""

    method: str
    url: str
    params: Optional[List[Tuple[str, Union[str, int]]]] = None
    body: Optional[Dict[str, Any]] = None
    idempotency_key: Optional[str] = None
    read_timeout: Optional[float] = None
    content: Optional[bytes] = None
    """A raw body (instead of ``body``'s JSON)."""
    once: bool = False
    """Never retried: a second attempt could repeat what the first did
    (bytes written to a command's stdin)."""
    headers: Optional[Tuple[Tuple[str, str], ...]] = None
    """Request headers the operation declares (``Range``)."""


@dataclass
class Reply:
    """The final answer to a :class:`Call` (after any retries)."""

    status: int
    headers: Mapping[str, str]
    content: bytes
    attempts: int = 1

    def json(self) -> Any:
        return json.loads(self.content) if self.content else None

    def error(self) -> Optional[ApiError]:
        if self.status < 400:
            return None
        try:
            body = self.json()
        except ValueError:
            body = None
        return from_response(self.status, body, self.headers.get("x-request-id"), retry_after(self.headers))

    def ok(self) -> "Reply":
        error = self.error()
        if error is not None:
            raise error
        return self

    def retryable(self) -> bool:
        if self.status in RETRIED_STATUSES:
            return True
        if self.status == 409:
            error = self.error()
            return error is not None and error.code == "idempotency_in_progress"
        return False


def retry_after(headers: Mapping[str, str]) -> Optional[float]:
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds: float = max(0.0, float(value))
        return seconds
    except ValueError:
        return None  # an HTTP date: the backoff applies


@dataclass(frozen=True)
class OutputChunk:
    """Bytes a command wrote to ``stream`` from ``offset`` up to ``next_offset``."""

    stream: str
    data: bytes
    offset: int
    next_offset: int
    complete: bool
    state: str

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class CommandResult:
    """A command's end: the honest ``state`` (``exited``, ``timed_out``,
    ``unknown``…), ``exit_code`` (only when exited) and its output."""

    command: wire.Command
    stdout: bytes
    stderr: bytes

    @property
    def id(self) -> str:
        return self.command.id

    @property
    def state(self) -> str:
        return self.command.state

    @property
    def exit_code(self) -> Optional[int]:
        return self.command.exit_code

    @property
    def ok(self) -> bool:
        """Exited with status 0."""
        return self.command.state == "exited" and self.command.exit_code == 0

    @property
    def stdout_text(self) -> str:
        return self.stdout.decode("utf-8", errors="replace")

    @property
    def stderr_text(self) -> str:
        return self.stderr.decode("utf-8", errors="replace")

    def check(self) -> "CommandResult":
        """Itself if :attr:`ok`, else raises :class:`CommandFailed`."""
        if not self.ok:
            raise CommandFailed(self)
        return self


class CommandFailed(RoostError):
    """A command did not exit 0 (raised only by :meth:`CommandResult.check`)."""

    def __init__(self, result: CommandResult) -> None:
        how = f"exit code {result.exit_code}" if result.state == "exited" else result.state
        reason = f" ({result.command.state_reason})" if result.command.state_reason else ""
        super().__init__(f"command {result.command.argv!r} ended {how}{reason}: {result.stderr_text[-500:]}")
        self.result = result


@dataclass(frozen=True)
class Page:
    """One page of a list: its records and the cursor of the next (``None``: last)."""

    items: List[Any]
    next_cursor: Optional[str]


Op = Generator[Call, Reply, T]
StreamOp = Generator[Union[Call, OutputChunk], Optional[Reply], wire.Command]


def new_key() -> str:
    return f"sdk-{uuid.uuid4().hex}"


def _poll_seconds(deadline: Optional[float]) -> int:
    if deadline is None:
        return wire.LONG_POLL_MAX_S
    return max(0, min(wire.LONG_POLL_MAX_S, math.ceil(deadline - time.monotonic())))


def _long_poll_timeout(seconds: int) -> float:
    # The server answers by `seconds`; the margin covers a busy server.
    return seconds + 15.0


def record(op: wire.Operation, reply: Reply) -> Any:
    assert op.response is not None
    return wire.decode(op.response, reply.ok().json())


def call(
    op: wire.Operation,
    path: Mapping[str, str],
    params: Optional[Sequence[Tuple[str, Union[str, int]]]] = None,
    body: Optional[Dict[str, Any]] = None,
    key: Optional[str] = None,
    read_timeout: Optional[float] = None,
    content: Optional[bytes] = None,
    headers: Optional[Mapping[str, str]] = None,
) -> Call:
    """A :class:`Call` of a declared operation (see :mod:`roost._wire`)."""
    op.check(dict(params or ()), body, headers)
    if op.method != "GET" and key is None:
        # Every mutation carries a key for all its attempts; where the API
        # declares none (stop, start, delete, signal, update, keepalive)
        # the call is idempotent by itself and the header is ignored.
        key = new_key()
    return Call(
        op.method,
        op.url(**path),
        list(params) if params else None,
        body,
        key,
        read_timeout,
        content,
        op.once,
        tuple(headers.items()) if headers else None,
    )


# ---- sandboxes ----------------------------------------------------------


def create_sandbox(body: Dict[str, Any], key: Optional[str]) -> Op[wire.Sandbox]:
    reply = yield call(wire.CREATE_SANDBOX, {}, body=body, key=key or new_key())
    sandbox: wire.Sandbox = record(wire.CREATE_SANDBOX, reply)
    return sandbox


def sandbox_body(
    *,
    image: Optional[str],
    storage_class: Optional[str],
    resources: Optional[Union[wire.Resources, Mapping[str, Any]]],
    network: Optional[str],
    env: Optional[Mapping[str, str]],
    labels: Optional[Mapping[str, str]],
    ttl_s: Optional[int],
    placement: Optional[str],
    save_interval_s: Optional[int],
    from_snapshot: Optional[str],
    mounts: Optional[Sequence[Union[wire.Mount, Mapping[str, Any]]]] = None,
    secrets: Optional[Sequence[Mapping[str, str]]] = None,
    idle_timeout_s: Optional[int] = None,
    auto_wake: Optional[bool] = None,
) -> Dict[str, Any]:
    body: Dict[str, Any] = {}
    for name, value in (
        ("image", image),
        ("storage_class", storage_class),
        ("network", network),
        ("ttl", ttl_s),
        ("placement", placement),
        ("save_interval_s", save_interval_s),
        ("from_snapshot", from_snapshot),
        ("idle_timeout_s", idle_timeout_s),
        ("auto_wake", auto_wake),
    ):
        if value is not None:
            body[name] = value
    if resources is not None:
        body["resources"] = resources.to_json() if isinstance(resources, wire.Resources) else dict(resources)
    if env:
        body["env"] = dict(env)
    if labels:
        body["labels"] = dict(labels)
    if mounts:
        body["mounts"] = [m.to_json() if isinstance(m, wire.Mount) else dict(m) for m in mounts]
    if secrets:
        # [{"name": N, "env": VAR}] or [{"name": N, "file": F}]: names, never values.
        body["secrets"] = [dict(secret) for secret in secrets]
    return body


def get_sandbox(sandbox_id: str) -> Op[wire.Sandbox]:
    reply = yield call(wire.GET_SANDBOX, {"id": sandbox_id})
    sandbox: wire.Sandbox = record(wire.GET_SANDBOX, reply)
    return sandbox


def _settled_elsewhere(sandbox: wire.Sandbox, target: str) -> bool:
    """As the server's `settles_wait_for`: the target cannot be reached now."""
    if sandbox.state in wire.SANDBOX_TERMINAL_STATES:
        return True
    return sandbox.state == "stopped" and sandbox.desired != "running" and target != "stopped"


def wait_sandbox(sandbox_id: str, state: str, timeout: Optional[float]) -> Op[wire.Sandbox]:
    """Long-polls until the sandbox is in ``state``; raises
    :class:`UnexpectedState` when it settles elsewhere (ended, or stopped
    while nobody wants it running) and :class:`WaitTimeout` after ``timeout``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        seconds = _poll_seconds(deadline)
        reply = yield call(
            wire.GET_SANDBOX,
            {"id": sandbox_id},
            params=[("wait_for", state), ("timeout", seconds)],
            read_timeout=_long_poll_timeout(seconds),
        )
        sandbox: wire.Sandbox = record(wire.GET_SANDBOX, reply)
        if sandbox.state == state:
            return sandbox
        if _settled_elsewhere(sandbox, state):
            raise UnexpectedState(
                f"sandbox {sandbox_id} is {sandbox.state} ({sandbox.state_reason}), not {state}: "
                f"{sandbox.state_message or 'no message'}",
                sandbox,
            )
        if deadline is not None and time.monotonic() >= deadline:
            raise WaitTimeout(f"sandbox {sandbox_id} is still {sandbox.state} after {timeout} s, not {state}")


def list_page(
    op: wire.Operation, path: Mapping[str, str], params: List[Tuple[str, Union[str, int]]], cursor: Optional[str]
) -> Op[Page]:
    if cursor is not None:
        params = params + [("cursor", cursor)]
    reply = yield call(op, path, params=params)
    body = reply.ok().json()
    assert op.list_field is not None and op.response is not None
    model: Type[Any] = op.response
    items = [wire.decode(model, item) for item in body[op.list_field]]
    return Page(items, body.get("next_cursor"))


def sandbox_action(op: wire.Operation, sandbox_id: str) -> Op[wire.Sandbox]:
    reply = yield call(op, {"id": sandbox_id})
    sandbox: wire.Sandbox = record(op, reply)
    return sandbox


def update_sandbox(sandbox_id: str, idle_timeout_s: Optional[int], auto_wake: Optional[bool]) -> Op[wire.Sandbox]:
    """A new idle policy: only the fields given are sent (the others stay
    as they are); idempotent, so a retried attempt is harmless."""
    body: Dict[str, Any] = {}
    if idle_timeout_s is not None:
        body["idle_timeout_s"] = idle_timeout_s
    if auto_wake is not None:
        body["auto_wake"] = auto_wake
    reply = yield call(wire.UPDATE_SANDBOX, {"id": sandbox_id}, body=body)
    sandbox: wire.Sandbox = record(wire.UPDATE_SANDBOX, reply)
    return sandbox


def delete_sandbox(sandbox_id: str) -> Op[Optional[wire.Sandbox]]:
    """202 with the record; a retried delete whose first attempt went
    through gets 404, which is then success (``None``)."""
    reply = yield call(wire.DELETE_SANDBOX, {"id": sandbox_id})
    error = reply.error()
    if isinstance(error, NotFound) and reply.attempts > 1:
        return None
    sandbox: wire.Sandbox = record(wire.DELETE_SANDBOX, reply)
    return sandbox


def sandbox_events(sandbox_id: str) -> Op[List[wire.Event]]:
    """The whole history, oldest first, every page of it."""
    events: List[wire.Event] = []
    cursor: Optional[str] = None
    while True:
        page = yield from list_page(wire.SANDBOX_EVENTS, {"id": sandbox_id}, [], cursor)
        events.extend(page.items)
        if page.next_cursor is None:
            return events
        cursor = page.next_cursor


# ---- commands -----------------------------------------------------------


def send_stdin(sandbox_id: str, command_id: str, data: bytes, close: bool = True) -> Op[int]:
    """Writes ``data`` to a command's stdin (created with ``stdin=True``),
    closing it after unless ``close`` is false; returns the bytes taken.
    Never retried: a repeat could write the bytes twice."""
    reply = yield call(
        wire.COMMAND_STDIN,
        {"id": sandbox_id, "command_id": command_id},
        params=[("close", "true" if close else "false")],
        content=data,
    )
    reply.ok()
    answer = reply.json()
    return int(answer["bytes"]) if isinstance(answer, dict) else 0


def command_body(
    command: Union[str, Sequence[str]],
    env: Optional[Mapping[str, str]],
    cwd: Optional[str],
    timeout: Optional[float],
    stdin: bool = False,
) -> Dict[str, Any]:
    """A shell string runs under ``sh -c``; a sequence is the argv itself."""
    argv = ["sh", "-c", command] if isinstance(command, str) else list(command)
    body: Dict[str, Any] = {"argv": argv}
    if env:
        body["env"] = dict(env)
    if cwd is not None:
        body["cwd"] = cwd
    if timeout is not None:
        body["timeout"] = max(1, math.ceil(timeout))
    if stdin:
        body["stdin"] = True
    return body


def create_command(sandbox_id: str, body: Dict[str, Any], key: Optional[str]) -> Op[wire.Command]:
    reply = yield call(wire.CREATE_COMMAND, {"id": sandbox_id}, body=body, key=key or new_key())
    command: wire.Command = record(wire.CREATE_COMMAND, reply)
    return command


def get_command(sandbox_id: str, command_id: str) -> Op[wire.Command]:
    reply = yield call(wire.GET_COMMAND, {"id": sandbox_id, "command_id": command_id})
    command: wire.Command = record(wire.GET_COMMAND, reply)
    return command


def wait_command(
    sandbox_id: str, command_id: str, state: str = "ended", timeout: Optional[float] = None
) -> Op[wire.Command]:
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        seconds = _poll_seconds(deadline)
        reply = yield call(
            wire.GET_COMMAND,
            {"id": sandbox_id, "command_id": command_id},
            params=[("wait_for", state), ("timeout", seconds)],
            read_timeout=_long_poll_timeout(seconds),
        )
        command: wire.Command = record(wire.GET_COMMAND, reply)
        if command.state == state or (state == "ended" and command.ended):
            return command
        if command.ended:
            raise UnexpectedState(f"command {command_id} ended {command.state}, not {state}", command)
        if deadline is not None and time.monotonic() >= deadline:
            raise WaitTimeout(f"command {command_id} is still {command.state} after {timeout} s")


def read_output(
    sandbox_id: str, command_id: str, stream: str, offset: int, timeout: int = 0
) -> Op[OutputChunk]:
    """One read of ``stream`` from ``offset``; with ``timeout`` (s) it waits
    for new bytes or the command's end."""
    reply = yield call(
        wire.COMMAND_OUTPUT,
        {"id": sandbox_id, "command_id": command_id},
        params=[("stream", stream), ("offset", offset), ("timeout", timeout)],
        read_timeout=_long_poll_timeout(timeout),
    )
    reply.ok()
    headers = reply.headers
    return OutputChunk(
        stream,
        reply.content,
        offset,
        int(headers.get("x-roost-next-offset", offset + len(reply.content))),
        headers.get("x-roost-complete") == "true",
        headers.get("x-roost-command-state", ""),
    )


def read_all(sandbox_id: str, command_id: str, stream: str, length: int) -> Op[bytes]:
    """Every byte of an ended command's stream (reads are capped server-side)."""
    data = bytearray()
    offset = 0
    while offset < length:
        chunk = yield from read_output(sandbox_id, command_id, stream, offset)
        data += chunk.data
        if chunk.complete or chunk.next_offset == offset:
            break
        offset = chunk.next_offset
    return bytes(data)


def exec_command(
    sandbox_id: str,
    body: Dict[str, Any],
    key: Optional[str],
    wait_timeout: Optional[float],
    stdin: Optional[bytes] = None,
) -> Op[CommandResult]:
    created = yield from create_command(sandbox_id, body, key)
    if stdin is not None and not created.ended:
        try:
            yield from send_stdin(sandbox_id, created.id, stdin)
        except ApiError as error:
            # Ended (or closed its stdin) before reading it all: its end
            # says what happened.
            if error.code != "invalid_state":
                raise
    ended = yield from wait_command(sandbox_id, created.id, "ended", wait_timeout)
    return (yield from collect(sandbox_id, ended))


def collect(sandbox_id: str, ended: wire.Command) -> Op[CommandResult]:
    stdout = b""
    stderr = b""
    if ended.stdout_bytes:
        stdout = yield from read_all(sandbox_id, ended.id, "stdout", ended.stdout_bytes)
    if ended.stderr_bytes:
        stderr = yield from read_all(sandbox_id, ended.id, "stderr", ended.stderr_bytes)
    return CommandResult(ended, stdout, stderr)


#: How long a follower long-polls stdout when neither stream had news (a
#: byte on stderr alone waits at most this long to be seen).
FOLLOW_POLL_S = 1


def follow(sandbox_id: str, command_id: str, stdout_offset: int = 0, stderr_offset: int = 0) -> StreamOp:
    """Yields output chunks as they come, both streams, until the command has
    ended and every byte is read; returns the ended command."""
    offsets = {"stdout": stdout_offset, "stderr": stderr_offset}
    done: Set[str] = set()
    idle = False
    while len(done) < 2:
        news = False
        for stream in ("stdout", "stderr"):
            if stream in done:
                continue
            wait = FOLLOW_POLL_S if idle and not news else 0
            reading = read_output(sandbox_id, command_id, stream, offsets[stream], wait)
            step = next(reading)
            try:
                while True:
                    reply = yield step
                    assert reply is not None
                    step = reading.send(reply)
            except StopIteration as stop:
                chunk: OutputChunk = stop.value
            if chunk.data:
                news = True
                yield chunk
            offsets[stream] = chunk.next_offset
            if chunk.complete:
                done.add(stream)
        idle = not news
    reply = yield call(wire.GET_COMMAND, {"id": sandbox_id, "command_id": command_id})
    assert reply is not None
    command: wire.Command = record(wire.GET_COMMAND, reply)
    return command


def signal_command(sandbox_id: str, command_id: str, signal: str) -> Op[wire.Command]:
    name = signal.upper()
    name = name[3:] if name.startswith("SIG") else name
    reply = yield call(wire.SIGNAL_COMMAND, {"id": sandbox_id, "command_id": command_id}, body={"signal": name})
    command: wire.Command = record(wire.SIGNAL_COMMAND, reply)
    return command


# ---- snapshots and images -----------------------------------------------


def create_snapshot(
    sandbox_id: str, durability: Optional[str], deadline_s: Optional[int], key: Optional[str]
) -> Op[wire.Snapshot]:
    body: Dict[str, Any] = {}
    if durability is not None:
        body["durability"] = durability
    if deadline_s is not None:
        body["deadline"] = deadline_s
    reply = yield call(wire.CREATE_SNAPSHOT, {"id": sandbox_id}, body=body, key=key or new_key())
    snapshot: wire.Snapshot = record(wire.CREATE_SNAPSHOT, reply)
    return snapshot


_DURABILITY_RANK = {"pending": 0, "local": 1, "replicated": 2}


def wait_snapshot(snapshot_id: str, durability: str, timeout: Optional[float]) -> Op[wire.Snapshot]:
    """Until the snapshot has at least ``durability`` (``replicated``
    implies ``local``); :class:`UnexpectedState` if it failed."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        seconds = _poll_seconds(deadline)
        reply = yield call(
            wire.GET_SNAPSHOT,
            {"id": snapshot_id},
            params=[("wait_for", durability), ("timeout", seconds)],
            read_timeout=_long_poll_timeout(seconds),
        )
        snapshot: wire.Snapshot = record(wire.GET_SNAPSHOT, reply)
        if _DURABILITY_RANK.get(snapshot.durability, -1) >= _DURABILITY_RANK.get(durability, 99):
            return snapshot
        if snapshot.durability == durability:
            return snapshot
        if snapshot.durability == "failed":
            raise UnexpectedState(f"snapshot {snapshot_id} failed ({snapshot.reason})", snapshot)
        if snapshot.durability == "replicated":
            # Ended: a wait for `failed` can never be met (the server answers at once).
            raise UnexpectedState(f"snapshot {snapshot_id} replicated; it will not be {durability}", snapshot)
        if deadline is not None and time.monotonic() >= deadline:
            raise WaitTimeout(f"snapshot {snapshot_id} is still {snapshot.durability} after {timeout} s")


# ---- secrets --------------------------------------------------------------


def set_secret(name: str, value: str) -> Op[wire.SecretRecord]:
    """Sets (makes or rotates) an org secret. Setting the same value again is
    harmless, so a retried attempt is safe (only the version moves on)."""
    reply = yield call(wire.SET_SECRET, {"name": name}, body={"value": value})
    secret: wire.SecretRecord = record(wire.SET_SECRET, reply)
    return secret


def delete_secret(name: str) -> Op[Optional[wire.SecretRecord]]:
    reply = yield call(wire.DELETE_SECRET, {"name": name})
    if reply.attempts > 1 and reply.status == 404:
        return None  # an earlier attempt deleted it
    secret: wire.SecretRecord = record(wire.DELETE_SECRET, reply)
    return secret


# ---- files ----------------------------------------------------------------


def write_file(
    sandbox_id: str, path: str, data: Union[bytes, str], mode: Optional[str], parents: bool
) -> Op[wire.FileWritten]:
    """Writes ``data`` to ``path`` in the sandbox: in place only once whole
    (a retry writes the same bytes again, which is harmless)."""
    params: List[Tuple[str, Union[str, int]]] = [("path", path), ("parents", "true" if parents else "false")]
    if mode is not None:
        params.append(("mode", mode))
    content = data.encode() if isinstance(data, str) else bytes(data)
    reply = yield call(wire.WRITE_FILE, {"id": sandbox_id}, params=params, content=content)
    written: wire.FileWritten = record(wire.WRITE_FILE, reply)
    return written


def read_file(sandbox_id: str, path: str, offset: Optional[int], length: Optional[int]) -> Op[bytes]:
    """``path``'s bytes; from ``offset`` and at most ``length`` of them when
    given (:class:`RangeNotSatisfiable` when ``offset`` is at or past the end)."""
    headers: Optional[Dict[str, str]] = None
    if offset is not None or length is not None:
        start = offset or 0
        if length is not None and length <= 0:
            return b""
        end = "" if length is None else str(start + length - 1)
        headers = {"Range": f"bytes={start}-{end}"}
    reply = yield call(wire.READ_FILE, {"id": sandbox_id}, params=[("path", path)], headers=headers)
    return reply.ok().content


def list_files(sandbox_id: str, path: str, depth: int) -> Op[wire.FileList]:
    reply = yield call(wire.LIST_FILES, {"id": sandbox_id}, params=[("path", path), ("depth", depth)])
    listing: wire.FileList = record(wire.LIST_FILES, reply)
    return listing


def remove_file(sandbox_id: str, path: str, recursive: bool) -> Op[Optional[wire.FileRemoved]]:
    """A retried removal whose first attempt went through gets 404: then
    success (``None``)."""
    params: List[Tuple[str, Union[str, int]]] = [("path", path), ("recursive", "true" if recursive else "false")]
    reply = yield call(wire.REMOVE_FILE, {"id": sandbox_id}, params=params)
    if isinstance(reply.error(), NotFound) and reply.attempts > 1:
        return None
    removed: wire.FileRemoved = record(wire.REMOVE_FILE, reply)
    return removed


def move_file(sandbox_id: str, source: str, destination: str, overwrite: bool) -> Op[None]:
    body = {"from": source, "to": destination, "overwrite": overwrite}
    reply = yield call(wire.MOVE_FILE, {"id": sandbox_id}, body=body)
    reply.ok()
    return None


def make_directory(sandbox_id: str, path: str, parents: bool, mode: Optional[str]) -> Op[wire.DirectoryMade]:
    body: Dict[str, Any] = {"path": path, "parents": parents}
    if mode is not None:
        body["mode"] = mode
    reply = yield call(wire.MAKE_DIRECTORY, {"id": sandbox_id}, body=body)
    made: wire.DirectoryMade = record(wire.MAKE_DIRECTORY, reply)
    return made


def get_record(op: wire.Operation, path: Mapping[str, str]) -> Op[Any]:
    reply = yield call(op, path)
    return record(op, reply)


def shell_join(argv: Sequence[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)


@dataclass
class Stats:
    """Counts a client keeps (for tests and benchmarks)."""

    requests: int = 0
    retries: int = 0
    by_status: Dict[int, int] = field(default_factory=dict)

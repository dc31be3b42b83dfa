"""The asyncio client: :class:`AsyncRoost` and :class:`AsyncSandbox`, the
same surface as the blocking one with ``await`` (operations shared in
:mod:`roost._core`)."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Dict, AsyncIterator, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union, cast

import httpx

from . import _core as core
from . import _wire as wire
from ._core import Call, CommandResult, OutputChunk, Page, Reply, RetryPolicy, Stats
from ._errors import TransportError

__all__ = ["AsyncRoost", "AsyncSandbox", "AsyncCommandStream", "AsyncPaginator"]

T = TypeVar("T")


class _Transport:
    def __init__(
        self, url: str, token: str, retry: RetryPolicy, timeout: float, http: Optional[httpx.AsyncClient]
    ):
        self.retry = retry
        self.stats = Stats()
        self._timeout_s = timeout
        self._timeout = httpx.Timeout(timeout, connect=min(timeout, 10.0))
        self._long_timeouts: Dict[float, httpx.Timeout] = {}
        self._http = http or httpx.AsyncClient(base_url=url, timeout=self._timeout)
        self._http.headers["Authorization"] = f"Bearer {token}"
        self._http.headers["User-Agent"] = f"roost-python/{core.VERSION}"

    async def send(self, call: Call) -> Reply:
        headers = {"Idempotency-Key": call.idempotency_key} if call.idempotency_key else None
        if call.headers:
            headers = {**(headers or {}), **dict(call.headers)}
        timeout = self._timeout if call.read_timeout is None else self._long_timeout(call.read_timeout)
        started = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            self.stats.requests += 1
            try:
                response = await self._http.request(
                    call.method,
                    call.url,
                    params=tuple(call.params) if call.params else None,
                    json=call.body if call.content is None else None,
                    content=call.content,
                    headers=headers,
                    timeout=timeout,
                )
            except httpx.TransportError as error:
                pause = None if call.once else self.retry.delay(attempt, started, None)
                if pause is None:
                    raise TransportError(f"{call.method} {call.url}: {error!r} after {attempt} attempt(s)") from error
            else:
                reply = Reply(response.status_code, response.headers, response.content, attempt)
                if reply.status < 400 or not reply.retryable() or call.once:
                    return reply
                pause = self.retry.delay(attempt, started, core.retry_after(reply.headers))
                if pause is None:
                    return reply
            self.stats.retries += 1
            await asyncio.sleep(pause)

    def _long_timeout(self, read: float) -> httpx.Timeout:
        """A long-poll's timeouts: the read outlasts the server's wait."""
        timeout = self._long_timeouts.get(read)
        if timeout is None:
            timeout = httpx.Timeout(self._timeout_s, connect=min(self._timeout_s, 10.0), read=read)
            self._long_timeouts[read] = timeout
        return timeout

    async def run(self, op: core.Op[T]) -> T:
        try:
            step = next(op)
            while True:
                step = op.send(await self.send(step))
        except StopIteration as stop:
            return cast(T, stop.value)

    async def close(self) -> None:
        await self._http.aclose()


class AsyncPaginator(AsyncIterator[T]):
    """``async for`` over every record of a list; :meth:`pages` gives pages."""

    def __init__(
        self, transport: _Transport, op: wire.Operation, path: Mapping[str, str], params: List[Tuple[str, Any]]
    ):
        self._transport = transport
        self._op = op
        self._path = path
        self._params = params
        self._items: AsyncIterator[T] = self._all()

    async def pages(self) -> AsyncIterator[Page]:
        cursor: Optional[str] = None
        while True:
            page = await self._transport.run(core.list_page(self._op, self._path, self._params, cursor))
            yield page
            if not page.next_cursor:
                return
            cursor = page.next_cursor

    async def _all(self) -> AsyncIterator[T]:
        async for page in self.pages():
            for item in page.items:
                yield item

    async def __anext__(self) -> T:
        return await self._items.__anext__()


class AsyncCommandStream(AsyncIterator[OutputChunk]):
    """``async for`` over output chunks as they come; then :attr:`result`."""

    def __init__(self, transport: _Transport, sandbox_id: str, command_id: str, op: core.StreamOp):
        self._transport = transport
        self.sandbox_id = sandbox_id
        self.command_id = command_id
        self._op = op
        self._reply: Optional[Reply] = None
        self._out = bytearray()
        self._err = bytearray()
        self.result: Optional[CommandResult] = None

    async def __anext__(self) -> OutputChunk:
        if self.result is not None:
            raise StopAsyncIteration
        try:
            while True:
                step = self._op.send(self._reply)
                self._reply = None
                if isinstance(step, OutputChunk):
                    (self._out if step.stream == "stdout" else self._err).extend(step.data)
                    return step
                self._reply = await self._transport.send(step)
        except StopIteration as stop:
            self.result = CommandResult(stop.value, bytes(self._out), bytes(self._err))
            raise StopAsyncIteration from None

    async def wait(self) -> CommandResult:
        async for _ in self:
            pass
        assert self.result is not None
        return self.result


class AsyncCommands:
    def __init__(self, transport: _Transport, sandbox_id: str):
        self._t = transport
        self._id = sandbox_id

    def list(self, *, state: Optional[str] = None, limit: Optional[int] = None) -> AsyncPaginator[wire.Command]:
        """The sandbox's commands, oldest first; ``state="running"``: the
        background ones (with their ``pid``)."""
        params: List[Tuple[str, Any]] = [] if limit is None else [("limit", limit)]
        if state is not None:
            params.append(("state", state))
        return AsyncPaginator(self._t, wire.LIST_COMMANDS, {"id": self._id}, params)

    async def get(self, command_id: str) -> wire.Command:
        return await self._t.run(core.get_command(self._id, command_id))

    async def wait(self, command_id: str, state: str = "ended", timeout: Optional[float] = None) -> wire.Command:
        return await self._t.run(core.wait_command(self._id, command_id, state, timeout))

    async def output(self, command_id: str, stream: str = "stdout", offset: int = 0, timeout: int = 0) -> OutputChunk:
        return await self._t.run(core.read_output(self._id, command_id, stream, offset, timeout))

    async def result(self, command_id: str, timeout: Optional[float] = None) -> CommandResult:
        ended = await self._t.run(core.wait_command(self._id, command_id, "ended", timeout))
        return await self._t.run(core.collect(self._id, ended))

    def stream(self, command_id: str, *, stdout_offset: int = 0, stderr_offset: int = 0) -> AsyncCommandStream:
        return AsyncCommandStream(self._t, self._id, command_id, core.follow(self._id, command_id, stdout_offset, stderr_offset))

    async def signal(self, command_id: str, signal: str) -> wire.Command:
        return await self._t.run(core.signal_command(self._id, command_id, signal))


class AsyncFiles:
    """A running sandbox's files, read and written by its own agent inside
    it (paths absolute, or relative to ``/workspace``)."""

    def __init__(self, transport: _Transport, sandbox_id: str):
        self._t = transport
        self._id = sandbox_id

    async def write(
        self, path: str, data: Union[bytes, str], *, mode: Optional[str] = None, parents: bool = True
    ) -> wire.FileWritten:
        """Writes ``data`` (``str``: UTF-8) to ``path``, in place only once
        whole; ``mode`` in octal (``"0755"``), missing parents made unless
        ``parents`` is false. :class:`InsufficientStorage` on a full disk."""
        return await self._t.run(core.write_file(self._id, path, data, mode, parents))

    async def read(self, path: str, *, offset: Optional[int] = None, length: Optional[int] = None) -> bytes:
        """``path``'s bytes (or ``length`` of them from ``offset``)."""
        return await self._t.run(core.read_file(self._id, path, offset, length))

    async def list(self, path: str = ".", depth: int = 1) -> wire.FileList:
        """``path``'s entries, ``depth`` levels down (1 to 16), sorted by path."""
        return await self._t.run(core.list_files(self._id, path, depth))

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        """Removes a file, a symlink, or a directory (non-empty: ``recursive``)."""
        await self._t.run(core.remove_file(self._id, path, recursive))

    async def move(self, source: str, destination: str, *, overwrite: bool = False) -> None:
        """Renames ``source`` to ``destination`` (replacing it only with ``overwrite``)."""
        await self._t.run(core.move_file(self._id, source, destination, overwrite))

    async def mkdir(self, path: str, *, parents: bool = False, mode: Optional[str] = None) -> bool:
        """Makes a directory; whether it was made (with ``parents`` an existing one is fine)."""
        made = await self._t.run(core.make_directory(self._id, path, parents, mode))
        return made.created


class AsyncSandbox:
    """A handle on one sandbox; ``async with`` deletes it on exit unless
    ``delete_on_exit`` is false (or :meth:`keep`)."""

    def __init__(self, transport: _Transport, record: wire.Sandbox, delete_on_exit: bool = True):
        self._t = transport
        self.record = record
        self.delete_on_exit = delete_on_exit
        self.commands = AsyncCommands(transport, record.id)
        self.files = AsyncFiles(transport, record.id)

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def state(self) -> str:
        return self.record.state

    def __repr__(self) -> str:
        return f"AsyncSandbox(id={self.id!r}, state={self.state!r})"

    async def refresh(self) -> wire.Sandbox:
        self.record = await self._t.run(core.get_sandbox(self.id))
        return self.record

    async def wait(self, state: str = "running", timeout: Optional[float] = None) -> wire.Sandbox:
        self.record = await self._t.run(core.wait_sandbox(self.id, state, timeout))
        return self.record

    async def stop(self, *, wait: bool = False, timeout: Optional[float] = None) -> wire.Sandbox:
        self.record = await self._t.run(core.sandbox_action(wire.STOP_SANDBOX, self.id))
        return await self.wait("stopped", timeout) if wait else self.record

    async def start(self, *, wait: bool = False, timeout: Optional[float] = None) -> wire.Sandbox:
        self.record = await self._t.run(core.sandbox_action(wire.START_SANDBOX, self.id))
        return await self.wait("running", timeout) if wait else self.record

    async def update(self, *, idle_timeout_s: Optional[int] = None, auto_wake: Optional[bool] = None) -> wire.Sandbox:
        """Changes the idle policy; what is not given stays as it is.
        ``idle_timeout_s``: 0 (never) or within the deployment's bounds
        (:class:`InvalidRequest` naming the field otherwise); the deadline
        moves to the last activity plus it."""
        self.record = await self._t.run(core.update_sandbox(self.id, idle_timeout_s, auto_wake))
        return self.record

    async def keepalive(self) -> wire.Sandbox:
        """Counts as activity now: the running sandbox's ``idle_deadline``
        moves on. It does not wake a stopped one (:class:`InvalidState`;
        a command does)."""
        self.record = await self._t.run(core.sandbox_action(wire.KEEPALIVE_SANDBOX, self.id))
        return self.record

    async def delete(self) -> None:
        deleted = await self._t.run(core.delete_sandbox(self.id))
        if deleted is not None:
            self.record = deleted

    async def events(self) -> List[wire.Event]:
        return await self._t.run(core.sandbox_events(self.id))

    async def exec(
        self,
        command: Union[str, Sequence[str]],
        *,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        timeout: Optional[float] = None,
        idempotency_key: Optional[str] = None,
        stdin: Optional[bytes] = None,
    ) -> CommandResult:
        body = core.command_body(command, env, cwd, timeout, stdin is not None)
        return await self._t.run(core.exec_command(self.id, body, idempotency_key, None, stdin))

    async def exec_stream(
        self,
        command: Union[str, Sequence[str]],
        *,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        timeout: Optional[float] = None,
        idempotency_key: Optional[str] = None,
    ) -> AsyncCommandStream:
        body = core.command_body(command, env, cwd, timeout)
        created = await self._t.run(core.create_command(self.id, body, idempotency_key))
        return self.commands.stream(created.id)

    async def snapshot(
        self,
        *,
        durability: Optional[str] = None,
        deadline_s: Optional[int] = None,
        wait: bool = False,
        timeout: Optional[float] = None,
        idempotency_key: Optional[str] = None,
    ) -> wire.Snapshot:
        snapshot = await self._t.run(core.create_snapshot(self.id, durability, deadline_s, idempotency_key))
        if wait:
            snapshot = await self._t.run(core.wait_snapshot(snapshot.id, durability or "replicated", timeout))
        return snapshot

    def keep(self) -> "AsyncSandbox":
        self.delete_on_exit = False
        return self

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self.delete_on_exit:
            await self.delete()


class AsyncSandboxes:
    def __init__(self, transport: _Transport):
        self._t = transport

    async def create(
        self,
        *,
        image: Optional[str] = None,
        storage_class: Optional[str] = None,
        resources: Optional[Union[wire.Resources, Mapping[str, Any]]] = None,
        network: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        labels: Optional[Mapping[str, str]] = None,
        ttl_s: Optional[int] = None,
        placement: Optional[str] = None,
        save_interval_s: Optional[int] = None,
        from_snapshot: Optional[str] = None,
        mounts: Optional[Sequence[Union[wire.Mount, Mapping[str, Any]]]] = None,
        secrets: Optional[Sequence[Mapping[str, str]]] = None,
        idle_timeout_s: Optional[int] = None,
        auto_wake: Optional[bool] = None,
        wait: bool = True,
        timeout: Optional[float] = 120.0,
        delete_on_exit: bool = True,
        idempotency_key: Optional[str] = None,
    ) -> AsyncSandbox:
        body = core.sandbox_body(
            image=image,
            storage_class=storage_class,
            resources=resources,
            network=network,
            env=env,
            labels=labels,
            ttl_s=ttl_s,
            placement=placement,
            save_interval_s=save_interval_s,
            from_snapshot=from_snapshot,
            mounts=mounts,
            secrets=secrets,
            idle_timeout_s=idle_timeout_s,
            auto_wake=auto_wake,
        )
        record = await self._t.run(core.create_sandbox(body, idempotency_key))
        sandbox = AsyncSandbox(self._t, record, delete_on_exit)
        if wait:
            await sandbox.wait("running", timeout)
        return sandbox

    async def get(self, sandbox_id: str, *, delete_on_exit: bool = False) -> AsyncSandbox:
        return AsyncSandbox(self._t, await self._t.run(core.get_sandbox(sandbox_id)), delete_on_exit)

    def list(
        self,
        *,
        state: Union[str, Sequence[str], None] = None,
        labels: Optional[Mapping[str, str]] = None,
        limit: Optional[int] = None,
    ) -> AsyncPaginator[wire.Sandbox]:
        params: List[Tuple[str, Any]] = []
        for one in [state] if isinstance(state, str) else list(state or []):
            params.append(("state", one))
        for key, value in (labels or {}).items():
            params.append(("label", f"{key}={value}"))
        if limit is not None:
            params.append(("limit", limit))
        return AsyncPaginator(self._t, wire.LIST_SANDBOXES, {}, params)

    async def wait(self, sandbox_id: str, state: str, timeout: Optional[float] = None) -> wire.Sandbox:
        return await self._t.run(core.wait_sandbox(sandbox_id, state, timeout))

    async def stop(self, sandbox_id: str) -> wire.Sandbox:
        return await self._t.run(core.sandbox_action(wire.STOP_SANDBOX, sandbox_id))

    async def start(self, sandbox_id: str) -> wire.Sandbox:
        return await self._t.run(core.sandbox_action(wire.START_SANDBOX, sandbox_id))

    async def update(
        self, sandbox_id: str, *, idle_timeout_s: Optional[int] = None, auto_wake: Optional[bool] = None
    ) -> wire.Sandbox:
        """Changes a sandbox's idle policy (see :meth:`AsyncSandbox.update`)."""
        return await self._t.run(core.update_sandbox(sandbox_id, idle_timeout_s, auto_wake))

    async def keepalive(self, sandbox_id: str) -> wire.Sandbox:
        """Activity that keeps a running sandbox awake (see :meth:`AsyncSandbox.keepalive`)."""
        return await self._t.run(core.sandbox_action(wire.KEEPALIVE_SANDBOX, sandbox_id))

    async def delete(self, sandbox_id: str) -> Optional[wire.Sandbox]:
        return await self._t.run(core.delete_sandbox(sandbox_id))


class AsyncSnapshots:
    def __init__(self, transport: _Transport):
        self._t = transport

    async def create(
        self,
        sandbox_id: str,
        *,
        durability: Optional[str] = None,
        deadline_s: Optional[int] = None,
        wait: bool = False,
        timeout: Optional[float] = None,
        idempotency_key: Optional[str] = None,
    ) -> wire.Snapshot:
        snapshot = await self._t.run(core.create_snapshot(sandbox_id, durability, deadline_s, idempotency_key))
        if wait:
            snapshot = await self.wait(snapshot.id, durability or "replicated", timeout)
        return snapshot

    async def get(self, snapshot_id: str) -> wire.Snapshot:
        snapshot: wire.Snapshot = await self._t.run(core.get_record(wire.GET_SNAPSHOT, {"id": snapshot_id}))
        return snapshot

    async def wait(
        self, snapshot_id: str, durability: str = "replicated", timeout: Optional[float] = None
    ) -> wire.Snapshot:
        return await self._t.run(core.wait_snapshot(snapshot_id, durability, timeout))

    def list(self, *, sandbox_id: Optional[str] = None, limit: Optional[int] = None) -> AsyncPaginator[wire.Snapshot]:
        params: List[Tuple[str, Any]] = []
        if sandbox_id is not None:
            params.append(("sandbox_id", sandbox_id))
        if limit is not None:
            params.append(("limit", limit))
        return AsyncPaginator(self._t, wire.LIST_SNAPSHOTS, {}, params)

    async def delete(self, snapshot_id: str) -> Optional[wire.Snapshot]:
        reply = await self._t.send(core.call(wire.DELETE_SNAPSHOT, {"id": snapshot_id}))
        if reply.attempts > 1 and reply.status == 404:
            return None
        snapshot: wire.Snapshot = core.record(wire.DELETE_SNAPSHOT, reply)
        return snapshot


class AsyncImages:
    def __init__(self, transport: _Transport):
        self._t = transport

    async def list(self) -> List[wire.Image]:
        page = await self._t.run(core.list_page(wire.LIST_IMAGES, {}, [], None))
        return list(page.items)

    async def get(self, name: str) -> wire.Image:
        image: wire.Image = await self._t.run(core.get_record(wire.GET_IMAGE, {"name": name}))
        return image


class AsyncSecrets:
    """The org's secrets: values go in, never come back (``list`` shows names,
    versions and times). Sandboxes ask for them on create:
    ``secrets=[{"name": "gh", "env": "GH_TOKEN"}, {"name": "key", "file": "key"}]``."""

    def __init__(self, transport: _Transport):
        self._t = transport

    async def set(self, name: str, value: str) -> wire.SecretRecord:
        """Sets ``name`` to ``value`` (a new version; sandboxes launched from
        now on get it)."""
        return await self._t.run(core.set_secret(name, value))

    async def list(self) -> List[wire.SecretRecord]:
        page = await self._t.run(core.list_page(wire.LIST_SECRETS, {}, [], None))
        return list(page.items)

    async def delete(self, name: str) -> Optional[wire.SecretRecord]:
        return await self._t.run(core.delete_secret(name))


class AsyncRoost:
    """The asyncio client; see :class:`roost.Roost` for the arguments."""

    def __init__(
        self,
        url: Optional[str] = None,
        token: Optional[str] = None,
        *,
        retry: Optional[RetryPolicy] = None,
        timeout: float = 30.0,
        http_client: Optional[httpx.AsyncClient] = None,
    ) -> None:
        self.url, token = core.resolve_credentials(url, token)
        self._t = _Transport(self.url, token, retry or RetryPolicy(), timeout, http_client)
        self.sandboxes = AsyncSandboxes(self._t)
        self.snapshots = AsyncSnapshots(self._t)
        self.images = AsyncImages(self._t)
        self.secrets = AsyncSecrets(self._t)

    @property
    def stats(self) -> Stats:
        return self._t.stats

    async def close(self) -> None:
        await self._t.close()

    async def __aenter__(self) -> "AsyncRoost":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

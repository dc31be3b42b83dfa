"""The SDK against a real `roost up` (issue 19, points 2, 4 and 6):
sandboxes under runc, commands, streaming, durable stop/start, snapshots
and typed errors, through the sync and the async client."""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timedelta
from typing import Any, List, Optional

import pytest

import roost
from roost import (
    AsyncRoost,
    IdempotencyConflict,
    InsufficientStorage,
    InvalidRequest,
    InvalidState,
    NotFound,
    Quarantined,
    QuotaExceeded,
    RangeNotSatisfiable,
    RetryPolicy,
    Roost,
    UnsupportedCapability,
)

from conftest import Deployment, wait_until


def test_client_finds_what_roost_up_saved(deployment: Deployment) -> None:
    with Roost() as client:  # no url, no token: the credentials file
        assert client.url == deployment.url
        assert isinstance(client.images.list(), list)


def test_create_exec_and_honest_command_states(roost_client: Roost) -> None:
    with roost_client.sandboxes.create(labels={"test": "exec"}) as sandbox:
        assert sandbox.state == "running"
        result = sandbox.exec(["sh", "-c", "echo out; echo err >&2; exit 3"])
        assert (result.state, result.exit_code) == ("exited", 3)
        assert (result.stdout, result.stderr) == (b"out\n", b"err\n")
        assert not result.ok
        with pytest.raises(roost.CommandFailed):
            result.check()
        shell = sandbox.exec("echo $GREETING from $(pwd)", env={"GREETING": "hi"}, cwd="/tmp")
        assert shell.ok and shell.stdout_text == "hi from /tmp\n"
        slow = sandbox.exec("sleep 30", timeout=1)
        assert slow.state == "timed_out" and slow.exit_code is None
        listed = [c.id for c in sandbox.commands.list(limit=1)]  # pages of one
        assert listed[-1] == slow.id and len(listed) == 3
        # The record shows up in the listing by label; delete on leaving.
        found = [s.id for s in roost_client.sandboxes.list(labels={"test": "exec"})]
        assert sandbox.id in found
    assert roost_client.sandboxes.wait(sandbox.id, "deleted", timeout=60).state == "deleted"


def test_streaming_reattach_and_signal(roost_client: Roost) -> None:
    with roost_client.sandboxes.create() as sandbox:
        stream = sandbox.exec_stream("echo first; sleep 2; echo second; echo warn >&2")
        chunks = list(stream)
        assert stream.result is not None and stream.result.ok
        # Output came while the command ran, not only at its end.
        assert chunks[0].data == b"first\n" and chunks[0].state == "running", chunks
        assert stream.result.stdout == b"first\nsecond\n" and stream.result.stderr == b"warn\n"
        # Re-attached from an offset: only what follows it.
        again = sandbox.commands.stream(stream.result.id, stdout_offset=6).wait()
        assert again.stdout == b"second\n" and again.stderr == b"warn\n"
        # A signal ends a running command, and its state says so.
        sleeper = sandbox.exec_stream("sleep 60")
        sandbox.commands.wait(sleeper.command_id, "running", timeout=30)
        sandbox.commands.signal(sleeper.command_id, "SIGKILL")
        ended = sleeper.wait()
        assert (ended.state, ended.command.signal) == ("interrupted", "KILL"), ended.command


def test_durable_stop_start_and_snapshots(roost_client: Roost) -> None:
    sandbox = roost_client.sandboxes.create(storage_class="durable", timeout=120)
    try:
        sandbox.exec("echo kept > notes.txt").check()
        assert sandbox.stop(wait=True, timeout=120).state == "stopped"
        assert sandbox.start(wait=True, timeout=120).state == "running"
        assert sandbox.exec("cat notes.txt").stdout == b"kept\n"
        snapshot = sandbox.snapshot(durability="replicated", wait=True, timeout=120)
        assert snapshot.durability == "replicated"
        assert snapshot.id in [s.id for s in roost_client.snapshots.list(sandbox_id=sandbox.id)]
        with roost_client.sandboxes.create(storage_class="durable", from_snapshot=snapshot.id) as child:
            assert child.record.from_snapshot == snapshot.id
            assert child.exec("cat notes.txt").stdout == b"kept\n"
        assert roost_client.snapshots.delete(snapshot.id) is not None
        with pytest.raises(NotFound):
            roost_client.snapshots.get(snapshot.id)
    finally:
        sandbox.delete()


def test_errors_are_types_with_request_ids(roost_client: Roost, deployment: Deployment) -> None:
    with pytest.raises(NotFound) as missing:
        roost_client.sandboxes.get("sbx_" + "0" * 32)
    assert missing.value.status == 404 and missing.value.request_id

    with pytest.raises(UnsupportedCapability) as unsupported:
        roost_client.sandboxes.create(image="no-such-image", wait=False)
    assert unsupported.value.missing == ["image:no-such-image"] and unsupported.value.request_id

    key = f"conflict-{uuid.uuid4().hex}"
    first = roost_client.sandboxes.create(idempotency_key=key, labels={"n": "1"}, wait=False)
    try:
        same = roost_client.sandboxes.create(idempotency_key=key, labels={"n": "1"}, wait=False)
        assert same.id == first.id
        with pytest.raises(IdempotencyConflict) as conflict:
            roost_client.sandboxes.create(idempotency_key=key, labels={"n": "2"}, wait=False)
        assert conflict.value.request_id

        deployment.admin("POST", f"/v1/admin/sandboxes/{first.id}/quarantine", {"reason": "sdk test"})
        with pytest.raises(Quarantined) as frozen:
            first.stop()
        assert frozen.value.status == 409 and frozen.value.request_id
        deployment.admin("DELETE", f"/v1/admin/sandboxes/{first.id}/quarantine")
    finally:
        first.delete()

    org = deployment.admin("POST", "/v1/admin/orgs", {"name": f"q{uuid.uuid4().hex[:12]}", "max_total": 0})
    # A quota is retried within the budget, then raised with its numbers.
    with Roost(deployment.url, org["token"], retry=RetryPolicy(budget_s=0.5)) as limited:
        with pytest.raises(QuotaExceeded) as quota:
            limited.sandboxes.create(wait=False)
    error = quota.value
    assert (error.metric, error.limit, error.current) == ("sandboxes.total", 0, 0)
    assert error.retry_after is not None and error.request_id


def test_async_client_has_the_same_surface(deployment: Deployment) -> None:
    async def scenario() -> List[Any]:
        async with AsyncRoost(deployment.url, deployment.token) as client:
            async with await client.sandboxes.create(labels={"test": "async"}) as sandbox:
                result = await sandbox.exec("echo async")
                stream = await sandbox.exec_stream(["sh", "-c", "echo a; echo b >&2"])
                chunks = [chunk async for chunk in stream]
                listed = [s.id async for s in client.sandboxes.list(labels={"test": "async"})]
                assert sandbox.id in listed
                commands = [c.id async for c in sandbox.commands.list()]
            gone = await client.sandboxes.wait(sandbox.id, "deleted", timeout=60)
            return [result, chunks, stream.result, commands, gone]

    result, chunks, streamed, commands, gone = asyncio.run(scenario())
    assert result.stdout == b"async\n" and result.ok
    assert {c.stream for c in chunks} == {"stdout", "stderr"}
    assert streamed.stdout == b"a\n" and streamed.stderr == b"b\n"
    assert len(commands) == 2 and gone.state == "deleted"


def test_mounts_reach_admission(roost_client: Roost, deployment: Deployment) -> None:
    # Unbound, then bound but on no runner: refused naming the filesystem
    # either way (`roost up` declares no shared filesystem).
    mount = roost.Mount(filesystem="team", subpath="proj", path="/workspace", read_only=True)
    with pytest.raises(UnsupportedCapability) as unbound:
        roost_client.sandboxes.create(mounts=[mount], wait=False)
    assert unbound.value.missing == ["filesystem:team"]
    import json
    import urllib.request

    request = urllib.request.Request(
        deployment.url + "/v1/whoami", headers={"Authorization": f"Bearer {deployment.token}"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        org_id = json.loads(response.read())["org_id"]
    deployment.admin("PUT", f"/v1/admin/filesystems/team/orgs/{org_id}", {"read_only": False})
    try:
        with pytest.raises(UnsupportedCapability) as nowhere:
            roost_client.sandboxes.create(mounts=[{"filesystem": "team", "path": "/mnt/team"}], wait=False)
        assert nowhere.value.missing == ["filesystem:team"]
    finally:
        deployment.admin("DELETE", f"/v1/admin/filesystems/team/orgs/{org_id}")


def test_stdin_and_background_commands(roost_client: Roost, deployment: Deployment) -> None:
    # Issue 15: bytes on a command's stdin through the data path (sync and
    # async), and a background command listed running with its pid.
    payload = bytes(range(256)) * 4096  # 1 MiB
    with roost_client.sandboxes.create(labels={"test": "stdin"}) as sandbox:
        result = sandbox.exec(["sh", "-c", "wc -c; head -c 3 | od -An -tx1"], stdin=payload)
        assert result.ok, result
        assert result.stdout.split()[0] == str(len(payload)).encode()
        background = sandbox.exec_stream(["sleep", "60"])
        running = sandbox.commands.wait(background.command_id, "running", timeout=30)
        listed = list(sandbox.commands.list(state="running"))
        assert [c.id for c in listed] == [running.id]
        assert listed[0].pid is not None and listed[0].pid > 1
        sandbox.commands.signal(running.id, "TERM")
        ended = sandbox.commands.wait(running.id, timeout=30)
        assert ended.state == "interrupted"

    async def scenario() -> bytes:
        async with AsyncRoost(deployment.url, deployment.token) as client:
            async with await client.sandboxes.create(labels={"test": "stdin-async"}) as sandbox:
                result = await sandbox.exec("cat", stdin=b"through the async client")
                return result.stdout

    assert asyncio.run(scenario()) == b"through the async client"


def test_files_written_read_listed_moved_and_removed(roost_client: Roost, deployment: Deployment) -> None:
    # Issue 15, point 5: a sandbox's files through its agent (sync and async).
    payload = bytes(range(256)) * 4096  # 1 MiB
    with roost_client.sandboxes.create(labels={"test": "files"}) as sandbox:
        files = sandbox.files
        written = files.write("data/blob.bin", payload)
        assert (written.path, written.size) == ("data/blob.bin", len(payload))
        assert files.read("/workspace/data/blob.bin") == payload
        assert files.read("data/blob.bin", offset=256, length=3) == bytes([0, 1, 2])
        assert files.read("data/blob.bin", offset=len(payload) - 2) == bytes([254, 255])
        with pytest.raises(RangeNotSatisfiable) as past:
            files.read("data/blob.bin", offset=len(payload))
        assert past.value.size == len(payload)
        files.write("tool.sh", "#!/bin/sh\necho tool\n", mode="0755")
        assert sandbox.exec("./tool.sh").stdout == b"tool\n"
        assert files.mkdir("a/b", parents=True) is True
        assert files.mkdir("a/b", parents=True) is False
        files.move("tool.sh", "a/b/tool.sh")
        listing = files.list("/workspace", depth=3)
        assert not listing.truncated
        by_path = {entry.path: entry for entry in listing.entries}
        assert by_path["/workspace/a/b/tool.sh"].mode == "0755"
        assert by_path["/workspace/a/b/tool.sh"].type == "file"
        assert by_path["/workspace/data"].type == "directory"
        assert by_path["/workspace/data/blob.bin"].size == len(payload)
        with pytest.raises(InvalidState):
            files.remove("a")  # not empty
        files.remove("a", recursive=True)
        with pytest.raises(NotFound):
            files.read("a/b/tool.sh")
        with pytest.raises(InvalidRequest):
            files.read("../etc/passwd")
        with pytest.raises(InsufficientStorage):
            files.write("/dev/shm/too-big", b"x" * (65 << 20))  # /dev/shm is 64 MiB
        assert [e.path for e in files.list("/dev/shm").entries] == []

    async def scenario() -> bytes:
        async with AsyncRoost(deployment.url, deployment.token) as client:
            async with await client.sandboxes.create(labels={"test": "files-async"}) as sandbox:
                await sandbox.files.write("notes.txt", "through the async client")
                assert [e.path for e in (await sandbox.files.list()).entries] == ["/workspace/notes.txt"]
                return await sandbox.files.read("notes.txt")

    assert asyncio.run(scenario()) == b"through the async client"


def _at(value: Optional[str]) -> datetime:
    """An RFC 3339 instant of a record (``2026-01-02T03:04:05.678Z``)."""
    assert value is not None
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%S.%f%z")


def test_idle_policy_round_trip_keepalive_and_refusals(roost_client: Roost) -> None:
    # Issue 16, point 1: the idle policy on create and changed later (absent
    # fields stay), the activity fields, a keepalive moving the deadline.
    with roost_client.sandboxes.create(idle_timeout_s=600, auto_wake=False, labels={"test": "idle"}) as sandbox:
        record = sandbox.refresh()
        assert (record.idle_timeout_s, record.auto_wake) == (600, False)
        assert record.last_activity in ("created", "started"), record
        assert _at(record.idle_deadline) == _at(record.last_activity_at) + timedelta(seconds=600), record

        longer = sandbox.update(idle_timeout_s=1200)
        assert (longer.idle_timeout_s, longer.auto_wake) == (1200, False)  # auto_wake not sent: kept
        assert _at(longer.idle_deadline) == _at(longer.last_activity_at) + timedelta(seconds=1200)
        assert sandbox.record is longer
        waking = roost_client.sandboxes.update(sandbox.id, auto_wake=True)
        assert (waking.idle_timeout_s, waking.auto_wake) == (1200, True)
        assert waking.idle_deadline == longer.idle_deadline  # no activity: the same deadline

        kept = sandbox.keepalive()
        assert kept.last_activity == "keepalive"
        assert _at(kept.last_activity_at) > _at(longer.last_activity_at)
        assert _at(kept.idle_deadline) == _at(kept.last_activity_at) + timedelta(seconds=1200)
        assert _at(kept.idle_deadline) > _at(longer.idle_deadline)
        again = roost_client.sandboxes.keepalive(sandbox.id)
        assert _at(again.idle_deadline) >= _at(kept.idle_deadline)

        never = sandbox.update(idle_timeout_s=0)
        assert never.idle_timeout_s == 0 and never.idle_deadline is None

        # Out of the deployment's bounds (`roost up`: 10 s to 7 days): 400
        # naming the field, on update and on create; nothing changed.
        with pytest.raises(InvalidRequest) as short:
            sandbox.update(idle_timeout_s=5)
        assert short.value.status == 400 and short.value.details.get("field") == "idle_timeout_s"
        assert "idle_timeout_s" in short.value.message and short.value.request_id
        assert sandbox.refresh().idle_timeout_s == 0
        with pytest.raises(InvalidRequest) as long:
            roost_client.sandboxes.create(idle_timeout_s=10**9, wait=False)
        assert long.value.details.get("field") == "idle_timeout_s"

        # Stopped: a keepalive does not wake it (409), nor, with auto_wake
        # off, does a command.
        sandbox.update(auto_wake=False)
        assert sandbox.stop(wait=True, timeout=120).state == "stopped"
        with pytest.raises(InvalidState) as asleep:
            sandbox.keepalive()
        assert asleep.value.status == 409 and asleep.value.request_id
        with pytest.raises(InvalidState):
            roost_client.sandboxes.keepalive(sandbox.id)
        with pytest.raises(InvalidState) as refused:
            sandbox.exec("true")
        assert refused.value.status == 409
        assert sandbox.refresh().state == "stopped"


def test_an_idle_sandbox_sleeps_and_exec_wakes_it(roost_client: Roost) -> None:
    # Issue 16, points 3 and 4: with nothing running it goes to sleep on its
    # own at the deployment's shortest timeout; a command wakes it under the
    # same id, its record saying it waited for the wake.
    with roost_client.sandboxes.create(idle_timeout_s=10, labels={"test": "sleep"}) as sandbox:
        assert sandbox.exec("echo before-sleep > note.txt").ok
        asleep = sandbox.wait("stopped", timeout=120)  # a long-poll: not activity
        assert (asleep.state, asleep.state_reason, asleep.desired) == ("stopped", "idle", "stopped"), asleep
        assert asleep.idle_deadline is None and asleep.auto_wake
        assert any(e.state == "stopped" and e.reason == "idle" for e in sandbox.events())

        result = sandbox.exec("cat note.txt")
        assert result.ok and result.stdout == b"before-sleep\n", result
        assert result.command.waited_for_wake
        awake = sandbox.refresh()
        assert (awake.id, awake.state) == (asleep.id, "running")
        assert [c.waited_for_wake for c in sandbox.commands.list()] == [False, True]


def test_a_parked_durable_sandbox_saves_nothing(roost_client: Roost) -> None:
    # Issue 16, point 5: a durable home that did not change since its last
    # completed save is not stored again; the save record says so.
    with roost_client.sandboxes.create(
        storage_class="durable", save_interval_s=10, idle_timeout_s=0, labels={"test": "parked"}
    ) as sandbox:
        assert sandbox.exec("echo parked > note.txt").ok

        def parked() -> Any:
            save = sandbox.refresh().save
            assert save is not None
            return save if save.last_unchanged_at is not None and save.last_completed_at is not None else None

        save = wait_until(parked, timeout=180, what="a save that found the home unchanged")
        assert _at(save.last_unchanged_at) > _at(save.last_completed_at)
        assert save.state == "ok"


def test_async_client_idle_surface(deployment: Deployment) -> None:
    async def scenario() -> List[Any]:
        async with AsyncRoost(deployment.url, deployment.token) as client:
            async with await client.sandboxes.create(idle_timeout_s=300, auto_wake=False) as sandbox:
                created = await sandbox.refresh()
                updated = await sandbox.update(idle_timeout_s=900)
                same = await client.sandboxes.update(sandbox.id, auto_wake=True)
                kept = await sandbox.keepalive()
                again = await client.sandboxes.keepalive(sandbox.id)
                with pytest.raises(InvalidRequest) as bad:
                    await client.sandboxes.update(sandbox.id, idle_timeout_s=10**9)
                return [created, updated, same, kept, again, bad.value]

    created, updated, same, kept, again, bad = asyncio.run(scenario())
    assert (created.idle_timeout_s, created.auto_wake) == (300, False)
    assert (updated.idle_timeout_s, updated.auto_wake) == (900, False)
    assert (same.idle_timeout_s, same.auto_wake) == (900, True)
    assert kept.last_activity == again.last_activity == "keepalive"
    assert _at(kept.idle_deadline) == _at(kept.last_activity_at) + timedelta(seconds=900)
    assert bad.details.get("field") == "idle_timeout_s"

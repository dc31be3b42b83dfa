"""E2B's own SDK (the `e2b` package from PyPI, pinned in scripts/test.sh)
against a real `roost up` (issue 24): a harness written for E2B switches by
setting E2B_API_URL and E2B_SANDBOX_URL, with a roost org token as its
E2B_API_KEY."""

from __future__ import annotations

import json
import os
import uuid
from typing import Iterator

import httpx
import pytest

from conftest import Deployment, wait_until

e2b = pytest.importorskip("e2b")

from e2b import (  # noqa: E402
    AuthenticationException,
    CommandExitException,
    FileNotFoundException,
    FileType,
    Sandbox,
    SandboxException,
    SandboxQuery,
    SandboxState,
)


@pytest.fixture(scope="module")
def e2b_env(deployment: Deployment) -> Iterator[None]:
    """The two variables (and the key) a harness sets to use roost."""
    names = ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN", "E2B_DEBUG")
    previous = {name: os.environ.get(name) for name in names}
    os.environ["E2B_API_URL"] = deployment.url + "/e2b"
    os.environ["E2B_SANDBOX_URL"] = deployment.url + "/e2b/envd"
    os.environ["E2B_API_KEY"] = deployment.token
    os.environ.pop("E2B_DOMAIN", None)
    os.environ.pop("E2B_DEBUG", None)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture
def sandbox(e2b_env: None) -> Iterator[Sandbox]:
    sbx = Sandbox.create(timeout=600)
    try:
        yield sbx
    finally:
        sbx.kill()


def test_create_run_output_and_exit_code(sandbox: Sandbox) -> None:
    assert sandbox.is_running()
    result = sandbox.commands.run("echo out; echo err >&2; echo $GREETING", envs={"GREETING": "hi"})
    assert result.exit_code == 0
    assert result.stdout == "out\nhi\n"
    assert result.stderr == "err\n"
    with pytest.raises(CommandExitException) as failed:
        sandbox.commands.run("echo before; exit 3")
    assert failed.value.exit_code == 3
    assert failed.value.stdout == "before\n"


def test_background_command_is_reconnected_with_all_its_output(sandbox: Sandbox) -> None:
    handle = sandbox.commands.run(
        "for i in 1 2 3; do echo line$i; sleep 0.5; done", background=True
    )
    assert handle.pid > 0
    running = [p.pid for p in sandbox.commands.list()]
    assert handle.pid in running
    handle.disconnect()
    again = sandbox.commands.connect(handle.pid)
    result = again.wait()
    assert result.exit_code == 0
    # roost keeps a command's output: a reconnect gets it from the start.
    assert result.stdout == "line1\nline2\nline3\n"


def test_a_killed_command_shows_its_end_not_a_clean_exit_code(sandbox: Sandbox) -> None:
    handle = sandbox.commands.run("sleep 60", background=True)
    assert sandbox.commands.kill(handle.pid)
    with pytest.raises(CommandExitException) as ended:
        handle.wait()
    assert ended.value.exit_code == -1
    assert ended.value.error and "KILL" in ended.value.error


def test_stdin_reaches_the_command(sandbox: Sandbox) -> None:
    handle = sandbox.commands.run("head -c 5", background=True, stdin=True)
    sandbox.commands.send_stdin(handle.pid, "hello")
    result = handle.wait()
    assert result.stdout == "hello"


def test_one_input_stream_feeds_one_process(sandbox: Sandbox, deployment: Deployment) -> None:
    """Audit finding: every `start` in a StreamInput looked the process up
    and opened a feed to the runner again; one stream now feeds one
    process, and a second start is refused."""
    handle = sandbox.commands.run("cat", background=True, stdin=True)

    def envelope(flags: int, message: bytes) -> bytes:
        return bytes([flags]) + len(message).to_bytes(4, "big") + message

    start = json.dumps({"start": {"process": {"pid": handle.pid}}}).encode()
    answer = httpx.post(
        deployment.url + "/e2b/envd/process.Process/StreamInput",
        content=envelope(0, start) + envelope(0, start) + envelope(2, b"{}"),
        headers={
            "Content-Type": "application/connect+json",
            "X-Access-Token": deployment.token,
            "E2b-Sandbox-Id": sandbox.sandbox_id,
        },
        timeout=60,
    )
    text = answer.content.decode(errors="replace")
    assert "invalid_argument" in text and "second start" in text, text
    assert sandbox.commands.kill(handle.pid)


def test_binary_file_round_trip_and_filesystem_calls(sandbox: Sandbox) -> None:
    # Every byte value, CRLFs and something like a multipart delimiter.
    data = bytes(range(256)) * 64 + b"\r\n--boundary\r\n" + os.urandom(4096)
    info = sandbox.files.write("/workspace/dir/blob.bin", data)
    assert info.path == "/workspace/dir/blob.bin"
    assert bytes(sandbox.files.read("/workspace/dir/blob.bin", format="bytes")) == data
    entry = sandbox.files.get_info("/workspace/dir/blob.bin")
    assert entry.size == len(data)
    assert [e.name for e in sandbox.files.list("/workspace/dir")] == ["blob.bin"]
    assert sandbox.files.make_dir("/workspace/made")
    assert not sandbox.files.make_dir("/workspace/made")
    sandbox.files.rename("/workspace/dir/blob.bin", "/workspace/made/moved.bin")
    assert sandbox.files.exists("/workspace/made/moved.bin")
    assert not sandbox.files.exists("/workspace/dir/blob.bin")
    sandbox.files.remove("/workspace/made")
    assert not sandbox.files.exists("/workspace/made")
    with pytest.raises(FileNotFoundException):
        sandbox.files.read("/workspace/nothing-here")


def test_get_info_finds_a_file_past_what_a_listing_of_its_directory_holds(sandbox: Sandbox) -> None:
    # A listing stops at 10,000 entries; a file's own info must not depend
    # on being among them.
    sandbox.commands.run("mkdir /workspace/big && cd /workspace/big && seq 1 10050 | xargs touch")
    listed = {e.name for e in sandbox.files.list("/workspace/big")}
    assert len(listed) == 10_000
    unlisted = [str(i) for i in range(1, 10051) if str(i) not in listed]
    assert len(unlisted) == 50
    for name in unlisted[:5]:
        entry = sandbox.files.get_info(f"/workspace/big/{name}")
        assert (entry.name, entry.size) == (name, 0)
        assert sandbox.files.exists(f"/workspace/big/{name}")
    assert sandbox.files.get_info("/workspace/big").type == FileType.DIR
    assert not sandbox.files.exists("/workspace/big/10051")


def test_pause_and_resume_keep_the_home_and_the_id(e2b_env: None) -> None:
    sbx = Sandbox.create(timeout=600)
    try:
        sbx.files.write("/workspace/kept.txt", "still here")
        assert sbx.pause()
        assert sbx.get_info().state == SandboxState.PAUSED
        paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
        assert sbx.sandbox_id in [s.sandbox_id for s in paused]
        resumed = Sandbox.connect(sbx.sandbox_id)
        assert resumed.sandbox_id == sbx.sandbox_id
        assert resumed.get_info().state == SandboxState.RUNNING
        assert resumed.files.read("/workspace/kept.txt") == "still here"
        assert resumed.commands.run("cat /workspace/kept.txt").stdout == "still here"
    finally:
        Sandbox.kill(sbx.sandbox_id)


def _roost_view(deployment: Deployment, sandbox_id: str) -> str:
    """The sandbox's commands and events as roost records them (for a
    failure's message: what ended a command E2B saw exit -1)."""
    import httpx

    headers = {"Authorization": f"Bearer {deployment.token}"}
    commands = httpx.get(f"{deployment.url}/v1/sandboxes/{sandbox_id}/commands", headers=headers).text
    events = httpx.get(f"{deployment.url}/v1/sandboxes/{sandbox_id}/events", headers=headers).text
    return f"commands: {commands}\nevents: {events}"


def test_auto_pause_sleeps_an_idle_sandbox_and_connect_resumes_it_with_its_home(
    e2b_env: None, deployment: Deployment
) -> None:
    # roost's auto-pause is sleep on idle: `timeout` seconds without
    # activity (10 s, the deployment's shortest), then paused, home secured.
    sbx = Sandbox.create(timeout=10, lifecycle={"on_timeout": "pause"})
    try:
        sbx.files.write("/workspace/asleep.txt", "kept while asleep")
        wait_until(
            lambda: sbx.get_info().state == SandboxState.PAUSED,
            what="the idle sandbox paused",
            timeout=60,
        )
        resumed = Sandbox.connect(sbx.sandbox_id)
        assert resumed.sandbox_id == sbx.sandbox_id
        try:
            ran = resumed.commands.run("cat /workspace/asleep.txt")
        except CommandExitException as ended:
            raise AssertionError(f"{ended.error!r}; {_roost_view(deployment, sbx.sandbox_id)}") from ended
        assert ran.stdout == "kept while asleep"
    finally:
        Sandbox.kill(sbx.sandbox_id)


def test_list_kill_and_metadata(e2b_env: None) -> None:
    tag = uuid.uuid4().hex[:8]
    sbx = Sandbox.create(timeout=600, metadata={"run": tag})
    listed = Sandbox.list(query=SandboxQuery(metadata={"run": tag})).next_items()
    assert [s.sandbox_id for s in listed] == [sbx.sandbox_id]
    assert listed[0].metadata == {"run": tag}
    assert listed[0].state == SandboxState.RUNNING
    sbx.set_timeout(900)
    assert sbx.kill()
    wait_until(
        lambda: sbx.sandbox_id
        not in [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(metadata={"run": tag})).next_items()],
        what="the killed sandbox gone from the list",
    )
    assert not Sandbox.kill(sbx.sandbox_id)


def test_errors_are_e2bs_and_name_what_roost_refuses(e2b_env: None, deployment: Deployment) -> None:
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="roost_org_" + "0" * 64)
    with pytest.raises(SandboxException) as refused:
        Sandbox.create(lifecycle={"on_timeout": "pause", "auto_resume": True})
    assert "autoResume" in str(refused.value)
    with pytest.raises(SandboxException) as missing:
        Sandbox.create(template="no-such-image-" + uuid.uuid4().hex[:6])
    assert "no-such-image" in str(missing.value)


def test_a_terminal_is_created_resized_and_typed_into(sandbox: Sandbox) -> None:
    from e2b import PtySize

    output: list[bytes] = []
    terminal = sandbox.pty.create(PtySize(rows=24, cols=80))
    sandbox.pty.resize(terminal.pid, PtySize(rows=30, cols=100))
    sandbox.pty.send_stdin(terminal.pid, b"stty size; exit\n")
    result = terminal.wait(on_pty=lambda data: output.append(bytes(data)))
    assert result.exit_code == 0
    assert b"30 100" in b"".join(output)

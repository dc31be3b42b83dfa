"""One real deployment per test session: `roost up` (server, local home
store and a runc runner in one process) on loopback, from the binary at
``$ROOST_BIN`` (default: the repository's target/debug/roost)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest

REPO = Path(__file__).resolve().parents[3]


@dataclass
class Deployment:
    url: str
    token: str
    admin_token: str
    data_dir: Path
    config_home: Path

    def admin(self, method: str, path: str, body: Optional[Dict[str, Any]] = None) -> Any:
        """A call with the admin token (orgs, quarantine): not SDK surface."""
        request = urllib.request.Request(
            self.url + path,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {self.admin_token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read() or b"null")


def _binary() -> str:
    given = os.environ.get("ROOST_BIN")
    if given:
        return given
    for target in (os.environ.get("CARGO_TARGET_DIR"), str(REPO / "target")):
        if target and (Path(target) / "debug" / "roost").exists():
            return str(Path(target) / "debug" / "roost")
    raise RuntimeError("no roost binary: build it (`cargo build -p cli`) or set ROOST_BIN")


def _cleanup(data_dir: Path) -> None:
    """What a stopped `roost up` leaves: containers still running and the
    loop-mounted homes image (as the Rust e2e tests clean up)."""
    runtime = data_dir / "runner" / "runtime"
    if runtime.is_dir():
        for entry in runtime.iterdir():
            subprocess.run(
                ["runc", f"--root={runtime}", "delete", "--force", entry.name],
                stderr=subprocess.DEVNULL,
                check=False,
            )
    subprocess.run(["umount", "-l", str(data_dir / "runner" / "volumes")], stderr=subprocess.DEVNULL, check=False)
    # The runner's tmpfs for delivered secrets (default place: named after
    # its data dir, under /run/roost/secrets).
    runner = str(data_dir / "runner").strip("/")
    secrets = Path("/run/roost/secrets") / "".join(c if c.isascii() and (c.isalnum() or c == "-") else "_" for c in runner)
    subprocess.run(["umount", "-l", str(secrets)], stderr=subprocess.DEVNULL, check=False)
    try:
        secrets.rmdir()
    except OSError:
        pass


@pytest.fixture(scope="session")
def deployment() -> Iterator[Deployment]:
    tmp = Path(tempfile.mkdtemp(prefix="roost-sdk-"))
    config_home = tmp / "config"
    data_dir = tmp / "data"
    env = dict(os.environ)
    for name in ("ROOST_URL", "ROOST_TOKEN", "ROOST_FAILPOINT"):
        env.pop(name, None)
    env.update({"XDG_CONFIG_HOME": str(config_home), "HOME": str(tmp / "home"), "ROOST_LOG": "warn"})
    up = subprocess.Popen(
        [_binary(), "up", "--listen", "127.0.0.1:0", "--runtime", "runc", "--data-dir", str(data_dir)],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stderr_lines: List[str] = []
    assert up.stderr is not None and up.stdout is not None
    threading.Thread(target=lambda: stderr_lines.extend(up.stderr or []), daemon=True).start()
    first = up.stdout.readline()
    if not first.startswith("roost is up at "):
        up.kill()
        raise RuntimeError(f"roost up did not start: {first!r} {''.join(stderr_lines)}")
    threading.Thread(target=lambda: [None for _ in up.stdout or []], daemon=True).start()
    saved = json.loads((config_home / "roost" / "credentials.json").read_text())
    admin_token = (data_dir / "server" / "admin-token").read_text().strip()
    # The SDK's own resolution (Roost() with no arguments) finds them here.
    previous = {name: os.environ.get(name) for name in ("XDG_CONFIG_HOME", "ROOST_URL", "ROOST_TOKEN")}
    os.environ["XDG_CONFIG_HOME"] = str(config_home)
    os.environ.pop("ROOST_URL", None)
    os.environ.pop("ROOST_TOKEN", None)
    try:
        yield Deployment(saved["url"], saved["token"], admin_token, data_dir, config_home)
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=20)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
        _cleanup(data_dir)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def roost_client(deployment: Deployment) -> Iterator[Any]:
    from roost import Roost

    with Roost(deployment.url, deployment.token) as client:
        yield client


def wait_until(check: Any, timeout: float = 30.0, what: str = "condition") -> Any:
    """Polls ``check`` until it returns something truthy (deadline, no fixed sleeps)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(0.1)

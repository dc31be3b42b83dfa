"""Org secrets through the SDK (issue 17, points 6 and 7): set, list (never
a value), rotate, delete; a sandbox given one as env and as a file sees it,
through the sync and the async client."""

from __future__ import annotations

import asyncio
import hashlib
import uuid

import pytest

from roost import AsyncRoost, InvalidRequest, Roost

from conftest import Deployment

# Hashes, not values, come back out of the sandbox: command output is stored.
SEEN = (
    'printf %s "$TOKEN" | sha256sum | cut -d" " -f1; '
    "sha256sum < /run/secrets/token | cut -d' ' -f1; stat -c '%a %u' /run/secrets/token"
)


def test_secrets_set_list_delete_and_delivery(roost_client: Roost) -> None:
    name = f"sdk-{uuid.uuid4().hex[:8]}"
    value = f"sdk-secret-{uuid.uuid4().hex}"
    first = roost_client.secrets.set(name, "an old value")
    assert first.version == 1
    rotated = roost_client.secrets.set(name, value)
    assert (rotated.name, rotated.version) == (name, 2)
    listed = {s.name: s for s in roost_client.secrets.list()}
    assert listed[name].version == 2
    assert not hasattr(listed[name], "value")

    secrets = [{"name": name, "env": "TOKEN"}, {"name": name, "file": "token"}]
    with roost_client.sandboxes.create(secrets=secrets, labels={"test": "secrets"}) as sandbox:
        result = sandbox.exec(["sh", "-c", SEEN])
        digest = hashlib.sha256(value.encode()).hexdigest()
        assert result.stdout.decode() == f"{digest}\n{digest}\n400 0\n"

    with pytest.raises(InvalidRequest):
        roost_client.sandboxes.create(secrets=[{"name": "no-such-secret", "env": "X"}])
    deleted = roost_client.secrets.delete(name)
    assert deleted is not None and deleted.name == name
    assert name not in {s.name for s in roost_client.secrets.list()}


def test_async_secrets(deployment: Deployment) -> None:
    async def scenario() -> None:
        async with AsyncRoost(deployment.url, deployment.token) as client:
            name = f"sdk-async-{uuid.uuid4().hex[:8]}"
            record = await client.secrets.set(name, "async value")
            assert record.version == 1
            assert name in {s.name for s in await client.secrets.list()}
            assert (await client.secrets.delete(name)) is not None

    asyncio.run(scenario())

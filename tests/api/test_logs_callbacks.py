"""Function logs and callbacks over HTTP, as a tenant uses them (the real app and its workers).
Following logs (SSE) needs a real connection: tests/cli/test_guest_life.py, against a server process."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.errors import Unavailable
from tests.helpers import deploy, new_tenant, submit, wait_status, wat


@dataclass
class Receiver:
    """A callback receiver on a free loopback port: answers `statuses` in turn (then 200)."""

    statuses: list[int]
    got: list[tuple[dict[str, str], bytes, float]] = field(default_factory=list)
    url: str = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        self.got.append((headers, body, time.monotonic()))
        status = self.statuses.pop(0) if self.statuses else 200
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        writer.close()


@asynccontextmanager
async def receiver(*statuses: int) -> AsyncIterator[Receiver]:
    r = Receiver(list(statuses))
    server = await asyncio.start_server(r.handle, "127.0.0.1", 0)
    r.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/hook"
    try:
        yield r
    finally:
        server.close()
        await server.wait_closed()


def verify(secret: str, headers: dict[str, str], body: bytes) -> bool:
    """What the README tells a receiver to do."""
    fields = dict(p.split("=", 1) for p in headers["x-tensorwasm-signature"].split(","))
    expected = hmac.new(secret.encode(), f"{fields['t']}.".encode() + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, fields["sha256"]) and abs(time.time() - int(fields["t"])) < 300


async def test_logs_of_sync_and_async_calls(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client)
    assert (await deploy(client, key, "talker", wat("echo_stderr"))).status_code == 201
    r = await client.post("/v1/functions/talker/invoke", content=b"first line\nsecond line\n", headers=key)
    assert r.status_code == 200 and r.content == b"ok"
    sync_id = r.headers["X-Invocation-Id"]
    inv = (await submit(client, key, "talker", b"from async\n")).json()["id"]
    await wait_status(client, key, inv, "succeeded")

    page = (await client.get("/v1/functions/talker/logs", headers=key)).json()
    lines = [(x["invocation_id"], x["line"]) for x in page["lines"]]
    # in the order they were stored: a front's batch of sync records may land after the async end
    assert sorted(lines, key=lambda x: x[0] != sync_id) == [(sync_id, "first line"), (sync_id, "second line"), (inv, "from async")]
    assert all(x["version"] == 1 and x["time"].endswith(("Z", "+00:00")) for x in page["lines"])
    assert [x["line"] for x in (await client.get("/v1/functions/talker/logs?limit=1", headers=key)).json()["lines"]] == [lines[-1][1]]

    # another tenant's function, an unknown one and bad bounds are answered in the envelope
    _, other = await new_tenant(client)
    missing = await client.get("/v1/functions/talker/logs", headers=other)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    bad = await client.get("/v1/functions/talker/logs?limit=0", headers=key)
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "validation_error"


async def test_logs_are_kept_within_the_tenant_budget(app_factory: Callable[..., Any]) -> None:
    async with app_factory(log_bytes_per_tenant=1000) as (client, _):
        _, key = await new_tenant(client)
        assert (await deploy(client, key, "talker", wat("echo_stderr"))).status_code == 201
        for i in range(12):
            await client.post("/v1/functions/talker/invoke", content=f"{i:02d} {'x' * 96}\n".encode(), headers=key)
        lines = [x["line"][:2] for x in (await client.get("/v1/functions/talker/logs?limit=1000", headers=key)).json()["lines"]]
        # 100 bytes a call: the newest that fit 1000 bytes, oldest deleted first
        assert lines == [f"{i:02d}" for i in range(2, 12)]


async def test_callback_url_is_checked_at_submit(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client)
    assert (await deploy(client, key, "talker", wat("echo_stderr"))).status_code == 201
    for url, code in (
        ("http://127.0.0.1:9/hook", "callback_url_not_allowed"),
        ("http://10.1.2.3/hook", "callback_url_not_allowed"),
        ("http://[::1]/hook", "callback_url_not_allowed"),
        ("http://169.254.169.254/latest", "callback_url_not_allowed"),
        ("ftp://example.com/x", "invalid_callback_url"),
        ("http://user:pw@example.com/x", "invalid_callback_url"),
    ):
        r = await submit(client, key, "talker", headers={"X-Callback-Url": url})
        assert r.status_code == 422 and r.json()["error"]["code"] == code, (url, r.text)
        assert "callback" in r.json()["error"]["message"].lower()
    # nothing was queued by a refused submit
    assert (await client.get("/v1/invocations?function=talker", headers=key)).json()["items"] == []


async def test_callback_arrives_signed_and_is_retried(app_factory: Callable[..., Any], server_database_url: str) -> None:
    # a database of its own: the session's app, which allows no private address, would take
    # these deliveries too and count a refused attempt
    async with app_factory(
        database_url=server_database_url, callback_allow_private=True, callback_backoff_s=0.2, callback_poll_s=0.1
    ) as (client, platform), receiver(500) as hook:
        _, key = await new_tenant(client)
        assert (await deploy(client, key, "talker", wat("echo_stderr"))).status_code == 201
        secret = (await client.get("/v1/callbacks/secret", headers=key)).json()["secret"]
        assert secret == (await client.get("/v1/callbacks/secret", headers=key)).json()["secret"]  # stable until rotated

        r = await submit(client, key, "talker", b"hi\n", headers={"X-Callback-Url": hook.url})
        assert r.status_code == 202, r.text
        inv = r.json()["id"]
        assert r.json()["callback"] == {"url": hook.url, "status": "pending", "attempts": 0, "last_status_code": None,
                                        "last_error": None, "delivered_at": None}
        deadline = time.monotonic() + 20
        while len(hook.got) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert len(hook.got) == 2, hook.got  # the 500 was retried
        (h1, b1, t1), (h2, b2, t2) = hook.got
        assert t2 - t1 >= 0.15  # after its back-off
        for h, b, _ in hook.got:
            assert verify(secret, h, b) and h["x-invocation-id"] == inv and h["content-type"] == "application/json"
            assert h["x-tensorwasm-timestamp"] == h["x-tensorwasm-signature"].split(",")[0][2:]
        assert not verify("whsec_wrong", h2, b2) and not verify(secret, h2, b2 + b" ")
        body = json.loads(b2)
        assert body["id"] == inv and body["status"] == "succeeded" and body["stderr_tail"] == "hi\n"
        assert body["callback"]["attempts"] == 2

        async def delivered() -> dict[str, Any]:
            while True:
                rec: dict[str, Any] = (await client.get(f"/v1/invocations/{inv}", headers=key)).json()
                if rec["callback"]["status"] != "pending":
                    return rec
                await asyncio.sleep(0.05)

        rec = await asyncio.wait_for(delivered(), 10)
        assert rec["callback"]["status"] == "delivered" and rec["callback"]["attempts"] == 2
        assert rec["callback"]["last_status_code"] == 200 and rec["callback"]["delivered_at"]
        metrics = platform.metrics.render().decode()
        assert 'tensorwasm_callbacks_total{outcome="delivered"} 1.0' in metrics
        assert 'tensorwasm_callbacks_total{outcome="retried"} 1.0' in metrics

        # rotation: a new key signs from now on
        rotated = (await client.post("/v1/callbacks/secret", headers=key)).json()["secret"]
        assert rotated != secret and (await client.get("/v1/callbacks/secret", headers=key)).json()["secret"] == rotated


# callbacks to a local receiver, given up 2 s after the first attempt: about 5 attempts (backing
# off from 0.1 s, doubling), at least 2 even where an attempt is slow (a database read and an
# unsealing each, on a busy host)
SHORT_RETRIES = {"callback_allow_private": True, "callback_backoff_s": 0.1, "callback_poll_s": 0.05, "callback_retry_s": 2.0}


async def _callback_failed(client: httpx.AsyncClient, key: dict[str, str], inv: str) -> dict[str, Any]:
    """The invocation's record once its callback ended `failed` (or as it is after 20 s)."""
    deadline = time.monotonic() + 20
    while True:
        rec: dict[str, Any] = (await client.get(f"/v1/invocations/{inv}", headers=key)).json()
        if rec["callback"]["status"] == "failed" or time.monotonic() > deadline:
            return rec
        await asyncio.sleep(0.05)


async def test_callback_gives_up_after_the_retry_time(app_factory: Callable[..., Any], server_database_url: str) -> None:
    # a database of its own: the session's app, which allows no private address, would take
    # these deliveries too and count a refused attempt
    async with app_factory(
        database_url=server_database_url, **SHORT_RETRIES,
    ) as (client, _), receiver(*[503] * 100) as hook:
        _, key = await new_tenant(client)
        assert (await deploy(client, key, "talker", wat("echo_stderr"))).status_code == 201
        inv = (await submit(client, key, "talker", b"x", headers={"X-Callback-Url": hook.url})).json()["id"]
        rec = await _callback_failed(client, key, inv)
        assert rec["callback"]["status"] == "failed" and rec["callback"]["last_status_code"] == 503
        assert 2 <= rec["callback"]["attempts"] == len(hook.got) <= 10


async def test_the_signing_secret_is_kept_sealed(client: httpx.AsyncClient, platform: Any, tmp_path: Path) -> None:
    """At rest the callback signing secret is sealed with the node key, as tenants' secrets are;
    one written in clear by an older version is sealed at its first read, unchanged; a node with
    another key says so instead of signing with something else."""
    from app.db.models import CallbackSecret
    from app.services.callbacks import CallbackSecrets
    from app.services.sealing import NodeKey
    from tests.helpers import make_settings

    tid, key = await new_tenant(client)
    secret = (await client.get("/v1/callbacks/secret", headers=key)).json()["secret"]
    async with platform.sessionmaker() as s:
        row = await s.get(CallbackSecret, tid)
        assert row.secret is None and row.ciphertext and secret.encode() not in row.ciphertext

    old, key2 = await new_tenant(client)
    async with platform.sessionmaker() as s:  # as a version before sealing wrote it
        s.add(CallbackSecret(tenant_id=old, secret="whsec_written_in_clear", created_at=datetime.now(UTC)))
        await s.commit()
    r = await client.get("/v1/callbacks/secret", headers=key2)
    assert r.status_code == 200 and r.json()["secret"] == "whsec_written_in_clear"
    async with platform.sessionmaker() as s:
        row = await s.get(CallbackSecret, old)
        assert row.secret is None and b"written_in_clear" not in row.ciphertext
    assert (await client.get("/v1/callbacks/secret", headers=key2)).json()["secret"] == "whsec_written_in_clear"

    rotated = (await client.post("/v1/callbacks/secret", headers=key)).json()["secret"]
    async with platform.sessionmaker() as s:
        row = await s.get(CallbackSecret, tid)
        assert row.secret is None and rotated.encode() not in row.ciphertext

    other_node = CallbackSecrets(platform.sessionmaker, platform.clock, NodeKey(make_settings("sqlite://", tmp_path / "other")))
    with pytest.raises(Unavailable) as refused:
        await other_node.get(tid)
    assert refused.value.code == "secrets_key_mismatch" and "TENSORWASM_SECRETS_KEY" in refused.value.message

    # a rotation that lands between a read of a clear secret and its sealing is not undone
    racer, key3 = await new_tenant(client)
    async with platform.sessionmaker() as s:
        s.add(CallbackSecret(tenant_id=racer, secret="whsec_old_in_clear", created_at=datetime.now(UTC)))
        await s.commit()
    from app.db.repositories.callbacks import CallbackRepository

    real = CallbackRepository.seal_clear_secret

    async def rotated_first(self: CallbackRepository, tenant_id: str, value: str, sealed: bytes) -> bool:
        if tenant_id == racer and value == "whsec_old_in_clear":
            async with platform.sessionmaker() as other:  # another node rotates, and commits first
                await CallbackRepository(other).put_secret(racer, platform.callback_secrets._seal(racer, "whsec_rotated"), datetime.now(UTC))
                await other.commit()
        return await real(self, tenant_id, value, sealed)

    CallbackRepository.seal_clear_secret = rotated_first  # type: ignore[method-assign]
    try:
        assert (await client.get("/v1/callbacks/secret", headers=key3)).json()["secret"] == "whsec_rotated"
    finally:
        CallbackRepository.seal_clear_secret = real  # type: ignore[method-assign]


async def test_a_callback_that_cannot_be_signed_fails_after_the_retry_time(app_factory: Callable[..., Any], server_database_url: str) -> None:
    """A node whose secrets key does not open the tenant's signing secret sends nothing unsigned:
    each attempt fails, backs off and the delivery ends `failed` within its retry time."""
    from app.db.models import CallbackSecret
    from app.services.callbacks import _aad
    from app.services.sealing import SecretBox

    async with app_factory(
        database_url=server_database_url, **SHORT_RETRIES,
    ) as (client, platform), receiver(*[200] * 10) as hook:
        tid, key = await new_tenant(client)
        assert (await deploy(client, key, "talker", wat("echo_stderr"))).status_code == 201
        async with platform.sessionmaker() as s:  # sealed by a node with another key
            s.add(CallbackSecret(tenant_id=tid, ciphertext=SecretBox(os.urandom(32)).seal(b"whsec_x", _aad(tid)), created_at=datetime.now(UTC)))
            await s.commit()
        assert (await client.get("/v1/callbacks/secret", headers=key)).json()["error"]["code"] == "secrets_key_mismatch"
        inv = (await submit(client, key, "talker", b"x", headers={"X-Callback-Url": hook.url})).json()["id"]
        rec = await _callback_failed(client, key, inv)
        assert rec["callback"]["status"] == "failed" and rec["callback"]["last_status_code"] is None
        assert rec["callback"]["last_error"].startswith("secrets_key_mismatch")
        assert 2 <= rec["callback"]["attempts"] <= 10 and hook.got == []

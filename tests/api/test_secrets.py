"""Secrets as a user meets them over HTTP: kept sealed, listed by name, given to the functions
that name them as environment variables, and never answered, recorded, logged or counted."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from app.db.models import Secret
from app.services.sealing import SecretBox, Unsealable, parse_key
from tests.api.test_call_args import _report
from tests.helpers import ADMIN, deploy, new_tenant, submit, wait_status, wat

VALUE = "s3cr3t-VALUE-\u00e9-9f2c7a"  # looked for everywhere it must not be


async def _put(client: httpx.AsyncClient, key: dict[str, str], name: str, value: str | bytes) -> httpx.Response:
    data = value.encode() if isinstance(value, str) else value
    return await client.put(f"/v1/secrets/{name}", content=data, headers={**key, "Content-Type": "application/octet-stream"})


async def test_a_secret_reaches_the_guest_and_nothing_else(
    client: httpx.AsyncClient, platform: Any, c_guest: Callable[[str], bytes], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    _, key = await new_tenant(client)
    r = await _put(client, key, "API_KEY", VALUE)
    assert r.status_code == 201 and r.json()["name"] == "API_KEY" and r.json()["size"] == len(VALUE.encode()), r.text
    assert VALUE not in r.text
    r = await client.get("/v1/secrets", headers=key)
    assert [s["name"] for s in r.json()] == ["API_KEY"] and VALUE not in r.text
    assert set(r.json()[0]) == {"name", "size", "created_at", "updated_at"}

    r = await deploy(client, key, "p", c_guest("wasi_probe.c"), arg=["env"], secret=["API_KEY"], env=["PLAIN=1"])
    assert r.status_code == 201 and r.json()["secrets"] == ["API_KEY"] and VALUE not in r.text, r.text
    responses = [r]
    r = await client.post("/v1/functions/p/invoke", headers=key)
    assert r.status_code == 200 and _report(r.text)[1] == {"PLAIN": "1", "API_KEY": VALUE}, r.text
    sync_id = r.headers["x-invocation-id"]
    r = await client.post("/v1/functions/p/invoke?stream=raw", headers=key)
    assert _report(r.text)[1]["API_KEY"] == VALUE
    r = await submit(client, key, "p")
    rec = await wait_status(client, key, r.json()["id"], "succeeded")
    assert _report((await client.get(f"/v1/invocations/{rec['id']}/output", headers=key)).text)[1]["API_KEY"] == VALUE

    # a guest that fails: its record and error carry no value either (the value is not on stderr)
    responses += [
        await client.get("/v1/functions/p", headers=key),
        await client.get("/v1/functions/p/versions", headers=key),
        await client.get("/v1/functions", headers=key),
        await client.get(f"/v1/invocations/{sync_id}", headers=key),
        await client.get("/v1/invocations", headers=key),
        await client.get("/metrics", headers=ADMIN),
        await client.get("/v1/usage", headers=key),
    ]
    for resp in responses:
        assert resp.status_code in (200, 201), resp.text
        assert VALUE not in resp.text
    assert VALUE not in caplog.text
    # at rest: sealed, not the value
    async with platform.sessionmaker() as session:
        sealed = (await session.scalars(select(Secret.ciphertext))).all()
    assert sealed and all(VALUE.encode() not in c for c in sealed)


async def test_replace_delete_and_refusals(client: httpx.AsyncClient, c_guest: Callable[[str], bytes]) -> None:
    _, key = await new_tenant(client, max_secrets=2, max_secret_bytes=100)
    assert (await _put(client, key, "A", "one")).status_code == 201
    r = await _put(client, key, "A", "two")  # replaced
    assert r.status_code == 200
    # a deploy naming a secret the tenant does not have: 422 naming it, nothing deployed
    r = await deploy(client, key, "p", c_guest("wasi_probe.c"), arg=["env"], secret=["A", "MISSING"])
    assert r.status_code == 422 and r.json()["error"]["code"] == "secret_not_found" and "MISSING" in r.json()["error"]["message"]
    assert (await client.get("/v1/functions/p", headers=key)).status_code == 404
    r = await deploy(client, key, "p", c_guest("wasi_probe.c"), arg=["env"], secret=["A"], env=["A=x"])
    assert r.status_code == 422 and "A" in r.json()["error"]["message"]
    assert (await deploy(client, key, "p", c_guest("wasi_probe.c"), arg=["env"], secret=["A"])).status_code == 201
    assert _report((await client.post("/v1/functions/p/invoke", headers=key)).text)[1]["A"] == "two"
    assert (await _put(client, key, "A", "three")).status_code == 200  # the next call sees the new value
    assert _report((await client.post("/v1/functions/p/invoke", headers=key)).text)[1]["A"] == "three"

    # in use by an active version: 409 naming the function
    r = await client.delete("/v1/secrets/A", headers=key)
    assert r.status_code == 409 and r.json()["error"]["code"] == "secret_in_use" and "p" in r.json()["error"]["message"]
    # a new version without it (one empty secret=): then it can go; the old version cannot come back
    r = await deploy(client, key, "p", c_guest("wasi_probe.c"), secret=[""])
    assert r.status_code == 200 and r.json()["secrets"] == [] and r.json()["version"] == 2
    assert (await client.delete("/v1/secrets/A", headers=key)).status_code == 204
    assert (await client.delete("/v1/secrets/A", headers=key)).status_code == 404
    r = await client.post("/v1/functions/p/rollback", json={"version": 1}, headers=key)
    assert r.status_code == 422 and r.json()["error"]["code"] == "secret_not_found"
    r = await client.post("/v1/functions/p/invoke", headers={**key, "X-Function-Version": "1"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "secret_not_found"

    # bounds: value size, UTF-8 without NUL, names, count and bytes quotas
    r = await _put(client, key, "BIG", b"x" * (64 * 1024 + 1))
    assert r.status_code == 413
    for bad in (b"a\x00b", b"\xff\xfe"):
        r = await _put(client, key, "BAD", bad)
        assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error"
    for name in ("1A", "A-B", "x" * 129):
        assert (await _put(client, key, name, "v")).status_code == 422
    assert (await _put(client, key, "B", "b" * 60)).status_code == 201
    r = await _put(client, key, "C", "c" * 50)  # 110 bytes > 100
    assert r.status_code == 409 and r.json()["error"]["code"] == "quota_exceeded"
    assert (await _put(client, key, "C", "c")).status_code == 201
    r = await _put(client, key, "D", "d")  # a third secret
    assert r.status_code == 409 and "max_secrets" in r.json()["error"]["message"]
    assert [s["name"] for s in (await client.get("/v1/secrets", headers=key)).json()] == ["B", "C"]
    # a tenant sees only its own
    _, other = await new_tenant(client)
    assert (await client.get("/v1/secrets", headers=other)).json() == []
    assert (await client.delete("/v1/secrets/B", headers=other)).status_code == 404
    r = await deploy(client, other, "q", wat("noop"), secret=["B"])
    assert r.status_code == 422


async def test_quota_fields_have_bounds(client: httpx.AsyncClient) -> None:
    tid, _ = await new_tenant(client)
    r = await client.patch(f"/v1/admin/tenants/{tid}/quota", json={"max_secrets": 5, "max_secret_bytes": 4096}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["max_secrets"] == 5 and r.json()["max_secret_bytes"] == 4096, r.text
    for field, value in (("max_secrets", 10**9), ("max_secret_bytes", 2**40), ("max_secrets", -1)):
        r = await client.patch(f"/v1/admin/tenants/{tid}/quota", json={field: value}, headers=ADMIN)
        assert r.status_code == 422, (field, r.text)


def test_sealing_and_the_node_key(tmp_path: Path) -> None:
    from app.services.sealing import NodeKey
    from tests.helpers import make_settings

    settings = make_settings("sqlite://", tmp_path / "d")
    box = NodeKey(settings).box()
    path = tmp_path / "d" / "secrets_key"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert NodeKey(settings).box().open(box.seal(b"v", b"a"), b"a") == b"v"  # read back, not generated again
    sealed = box.seal(b"value", b"t/A")
    assert box.open(sealed, b"t/A") == b"value"
    with pytest.raises(Unsealable):
        box.open(sealed, b"t/B")  # moved to another row
    with pytest.raises(Unsealable):
        box.open(sealed[:-1] + bytes([sealed[-1] ^ 1]), b"t/A")
    with pytest.raises(Unsealable):
        SecretBox(os.urandom(32)).open(sealed, b"t/A")  # another node's key
    key = os.urandom(32)
    assert parse_key(key.hex()) == key and len(repr(SecretBox(key))) < 20
    import base64

    assert parse_key(base64.b64encode(key).decode()) == key
    with pytest.raises(ValueError):
        parse_key("short")

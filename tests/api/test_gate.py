"""Credentials before bodies, and bad credentials that cost the node little (app/api/gate.py,
app/api/deps.py): the caller is known from the head alone; a token that cannot be a key, or a
key just found missing, is never looked up; an address failing too often waits."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from app.services.api_keys import ApiKeyService, generate_key
from tests.helpers import ADMIN, CountingBody, from_address, new_tenant, until


@pytest.mark.parametrize(
    ("method", "path", "headers"),
    [
        ("POST", "/v1/admin/tenants", {}),  # a JSON route: FastAPI would read the body first
        ("POST", "/v1/admin/tenants", {"Authorization": "Bearer not-the-admin-token"}),
        ("PUT", "/v1/functions/f", {"Content-Type": "application/wasm"}),
        ("POST", "/v1/functions/f/invoke", {"Authorization": "Bearer " + generate_key()}),
        ("POST", "/v1/functions/f/invocations", {"Authorization": "Bearer tw_short"}),
        ("PUT", "/v1/kernels/k", {}),
    ],
)
async def test_no_body_is_read_before_the_caller_is_known(client: httpx.AsyncClient, method: str, path: str, headers: dict[str, str]) -> None:
    body = CountingBody(1024 * 1024 - 1)
    async with from_address(client, "192.0.2.10") as stranger:
        r = await stranger.request(method, path, content=body, headers={**headers, "Content-Length": str(body.total)})  # type: ignore[arg-type]
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    assert body.sent == 0


async def test_a_bad_key_is_looked_up_once_and_a_malformed_one_never(client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    looked_up: list[str] = []
    authenticate = ApiKeyService.authenticate

    async def counted(self: ApiKeyService, key: str) -> Any:
        looked_up.append(key)
        return await authenticate(self, key)

    monkeypatch.setattr(ApiKeyService, "authenticate", counted)
    bad = generate_key()  # shaped like a key, and no key
    async with from_address(client, "192.0.2.11") as stranger:
        for _ in range(3):
            assert (await stranger.get("/v1/functions", headers={"Authorization": f"Bearer {bad}"})).status_code == 401
        for token in ("tw_" + "x" * 42, "tw_" + "!" * 43, "twadmin_guess", bad + "x"):
            assert (await stranger.get("/v1/functions", headers={"Authorization": f"Bearer {token}"})).status_code == 401
    assert looked_up == [bad]


def _auth_failures(platform: Any, outcome: str) -> float:
    return float(platform.metrics.registry.get_sample_value("tensorwasm_auth_failures_total", {"outcome": outcome}) or 0)


async def test_an_address_failing_too_often_waits_and_valid_callers_do_not(app_factory: Any) -> None:
    # A slow rate: with the default 5 a second the burst and one more must all fail within 0.2 s
    # to see the refusal, and each failure is a database lookup (a CI run on PostgreSQL took longer)
    async with app_factory(auth_failures_per_s=0.1, auth_failure_burst=5) as (client, platform):
        await _guesser_waits(client, platform)


async def _guesser_waits(client: httpx.AsyncClient, platform: Any) -> None:
    refused, throttled = _auth_failures(platform, "refused"), _auth_failures(platform, "throttled")
    _, key = await new_tenant(client)
    assert (await client.get("/v1/functions", headers=key)).status_code == 200  # cached now
    burst = platform.settings.auth_failure_burst
    async with from_address(client, "192.0.2.12") as guesser, from_address(client, "192.0.2.13") as other:
        for _ in range(burst):
            r = await guesser.get("/v1/functions", headers={"Authorization": f"Bearer {generate_key()}"})
            assert r.status_code == 401
        r = await guesser.get("/v1/functions", headers={"Authorization": f"Bearer {generate_key()}"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_auth_failures"
        assert int(r.headers["retry-after"]) >= 1
        r = await guesser.post("/v1/admin/tenants", json={"name": "x"}, headers={"Authorization": "Bearer guess"})
        assert r.status_code == 429  # the admin token is guessed no faster
        assert (await guesser.get("/v1/functions", headers=key)).status_code == 200  # a valid caller there is served
        assert (await guesser.get("/v1/admin/tenants", headers=ADMIN)).status_code == 200
        assert (await other.get("/v1/functions", headers={"Authorization": f"Bearer {generate_key()}"})).status_code == 401
    assert _auth_failures(platform, "refused") - refused == burst + 1
    assert _auth_failures(platform, "throttled") - throttled == 2


async def test_credentials_of_the_wrong_kind_still_say_so(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client)
    r = await client.post("/v1/admin/tenants", json={"name": "x"}, headers=key)
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    r = await client.post("/v1/functions/f/invoke", content=b"x", headers=ADMIN)
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"


async def test_calls_that_bring_an_uncached_key_together_share_one_lookup(client: httpx.AsyncClient, platform: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node just started, or a key's entry expired: a loaded front's calls of that key all miss
    at once, and one read answers them; an admin change meanwhile keeps its result out of the cache."""
    tid, key = await new_tenant(client)
    looked_up, go = [], asyncio.Event()
    authenticate = ApiKeyService.authenticate

    async def slow(self: ApiKeyService, token: str) -> Any:
        looked_up.append(token)
        found = await authenticate(self, token)
        await go.wait()  # read, and not yet answered
        return found

    platform.auth_cache.clear()  # the key as a fresh front finds it
    monkeypatch.setattr(ApiKeyService, "authenticate", slow)
    calls = [asyncio.create_task(client.get("/v1/functions", headers=key)) for _ in range(12)]
    await until(lambda: len(looked_up) == 1, "the first lookup")
    await asyncio.sleep(0.05)  # the other calls arrive meanwhile
    go.set()
    assert [r.status_code for r in await asyncio.gather(*calls)] == [200] * 12
    assert len(looked_up) == 1 and len(platform.auth_cache.reads) == 0

    # revoked on this node while a lookup of it runs: its result serves the calls that were
    # waiting, and is not cached; the next call reads again and is refused
    go.clear()
    platform.auth_cache.clear()
    waiting = asyncio.create_task(client.get("/v1/functions", headers=key))
    await until(lambda: len(looked_up) == 2, "the second lookup")
    key_id = (await client.get(f"/v1/admin/tenants/{tid}/api-keys", headers=ADMIN)).json()[0]["id"]
    assert (await client.delete(f"/v1/admin/tenants/{tid}/api-keys/{key_id}", headers=ADMIN)).status_code == 204
    go.set()
    assert (await waiting).status_code == 200
    assert (await client.get("/v1/functions", headers=key)).status_code == 401
    assert len(looked_up) == 3


async def test_a_key_seen_before_is_refused_once_revoked_and_a_long_header_is_not_held(client: httpx.AsyncClient) -> None:
    # the front keeps each key-sized header's digest (app/api/deps.py): a pure function of the
    # header, so a revocation still acts on the next call; a longer header is parsed every time
    from app.api.deps import _SEEN_MAX, _digest_seen

    tid, key = await new_tenant(client)
    for _ in range(2):
        assert (await client.get("/v1/functions", headers=key)).status_code == 200
    created = (await client.get(f"/v1/admin/tenants/{tid}/api-keys", headers=ADMIN)).json()[0]
    padded = {"Authorization": "Bearer" + " " * _SEEN_MAX + key["Authorization"].removeprefix("Bearer ")}
    held = _digest_seen.cache_info().currsize
    assert (await client.get("/v1/functions", headers=padded)).status_code == 200  # the same key, padded
    assert _digest_seen.cache_info().currsize == held
    assert (await client.delete(f"/v1/admin/tenants/{tid}/api-keys/{created['id']}", headers=ADMIN)).status_code == 204
    for headers in (key, padded):
        r = await client.get("/v1/functions", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"

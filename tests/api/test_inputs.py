"""Bad inputs get a clear 4xx in the envelope and never reach the database or a later call:
quota bounds, media types, env entries, JSON body size, and timestamps that keep their zone."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from sqlalchemy import update

from app.db.models import Function
from app.services.principal import QUOTA_BOUNDS
from tests.helpers import ADMIN, CountingBody, deploy, new_tenant, wat


async def _tenant_id(client: httpx.AsyncClient) -> str:
    tid, _ = await new_tenant(client)
    return tid


@pytest.mark.parametrize("field", sorted(QUOTA_BOUNDS))
async def test_each_quota_field_has_an_upper_bound(client: httpx.AsyncClient, field: str) -> None:
    tid = await _tenant_id(client)
    bound = QUOTA_BOUNDS[field]
    r = await client.patch(f"/v1/admin/tenants/{tid}/quota", json={field: bound}, headers=ADMIN)
    assert r.status_code == 200, r.text
    assert r.json()[field] == bound  # the bound itself fits its column on this database
    assert (await client.get(f"/v1/admin/tenants/{tid}/quota", headers=ADMIN)).json()[field] == bound
    for past in (bound + 1, 2**63, 2**64 + 1, 10**40):
        for method in ("put", "patch"):
            r = await client.request(method, f"/v1/admin/tenants/{tid}/quota", json={field: past}, headers=ADMIN)
            assert r.status_code == 422, (method, past, r.text)
            assert r.json()["error"]["code"] == "validation_error" and field in r.json()["error"]["message"]
    r = await client.post("/v1/admin/tenants", json={"name": f"b-{tid[:8]}", "quota": {field: 2**63}}, headers=ADMIN)
    assert r.status_code == 422


async def test_rate_must_be_finite_and_not_vanishing(client: httpx.AsyncClient) -> None:
    tid = await _tenant_id(client)
    for bad in (0, 1e-300, 5e-324, -1):
        r = await client.patch(f"/v1/admin/tenants/{tid}/quota", json={"requests_per_second": bad}, headers=ADMIN)
        assert r.status_code == 422, bad
    for literal in (b"Infinity", b"NaN"):
        body = b'{"requests_per_second": ' + literal + b"}"
        r = await client.patch(
            f"/v1/admin/tenants/{tid}/quota", content=body, headers={**ADMIN, "Content-Type": "application/json"}
        )
        assert r.status_code == 422, literal


async def test_patch_quota_changes_only_the_fields_given(client: httpx.AsyncClient) -> None:
    tid = await _tenant_id(client)
    before = (await client.get(f"/v1/admin/tenants/{tid}/quota", headers=ADMIN)).json()
    r = await client.patch(f"/v1/admin/tenants/{tid}/quota", json={"timeout_ms": 1234}, headers=ADMIN)
    assert r.json() == {**before, "timeout_ms": 1234}


@pytest.mark.parametrize(
    "value",
    ["text/plain\r\nX-Evil: 1", "text/plain\nX-Evil: 1", "\u2603", "text/plain\x00", "text", "text/", "/plain", "text/plain; charset", "a b/c"],
)
async def test_content_type_must_be_a_media_type(client: httpx.AsyncClient, value: str) -> None:
    _, key = await new_tenant(client)
    r = await deploy(client, key, "f", wat("echo"), content_type=value)
    assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error", r.text
    assert "content_type" in r.json()["error"]["message"]
    assert (await client.get("/v1/functions/f", headers=key)).status_code == 404  # nothing stored


@pytest.mark.parametrize("value", ["text/plain", "text/plain; charset=utf-8", 'application/vnd.x+json;profile="a b"'])
async def test_valid_media_types_are_answered_with(client: httpx.AsyncClient, value: str) -> None:
    _, key = await new_tenant(client)
    assert (await deploy(client, key, "f", wat("echo"), content_type=value)).status_code == 201
    r = await client.post("/v1/functions/f/invoke", content=b"hi", headers=key)
    assert r.status_code == 200 and r.content == b"hi"
    # text/* without a charset gets the server's utf-8 added
    assert r.headers["content-type"] == (value if value != "text/plain" else "text/plain; charset=utf-8")


async def test_a_bad_stored_content_type_never_breaks_an_invoke(client: httpx.AsyncClient, platform: Any) -> None:
    tid, key = await new_tenant(client)
    assert (await deploy(client, key, "f", wat("echo"))).status_code == 201
    async with platform.sessionmaker() as session:  # a value stored before deploys were checked
        await session.execute(update(Function).where(Function.tenant_id == tid).values(content_type="text/plain\r\nX-Evil: 1"))
        await session.commit()
    platform.function_cache.drop(tid, "f")
    r = await client.post("/v1/functions/f/invoke", content=b"hi", headers=key)
    assert r.status_code == 200 and r.content == b"hi"
    assert r.headers["content-type"] == "application/octet-stream" and "x-evil" not in r.headers


@pytest.mark.parametrize(
    "entry",
    ["TW_TENANT\n=evil", "A\n=1", "1A=x", "A-B=x", "=x", "A", "A=x\x00y", "A=" + "x" * 4097, "K" * 129 + "=v", "QUERY_STRING=x"],
)
async def test_env_entries_are_checked_whole(client: httpx.AsyncClient, entry: str) -> None:
    _, key = await new_tenant(client)
    r = await deploy(client, key, "f", wat("echo"), env=[entry])
    assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error", r.text


async def test_env_entries_within_rules_are_kept(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client)
    r = await deploy(client, key, "f", wat("echo"), env=["_A1=x=y", "B=caf\u00e9 ok", "C=", "PEM=a\nb\r\n\tc\x7f"])
    assert r.status_code == 201 and r.json()["env"] == {"_A1": "x=y", "B": "caf\u00e9 ok", "C": "", "PEM": "a\nb\r\n\tc\x7f"}
    r = await deploy(client, key, "g", wat("echo"), env=[f"K{i}=v" for i in range(65)])
    assert r.status_code == 422


async def test_json_body_over_the_limit_is_refused_unread(client: httpx.AsyncClient, platform: Any) -> None:
    limit = platform.settings.max_json_bytes
    stranger = CountingBody(200 * 1024 * 1024)
    r = await client.post(
        "/v1/admin/tenants", content=stranger,  # type: ignore[arg-type]
        headers={"Content-Type": "application/json", "Content-Length": str(stranger.total)},  # no credentials
    )
    assert r.status_code == 401 and stranger.sent == 0  # the caller first, from the head alone

    body = CountingBody(200 * 1024 * 1024)
    r = await client.post(
        "/v1/admin/tenants", content=body,  # type: ignore[arg-type]
        headers={**ADMIN, "Content-Type": "application/json", "Content-Length": str(body.total)},
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
    assert str(limit) in r.json()["error"]["message"]
    assert body.sent == 0  # refused from the declared length alone

    chunked = CountingBody(200 * 1024 * 1024)  # no length declared: stopped as it passes the limit
    r = await client.post("/v1/admin/tenants", content=chunked, headers={**ADMIN, "Content-Type": "application/json"})  # type: ignore[arg-type]
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
    assert chunked.sent <= limit + chunked.chunk

    r = await client.patch("/v1/admin/tenants/x/quota", content=b" " * (limit + 1), headers={**ADMIN, "Content-Type": "application/json"})
    assert r.status_code == 413
    r = await client.post("/v1/admin/tenants", content=b"{}", headers={**ADMIN, "Content-Type": "application/json", "Content-Length": "x"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request"


async def test_json_body_within_the_limit_still_works(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/admin/tenants", json={"name": "padded-" + "x" * 8}, headers=ADMIN)
    assert r.status_code == 201
    assert (await client.post("/v1/admin/tenants", json={"name": "y"})).status_code == 401  # small: auth decides


async def test_the_limit_is_a_setting(app_factory: Any) -> None:
    async with app_factory(max_json_bytes=64) as (client, _):
        r = await client.post("/v1/admin/tenants", json={"name": "n" * 60}, headers=ADMIN)
        assert r.status_code == 413
        assert (await client.post("/v1/admin/tenants", json={"name": "small"}, headers=ADMIN)).status_code == 201


async def test_put_and_get_render_timestamps_identically(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client)
    put = (await deploy(client, key, "f", wat("echo"))).json()
    got = (await client.get("/v1/functions/f", headers=key)).json()
    listed = (await client.get("/v1/functions", headers=key)).json()[0]
    for field in ("created_at", "updated_at"):
        assert put[field] == got[field] == listed[field]
        assert put[field].endswith("Z")
    assert got["versions"][0]["created_at"].endswith("Z")
    r = await client.post("/v1/functions/f/invoke", content=b"x", headers=key)
    inv = (await client.get(f"/v1/invocations/{r.headers['x-invocation-id']}", headers=key)).json()
    assert inv["started_at"].endswith("Z")
    tenants = (await client.get("/v1/admin/tenants", headers=ADMIN)).json()
    assert all(t["created_at"].endswith("Z") and t["updated_at"].endswith("Z") for t in tenants)


async def test_ids_and_names_outside_their_pattern_are_422(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client)
    for path in ("/v1/admin/tenants/%00", "/v1/admin/tenants/a%0Ab", "/v1/admin/tenants/" + "a" * 65):
        r = await client.get(path, headers=ADMIN)
        assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error"
    assert (await client.get("/v1/invocations/%00", headers=key)).status_code == 422
    assert (await client.get("/v1/invocations", params={"function": "a\x00"}, headers=key)).status_code == 422


async def test_kernel_source_with_nul_is_refused(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client)
    r = await client.put("/v1/kernels/k", content=b"__global__ void f() {}\x00", headers={**key, "Content-Type": "text/plain"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_kernel"

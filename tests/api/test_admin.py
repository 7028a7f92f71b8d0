"""Admin API: tenants, quotas, API keys, and every auth rule."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import ADMIN, deploy, new_tenant, wat

QUOTA = {
    "gpu_memory_bytes": 64 * 1024 * 1024,
    "max_concurrency": 3,
    "requests_per_second": 12.5,
    "max_functions": 7,
    "max_module_bytes": 1 << 20,
    "wasm_memory_bytes": 32 * 1024 * 1024,
    "timeout_ms": 1500,
    "max_queued": 17,
}


async def test_tenant_crud(client: httpx.AsyncClient, platform) -> None:
    r = await client.post("/v1/admin/tenants", json={"name": "crud-tenant", "quota": {"max_concurrency": 2}}, headers=ADMIN)
    assert r.status_code == 201
    t = r.json()
    assert t["name"] == "crud-tenant" and t["disabled"] is False
    assert t["quota"]["max_concurrency"] == 2
    assert t["quota"]["timeout_ms"] == platform.settings.default_timeout_ms  # omitted = default

    r = await client.post("/v1/admin/tenants", json={"name": "crud-tenant"}, headers=ADMIN)
    assert r.status_code == 409 and r.json()["error"]["code"] == "conflict"

    r = await client.get("/v1/admin/tenants", headers=ADMIN)
    assert t["id"] in [x["id"] for x in r.json()]
    r = await client.get(f"/v1/admin/tenants/{t['id']}", headers=ADMIN)
    assert r.json()["name"] == "crud-tenant"

    r = await client.patch(f"/v1/admin/tenants/{t['id']}", json={"name": "crud-renamed"}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["name"] == "crud-renamed"

    r = await client.delete(f"/v1/admin/tenants/{t['id']}", headers=ADMIN)
    assert r.status_code == 204
    r = await client.get(f"/v1/admin/tenants/{t['id']}", headers=ADMIN)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert (await client.delete(f"/v1/admin/tenants/{t['id']}", headers=ADMIN)).status_code == 404


@pytest.mark.parametrize(
    "body",
    [
        {"name": "bad name!"},
        {"name": ""},
        {"name": "x" * 64},
        {"name": "ok", "quota": {"max_concurrency": 0}},
        {"name": "ok", "quota": {"unknown_field": 1}},
        {"name": "ok", "extra": True},
    ],
)
async def test_tenant_create_validation(client: httpx.AsyncClient, body: dict) -> None:
    r = await client.post("/v1/admin/tenants", json=body, headers=ADMIN)
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["code"] == "validation_error" and err["message"]


async def test_malformed_json_is_enveloped(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/admin/tenants", content=b"{not json", headers={**ADMIN, "Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error"


async def test_quota_get_put_all_fields(client: httpx.AsyncClient, platform) -> None:
    tid, _ = await new_tenant(client)
    r = await client.put(f"/v1/admin/tenants/{tid}/quota", json=QUOTA, headers=ADMIN)
    assert r.status_code == 200 and r.json() == QUOTA
    assert (await client.get(f"/v1/admin/tenants/{tid}/quota", headers=ADMIN)).json() == QUOTA

    # PUT replaces: omitted fields go back to the defaults
    r = await client.put(f"/v1/admin/tenants/{tid}/quota", json={"timeout_ms": 99}, headers=ADMIN)
    q = r.json()
    assert q["timeout_ms"] == 99
    assert q["max_concurrency"] == platform.settings.default_max_concurrency
    assert q["gpu_memory_bytes"] == platform.settings.default_gpu_memory_bytes


async def test_quota_patch_changes_only_the_given_fields(client: httpx.AsyncClient) -> None:
    tid, _ = await new_tenant(client)
    await client.put(f"/v1/admin/tenants/{tid}/quota", json=QUOTA, headers=ADMIN)
    r = await client.patch(f"/v1/admin/tenants/{tid}/quota", json={"timeout_ms": 5000}, headers=ADMIN)
    assert r.status_code == 200 and r.json() == {**QUOTA, "timeout_ms": 5000}
    assert (await client.get(f"/v1/admin/tenants/{tid}/quota", headers=ADMIN)).json() == {**QUOTA, "timeout_ms": 5000}
    r = await client.patch(f"/v1/admin/tenants/{tid}/quota", json={"max_concurrency": 0}, headers=ADMIN)
    assert r.status_code == 422 and "max_concurrency" in r.json()["error"]["message"]
    r = await client.patch("/v1/admin/tenants/nope/quota", json={"timeout_ms": 1}, headers=ADMIN)
    assert r.status_code == 404


@pytest.mark.parametrize(
    "field,value",
    [
        ("gpu_memory_bytes", -1),
        ("max_concurrency", 0),
        ("requests_per_second", 0),
        ("max_functions", -1),
        ("max_module_bytes", 0),
        ("wasm_memory_bytes", 1024),
        ("timeout_ms", 0),
    ],
)
async def test_quota_field_bounds(client: httpx.AsyncClient, field: str, value: float) -> None:
    tid, _ = await new_tenant(client)
    r = await client.put(f"/v1/admin/tenants/{tid}/quota", json={field: value}, headers=ADMIN)
    assert r.status_code == 422, r.text
    assert field in r.json()["error"]["message"]


async def test_quota_of_missing_tenant(client: httpx.AsyncClient) -> None:
    assert (await client.get("/v1/admin/tenants/nope/quota", headers=ADMIN)).status_code == 404
    assert (await client.put("/v1/admin/tenants/nope/quota", json={}, headers=ADMIN)).status_code == 404


async def test_api_keys_shown_once_hashed_and_revocable(client: httpx.AsyncClient, platform) -> None:
    tid, _ = await new_tenant(client)
    r = await client.post(f"/v1/admin/tenants/{tid}/api-keys", headers=ADMIN)
    created = r.json()
    assert created["key"].startswith("tw_") and len(created["key"]) > 40
    listed = (await client.get(f"/v1/admin/tenants/{tid}/api-keys", headers=ADMIN)).json()
    assert created["id"] in [k["id"] for k in listed]
    assert all("key" not in k for k in listed)  # the secret is never shown again

    from sqlalchemy import select

    from app.db.models import ApiKey

    async with platform.sessionmaker() as s:
        row = await s.scalar(select(ApiKey).where(ApiKey.id == created["id"]))
    assert row.key_hash != created["key"] and created["key"] not in row.key_hash

    key = {"Authorization": f"Bearer {created['key']}"}
    assert (await client.get("/v1/functions", headers=key)).status_code == 200
    r = await client.delete(f"/v1/admin/tenants/{tid}/api-keys/{created['id']}", headers=ADMIN)
    assert r.status_code == 204
    r = await client.get("/v1/functions", headers=key)
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    listed = (await client.get(f"/v1/admin/tenants/{tid}/api-keys", headers=ADMIN)).json()
    assert next(k for k in listed if k["id"] == created["id"])["revoked_at"] is not None
    assert (await client.delete(f"/v1/admin/tenants/{tid}/api-keys/missing", headers=ADMIN)).status_code == 404


async def test_keys_of_other_tenant_cannot_be_revoked_through_another(client: httpx.AsyncClient) -> None:
    tid_a, _ = await new_tenant(client)
    tid_b, _ = await new_tenant(client)
    key_b = (await client.post(f"/v1/admin/tenants/{tid_b}/api-keys", headers=ADMIN)).json()
    r = await client.delete(f"/v1/admin/tenants/{tid_a}/api-keys/{key_b['id']}", headers=ADMIN)
    assert r.status_code == 404


async def test_disabled_and_deleted_tenant_keys_stop_at_once(client: httpx.AsyncClient) -> None:
    tid, key = await new_tenant(client)
    assert (await client.get("/v1/functions", headers=key)).status_code == 200  # now cached
    await client.patch(f"/v1/admin/tenants/{tid}", json={"disabled": True}, headers=ADMIN)
    r = await client.get("/v1/functions", headers=key)
    assert r.status_code == 403 and r.json()["error"]["code"] == "tenant_disabled"
    assert "disabled" in r.json()["error"]["message"] and "operator" in r.json()["error"]["message"]
    r = await client.post(f"/v1/admin/tenants/{tid}/api-keys", headers=ADMIN)
    assert r.status_code == 409 and r.json()["error"]["code"] == "tenant_disabled"
    await client.patch(f"/v1/admin/tenants/{tid}", json={"disabled": False}, headers=ADMIN)
    assert (await client.get("/v1/functions", headers=key)).status_code == 200
    await client.delete(f"/v1/admin/tenants/{tid}", headers=ADMIN)
    assert (await client.get("/v1/functions", headers=key)).status_code == 401


async def test_auth_rules(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client)
    r = await client.get("/v1/admin/tenants")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert (await client.get("/v1/admin/tenants", headers={"Authorization": "Bearer wrong"})).status_code == 401
    assert (await client.get("/v1/admin/tenants", headers={"Authorization": "Basic abc"})).status_code == 401
    r = await client.get("/v1/admin/tenants", headers=key)
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    assert (await client.get("/v1/functions")).status_code == 401
    assert (await client.get("/v1/functions", headers={"Authorization": "Bearer tw_notarealkey_123456789"})).status_code == 401
    r = await client.get("/v1/functions", headers=ADMIN)
    assert r.status_code == 403
    for path in ("/v1/usage", "/v1/kernels", "/v1/invocations"):
        assert (await client.get(path)).status_code == 401


async def test_tenant_delete_removes_its_functions(client: httpx.AsyncClient) -> None:
    tid, key = await new_tenant(client)
    assert (await deploy(client, key, "f", wat("noop"))).status_code == 201
    await client.delete(f"/v1/admin/tenants/{tid}", headers=ADMIN)
    tid2, key2 = await new_tenant(client)
    assert (await client.get("/v1/functions", headers=key2)).json() == []


async def test_admin_workers_lists_workers(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/admin/workers", headers=ADMIN)
    assert r.status_code == 200
    workers = r.json()
    assert workers and {"id", "pid", "state", "tenant", "gpu_bytes_in_use", "gpu_bytes_cap"} <= set(workers[0])

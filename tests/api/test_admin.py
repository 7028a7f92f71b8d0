"""Admin API: tenants, quotas, API keys, and every auth rule."""

from __future__ import annotations

from datetime import datetime, timedelta

import httpx
import pytest

from app.db.repositories.nodes import NodeRepository
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
    "max_stored_bytes": 5 << 20,
    "max_files_bytes": 3 << 20,
    "scratch_bytes": 1 << 20,
    "max_secrets": 9,
    "max_secret_bytes": 4096,
    "gpu_weight": 4,
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
        ("max_stored_bytes", -1),
        ("max_stored_bytes", (1 << 40) + 1),
        ("max_files_bytes", -1),
        ("max_files_bytes", (4 << 30) + 1),
        ("scratch_bytes", -1),
        ("scratch_bytes", (4 << 30) + 1),
        ("gpu_weight", 0),
        ("gpu_weight", 101),
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


async def test_admin_nodes_lists_the_nodes_table_and_readyz_says_who_answered(client: httpx.AsyncClient, platform) -> None:
    """This node (its queue runner heartbeats) alive, a node last seen a minute ago dead; /readyz
    names the node that answered and counts the live ones."""
    me = platform.settings.resolved_node_id
    gone = platform.clock() - timedelta(seconds=60)
    async with platform.sessionmaker() as session:
        await NodeRepository(session).beat("node-gone", "elsewhere", gone, started=True)
        await session.commit()
    r = await client.get("/v1/admin/nodes", headers=ADMIN)
    assert r.status_code == 200, r.text
    nodes = {n["id"]: n for n in r.json()}
    assert nodes[me]["alive"] is True and nodes[me]["host"]
    assert nodes["node-gone"]["alive"] is False and nodes["node-gone"]["host"] == "elsewhere"
    assert datetime.fromisoformat(nodes["node-gone"]["last_seen"]) == gone
    ready = (await client.get("/readyz")).json()
    assert ready["cluster"]["node"] == me and ready["cluster"]["heartbeat"] == "ok"
    assert ready["cluster"]["nodes_alive"] == 1 and 0 <= ready["cluster"]["heartbeat_age_s"] < platform.settings.node_dead_after_s
    _, key = await new_tenant(client)
    r = await client.get("/v1/admin/nodes", headers=key)
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"


async def test_every_tenant_route_takes_the_id_or_the_name(client: httpx.AsyncClient) -> None:
    tid, _ = await new_tenant(client)
    name = (await client.get(f"/v1/admin/tenants/{tid}", headers=ADMIN)).json()["name"]
    for ref in (tid, name):
        assert (await client.get(f"/v1/admin/tenants/{ref}", headers=ADMIN)).json()["id"] == tid
        r = await client.patch(f"/v1/admin/tenants/{ref}/quota", json={"timeout_ms": 4321}, headers=ADMIN)
        assert r.status_code == 200 and r.json()["timeout_ms"] == 4321
        assert (await client.put(f"/v1/admin/tenants/{ref}/quota", json={"timeout_ms": 1234}, headers=ADMIN)).json()["timeout_ms"] == 1234
        assert (await client.get(f"/v1/admin/tenants/{ref}/quota", headers=ADMIN)).json()["timeout_ms"] == 1234
        made = (await client.post(f"/v1/admin/tenants/{ref}/api-keys", headers=ADMIN)).json()
        assert made["id"] in [k["id"] for k in (await client.get(f"/v1/admin/tenants/{ref}/api-keys", headers=ADMIN)).json()]
        assert (await client.delete(f"/v1/admin/tenants/{ref}/api-keys/{made['id']}", headers=ADMIN)).status_code == 204
        assert (await client.patch(f"/v1/admin/tenants/{ref}", json={"disabled": True}, headers=ADMIN)).json()["disabled"] is True
        assert (await client.patch(f"/v1/admin/tenants/{ref}", json={"disabled": False}, headers=ADMIN)).json()["disabled"] is False
    r = await client.get("/v1/admin/tenants/no-such-tenant", headers=ADMIN)
    assert r.status_code == 404 and r.json()["error"]["message"] == "no tenant with the id or name 'no-such-tenant'"
    # an id wins over a name: a tenant named like another's id does not shadow it
    r = await client.post("/v1/admin/tenants", json={"name": tid}, headers=ADMIN)
    assert r.status_code == 201
    assert (await client.get(f"/v1/admin/tenants/{tid}", headers=ADMIN)).json()["name"] == name
    assert (await client.delete(f"/v1/admin/tenants/{r.json()['id']}", headers=ADMIN)).status_code == 204
    assert (await client.delete(f"/v1/admin/tenants/{name}", headers=ADMIN)).status_code == 204
    assert (await client.get(f"/v1/admin/tenants/{tid}", headers=ADMIN)).status_code == 404


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
async def test_quota_refuses_nan_and_infinity(client: httpx.AsyncClient, literal: bytes) -> None:
    tid, _ = await new_tenant(client)
    body = b'{"requests_per_second": ' + literal + b"}"
    for method in ("PATCH", "PUT"):
        r = await client.request(method, f"/v1/admin/tenants/{tid}/quota", content=body, headers={**ADMIN, "Content-Type": "application/json"})
        assert r.status_code == 422, r.text
        assert "requests_per_second" in r.json()["error"]["message"] and "finite" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "content,content_type,said",
    [
        (b'{"timeout_ms": 1000}', "application/x-www-form-urlencoded", "sent as application/x-www-form-urlencoded, not JSON"),
        (b'{"timeout_ms": 1000}', "text/plain", "sent as text/plain, not JSON"),
        (b"", "application/json", "the body is empty"),
        (b"[1]", "application/json", "the body is a JSON array"),
        (b'"x"', "application/json", "the body is a JSON string"),
        (b"{bad", "application/json", "the body is not valid JSON"),
    ],
)
async def test_a_body_that_is_not_a_json_object_says_what_to_send(
    client: httpx.AsyncClient, content: bytes, content_type: str, said: str
) -> None:
    tid, _ = await new_tenant(client)
    r = await client.patch(f"/v1/admin/tenants/{tid}/quota", content=content, headers={**ADMIN, "Content-Type": content_type})
    assert r.status_code == 422
    message = r.json()["error"]["message"]
    assert said in message and message.endswith("send Content-Type: application/json with a JSON object body"), message
    assert "valid dictionary" not in message

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import deploy, new_tenant, wat


def _samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


async def test_metrics_cover_invocations_http_and_workers(client: httpx.AsyncClient) -> None:
    tid, key = await new_tenant(client)
    tenant = (await client.get(f"/v1/admin/tenants/{tid}", headers={"Authorization": "Bearer test-admin-token"})).json()["name"]
    await deploy(client, key, "echo", wat("echo"))
    await deploy(client, key, "trap", wat("trap"))
    assert (await client.post("/v1/functions/echo/invoke", content=b"x", headers=key)).status_code == 200
    assert (await client.post("/v1/functions/trap/invoke", headers=key)).status_code == 500
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    s = _samples(r.text)
    outcomes = {(x.labels["function"], x.labels["outcome"]): x.value for x in s["tensorwasm_invocations_total"] if x.labels["tenant"] == tenant}
    assert outcomes == {("echo", "succeeded"): 1.0, ("trap", "guest_error"): 1.0}
    routes = {x.labels["route"] for x in s["tensorwasm_http_requests_total"]}
    assert "/v1/functions/{name}/invoke" in routes and "/v1/functions/{name}" in routes
    assert not any(tenant in r or "echo" in r for r in routes), "routes are templates, never raw paths"
    assert sum(x.value for x in s["tensorwasm_workers"]) >= 1
    assert any(x.labels["tenant"] == tenant for x in s["tensorwasm_gpu_memory_cap_bytes"])
    assert s["tensorwasm_cold_start_seconds_count"][0].value >= 1
    starts = s["tensorwasm_worker_start_seconds_count"][0].value
    assert starts >= 1 and s["tensorwasm_worker_start_seconds_sum"][0].value > 0  # the spare the tenant bound
    assert {x.labels["result"] for x in s["tensorwasm_kernel_compile_cache_total"]} == {"hit", "miss"}
    assert "tensorwasm_worker_restarts_total" in s


async def test_rejections_are_counted(client: httpx.AsyncClient) -> None:
    tid, key = await new_tenant(client, requests_per_second=1)
    await deploy(client, key, "noop", wat("noop"))
    codes = [(await client.post("/v1/functions/noop/invoke", headers=key)).status_code for _ in range(4)]
    assert 429 in codes
    s = _samples((await client.get("/metrics")).text)
    assert any(x.labels["reason"] == "rate" and x.value >= 1 for x in s["tensorwasm_rejections_total"])


async def test_request_id_is_echoed(client: httpx.AsyncClient) -> None:
    r = await client.get("/healthz", headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    assert len((await client.get("/healthz")).headers["x-request-id"]) == 16


async def test_metrics_token(app_factory) -> None:
    async with app_factory(metrics_token="scrape-secret") as (client, _):
        assert (await client.get("/metrics")).status_code == 401
        assert (await client.get("/metrics", headers={"Authorization": "Bearer nope"})).status_code == 401
        assert (await client.get("/metrics", headers={"Authorization": "Bearer scrape-secret"})).status_code == 200

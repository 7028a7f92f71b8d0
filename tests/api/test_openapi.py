"""The OpenAPI document tells the truth: bearer schemes on every route that needs one, every error
status with the envelope the server really answers, and /docs that can authorize."""

from __future__ import annotations

import httpx

from app.main import create_app
from tests.helpers import ADMIN

SPEC = create_app().openapi()
ENVELOPE = "#/components/schemas/ErrorEnvelope"


def _operations() -> list[tuple[str, str, dict]]:
    return [(m.upper(), p, op) for p, ops in SPEC["paths"].items() for m, op in ops.items()]


def test_bearer_schemes_are_declared_on_every_route_that_needs_one() -> None:
    schemes = SPEC["components"]["securitySchemes"]
    assert schemes["AdminToken"] == {**schemes["AdminToken"], "type": "http", "scheme": "bearer"}
    assert schemes["ApiKey"] == {**schemes["ApiKey"], "type": "http", "scheme": "bearer"}
    for method, path, op in _operations():
        if path.startswith("/v1/admin/"):
            assert op.get("security") == [{"AdminToken": []}], (method, path)
        elif path.startswith("/v1/"):
            assert op.get("security") == [{"ApiKey": []}], (method, path)
        else:
            assert "security" not in op, (method, path)


def test_every_error_status_is_documented_with_the_envelope() -> None:
    assert "HTTPValidationError" not in SPEC["components"]["schemas"]
    assert "ValidationError" not in SPEC["components"]["schemas"]
    for method, path, op in _operations():
        errors = {s: r for s, r in op["responses"].items() if s[0] in "45" and path != "/readyz"}
        if path.startswith("/v1/"):
            assert {"401", "403", "500"} <= set(errors), (method, path)
        if op.get("parameters") or op.get("requestBody"):
            assert "422" in errors, (method, path)
        for status, response in errors.items():
            assert response["content"]["application/json"]["schema"] == {"$ref": ENVELOPE}, (method, path, status)


def test_statuses_each_route_can_answer() -> None:
    def statuses(method: str, path: str) -> set[str]:
        return set(SPEC["paths"][path][method.lower()]["responses"])

    assert {"400", "401", "404", "413", "422", "429", "500", "503", "504"} <= statuses("POST", "/v1/functions/{name}/invoke")
    assert {"403", "413", "415", "422"} <= statuses("PUT", "/v1/functions/{name}")
    assert {"409", "413", "415", "422"} <= statuses("PUT", "/v1/kernels/{name}")
    assert {"400", "409", "413", "422"} <= statuses("POST", "/v1/admin/tenants")
    assert {"404", "409"} <= statuses("POST", "/v1/admin/tenants/{tenant_id}/api-keys")
    assert {"400", "404", "413", "422"} <= statuses("PATCH", "/v1/admin/tenants/{tenant_id}/quota")


def test_quota_bounds_are_in_the_schema() -> None:
    quota = SPEC["components"]["schemas"]["Quota"]["properties"]
    assert all("maximum" in field for field in quota.values())


async def test_docs_can_authorize(client: httpx.AsyncClient) -> None:
    r = await client.get("/docs")
    assert r.status_code == 200 and "swagger-ui" in r.text
    spec = (await client.get("/openapi.json")).json()
    assert set(spec["components"]["securitySchemes"]) == {"AdminToken", "ApiKey"}
    # what Swagger UI sends once a token is entered under "Authorize"
    assert (await client.get("/v1/admin/tenants", headers=ADMIN)).status_code == 200

"""A plain invoke call takes the fast path past FastAPI's routing (app/api/fastpath.py); it
answers exactly as the FastAPI route does, and everything else still goes to FastAPI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.api import fastpath
from app.api.fastpath import InvokeFastPath
from app.main import create_app
from tests.helpers import ADMIN, deploy, make_settings, new_tenant, wat

_HEADERS = ("content-type", "www-authenticate", "retry-after")


async def _nothing(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("not called")


def _scope(path: str = "/v1/functions/echo/invoke", method: str = "POST", query: bytes = b"", **headers: str) -> dict[str, Any]:
    return {
        "type": "http", "method": method, "path": path, "query_string": query,
        "headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()],
    }


def test_only_a_plain_invoke_with_a_valid_name_takes_the_fast_path(database_url: str, tmp_path: Path) -> None:
    fast = InvokeFastPath(_nothing, create_app(make_settings(database_url, tmp_path)))
    assert fast._plain_invoke(_scope()) == "echo"
    assert fast._plain_invoke(_scope(query=b"x=1")) == "echo"
    assert fast._plain_invoke(_scope(accept="application/json")) == "echo"
    assert fast._plain_invoke(_scope(method="GET")) is None  # 405 from FastAPI
    assert fast._plain_invoke(_scope(path="/v1/functions/bad.name/invoke")) is None  # 422 from FastAPI
    assert fast._plain_invoke(_scope(path="/v1/functions/echo\n/invoke")) is None  # matched whole, as FastAPI does
    assert fast._plain_invoke(_scope(path="/v1/functions/a/b/invoke")) is None
    assert fast._plain_invoke(_scope(path="/v1/functions/echo/invoke/")) is None
    assert fast._plain_invoke(_scope(path="/v1/functions/echo")) is None
    assert fast._plain_invoke(_scope(query=b"stream=raw")) is None  # streams are FastAPI's
    assert fast._plain_invoke(_scope(accept="text/event-stream")) is None
    assert fast._plain_invoke({"type": "websocket", "path": "/v1/functions/echo/invoke"}) is None


async def _answers(client: httpx.AsyncClient, max_request_bytes: int) -> list[tuple[Any, ...]]:
    """Status, error code, the headers that matter and the body, for one call of each kind
    (each run with a tenant of its own: the rate case spends its tenant's only token)."""
    tid, key = await new_tenant(client)
    _, limited = await new_tenant(client, requests_per_second=1)
    for name, module in (("echo", "echo"), ("trap", "trap"), ("exit3", "exit3")):
        assert (await deploy(client, key, name, wat(module))).status_code == 201
    assert (await deploy(client, limited, "echo", wat("echo"))).status_code == 201
    calls: list[tuple[str, dict[str, str], bytes]] = [
        ("echo", {**key, "X-Request-Id": "r-1", "Content-Type": "text/plain"}, b"hello"),
        ("echo", {}, b""),  # no credentials
        ("echo", {"Authorization": "Bearer tw_not-a-key"}, b""),
        ("echo", ADMIN, b""),  # the admin token on a tenant route
        ("nothing-here", key, b""),
        ("trap", key, b""),
        ("exit3", key, b""),
        ("echo", key, b"x" * (max_request_bytes + 1)),
        ("echo", limited, b"1"),
        ("echo", limited, b"2"),
        ("echo", limited, b"3"),  # past its rate (a burst of 2 s)
        ("bad.name", key, b""),
        ("echo%0A", key, b""),  # a name ending in a newline: refused whole, not looked up
    ]
    out = []
    for name, headers, body in calls:
        r = await client.post(f"/v1/functions/{name}/invoke", content=body, headers=headers)
        error = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
        out.append((
            name, r.status_code, error.get("code"), error.get("exit_code"), {h: r.headers.get(h) for h in _HEADERS},
            "x-invocation-id" in r.headers, r.headers.get("x-request-id") == headers.get("X-Request-Id", r.headers.get("x-request-id")),
            r.content if r.status_code == 200 else None,
        ))
    return out


async def test_both_paths_answer_alike(client: httpx.AsyncClient, platform: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    limit = platform.settings.max_request_bytes
    taken: list[str] = []
    endpoint = fastpath.invoke_function

    async def counted(name: str, request: Any) -> Any:
        taken.append(name)
        return await endpoint(name, request)

    monkeypatch.setattr(fastpath, "invoke_function", counted)
    fast = await _answers(client, limit)
    assert len(taken) == 8  # every call the gate admitted (app/api/gate.py), but the bad name's, took the fast path
    monkeypatch.setattr(fastpath, "invoke_function", endpoint)
    monkeypatch.setattr(InvokeFastPath, "_plain_invoke", lambda self, scope: None)  # every call through FastAPI
    routed = await _answers(client, limit)
    assert fast == routed
    codes = [(name, status, code) for name, status, code, *_ in fast]
    assert codes == [
        ("echo", 200, None), ("echo", 401, "unauthorized"), ("echo", 401, "unauthorized"), ("echo", 403, "forbidden"),
        ("nothing-here", 404, "not_found"), ("trap", 500, "guest_error"), ("exit3", 500, "guest_error"),
        ("echo", 413, "payload_too_large"), ("echo", 200, None), ("echo", 200, None), ("echo", 429, "rate_limited"), ("bad.name", 422, "validation_error"),
        ("echo%0A", 422, "validation_error"),
    ]
    assert fast[0][-1] == b"hello" and fast[6][3] == 3


async def test_a_fast_path_call_is_counted_under_its_route_template(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client)
    assert (await deploy(client, key, "echo", wat("echo"))).status_code == 201

    async def served() -> float:
        text = (await client.get("/metrics")).text
        return sum(
            s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "tensorwasm_http_requests_total" and s.labels == {"method": "POST", "route": "/v1/functions/{name}/invoke", "status": "200"}
        )

    before = await served()
    r = await client.post("/v1/functions/echo/invoke", content=b"x", headers={**key, "X-Request-Id": "fast-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "fast-1"
    assert await served() == before + 1

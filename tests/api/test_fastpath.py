"""A plain invoke call takes the fast path ahead of FastAPI and its middleware
(app/api/fastpath.py); it answers exactly as the FastAPI route does, headers included, and
everything else still goes to FastAPI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.api import fastpath
from app.api.fastpath import InvokeFastPath
from app.main import create_app
from app.services.invocations import InvokeService
from tests.helpers import ADMIN, deploy, make_settings, new_tenant, wat

_HEADERS = ("content-type", "content-length", "www-authenticate", "retry-after")
_PER_CALL = {"date", "x-request-id", "x-invocation-id"}  # their values differ from call to call


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
    assert (await deploy(client, key, "text", wat("echo"), content_type="text/plain")).status_code == 201
    assert (await deploy(client, key, "json", wat("echo"), content_type="application/json; charset=utf-8")).status_code == 201
    assert (await deploy(client, limited, "echo", wat("echo"))).status_code == 201
    calls: list[tuple[str, dict[str, str], bytes]] = [
        ("echo", {**key, "X-Request-Id": "r-1", "Content-Type": "text/plain"}, b"hello"),
        ("text", key, b"caf\xc3\xa9"),  # a text/ type gets its charset, as Starlette writes it
        ("json", key, b'{"a": 1}'),
        ("echo", {**key, "X-Function-Args": '["-v", "x"]', "X-Function-Version": "1"}, b"args"),
        ("echo", {**key, "X-Function-Args": "not json"}, b""),
        ("echo", {**key, "X-Function-Args": '{"a": 1}'}, b""),
        ("echo", {**key, "X-Function-Version": "one"}, b""),
        ("echo", {**key, "X-Function-Version": "7"}, b""),  # a version it does not keep
        ("echo", {**key, "X-Request-Id": "bad id;"}, b""),  # replaced, never echoed
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
            r.content if r.status_code == 200 else None, sorted(set(r.headers) - _PER_CALL), "x-request-id" in r.headers,
        ))
    return out


async def test_both_paths_answer_alike(client: httpx.AsyncClient, platform: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    limit = platform.settings.max_request_bytes
    taken: list[str] = []
    run_call = fastpath.run_call

    async def counted(platform: Any, tenant: Any, head: Any, *rest: Any) -> Any:
        taken.append(head.name)
        return await run_call(platform, tenant, head, *rest)

    monkeypatch.setattr(fastpath, "run_call", counted)
    fast = await _answers(client, limit)
    # every call whose key and head were good, but the bad names', ran on the fast path
    assert taken == ["echo", "text", "json", "echo", "echo", "echo", "nothing-here", "trap", "exit3", "echo", "echo", "echo", "echo"]
    monkeypatch.setattr(fastpath, "run_call", run_call)
    monkeypatch.setattr(InvokeFastPath, "_plain_invoke", lambda self, scope: None)  # every call through FastAPI
    routed = await _answers(client, limit)
    assert fast == routed
    codes = [(name, status, code) for name, status, code, *_ in fast]
    assert codes == [
        ("echo", 200, None), ("text", 200, None), ("json", 200, None), ("echo", 200, None), ("echo", 400, "bad_request"),
        ("echo", 422, "validation_error"), ("echo", 400, "bad_request"), ("echo", 404, "version_not_found"), ("echo", 200, None),
        ("echo", 401, "unauthorized"), ("echo", 401, "unauthorized"), ("echo", 403, "forbidden"),
        ("nothing-here", 404, "not_found"), ("trap", 500, "guest_error"), ("exit3", 500, "guest_error"),
        ("echo", 413, "payload_too_large"), ("echo", 200, None), ("echo", 200, None), ("echo", 429, "rate_limited"), ("bad.name", 422, "validation_error"),
        ("echo%0A", 422, "validation_error"),
    ]
    assert fast[0][7] == b"hello" and fast[14][3] == 3
    assert fast[1][4]["content-type"] == "text/plain; charset=utf-8" and fast[2][4]["content-type"] == "application/json; charset=utf-8"


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


async def test_an_unexpected_error_is_answered_500_and_raised_to_the_server(database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As FastAPI's server-error layer does: the app's 500 envelope (here with the request id),
    then the exception raised again for the server to log."""
    app = create_app(make_settings(database_url, tmp_path))

    async def boom(*_: Any, **__: Any) -> Any:
        raise RuntimeError("boom")

    async with app.router.lifespan_context(app):
        answered = httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False), base_url="http://t", timeout=60)
        raised = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60)
        async with answered, raised:
            _, key = await new_tenant(answered)
            assert (await deploy(answered, key, "echo", wat("echo"))).status_code == 201
            monkeypatch.setattr(InvokeService, "invoke", boom)
            r = await answered.post("/v1/functions/echo/invoke", content=b"x", headers={**key, "X-Request-Id": "e-1"})
            assert r.status_code == 500 and r.json()["error"]["code"] == "internal" and r.headers["x-request-id"] == "e-1"
            with pytest.raises(RuntimeError, match="boom"):
                await raised.post("/v1/functions/echo/invoke", content=b"x", headers=key)

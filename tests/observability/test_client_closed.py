"""A client that goes away is not a server error: the invocation is recorded `client_closed`, its
guest is stopped, the log has no traceback, and the HTTP metric says 499, never 500."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from app.main import create_app
from tests.helpers import ADMIN, deploy, make_settings, new_tenant, wat


class _Client:
    """Drives the ASGI app the way a server does for one request, with a disconnect on cue."""

    def __init__(self, body: bytes, truncated: bool = False) -> None:
        self.parts = [body]
        self.truncated = truncated  # the client leaves after this part, before the rest
        self.gone = asyncio.Event()
        self.sent: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        if self.parts:
            part = self.parts.pop(0)
            return {"type": "http.request", "body": part, "more_body": self.truncated}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)


def _scope(method: str, path: str, headers: dict[str, str]) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 1234), "server": ("tw.test", 80),
    }


def _http_count(platform: Any, route: str, status: str) -> float:
    platform.metrics.publish()  # the counts the invoke path holds until the next publication
    value = platform.metrics.registry.get_sample_value(
        "tensorwasm_http_requests_total", {"method": "POST", "route": route, "status": status}
    )
    return value or 0.0


@pytest.mark.slow
async def test_disconnect_mid_invoke_is_client_closed(database_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    app = create_app(make_settings(database_url, tmp_path))
    async with app.router.lifespan_context(app):
        import httpx

        platform = app.state.platform
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://tw.test", timeout=60) as client:
            tid, key = await new_tenant(client, timeout_ms=20_000)
            tenant_name = (await client.get(f"/v1/admin/tenants/{tid}", headers=ADMIN)).json()["name"]
            assert (await deploy(client, key, "spin", wat("loop"), timeout_ms=20_000)).status_code == 201
            route = "/v1/functions/{name}/invoke"
            before_500 = _http_count(platform, route, "500")
            caplog.clear()
            caller = _Client(b"x")
            call = asyncio.create_task(app(_scope("POST", "/v1/functions/spin/invoke", key), caller.receive, caller.send))
            while platform.scheduler.tenant_usage(tid)["running"] == 0:
                await asyncio.sleep(0.01)  # the guest is running now
            caller.gone.set()
            await asyncio.wait_for(call, 10)  # far sooner than the guest's 20 s limit

            assert caller.sent[0]["status"] == 499
            assert platform.scheduler.tenant_usage(tid)["running"] == 0  # its slot is free again
            assert _http_count(platform, route, "499") == 1 and _http_count(platform, route, "500") == before_500
            assert not [r for r in caplog.records if r.exc_info], "a disconnect is not logged with a traceback"
            assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
            records = (await client.get("/v1/invocations", params={"function": "spin"}, headers=key)).json()["items"]
            assert [r["status"] for r in records] == ["client_closed"]
            outcome = platform.metrics.registry.get_sample_value(
                "tensorwasm_invocations_total", {"tenant": tenant_name, "function": "spin", "outcome": "client_closed"}
            )
            assert outcome == 1
            # the worker that ran it was stopped, and the tenant is served again at once
            assert (await deploy(client, key, "echo", wat("echo"))).status_code == 201
            r = await client.post("/v1/functions/echo/invoke", content=b"still here", headers=key)
            assert r.status_code == 200 and r.content == b"still here"


async def test_disconnect_while_sending_the_body_is_not_an_error(client: Any, platform: Any, caplog: pytest.LogCaptureFixture) -> None:
    _, key = await new_tenant(client)
    app = client._transport.app  # the app behind the shared client
    caplog.clear()
    for method, path, headers in (
        ("PUT", "/v1/functions/f", {**key, "Content-Type": "application/wasm"}),
        ("POST", "/v1/admin/tenants", {**ADMIN, "Content-Type": "application/json"}),
    ):
        caller = _Client(b"\0asm" * 100, truncated=True)
        caller.gone.set()
        await asyncio.wait_for(app(_scope(method, path, headers), caller.receive, caller.send), 10)
        assert caller.sent[0]["status"] == 499, (path, caller.sent)
    assert not [r for r in caplog.records if r.exc_info]
    assert (await client.get("/v1/functions/f", headers=key)).status_code == 404

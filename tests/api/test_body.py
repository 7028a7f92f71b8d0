"""Request bodies: a tenant's bodies in flight in one front are bounded, and only that tenant
is refused when it passes the bound."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from tests.helpers import deploy, new_tenant, until, wat


async def test_a_tenants_bodies_in_flight_are_bounded(app_factory: Callable[..., Any]) -> None:
    async with app_factory(max_tenant_body_bytes=1000) as (client, platform):
        tid_a, a = await new_tenant(client)
        tid_b, b = await new_tenant(client)
        for key in (a, b):
            assert (await deploy(client, key, "echo", wat("echo"))).status_code == 201

        go_on = asyncio.Event()

        async def slow_body() -> AsyncIterator[bytes]:
            yield b"x" * 100
            await go_on.wait()
            yield b"y" * 800

        # 900 bytes declared, 100 sent: the front holds the declared size while it reads the rest
        slow = asyncio.create_task(client.post(
            "/v1/functions/echo/invoke", content=slow_body(), headers={**a, "Content-Length": "900"}
        ))
        await until(lambda: platform.bodies.held(tid_a) == 900, "the slow body counted")

        r = await client.post("/v1/functions/echo/invoke", content=b"z" * 200, headers=a)
        assert r.status_code == 429 and r.headers["Retry-After"] == "1", r.text
        assert r.json()["error"]["code"] == "rate_limited" and "900 bytes" in r.json()["error"]["message"]

        async def chunked() -> AsyncIterator[bytes]:  # no declared length: counted as it arrives
            yield b"z" * 200

        r = await client.post("/v1/functions/echo/invoke", content=chunked(), headers=a)
        assert r.status_code == 429
        r = await client.post("/v1/functions/echo/invocations", content=b"z" * 200, headers=a)
        assert r.status_code == 429  # async submits count too
        assert platform.bodies.held(tid_a) == 900  # the refused requests hold nothing

        r = await client.post("/v1/functions/echo/invoke", content=b"w" * 900, headers=b)
        assert r.status_code == 200 and r.content == b"w" * 900  # another tenant is not held back

        go_on.set()
        r = await slow
        assert r.status_code == 200 and r.content == b"x" * 100 + b"y" * 800
        assert platform.bodies.held(tid_a) == 0
        r = await client.post("/v1/functions/echo/invoke", content=b"z" * 200, headers=a)
        assert r.status_code == 200 and r.content == b"z" * 200


def _receiver(*messages: dict[str, Any]) -> Callable[[], Any]:
    queue = list(messages)

    async def receive() -> dict[str, Any]:
        return queue.pop(0)

    return receive


async def test_a_body_read_from_the_servers_messages() -> None:
    import pytest
    from starlette.requests import ClientDisconnect

    from app.api.body import collect_received
    from app.api.errors import ApiError
    from app.services.body_budget import BodyBudget

    whole = b"x" * 100
    got = await collect_received(_receiver({"type": "http.request", "body": whole, "more_body": False}), "100", 1000)
    assert got is whole  # one message: returned as it came, not copied
    assert await collect_received(_receiver({"type": "http.request", "body": b"", "more_body": False}), None, 1000) == b""

    parts = [{"type": "http.request", "body": p, "more_body": True} for p in (b"ab", b"", b"cd")]
    budget = BodyBudget(10_000)
    with budget.hold("t") as hold:
        got = await collect_received(_receiver(*parts, {"type": "http.request", "body": b"ef", "more_body": False}), None, 1000, hold=hold)
        assert got == b"abcdef" and budget.held("t") == 6  # no declared length: held as it arrived

    with pytest.raises(ApiError) as refused:  # passed the limit in its third chunk
        await collect_received(_receiver(*parts[:2], {"type": "http.request", "body": b"x" * 9, "more_body": True}), None, 10)
    assert refused.value.status == 413
    with pytest.raises(ApiError) as refused:  # declared past it: refused before a byte is read
        await collect_received(_receiver(), "11", 10)
    assert refused.value.status == 413
    with pytest.raises(ClientDisconnect):
        await collect_received(_receiver(parts[0], {"type": "http.disconnect"}), None, 1000)

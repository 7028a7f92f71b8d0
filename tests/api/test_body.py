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

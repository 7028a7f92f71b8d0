"""How the queue runner records a run that failed before it started: a function deleted after
the submit is `not_found`; any other domain error is an `internal_error` (and logged)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from app.errors import Unavailable
from tests.helpers import deploy, new_tenant, submit, wait_status, wat


async def test_a_function_deleted_after_the_submit_ends_not_found(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client, max_concurrency=1, timeout_ms=20_000)
    assert (await deploy(client, key, "loop", wat("loop"))).status_code == 201
    assert (await deploy(client, key, "echo", wat("echo"))).status_code == 201
    running = (await submit(client, key, "loop")).json()["id"]
    await wait_status(client, key, running, "running")
    queued = (await submit(client, key, "echo", b"x")).json()["id"]  # waits: one at a time
    assert (await client.delete("/v1/functions/echo", headers=key)).status_code == 204
    assert (await client.post(f"/v1/invocations/{running}/cancel", headers=key)).status_code == 200
    rec = await wait_status(client, key, queued, "not_found", "succeeded", "internal_error")
    assert rec["status"] == "not_found" and rec["error"] == "function 'echo' not found"


async def test_another_domain_error_ends_internal_error(client: httpx.AsyncClient, platform: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _, key = await new_tenant(client)
    assert (await deploy(client, key, "echo", wat("echo"))).status_code == 201

    async def execute(*_: Any, **__: Any) -> Any:
        raise Unavailable("the compiler is unavailable; retry later", retry_after=5)

    monkeypatch.setattr(platform.queue_runner, "execute", execute)
    inv = (await submit(client, key, "echo", b"x")).json()["id"]
    rec = await wait_status(client, key, inv, "internal_error", "not_found", "succeeded")
    assert rec["status"] == "internal_error" and rec["error"] == "internal error: the compiler is unavailable; retry later"


async def test_a_database_busy_at_start_is_tried_again(platform: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The runner's first heartbeat meets SQLite's lock held past its wait (a node's fronts all
    starting): it tries again instead of failing its front's start."""
    from sqlalchemy.exc import OperationalError

    from app.queue import runner as runner_module
    from app.queue.runner import QueueRunner

    monkeypatch.setattr(runner_module, "START_RETRY_S", 0.01)
    q = QueueRunner(platform.sessionmaker, platform.settings, platform.queue_runner.execute, platform.clock, platform.queue.write_lock)
    real, fails = q.heartbeat.beat, [1]

    async def beat(*, started: bool = False) -> None:
        if fails:
            fails.pop()
            raise OperationalError("UPDATE nodes", {}, Exception("database is locked"))
        await real(started=started)

    monkeypatch.setattr(q.heartbeat, "beat", beat)
    await q.start()
    try:
        assert not fails and "the queue's first writes failed (database is locked); trying again" in caplog.text
    finally:
        await q.stop()


from __future__ import annotations

from datetime import datetime, timezone

from app.services.invocations import InvocationRecorder
from tests.conftest import new_tenant


async def test_a_record_of_a_deleted_tenant_does_not_block_the_batch(client, platform) -> None:
    tid, _ = await new_tenant(client)
    rec = InvocationRecorder(platform.sessionmaker, 60, 1000)
    now = datetime.now(timezone.utc)
    base = {"function": "f", "version": 1, "status": "succeeded", "started_at": now, "duration_ms": 1.0, "exit_code": 0, "error": None, "stderr_tail": None}
    rec.record({**base, "id": "a" * 32, "tenant_id": tid})
    rec.record({**base, "id": "b" * 32, "tenant_id": "gone-tenant"})
    await rec.flush()
    assert rec.dropped == 1 and not rec._pending
    from app.db.repositories.invocations import InvocationRepository

    async with platform.sessionmaker() as s:
        assert (await InvocationRepository(s, tid).get("a" * 32)) is not None

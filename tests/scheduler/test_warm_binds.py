"""A bound worker makes the backend's deferred set-up (cuBLAS's handle) ahead only for a tenant
whose calls have used it: the scheduler learns that from a worker's page, keeps it when the
worker goes, and says so in the next bind (`Bind.warm`). Workers are fakes (no process)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.contract.messages import Outcome
from app.worker.handle import WorkerHandle
from tests.helpers import fake_node, fake_workers, principal


class _Page:
    """A worker's stats page as the scheduler reads it."""

    def __init__(self, **fields: int) -> None:
        self.fields = fields

    def get(self, field: str) -> int:
        return self.fields.get(field, 0)


def _record_binds(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    binds: list[tuple[str, bool]] = []

    async def bind(
        self: WorkerHandle, tenant_id: str, tenant_name: str, gpu_cap: int, secret: bytes = b"", share_path: str = "",
        gpu_weight: int = 1, warm: bool = False,
    ) -> None:
        binds.append((tenant_id, warm))
        self.tenant_id, self.tenant_name, self.gpu_cap = tenant_id, tenant_name, gpu_cap

    monkeypatch.setattr(WorkerHandle, "bind", bind)
    return binds


async def _call(s: Any, p: Any, used_deferred: bool = False) -> WorkerHandle:
    lease = await s.lease(p)
    if used_deferred:
        lease.worker.stats = _Page(deferred_used=1)
    s.release(lease, Outcome.OK)
    return lease.worker


async def test_the_next_worker_of_a_tenant_that_used_it_is_told_to_warm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_workers(monkeypatch, seconds=0.01)
    binds = _record_binds(monkeypatch)
    async with fake_node(tmp_path, max_workers=2, warm_spares=0, max_warm_spares=0, retire_idle_after_s=0) as s:
        gemm, echo, other = principal(), principal(), principal()
        first = await _call(s, gemm, used_deferred=True)
        await _call(s, echo)
        assert binds == [(gemm.id, False), (echo.id, False)]  # nothing known yet: no warm-up
        await _call(s, other)  # the node is full: the least recently used worker (gemm's) goes
        assert first.tenant_id == gemm.id and first not in s.workers
        await _call(s, gemm)  # echo's goes; gemm's page was read before its worker left
        await _call(s, echo)
        assert binds[2:] == [(other.id, False), (gemm.id, True), (echo.id, False)]


async def test_a_live_worker_that_used_it_warms_its_tenants_next(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_workers(monkeypatch, seconds=0.01)
    binds = _record_binds(monkeypatch)
    async with fake_node(tmp_path, max_workers=4, warm_spares=0, max_warm_spares=0, retire_idle_after_s=0) as s:
        p = principal(max_concurrency=2)
        one = await s.lease(p)
        one.worker.stats = _Page(deferred_used=1)
        two = await s.lease(p)  # the first is busy: a second worker is bound beside it
        assert two.worker is not one.worker
        s.release(one, Outcome.OK)
        s.release(two, Outcome.OK)
        assert binds == [(p.id, False), (p.id, True)]

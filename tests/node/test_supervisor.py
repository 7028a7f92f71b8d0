"""The supervisor as a program: what it loads, and how it handles a front's withdrawn lease request."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from app.contract.messages import LeaseRequest, WithdrawLease
from app.node.supervisor import Supervisor, _Front
from tests.helpers import checkout_pythonpath, fake_workers, make_settings, principal


def test_the_supervisor_and_scheduler_import_no_database_layer() -> None:
    """The control plane holds no database session: what it needs of a tenant comes in its
    messages, so SQLAlchemy (and its import time and memory) stays out of it."""
    code = (
        "import sys, app.node.supervisor, app.scheduler.scheduler; "
        "print(sorted({m.split('.')[0] for m in sys.modules if m.startswith(('sqlalchemy', 'aiosqlite', 'psycopg'))}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONPATH": checkout_pythonpath()})
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


class _Wire:
    """A front's end of the supervisor's connection: what the supervisor wrote to it."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)


async def test_a_withdrawn_lease_request_leaves_the_queue_and_binds_no_worker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A front whose call went away sends `WithdrawLease`: the request waiting for a worker start
    leaves the tenant's queue, and the start ends as a spare, not bound to the tenant nor granted."""
    starts = fake_workers(monkeypatch, seconds=0.3)
    settings = make_settings("sqlite://", tmp_path, fork_server=False, backend="cpu", warm_spares=0, max_workers=2)
    sup = Supervisor(settings, "127.0.0.1", 0)
    try:
        await sup.scheduler.start(wait=False)
        wire = _Wire()
        front = _Front(transport=wire)  # type: ignore[arg-type]
        t = principal()
        sup._on_message(front, LeaseRequest(1, t, 5.0, True))
        await asyncio.sleep(0.05)
        assert 1 in front.waiting and starts.started == 1  # no spare kept: it waits for a start
        sup._on_message(front, WithdrawLease(1))
        assert front.waiting == {}
        await asyncio.sleep(0.6)  # the start has ended
        assert [w.tenant_id for w in sup.scheduler.workers if w.tenant_id is not None] == []
        assert wire.written == []  # nothing granted
    finally:
        await sup.scheduler.stop()
        sup.table.close()
        sup.table.path.unlink(missing_ok=True)
        shutil.rmtree(sup.run_dir, ignore_errors=True)

"""A worker's side of the node's GPU share table at bind (app/worker/main.py `_share`)."""

from __future__ import annotations

from pathlib import Path

from app.contract.messages import Bind
from app.gpu.share import ContextShare, ShareTable, tenant_key
from app.worker.main import _share


def _bind(path: Path, row: int = 1) -> Bind:
    return Bind(tenant_id="t1", tenant="one", gpu_memory_bytes=1 << 20, share_path=str(path), share_row=row, device=2, gpu_weight=3)


def test_the_worker_binds_its_row_to_its_tenant_device_and_weight(tmp_path: Path) -> None:
    table = ShareTable.create(tmp_path / "share", rows=4)
    share = _share(_bind(table.path))
    assert isinstance(share, ContextShare) and share.row == 1
    assert (table.a["tenant"][1], table.a["device"][1], table.a["weight"][1]) == (tenant_key("t1"), 2, 3.0)


def test_a_table_that_cannot_be_opened_leaves_launches_unheld(tmp_path: Path) -> None:
    assert _share(_bind(tmp_path / "missing")) is None
    (tmp_path / "other").write_bytes(b"\0" * 64)
    assert _share(_bind(tmp_path / "other")) is None

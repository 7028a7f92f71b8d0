"""No secret of the node reaches a process that runs tenant code: on a real node of two fronts,
after a deploy and a call, neither the environment nor the command line of the fork server,
any worker or any compile process holds the admin token, the database URL or the metrics
token (the supervisor's own environment, read the same way, does)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import ADMIN, ADMIN_TOKEN, Node, descendants, fresh_database, wat

METRICS_TOKEN = f"metrics-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Node, str]]:
    tmp = tmp_path_factory.mktemp("env-node")
    url, drop = fresh_database(tmp)
    n = Node(url, tmp / "data", TENSORWASM_PROCESSES="2", TENSORWASM_METRICS_TOKEN=METRICS_TOKEN).start()
    yield n, url
    n.stop()
    drop()


def _read(pid: int, what: str) -> str:
    return Path(f"/proc/{pid}/{what}").read_bytes().replace(b"\0", b"\n").decode(errors="replace")


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[1])


def tenant_code_processes(root: int) -> dict[int, str]:
    """The fork server, the workers (forked from it, so with its cmdline; or started as
    `app.worker.main`) and the compile processes below `root`, by kind."""
    kinds: dict[int, str] = {}
    for pid in descendants(root):
        cmd = _read(pid, "cmdline")
        if "app.worker.forkserver" in cmd:
            kinds[pid] = "fork server"
        elif "app.worker.main" in cmd:
            kinds[pid] = "worker"
        elif "app.sandbox.child" in cmd:
            kinds[pid] = "compile process"
    for pid, kind in list(kinds.items()):
        if kind == "fork server" and kinds.get(_parent(pid)) == "fork server":
            kinds[pid] = "worker"
    return kinds


def test_no_process_that_runs_tenant_code_holds_a_secret(node: tuple[Node, str]) -> None:
    n, database_url = node
    assert n.proc is not None
    with httpx.Client(base_url=n.url, timeout=60) as c:
        r = c.post("/v1/admin/tenants", json={"name": f"e-{uuid.uuid4().hex[:10]}"}, headers=ADMIN)
        assert r.status_code == 201, r.text
        tid = r.json()["id"]
        key = {"Authorization": f"Bearer {c.post(f'/v1/admin/tenants/{tid}/api-keys', headers=ADMIN).json()['key']}"}
        r = c.put("/v1/functions/echo", content=wat("echo"), headers={**key, "Content-Type": "application/wasm"})
        assert r.status_code == 201, r.text  # compiled in a compile process
        r = c.post("/v1/functions/echo/invoke", content=b"hi", headers=key)
        assert r.status_code == 200 and r.content == b"hi", r.text  # run by a worker
        processes = tenant_code_processes(n.proc.pid)
    assert set(processes.values()) == {"fork server", "worker", "compile process"}, processes
    secrets = {"admin token": ADMIN_TOKEN, "database URL": database_url, "metrics token": METRICS_TOKEN}
    # the way of reading finds them where they belong: the supervisor was started with them
    supervisor = _read(n.proc.pid, "environ")
    assert all(value in supervisor for value in secrets.values())
    leaks = [
        (kind, pid, what, secret)
        for pid, kind in processes.items()
        for what in ("environ", "cmdline")
        for secret, value in secrets.items()
        if value in _read(pid, what)
    ]
    assert leaks == []
    assert not [pid for pid in processes if "TENSORWASM_" in _read(pid, "environ")]

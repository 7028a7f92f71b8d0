"""`tensorwasm serve` as a user runs it: its start-up line and a clean Ctrl-C."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy.engine import make_url

from app.settings import Settings
from tests.helpers import ADMIN, ADMIN_TOKEN, ROOT, server_process
from tests.node.helpers import fronts as front_pids


def test_start_line_and_ctrl_c(server_database_url: str, tmp_path: Path) -> None:
    with server_process(tmp_path / "node", server_database_url, env={"TENSORWASM_ADMIN_TOKEN": ADMIN_TOKEN}) as node:
        # a call binds a worker, so both kinds of worker (bound and spare) see the Ctrl-C
        t = httpx.post(f"{node.url}/v1/admin/tenants", json={"name": f"sigint-{tmp_path.name[-8:]}"}, headers=ADMIN).json()
        key = httpx.post(f"{node.url}/v1/admin/tenants/{t['id']}/api-keys", headers=ADMIN).json()["key"]
        auth = {"Authorization": f"Bearer {key}"}
        wat = b'(module (memory (export "memory") 1) (func (export "_start")))'
        assert httpx.put(f"{node.url}/v1/functions/noop", content=wat, headers={**auth, "Content-Type": "application/wasm"}).status_code == 201
        assert httpx.post(f"{node.url}/v1/functions/noop/invoke", headers=auth, timeout=30).status_code == 200

        code = node.interrupt()
        log = node.log()
    assert code == 0, log
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
    assert "Application shutdown complete" in log
    shown = make_url(server_database_url).render_as_string(hide_password=True)
    (line,) = [x for x in log.splitlines() if "serving: backend" in x]
    backend = os.environ.get("TENSORWASM_TEST_BACKEND", "cpu")
    assert f"serving: backend {backend}, device(s) " in line and line.endswith(f", database {shown}")
    assert f"{Settings().processes} front(s)" in line  # the product default: one per core, up to 8
    if backend == "cpu":
        assert "device(s) cpu," in line


def _sigint_taken(pid: int) -> bool:
    """Whether `pid` catches or ignores SIGINT (its bit in /proc's SigCgt or SigIgn masks)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    masks = dict(line.split(":\t", 1) for line in status.splitlines() if line.startswith(("SigCgt", "SigIgn")))
    return any(int(masks.get(k, "0"), 16) >> (signal.SIGINT - 1) & 1 for k in ("SigCgt", "SigIgn"))


def test_a_front_takes_no_ctrl_c_of_its_own(server_database_url: str, tmp_path: Path) -> None:
    """Ctrl-C is the supervisor's to handle: a front started again (after its death) that gets
    SIGINT all through its start-up (importing, then serving) neither dies nor prints a
    traceback, and the node's Ctrl-C afterwards still stops everything cleanly."""
    env = {"TENSORWASM_ADMIN_TOKEN": ADMIN_TOKEN, "TENSORWASM_PROCESSES": "2"}
    with server_process(tmp_path / "node", server_database_url, env=env) as node:
        (old, other) = front_pids(node.proc.pid)
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not (new := set(front_pids(node.proc.pid)) - {old, other}):
            assert time.monotonic() < deadline, node.log()
            time.sleep(0.002)
        (front,) = new
        # from when the front's interpreter has taken SIGINT over from the default (which ends a
        # process quietly, as a node's Ctrl-C in a front's first milliseconds still does), and
        # the front is importing the app, all through its start-up and into serving
        while not _sigint_taken(front):
            time.sleep(0.001)
        time.sleep(0.05)
        until = time.monotonic() + 3  # a front's start-up is about a second
        while time.monotonic() < until:
            try:
                os.kill(front, signal.SIGINT)
            except ProcessLookupError:
                raise AssertionError(node.log()) from None
            time.sleep(0.02)
        assert set(front_pids(node.proc.pid)) == {front, other}, node.log()
        assert httpx.get(f"{node.url}/readyz").status_code == 200
        code = node.interrupt()
        log = node.log()
    assert code == 0, log
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log


def test_start_line_hides_the_database_password(tmp_path: Path) -> None:
    from app.node.startup import describe_database

    shown = describe_database("postgresql+psycopg://tw:s3cret@db.example:5432/tw")
    assert "s3cret" not in shown and shown == "postgresql+psycopg://tw:***@db.example:5432/tw"


@pytest.mark.parametrize("processes", ["1", "2"])
def test_a_taken_port_is_one_line(tmp_path: Path, processes: str) -> None:
    """The one-process node and the supervisor alike: one line naming the address and the
    settings to change, exit 1, nothing started."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORWASM_")}
        env.update(TENSORWASM_DATA_DIR=str(tmp_path / "data"), TENSORWASM_PORT=str(port), TENSORWASM_PROCESSES=processes, PYTHONPATH=str(ROOT))
        done = subprocess.run([sys.executable, "-m", "app.cli", "serve"], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 1, done
    assert done.stderr.splitlines() == [
        f"error: cannot listen on 127.0.0.1:{port}: the address is already in use (another server listens there); "
        "choose another port with --port or TENSORWASM_PORT"
    ], done.stderr
    assert done.stdout == ""


def test_the_supervisor_says_a_taken_port_too(tmp_path: Path) -> None:
    """Taken between the command's check and the supervisor's bind: the same error, and the
    supervisor's run directory is gone."""
    from app.node.serve import CannotListen
    from app.node.supervisor import RUN_DIR_PREFIX, run_supervisor

    settings = Settings(data_dir=str(tmp_path / "data"), processes=2, backend="cpu")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        before = set(Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()).iterdir())
        with pytest.raises(CannotListen, match=f"cannot listen on 127.0.0.1:{port}: the address is already in use"):
            run_supervisor(settings, "127.0.0.1", port)
    after = set(Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()).iterdir())
    assert not [p for p in after - before if p.name.startswith(f"{RUN_DIR_PREFIX}{os.getpid()}-")]

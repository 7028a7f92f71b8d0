"""`tensorwasm serve` as a user runs it: its start-up line and a clean Ctrl-C."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest
from sqlalchemy.engine import make_url

from app.settings import Settings
from tests.helpers import ADMIN, ADMIN_TOKEN, ROOT, server_process


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

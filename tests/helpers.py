"""Helpers shared by the tests: settings, a running app, tenants, deploys and guests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import wasmtime
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from app.main import create_app
from app.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
GUESTS = Path(__file__).resolve().parent / "guests"
EXAMPLES = ROOT / "examples"
ADMIN_TOKEN = "test-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

def fresh_postgres_database(base_url: str) -> tuple[str, Callable[[], None]]:
    """Create an empty database next to base_url; returns its URL and a dropper."""
    url = make_url(base_url).set(drivername="postgresql+psycopg")
    name = f"tw_test_{uuid.uuid4().hex[:10]}"
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))

    def drop() -> None:
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    return url.set(database=name).render_as_string(hide_password=False), drop


def make_settings(database_url: str, data_dir: Path, **overrides: Any) -> Settings:
    base: dict[str, Any] = dict(
        database_url=database_url,
        data_dir=data_dir,
        admin_token=ADMIN_TOKEN,
        backend=os.environ.get("TENSORWASM_TEST_BACKEND", "cpu"),
        max_workers=4,
        warm_spares=1,
        record_flush_interval_s=0.05,
        queue_wait_ms=300,
        cache_ttl_s=2.0,
    )
    base.update(overrides)
    return Settings(**base)


@asynccontextmanager
async def running_app(settings: Settings) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://tw.test", timeout=60) as client:
            yield client, app.state.platform


async def new_tenant(client: httpx.AsyncClient, **quota: Any) -> tuple[str, dict[str, str]]:
    """Create a tenant (unique name) and a key; returns (tenant_id, auth headers)."""
    body: dict[str, Any] = {"name": f"t-{uuid.uuid4().hex[:12]}"}
    if quota:
        body["quota"] = quota
    r = await client.post("/v1/admin/tenants", json=body, headers=ADMIN)
    assert r.status_code == 201, r.text
    tid = r.json()["id"]
    r = await client.post(f"/v1/admin/tenants/{tid}/api-keys", headers=ADMIN)
    assert r.status_code == 201, r.text
    return tid, {"Authorization": f"Bearer {r.json()['key']}"}


async def deploy(client: httpx.AsyncClient, headers: dict[str, str], name: str, wasm: bytes, **params: Any) -> httpx.Response:
    return await client.put(
        f"/v1/functions/{name}", content=wasm, params=params, headers={**headers, "Content-Type": "application/wasm"}
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def server_process(database_url: str, data_dir: Path, **env: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A real `tensorwasm serve` process on a free port (test admin token, the test backend),
    with this tree first on its path; yields (process, base URL) once /readyz answers 200.
    `env` adds or overrides TENSORWASM_* variables. The process is stopped on exit if alive."""
    port = free_port()
    full = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
        "TENSORWASM_DATABASE_URL": database_url,
        "TENSORWASM_DATA_DIR": str(data_dir),
        "TENSORWASM_ADMIN_TOKEN": ADMIN_TOKEN,
        "TENSORWASM_PORT": str(port),
        "TENSORWASM_BACKEND": os.environ.get("TENSORWASM_TEST_BACKEND", "cpu"),
        "TENSORWASM_LOG_LEVEL": "warning",
        **env,
    }
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve"], env=full, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, f"the server exited with {proc.returncode}"
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.1)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (fronts, workers, the fork server), walking /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(") ", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found and process_alive(child):
                found.add(child)
                todo.append(child)
    return found


def wat(name: str) -> bytes:
    return bytes(wasmtime.wat2wasm((GUESTS / f"{name}.wat").read_text()))


_C_CACHE: dict[str, bytes] = {}


def build_c(source: Path, out_dir: Path) -> bytes:
    """Compile a C guest with zig (from the ziglang package) for wasm32-wasi."""
    key = str(source)
    if key not in _C_CACHE:
        out = out_dir / (source.stem + ".wasm")
        cmd = [sys.executable, "-m", "ziglang", "cc", "-target", "wasm32-wasi", "-O2", "-s", f"-I{EXAMPLES}", str(source), "-o", str(out)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        assert res.returncode == 0, f"zig cc failed:\n{res.stderr}"
        _C_CACHE[key] = out.read_bytes()
    return _C_CACHE[key]

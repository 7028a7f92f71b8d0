"""Helpers shared by the tests: settings, a running app, tenants, deploys and guests."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import wasmtime
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from app.main import create_app
from app.runtime.artifacts import ArtifactCache
from app.runtime.engine import make_engine
from app.sandbox.bench import compile_bomb_wat
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


def compile_artifact(cache: ArtifactCache, wasm: bytes) -> str:
    """Compile a test's own (trusted) module in this process into `cache`; returns its sha256.

    The platform compiles tenant modules only in its sandbox (app.sandbox); tests that drive a
    GuestRunner directly need an artifact without a running app.
    """
    sha = hashlib.sha256(wasm).hexdigest()
    cache.store(sha, wasmtime.Module(make_engine(), wasm))
    return sha


def compile_bomb(n_locals: int, n_blocks: int) -> bytes:
    """A valid WASI command that is small to send and costly to compile: one function with
    `n_locals` i64 locals and `n_blocks` small `if` blocks that add locals (cranelift's memory
    grows with their product)."""
    return bytes(wasmtime.wat2wasm(compile_bomb_wat(n_locals, n_blocks)))

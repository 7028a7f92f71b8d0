"""Shared fixtures: a migrated database, the app with its real worker processes, guests."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import wasmtime
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from app.db.migrate import upgrade
from app.main import create_app
from app.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
GUESTS = Path(__file__).resolve().parent / "guests"
EXAMPLES = ROOT / "examples"
ADMIN_TOKEN = "test-admin-token"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("TENSORWASM_TEST_GPU") == "1":
        return
    try:
        from app.gpu.cuda import cuda_available

        has_gpu = cuda_available()
    except Exception:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with CuPy; run `pytest -m gpu` on a GPU machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


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


@pytest.fixture(scope="session")
def database_url(tmp_path_factory: pytest.TempPathFactory) -> Any:
    pg = os.environ.get("TENSORWASM_TEST_DATABASE_URL")
    if pg:
        url, drop = fresh_postgres_database(pg)
        upgrade(url)
        yield url
        drop()
    else:
        url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'test.db'}"
        upgrade(url)
        yield url


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("data")


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


@pytest.fixture(scope="session")
async def app_client(database_url: str, data_dir: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    async with running_app(make_settings(database_url, data_dir)) as pair:
        yield pair


@pytest.fixture
def client(app_client: tuple[httpx.AsyncClient, Any]) -> httpx.AsyncClient:
    return app_client[0]


@pytest.fixture
def platform(app_client: tuple[httpx.AsyncClient, Any]) -> Any:
    return app_client[1]


@pytest.fixture
def app_factory(database_url: str, tmp_path: Path) -> Callable[..., Any]:
    """An app with its own settings (and own workers), for tests that change the node's shape."""

    def factory(**overrides: Any) -> Any:
        return running_app(make_settings(database_url, tmp_path, **overrides))

    return factory


ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


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


@pytest.fixture(scope="session")
def c_guest(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], bytes]:
    out_dir = tmp_path_factory.mktemp("cguests")

    prebuilt = os.environ.get("TENSORWASM_PREBUILT_GUESTS")

    def get(name: str) -> bytes:
        if prebuilt:  # machines without zig (the GPU machine) get guests built elsewhere
            return (Path(prebuilt) / (Path(name).stem + ".wasm")).read_bytes()
        path = EXAMPLES / name if (EXAMPLES / name).exists() else GUESTS / name
        return build_c(path, out_dir)

    return get

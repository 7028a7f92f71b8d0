"""Shared fixtures: a migrated database, the app with its real worker processes, guests."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.db.migrate import upgrade
from tests.helpers import (
    EXAMPLES,
    GUESTS,
    LIVE_SERVERS,
    build_c,
    fresh_database,
    fresh_postgres_database,
    make_settings,
    running_app,
)


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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failing test against a real server shows the end of that server's log: its 500s and
    tracebacks are there, not in the test's output."""
    report = yield
    if report.failed:
        for server in LIVE_SERVERS:
            lines = server.log().splitlines()
            # a test that polls fills the log with access lines: what went wrong is in the others
            notable = [ln for ln in lines if "tensorwasm.access:" not in ln]
            report.sections.append((f"serve.log of {server.url} (last 80 lines but access lines)", "\n".join(notable[-80:])))
            report.sections.append((f"serve.log of {server.url} (last 20 lines)", "\n".join(lines[-20:])))
    return report


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


@pytest.fixture(scope="module")
def server_database_url(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A database of its own for the servers a module runs as processes. The in-process app of
    the other tests runs on the tests' event loop, which stands still between tests: a write of
    that app's left half done there (a record batch, a lease renewal) keeps SQLite's one write
    lock until the next async test, and a server sharing its file would wait it out."""
    url, drop = fresh_database(tmp_path_factory.mktemp("server-db"))
    upgrade(url)
    yield url
    drop()


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("data")


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
        url = overrides.pop("database_url", database_url)  # a test's own database, when it needs one
        return running_app(make_settings(url, tmp_path, **overrides))

    return factory


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

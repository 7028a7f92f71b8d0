"""Processes that run tenant code get the allowed environment only: the fork server, every
worker forked from it, and a worker started as a fresh interpreter never see the node's
secrets (`TENSORWASM_*`) nor anything else the node's own environment happens to hold."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from app.contract.messages import Ping, Pong
from app.runtime.environment import tenant_process_env
from app.worker.forkserver import ForkServer
from app.worker.handle import WorkerHandle
from tests.helpers import make_settings

SECRETS = {
    "TENSORWASM_ADMIN_TOKEN": "admin-secret-3f9c",
    "TENSORWASM_DATABASE_URL": "postgresql://tw:db-secret-77a1@db/tw",
    "TENSORWASM_METRICS_TOKEN": "metrics-secret-0b2e",
    "AWS_SECRET_ACCESS_KEY": "cloud-secret-5d10",
}


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(entry.decode().split("=", 1) for entry in raw.split(b"\0") if b"=" in entry)


def test_only_allowed_names_pass_and_extras_win() -> None:
    base = {**SECRETS, "PATH": "/bin", "LC_ALL": "C", "CUDA_HOME": "/cuda", "PYTHONPATH": "/src", "EDITOR": "vi"}
    env = tenant_process_env({"CUDA_VISIBLE_DEVICES": "1"}, base=base)
    assert env == {"PATH": "/bin", "LC_ALL": "C", "CUDA_HOME": "/cuda", "PYTHONPATH": "/src", "CUDA_VISIBLE_DEVICES": "1"}


@pytest.fixture()
def secret_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("CUDA_TW_TEST_MARK", "kept")  # an allowed prefix passes


def _assert_clean(pid: int) -> None:
    env = environ_of(pid)
    assert not [k for k in env if k.startswith("TENSORWASM_")], env
    leaked = [v for v in SECRETS.values() if v in Path(f"/proc/{pid}/environ").read_text() or v in Path(f"/proc/{pid}/cmdline").read_text()]
    assert leaked == []
    assert env.get("CUDA_TW_TEST_MARK") == "kept"


@pytest.mark.usefixtures("secret_env")
async def test_the_fork_server_and_its_workers_see_no_secret(tmp_path: Path) -> None:
    settings = make_settings("sqlite://", tmp_path, backend="cpu")
    fs = ForkServer("cpu")
    try:
        w = WorkerHandle(settings, spawner=fs)
        await w.start()
        reply, _ = await w.request(Ping())  # it runs on what it was given
        assert isinstance(reply, Pong)
        assert fs.pid is not None and w.pid is not None
        _assert_clean(fs.pid)
        _assert_clean(w.pid)
        await w.close()
    finally:
        fs.close_sync()


@pytest.mark.usefixtures("secret_env")
async def test_a_worker_started_as_its_own_interpreter_sees_no_secret(tmp_path: Path) -> None:
    w = WorkerHandle(make_settings("sqlite://", tmp_path, backend="cpu"))
    try:
        await w.start()
        reply, _ = await asyncio.wait_for(w.request(Ping()), 30)
        assert isinstance(reply, Pong) and w.pid is not None
        _assert_clean(w.pid)
    finally:
        await w.close()

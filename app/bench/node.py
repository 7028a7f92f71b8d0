"""Processes a benchmark measures: a real `tensorwasm serve` node, and the bare FastAPI baseline."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ADMIN = "bench-admin-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(proc: subprocess.Popen[bytes], url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not become ready")
        time.sleep(0.1)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def server(ready_path: str = "/readyz", root: str | None = None, **env: str) -> Iterator[str]:
    """A real `tensorwasm serve` on a free port with a fresh SQLite data dir; yields its base URL.
    `root`: serve the code of another checkout (to measure a change against the code before it).

    A node that keeps no warm spares is never "ready" before its first call: wait for /healthz.
    """
    with node_process(ready_path, root, **env) as (base, _pid):
        yield base


@contextmanager
def node_process(ready_path: str = "/readyz", root: str | None = None, **env: str) -> Iterator[tuple[str, int]]:
    """`server`, yielding the node's base URL and its first process's pid."""
    with tempfile.TemporaryDirectory(prefix="tw-bench-") as data:
        port = free_port()
        full = {
            **os.environ,
            **({"PYTHONPATH": root} if root else {}),
            "TENSORWASM_DATA_DIR": data,
            "TENSORWASM_ADMIN_TOKEN": ADMIN,
            "TENSORWASM_PORT": str(port),
            "TENSORWASM_LOG_LEVEL": "warning",
            **env,
        }
        full.pop("TENSORWASM_DATABASE_URL", None)
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve"], env=full, cwd=data)
        base = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(proc, f"{base}{ready_path}")
            yield base, proc.pid
        finally:
            _stop(proc)


@contextmanager
def bare_echo(processes: int, app: str = "app.bench.echo_app:app", env: dict[str, str] | None = None) -> Iterator[str]:
    """The baseline app under plain uvicorn with `processes` worker processes; yields the echo URL."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port),
        "--workers", str(processes), "--log-level", "warning", "--no-access-log",
    ]
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})})
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_ready(proc, f"{base}/docs")
        yield f"{base}/echo"
    finally:
        _stop(proc)


@contextmanager
def bare_relay(processes: int, far: int = 1, guest: bool = False) -> Iterator[str]:
    """The baseline with one process hop (`app.bench.relay_app`): `far` far processes (echo, or
    with `guest` the echo guest run as a worker runs it), then the app with `processes`."""
    with tempfile.TemporaryDirectory(prefix="tw-relay-") as run:
        paths = [str(Path(run) / f"far{i}.sock") for i in range(far)]
        procs = [subprocess.Popen([sys.executable, "-m", "app.bench.relay_app", path, *(["--guest"] if guest else [])]) for path in paths]
        try:
            deadline = time.monotonic() + 60
            while not all(os.path.exists(path) for path in paths):
                if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                    raise RuntimeError("the relay's far processes did not start")
                time.sleep(0.05)
            with bare_echo(processes, "app.bench.relay_app:app", {"TENSORWASM_BENCH_RELAY": ",".join(paths)}) as url:
                yield url
        finally:
            for p in procs:
                _stop(p)


def setup_tenant(client: httpx.Client, name: str, functions: dict[str, bytes], *, admin_token: str = ADMIN, **quota: Any) -> dict[str, str]:
    """Create a tenant and a key, deploy `functions` (name -> module); returns its auth header."""
    admin = {"Authorization": f"Bearer {admin_token}"}
    r = client.post("/v1/admin/tenants", json={"name": name, "quota": quota}, headers=admin)
    r.raise_for_status()
    key = client.post(f"/v1/admin/tenants/{r.json()['id']}/api-keys", headers=admin).json()["key"]
    headers = {"Authorization": f"Bearer {key}"}
    for fn, wasm in functions.items():
        client.put(f"/v1/functions/{fn}", content=wasm, headers={**headers, "Content-Type": "application/wasm"}).raise_for_status()
    return headers


def guest_wasm(source: Path) -> bytes:
    """A C guest for a benchmark: prebuilt (TENSORWASM_PREBUILT_GUESTS, for machines without zig)
    or built here with zig from the `ziglang` package."""
    prebuilt = os.environ.get("TENSORWASM_PREBUILT_GUESTS")
    if prebuilt:
        return (Path(prebuilt) / f"{source.stem}.wasm").read_bytes()
    out = Path(tempfile.mkdtemp()) / f"{source.stem}.wasm"
    cmd = [sys.executable, "-m", "ziglang", "cc", "-target", "wasm32-wasi", "-O2", "-s", f"-I{source.parent}", str(source), "-o", str(out)]
    subprocess.run(cmd, check=True)
    return out.read_bytes()

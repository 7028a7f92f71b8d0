"""Helpers shared by the tests: settings, a running app, tenants, deploys and guests."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import signal
import socket
import subprocess
import sys
import tarfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import wasmtime
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from app.bench.compile import compile_bomb_wat
from app.main import create_app
from app.runtime.artifacts import ArtifactCache
from app.runtime.engine import make_engine
from app.runtime.validation import has_start_function
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
        spare_room_share=0.0,  # tests count spares; the room's share is tested on its own
        record_flush_interval_s=0.05,
        queue_wait_ms=300,
        cache_ttl_s=2.0,
    )
    if overrides.get("backend", base["backend"]) == "cuda":
        # the queue wait bounds a call's wait for a worker's start too: a CUDA context takes
        # several times the CPU tests' 300 ms when others are starting
        base["queue_wait_ms"] = 30_000
    base.update(overrides)
    return Settings(**base)


class ServerTransport(httpx.ASGITransport):
    """The in-process app as a server runs it: httpx's transport runs the app in the test's own
    task, where a server runs each request in a task of its own and reads the next request in a
    later turn of its loop. So each answer here is followed by one turn of the loop, in which the
    app does what it left for the loop once its answer was written (a call's counts and record:
    app/observability/phases.py, `soon`)."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        await asyncio.sleep(0)
        return response


@asynccontextmanager
async def running_app(settings: Settings) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = ServerTransport(app=app)
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


async def submit(client: httpx.AsyncClient, key: dict[str, str], name: str, body: bytes = b"", headers: dict[str, str] | None = None) -> httpx.Response:
    """Submit an async invocation of `name` (POST .../invocations)."""
    return await client.post(f"/v1/functions/{name}/invocations", content=body, headers={**key, **(headers or {})})


async def wait_status(client: httpx.AsyncClient, key: dict[str, str], inv: str, *statuses: str, timeout_s: float = 30) -> dict[str, Any]:
    """Poll an invocation's record until its status is one of `statuses`; returns the record."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        rec: dict[str, Any] = (await client.get(f"/v1/invocations/{inv}", headers=key)).json()
        if rec["status"] in statuses:
            return rec
        assert asyncio.get_running_loop().time() < deadline, f"still {rec['status']}"
        await asyncio.sleep(0.05)


def wat(name: str) -> bytes:
    return bytes(wasmtime.wat2wasm((GUESTS / f"{name}.wat").read_text()))


_COUNTER = """(module
  (import "wasi_snapshot_preview1" "fd_write" (func $w (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") {pages})
  (data (i32.const 0) "0")
  (data (i32.const 8) "\\00\\00\\00\\00\\01\\00\\00\\00")
  (data (i32.const 32) "{tag}")
  {start}
  (func $bump (i32.store8 (i32.const 0) (i32.add (i32.load8_u (i32.const 0)) (i32.const 1))))
  (func (export "_start") (call $bump) (drop (call $w (i32.const 1) (i32.const 8) (i32.const 1) (i32.const 16)))))"""


def counter_module(*, start_function: bool = False, pages: int = 1, tag: str = "") -> bytes:
    """A guest that adds one to a byte its data segment sets to "0" and prints it: "1" from a
    fresh instance, "2" with `start_function` (which adds one at instantiation). `tag` makes
    the module's bytes (and so its sha256) unique."""
    start = "(start $bump)" if start_function else ""
    return bytes(wasmtime.wat2wasm(_COUNTER.format(pages=pages, start=start, tag=tag)))


def tar_archive(entries: dict[str, bytes | str | None]) -> bytes:
    """A tar archive of `entries` in order: bytes make a file, None a directory, a str a
    symbolic link to it."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, value in entries.items():
            info = tarfile.TarInfo(name)
            if value is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif isinstance(value, str):
                info.type, info.linkname = tarfile.SYMTYPE, value
                tar.addfile(info)
            else:
                info.size = len(value)
                tar.addfile(info, io.BytesIO(value))
    return buf.getvalue()


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


@dataclass(eq=False)  # by identity: kept in LIVE_SERVERS
class ServerProcess:
    """A `tensorwasm serve` running as its own process (group), as a user would start it."""

    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path  # its stdout and stderr

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def interrupt(self) -> int:
        """Ctrl-C as a terminal sends it (to the whole process group); returns the exit code."""
        os.killpg(self.proc.pid, signal.SIGINT)
        return self.proc.wait(timeout=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# the servers running now: a failing test's report shows the end of their logs (tests/conftest.py)
LIVE_SERVERS: set[ServerProcess] = set()


@contextmanager
def server_process(
    data_dir: Path,
    database_url: str | None = None,
    *,
    command: list[str] | None = None,
    env: dict[str, str | None] | None = None,
    cwd: Path | None = None,
) -> Iterator[ServerProcess]:
    """Start `tensorwasm serve` (or ``command``) on a free port and wait for /readyz; an
    ``env`` value of None removes that variable."""
    port = free_port()
    full = {k: v for k, v in os.environ.items() if not k.startswith("TENSORWASM_")}
    full.update(
        TENSORWASM_DATA_DIR=str(data_dir),
        TENSORWASM_PORT=str(port),
        TENSORWASM_BACKEND=os.environ.get("TENSORWASM_TEST_BACKEND", "cpu"),
        TENSORWASM_MAX_WORKERS="2",
        TENSORWASM_LOG_FORMAT="console",
    )
    if database_url:
        full["TENSORWASM_DATABASE_URL"] = database_url
    for k, v in (env or {}).items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command or [sys.executable, "-m", "app.cli", "serve"],
            env=full, cwd=cwd or data_dir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    server = ServerProcess(f"http://127.0.0.1:{port}", proc, log_path)
    LIVE_SERVERS.add(server)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{server.url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the server did not become ready:\n{server.log()}")
            time.sleep(0.2)
        yield server
    finally:
        LIVE_SERVERS.discard(server)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

def fresh_database(tmp_path: Path) -> tuple[str, Callable[[], None]]:
    """An empty database of the kind the suite runs on (PostgreSQL when configured)."""
    pg = os.environ.get("TENSORWASM_TEST_DATABASE_URL")
    if pg:
        return fresh_postgres_database(pg)
    return f"sqlite:///{tmp_path / f'node-{uuid.uuid4().hex[:6]}.db'}", lambda: None


def checkout_pythonpath() -> str:
    """PYTHONPATH for a child process: this checkout first, then what the test run was given
    (where dependencies live on a machine that installs them to a target directory)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)


class Node:
    """A real `tensorwasm serve` process (CPU backend) on a free port."""

    def __init__(self, database_url: str, data_dir: Path, **env: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "PYTHONPATH": checkout_pythonpath(),
            "TENSORWASM_DATABASE_URL": database_url,
            "TENSORWASM_DATA_DIR": str(data_dir),
            "TENSORWASM_ADMIN_TOKEN": ADMIN_TOKEN,
            "TENSORWASM_BACKEND": "cpu",
            "TENSORWASM_HOST": "127.0.0.1",
            "TENSORWASM_PORT": str(self.port),
            "TENSORWASM_LOG_LEVEL": "warning",
            **env,
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60) -> Node:
        import time

        self.proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve"], env=self.env, cwd=ROOT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "the node exited during start"
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError("the node did not become ready")

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def parent_of(pid: int) -> int | None:
    """`pid`'s parent, from /proc (None: gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(") ", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def children_of(pid: int) -> list[int]:
    """`pid`'s live children, walking /proc."""
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and parent_of(int(e)) == pid and process_alive(int(e))]


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (fronts, workers, the fork server), walking /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (ppid := parent_of(int(entry))) is not None:
            children.setdefault(ppid, []).append(int(entry))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found and process_alive(child):
                found.add(child)
                todo.append(child)
    return found


def compile_artifact(cache: ArtifactCache, wasm: bytes) -> str:
    """Compile a test's own (trusted) module in this process into `cache`; returns its sha256.

    The platform compiles tenant modules only in its sandbox (app.sandbox); tests that drive a
    GuestRunner directly need an artifact without a running app.
    """
    sha = hashlib.sha256(wasm).hexdigest()
    cache.store(sha, wasmtime.Module(make_engine(), wasm), start_function=has_start_function(wasm))
    return sha


def compile_bomb(n_locals: int, n_blocks: int) -> bytes:
    """A valid WASI command that is small to send and costly to compile: one function with
    `n_locals` i64 locals and `n_blocks` small `if` blocks that add locals (cranelift's memory
    grows with their product)."""
    return bytes(wasmtime.wat2wasm(compile_bomb_wat(n_locals, n_blocks)))


def fake_gpus(count: int, budget_bytes: int = 0, ceiling: int = 0) -> Callable[[Settings], Any]:
    """A device discovery that reports `count` GPUs (for the scheduler's `discover`): the
    workers still run the CPU backend, each started with CUDA_VISIBLE_DEVICES of its device."""
    from app.scheduler.devices import Device, Inventory

    async def discover(settings: Settings) -> Inventory:
        return Inventory(
            [Device(i, str(i), budget_bytes, f"fake{i}", ceiling or settings.max_contexts_per_device) for i in range(count)],
            settings.context_overhead_bytes,
        )

    return discover


async def until(check: Callable[[], bool], what: str, bound_s: float = 60) -> None:
    """Poll a condition; the bound only keeps a broken build from hanging the suite."""
    import asyncio

    deadline = time.monotonic() + bound_s
    while not check():
        assert time.monotonic() < deadline, f"never saw: {what}"
        await asyncio.sleep(0.02)


def from_address(client: httpx.AsyncClient, host: str) -> httpx.AsyncClient:
    """Another client of the same in-process app whose requests come from `host`."""
    app = client._transport.app  # type: ignore[attr-defined]
    return httpx.AsyncClient(transport=ServerTransport(app=app, client=(host, 40000)), base_url=str(client.base_url), timeout=60)


class CountingBody:
    """A request body that counts how much of it the server pulled."""

    def __init__(self, total: int, chunk: int = 64 * 1024) -> None:
        self.total, self.chunk, self.sent = total, chunk, 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while self.sent < self.total:
            self.sent += self.chunk
            yield b" " * self.chunk


# -- a scheduler whose workers are no processes: starts that take a set time ----------------------
class FakeProc:
    """What the scheduler reads of a worker's process: it runs until killed."""

    def __init__(self) -> None:
        self.pid = 0
        self.returncode: int | None = None
        self._ended = asyncio.Event()

    def kill(self) -> None:
        if self.returncode is None:
            self.returncode = -9
            self._ended.set()

    async def wait(self) -> int:
        await self._ended.wait()
        assert self.returncode is not None
        return self.returncode


@dataclass
class FakeStarts:
    """Worker starts as the fake driver makes them: each takes `seconds`; `fail` makes them fail;
    `serial` makes them one after another, as a GPU driver makes contexts (a start begun while k
    others are under way takes (k + 1) x `seconds`)."""

    seconds: float = 0.0
    fail: bool = False
    started: int = 0  # starts begun
    serial: bool = False
    driver: asyncio.Lock = field(default_factory=asyncio.Lock)  # held through a serial start


async def _fake_start(w: Any, starts: FakeStarts) -> None:
    from app.worker.handle import WorkerLost, WorkerState

    starts.started += 1
    async with starts.driver if starts.serial else nullcontext():
        await asyncio.sleep(starts.seconds)
    if starts.fail:
        raise WorkerLost(f"worker {w.id}: the fake driver failed its start")
    w.proc = FakeProc()
    w.backend, w.state = "cpu", WorkerState.SPARE


async def _fake_bind(w: Any, tenant_id: str, tenant_name: str, gpu_cap: int, *_: Any, **__: Any) -> None:
    w.tenant_id, w.tenant_name, w.gpu_cap = tenant_id, tenant_name, gpu_cap


def fake_workers(monkeypatch: Any, seconds: float = 0.0) -> FakeStarts:
    """Worker handles that start (after `seconds`), bind and close without a process."""
    from app.worker.handle import WorkerHandle

    starts = FakeStarts(seconds)

    async def start(self: WorkerHandle) -> None:
        await _fake_start(self, starts)

    async def close(self: WorkerHandle) -> None:
        self.kill()

    monkeypatch.setattr(WorkerHandle, "start", start)
    monkeypatch.setattr(WorkerHandle, "bind", _fake_bind)
    monkeypatch.setattr(WorkerHandle, "close", close)
    return starts


def fake_worker_factory(settings: Settings, seconds: float = 0.0) -> tuple[Callable[[Any], Any], FakeStarts]:
    """The same fakes as a worker factory (`WorkerPool`, `Scheduler`): nothing patched, so a test
    can drive the pool with them directly."""
    from app.worker.handle import WorkerHandle

    starts = FakeStarts(seconds)

    class FakeWorker(WorkerHandle):
        async def start(self) -> None:
            await _fake_start(self, starts)

        async def bind(self, tenant_id: str, tenant_name: str, gpu_cap: int, *args: Any, **kw: Any) -> None:
            await _fake_bind(self, tenant_id, tenant_name, gpu_cap)

        async def close(self) -> None:
            self.kill()

    def factory(device: Any) -> WorkerHandle:
        return FakeWorker(settings, device_index=device.index, visible_device=device.visible_id)

    return factory, starts


def principal(timeout_ms: int = 10_000, max_concurrency: int = 1, gpu_memory_bytes: int = 0) -> Any:
    """A tenant as the scheduler sees it (a unique id), with the quota fields it reads."""
    from app.contract.messages import Principal, Quota

    quota = Quota(
        gpu_memory_bytes=gpu_memory_bytes, max_concurrency=max_concurrency, requests_per_second=1000.0, max_functions=10,
        max_module_bytes=1 << 20, wasm_memory_bytes=64 << 20, timeout_ms=timeout_ms, max_queued=100,
    )
    return Principal(f"t-{uuid.uuid4().hex[:12]}", "fake", quota)


@asynccontextmanager
async def fake_node(data_dir: Path, devices: Any = None, wait: bool = True, **overrides: Any) -> AsyncIterator[Any]:
    """A started Scheduler on `devices` (one CPU device by default) with settings for tests;
    pair it with `fake_workers` so its workers are no processes."""
    from app.scheduler.devices import Inventory
    from app.scheduler.scheduler import Scheduler

    settings = make_settings("sqlite://", data_dir, fork_server=False, backend="cpu", **overrides)
    s = Scheduler(settings, devices=devices or Inventory.cpu(settings.context_overhead_bytes, settings.max_contexts_per_device))
    await s.start(wait=wait)
    try:
        yield s
    finally:
        await s.stop()

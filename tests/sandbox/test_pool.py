"""The sandbox's processes: one job each, killed at the time limit, never outliving the api
process (parent-death signal), and the verdicts they bring back."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import wasmtime

from app.sandbox.errors import CompileOutcome, Limit, LimitExceeded, SandboxUnavailable
from app.sandbox.pool import JobKind, Sandbox
from tests.helpers import ROOT, compile_bomb, wat

GiB = 1024**3


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


async def gone(pids: list[int], within_s: float = 30) -> bool:
    deadline = time.monotonic() + within_s
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def test_a_module_compiles_into_the_file_it_was_given(tmp_path: Path) -> None:
    sandbox = Sandbox(2 * GiB, 60, 2)
    sandbox.start()
    try:
        out = tmp_path / "echo.cwasm"
        out.touch()
        res = await sandbox.run("t", JobKind.WASM, wat("echo"), artifact=str(out))
        assert res.outcome is CompileOutcome.OK and res.data["uses_gpu"] is False
        assert res.max_rss and res.max_rss > 0
        # a platform artifact: it deserializes with the platform's engine
        from app.runtime.engine import make_engine

        wasmtime.Module.deserialize(make_engine(), out.read_bytes())
        res = await sandbox.run("t", JobKind.WASM, b"\0asm\x01\0\0\0\xff", artifact=str(out))
        assert res.outcome is CompileOutcome.INVALID and "not a valid WebAssembly module" in res.data["message"]
    finally:
        await sandbox.stop()
    assert sandbox.pids == []


async def test_the_time_limit_kills_the_process(tmp_path: Path) -> None:
    sandbox = Sandbox(2 * GiB, 1, 1, warm=0)  # warm=0: the job's process is the only one
    out = tmp_path / "slow.cwasm"
    job = asyncio.create_task(sandbox.run("t", JobKind.WASM, compile_bomb(1500, 8000), artifact=str(out)))
    while not sandbox.pids and not job.done():
        await asyncio.sleep(0.01)
    pids = sandbox.pids
    with pytest.raises(LimitExceeded) as exc:
        await job
    assert exc.value.limit is Limit.TIME
    assert "took longer than 1 s (TENSORWASM_COMPILE_TIMEOUT_S)" in exc.value.describe("the module")
    assert len(pids) == 1 and await gone(pids)
    await sandbox.stop()


async def test_the_memory_limit_is_reported_as_such(tmp_path: Path) -> None:
    sandbox = Sandbox(384 * 1024 * 1024, 120, 1, warm=0)
    with pytest.raises(LimitExceeded) as exc:
        await sandbox.run("t", JobKind.WASM, compile_bomb(5000, 3000), artifact=str(tmp_path / "x"))
    assert exc.value.limit is Limit.MEMORY
    assert "more than 402653184 bytes of memory (TENSORWASM_COMPILE_MEMORY_BYTES)" in exc.value.describe("the module")
    await sandbox.stop()


async def test_a_cancelled_job_takes_its_process_with_it(tmp_path: Path) -> None:
    sandbox = Sandbox(2 * GiB, 120, 1, warm=0)
    job = asyncio.create_task(sandbox.run("t", JobKind.WASM, compile_bomb(1500, 8000), artifact=str(tmp_path / "x")))
    while not sandbox.pids:
        await asyncio.sleep(0.01)
    pids = sandbox.pids
    job.cancel()
    with pytest.raises(asyncio.CancelledError):
        await job
    assert await gone(pids)
    assert sandbox.limiter.running == 0
    await sandbox.stop()


PARENT = textwrap.dedent(
    """
    import asyncio, sys
    from app.sandbox.pool import JobKind, Sandbox
    from tests.helpers import compile_bomb

    async def main():
        sandbox = Sandbox(2 << 30, 600, 2)
        sandbox.start()
        job = asyncio.create_task(sandbox.run("t", JobKind.WASM, compile_bomb(1500, 8000), artifact=sys.argv[1]))
        while not (sandbox.limiter.running == 1 and len(sandbox.pids) == 2 and sandbox._ready.qsize() == 1):
            await asyncio.sleep(0.05)  # one process took the job, the other is ready
        await asyncio.sleep(0.5)  # the job is compiling (its replacement starts only after it)
        print(*sandbox.pids, flush=True)
        await job

    asyncio.run(main())
    """
)


async def test_no_compile_process_survives_a_killed_api_process(tmp_path: Path) -> None:
    """SIGKILL of the parent mid-compile: the busy process and the ready ones die with it."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path / "x")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert parent.stdout is not None
        line = await asyncio.get_running_loop().run_in_executor(None, parent.stdout.readline)
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert await gone(pids)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


async def test_a_compile_process_sees_no_secret_of_the_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secrets = {"TENSORWASM_ADMIN_TOKEN": "admin-secret-3f9c", "TENSORWASM_DATABASE_URL": "postgresql://tw:db-secret-77a1@db/tw"}
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    sandbox = Sandbox(2 * GiB, 60, 1)
    sandbox.start()
    try:
        while not sandbox.pids:
            await asyncio.sleep(0.01)
        environ = Path(f"/proc/{sandbox.pids[0]}/environ").read_text()
        assert "TENSORWASM_" not in environ and not [v for v in secrets.values() if v in environ]
        out = tmp_path / "echo.cwasm"
        out.touch()
        res = await sandbox.run("t", JobKind.WASM, wat("echo"), artifact=str(out))  # it compiles without them
        assert res.outcome is CompileOutcome.OK
    finally:
        await sandbox.stop()


async def test_a_compile_process_that_fails_to_start_names_no_host_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho \'Traceback: File "/srv/node-secret/app/sandbox/child.py", line 1\' >&2\nexit 1\n')
    fake.chmod(0o700)
    monkeypatch.setattr(sys, "executable", str(fake))
    sandbox = Sandbox(2 * GiB, 60, 1, warm=0)
    with pytest.raises(SandboxUnavailable) as exc:
        await sandbox.run("t", JobKind.WASM, wat("echo"), artifact=str(tmp_path / "x"))
    message = str(exc.value)
    assert message.startswith("a compile process did not start (exit") and "node-secret" not in message
    await sandbox.stop()

"""The api process's side of the compile sandbox: a pool of ready compile processes, the fair
limiter, the limits, and the verdict of each job.

Why a warm pool and not a process started per compile: a fresh interpreter that imports the
compiler takes ~0.25 s of wall and CPU time to be ready (measured on the 2-core dev VM), more
than ten times a small module's whole deploy. The pool keeps one ready process per compile slot;
each takes exactly one job and exits, and a replacement is started in the background as soon as
one is taken, so a deploy pays only the job's round trip (docs/architecture.md, "Compiles").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from app.runtime.environment import tenant_process_env
from app.runtime.redact import without_host_paths
from app.sandbox.errors import CompileOutcome, Limit, LimitExceeded, SandboxCrashed, SandboxUnavailable, looks_like_oom
from app.sandbox.limiter import FairLimiter

log = logging.getLogger(__name__)

# Compiler threads per compile process: a module of many functions compiles in parallel, but
# compile_concurrency x this bounds what compiles can take of the node's cores.
COMPILE_THREADS = max(1, min(4, os.cpu_count() or 1))
# A compile process that is not ready by then is a fault of the node.
START_TIMEOUT_S = 60.0
STDERR_TAIL = 4000
# A compile still running after RENICE_AFTER_S is moved below the serving processes and workers
# (every thread of it): a long compile must not slow anyone's calls, but a small module's
# compile, the common case, is not slowed on a busy node either.
RENICE_AFTER_S = 0.25
NICENESS = 10


class JobKind(StrEnum):
    WASM = "wasm"
    CUDA = "cuda"


@dataclass
class SandboxResult:
    """A verdict on the code: `outcome` is OK or INVALID (limits and faults are raised)."""

    outcome: CompileOutcome
    data: dict[str, Any]
    seconds: float
    max_rss: int | None = None


@dataclass(eq=False)  # identity: kept in sets
class _Child:
    proc: asyncio.subprocess.Process
    killed: bool = field(default=False)

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.killed = True
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()


def child_env() -> dict[str, str]:
    """A compile process's environment: the allowed part of ours (no secret of the node,
    app/runtime/environment.py) and the compiler's own knobs."""
    env = tenant_process_env()
    env["RUST_BACKTRACE"] = "0"  # an allocation failure prints one line, not a backtrace
    env["RAYON_NUM_THREADS"] = str(COMPILE_THREADS)
    # One malloc arena per thread reserves 64 MiB of address space each: on a many-core node
    # that alone would eat the memory limit (RLIMIT_AS counts reservations).
    env["MALLOC_ARENA_MAX"] = "2"
    # NumPy comes in with NVRTC's bindings; OpenBLAS's per-core buffers failed its import under
    # a 512 MiB limit on a 16-core node. No compile uses BLAS.
    env["OPENBLAS_NUM_THREADS"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    return env


class SlotLimiter(Protocol):
    """Who may compile now: this process's FairLimiter, or the supervisor's for a node of
    several fronts (so the limits hold node-wide)."""

    def slot(self, key: str) -> AbstractAsyncContextManager[None]: ...


class Sandbox:
    """Runs compile jobs in child processes under the node's limits, fairly across tenants.

    `warm`: ready processes kept (default: one per slot; 0 starts one per job).
    `on_result(kind, outcome, seconds)` is called once per job, whatever its end.
    """

    def __init__(
        self,
        memory_bytes: int,
        timeout_s: float,
        concurrency: int,
        warm: int | None = None,
        on_result: Callable[[JobKind, CompileOutcome, float], None] | None = None,
        limiter: SlotLimiter | None = None,
    ) -> None:
        self.memory_bytes = memory_bytes
        self.timeout_s = timeout_s
        self.limiter: SlotLimiter = limiter or FairLimiter(concurrency)
        self.warm = concurrency if warm is None else warm
        self.on_result = on_result
        # ready processes, or the error of a start that failed (the taker then tries its own)
        self._ready: asyncio.Queue[_Child | SandboxUnavailable] = asyncio.Queue()
        self._starting = 0
        self._children: set[_Child] = set()  # alive: ready and busy
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    # --- pool ------------------------------------------------------------------------------

    def start(self) -> None:
        """Fill the pool in the background (the first compile does not wait for it)."""
        self._refill()

    async def stop(self) -> None:
        self._closed = True
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        children = list(self._children)
        for child in children:
            child.kill()
        for child in children:
            with contextlib.suppress(Exception):
                await child.proc.wait()
        self._children.clear()

    @property
    def pids(self) -> list[int]:
        """Compile processes alive now (ready and busy)."""
        return [c.proc.pid for c in self._children if c.proc.returncode is None]

    async def _spawn(self) -> _Child:
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "app.sandbox.child", "--parent", str(os.getpid()),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=child_env(),
                start_new_session=True,  # a terminal's Ctrl-C is for the node, not its children
            )
        except OSError as exc:  # the log says which file; the tenant reads the message
            log.error("a compile process could not be started: %s", exc)
            raise SandboxUnavailable(f"could not start a compile process: {without_host_paths(str(exc))}") from exc
        child = _Child(proc)
        self._children.add(child)
        proc_done = False
        try:
            assert proc.stdout is not None and proc.stderr is not None
            try:
                line = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)
            except TimeoutError:
                raise SandboxUnavailable(f"a compile process was not ready within {START_TIMEOUT_S:g} s") from None
            if line != b"ready\n":
                child.kill()
                await proc.wait()
                err = (await proc.stderr.read())[-STDERR_TAIL:].decode(errors="replace").strip()
                # its stderr (a traceback names the node's files) is for the log, not the tenant
                log.error("a compile process did not start (exit %s): %s", proc.returncode, err)
                raise SandboxUnavailable(f"a compile process did not start (exit {proc.returncode})")
            proc_done = True
            return child
        finally:
            if not proc_done:  # failed or cancelled
                child.kill()
                self._children.discard(child)
                self._reap(proc)

    def _refill(self) -> None:
        while not self._closed and self._ready.qsize() + self._starting < self.warm:
            self._starting += 1
            task = asyncio.get_running_loop().create_task(self._add_one())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _add_one(self) -> None:
        try:
            item: _Child | SandboxUnavailable = await self._spawn()
        except SandboxUnavailable as exc:
            log.error("starting a compile process failed: %s", exc)
            item = exc
        finally:
            self._starting -= 1
        self._ready.put_nowait(item)

    async def _take(self) -> _Child:
        if self.warm == 0:
            return await self._spawn()
        while True:
            self._refill()  # also restarts the pool after failed starts
            item = await self._ready.get()  # the process being started is as fast as a new one
            if isinstance(item, SandboxUnavailable):
                return await self._spawn()  # one try of our own before giving up
            if item.proc.returncode is None:
                return item
            self._children.discard(item)

    # --- jobs ------------------------------------------------------------------------------

    async def run(self, tenant: str, kind: JobKind, payload: bytes, **params: Any) -> SandboxResult:
        """Run one job for `tenant` (waits for its fair turn).

        Returns the verdict on the code (OK with the job's data, or INVALID with a message);
        raises LimitExceeded, SandboxCrashed or SandboxUnavailable otherwise.
        """
        async with self.limiter.slot(tenant):
            t0 = time.monotonic()
            try:
                result = await self._run_job(kind, payload, params)
            except LimitExceeded as exc:
                self._record(tenant, kind, exc.outcome, t0)
                raise
            except SandboxUnavailable:
                self._record(tenant, kind, CompileOutcome.UNAVAILABLE, t0)
                raise
            except SandboxCrashed:
                self._record(tenant, kind, CompileOutcome.CRASHED, t0)
                raise
            # (cancelled: the caller went away, its process was killed; no verdict to count)
            self._record(tenant, kind, result.outcome, t0)
            return result

    def _record(self, tenant: str, kind: JobKind, outcome: CompileOutcome, t0: float) -> None:
        seconds = time.monotonic() - t0
        if outcome not in (CompileOutcome.OK, CompileOutcome.INVALID):
            log.warning("compile refused: tenant=%s kind=%s outcome=%s after %.2f s", tenant, kind.value, outcome.value, seconds)
        if self.on_result is not None:
            self.on_result(kind, outcome, seconds)

    async def _run_job(self, kind: JobKind, payload: bytes, params: dict[str, Any]) -> SandboxResult:
        if self._closed:
            raise SandboxUnavailable("the node is shutting down")
        child = await self._take()
        proc = child.proc
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        header = {"kind": kind.value, "size": len(payload), "memory_bytes": self.memory_bytes, **params}
        stderr = asyncio.get_running_loop().create_task(_tail(proc.stderr))
        renice = asyncio.get_running_loop().call_later(RENICE_AFTER_S, _renice, proc.pid)
        t0 = time.monotonic()
        try:
            try:
                line = await asyncio.wait_for(self._exchange(proc, header, payload), self.timeout_s)
            except TimeoutError:
                child.kill()
                raise LimitExceeded(Limit.TIME, self.timeout_s) from None
            seconds = time.monotonic() - t0
            reply = _parse(line)
            if reply is not None:
                if reply.get("outcome") == CompileOutcome.MEMORY.value:
                    raise LimitExceeded(Limit.MEMORY, self.memory_bytes)
                outcome = CompileOutcome(reply["outcome"])
                if outcome not in (CompileOutcome.OK, CompileOutcome.INVALID):
                    raise SandboxCrashed(f"the compile process answered {reply['outcome']!r}")
                return SandboxResult(outcome, reply, seconds, reply.get("max_rss"))
            # no answer: the process died; how it died says why
            code = await proc.wait()
            tail = (await stderr).decode(errors="replace").strip()
            # The Rust compiler aborts (SIGABRT) when an allocation fails under the limit; NVRTC
            # does not check some allocations and faults (SIGSEGV) instead (seen on an H200 host
            # with a source whose preprocessing kept growing); a SIGKILL we did not send is the
            # kernel's OOM killer.
            faulted = code in (-signal.SIGSEGV, -signal.SIGBUS)
            if looks_like_oom(tail) or faulted or (code == -signal.SIGKILL and not child.killed):
                log.info("a compile process died (exit %s) under its memory limit: %s", code, tail[-300:])
                raise LimitExceeded(Limit.MEMORY, self.memory_bytes)
            log.error("a compile process died (exit %s): %s", code, tail[-500:])
            raise SandboxCrashed(f"the compiler stopped unexpectedly (exit status {code})")
        finally:
            # On every path, a cancelled request included, nothing outlives its job. The answer
            # is complete once its line is read (the artifact was written before it), so the
            # process is killed, not waited for: its interpreter's exit costs ~0.2 s.
            child.kill()
            renice.cancel()
            stderr.cancel()
            self._children.discard(child)
            self._reap(proc)
            self._refill()  # after the job, not beside it: a start costs ~0.3 s of CPU

    @staticmethod
    async def _exchange(proc: asyncio.subprocess.Process, header: dict[str, Any], payload: bytes) -> bytes:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps(header).encode() + b"\n")
            proc.stdin.write(payload)
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass  # it died; the empty answer below says so
        return await proc.stdout.readline()

    def _reap(self, proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is not None:
            return
        task = asyncio.get_running_loop().create_task(proc.wait())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _renice(pid: int) -> None:
    """Lower the priority of every thread of a process (nice is per thread on Linux)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return  # gone already
    for tid in tids:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, NICENESS)


async def _tail(stream: asyncio.StreamReader) -> bytes:
    """Read a stream to its end, keeping the last STDERR_TAIL bytes."""
    kept = b""
    while chunk := await stream.read(65536):
        kept = (kept + chunk)[-STDERR_TAIL:]
    return kept


def _parse(line: bytes) -> dict[str, Any] | None:
    if not line.endswith(b"\n"):
        return None  # cut short by the process's death
    try:
        reply = json.loads(line)
    except ValueError:
        return None
    return reply if isinstance(reply, dict) and "outcome" in reply else None

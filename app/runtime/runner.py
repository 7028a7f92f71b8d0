"""Run one guest invocation inside a worker: fresh Store + instance from a cached InstancePre.

The hot path. Per call: one Store, its WASI context (app/runtime/wasi.py: stdin handed over as
bytes, no file), one instantiate, one `_start` call. stdout/stderr go through our own `fd_write`
so the caps are enforced at the write that crosses them, and a flood traps at once instead of
spinning.

Every call still gets a fresh instance, but the worker builds the next one ahead of it
(`prepare`, after the previous call's reply and memory scrub): a worker's next call is almost
always of the same function, so the Store and the instantiation leave the caller's path, and
the call itself only sets its WASI context and runs `_start`. An instance is built ahead only
when instantiating runs no guest code, that is for a module without a start function (the
artifact cache records which, app/runtime/artifacts.py); a start function runs at its call, under
that call's WASI context and deadline, as before. (An epoch deadline already reached cannot stand
in for that record: wasmtime checks the epoch while it writes a module's data segments too.)
"""

from __future__ import annotations

import ctypes
import re
import select
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import wasmtime
from wasmtime import _ffi as ffi  # wasmtime is pinned to one major version

from app.contract.messages import Run, RunStatus
from app.runtime.artifacts import ArtifactCache, ArtifactUnavailable
from app.runtime.bundles import BundleStore
from app.runtime.files import FilesUnavailable, GuestFiles
from app.runtime.linking import (
    ADDRESS_SPACE,
    SLOTS_BY_ADDRESS,
    call_export,
    caller_pointer,
    context_address,
    define_raw,
    export_func,
    guest_memory_at,
    instance_memory,
    set_epoch_deadline,
    trap_with,
)
from app.runtime.memory import GuestMemory, Region
from app.runtime.redact import without_host_paths
from app.runtime.spans import SpanRecorder
from app.runtime.wasi import WasiContexts

WASI = "wasi_snapshot_preview1"
_WARM_UP_WAT = '(module (memory (export "memory") 1) (func (export "_start")))'
_EBADF, _EFAULT, _EINVAL = 8, 21, 28
_IOV_MAX = 1024  # as wasi-libc and Linux: a longer iovec table is refused, not copied
_IOVEC = struct.Struct("<II")
_U32 = struct.Struct("<I")
_FD_WRITE_PARAMS = struct.Struct("<i12xi12xi12xi")  # four i32 parameters, one per 16-byte value slot
_I32 = struct.Struct("<i")
_VALUES = ctypes.POINTER(ffi.wasmtime_val_raw_t)  # the slots as wasmtime-py's callbacks see them
_NO_OFFSET = (1 << 64) - 1  # wasmtime's offset of a frame it could not place (usize::MAX)
_NAME_CHARS = 128  # of a function's name in a trap's message


class OutputLimitExceeded(Exception):
    pass


class HostAbi(Protocol):
    """The `tensorwasm` import module as seen by the runner (app/gpu/abi.py)."""

    spans: Any  # a SpanRecorder while the invocation is traced

    def define(self, linker: wasmtime.Linker) -> None: ...
    def begin(self, invocation_id: str, kernels: dict[str, str] | None) -> None: ...
    def end(self) -> dict[str, Any]: ...


@dataclass
class RunResult:
    status: RunStatus
    exit_code: int | None = None
    error: str | None = None
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytes = b""
    duration_ms: float = 0.0
    host: dict[str, Any] = field(default_factory=dict)
    spans: list[dict[str, Any]] | None = None


class _Sink:
    """One of a run's output streams, bounded where it is written: a write is read from guest
    memory only as far as it is kept, so a single huge iovec costs the worker no more than the
    limit. stdout keeps its first `limit` bytes and stops the guest at the write that crosses
    it; stderr (`tail_only`) keeps its last `limit` bytes and never stops it."""

    __slots__ = ("buf", "limit", "tail_only", "emit", "sent")

    def __init__(self) -> None:
        self.buf = bytearray()
        self.limit = 0
        self.tail_only = False
        self.emit: Callable[[bytes], None] | None = None
        self.sent = 0

    def reset(self, limit: int, tail_only: bool, emit: Callable[[bytes], None] | None = None) -> None:
        self.buf = bytearray()
        self.limit = limit
        self.tail_only = tail_only
        self.emit = emit
        self.sent = 0

    def write(self, addr: int, length: int) -> None:
        """Take the `length` bytes at `addr` (guest memory), copied once, straight from it."""
        if self.tail_only:
            if length >= self.limit:  # this write alone fills the tail: read only its end
                start = addr + length - self.limit
                self.buf = bytearray(ADDRESS_SPACE[start : start + self.limit])
            else:
                self.buf += ADDRESS_SPACE[addr : addr + length]
                if len(self.buf) > self.limit:
                    del self.buf[: len(self.buf) - self.limit]
            return
        take = min(length, self.limit - self.sent)
        if take > 0:
            if self.emit is not None:  # streamed: each write leaves at once, only its size is kept
                self.emit(bytes(ADDRESS_SPACE[addr : addr + take]))
            else:
                self.buf += ADDRESS_SPACE[addr : addr + take]
            self.sent += take
        if take < length:  # cut at the limit: what is past it was never read
            raise OutputLimitExceeded(f"stdout exceeded the limit of {self.limit} bytes")


@dataclass
class _Ready:
    """A fresh instance built ahead of a call, for the function and memory limit in `key`."""

    key: tuple[str, int]  # (sha256, wasm_memory_bytes)
    store: wasmtime.Store
    instance: wasmtime.Instance
    start: Any  # its raw `_start` handle (linking.export_func)
    region: Region | None  # its exported memory, where it is one of the worker's regions
    context: int  # its store's context, by address


# instantiating checks the epoch (while it writes data segments): a deadline it never reaches
_AHEAD_DEADLINE_TICKS = 1 << 20

PARK_AFTER_S = 1.0  # a worker this long without a guest stops ticking until the next one


class _Ticker(threading.Thread):
    """Advances the engine's epoch every tick (the guests' time limit) and, while a run is
    watched, stops its guest once the run's connection turns readable: the caller that sent it
    gave up (a front half-closes it), so the worker answers at once and stays the tenant's.

    The epoch follows the wall clock, not the number of wake-ups: a guest that calls the host
    all the time (a loop of writes) holds the GIL for most of each tick, so this thread wakes
    late, and counting one tick per wake-up ran such a guest 25% past its time limit (past the
    front's hard deadline at 10 s, which kills the worker). Each wake-up adds every tick that
    has passed since the running guest began.

    An idle worker has no deadline to keep: after PARK_AFTER_S without a guest the ticker parks
    (200 wake-ups a second cost an idle worker ~4 ms of CPU a second, a node of hundreds of
    workers whole cores) and the next run wakes it. A deadline is set from the epoch when its
    guest starts, so the ticks missed while parked change none."""

    def __init__(self, engine: wasmtime.Engine, tick_s: float) -> None:
        super().__init__(name="epoch-ticker", daemon=True)
        self.engine = engine
        self.tick_s = tick_s
        self.lock = threading.Lock()
        self.watched: tuple[int, int] | None = None  # (run number, descriptor) of the running guest
        self.stopped = -1  # the run number the last stop was for
        self.ticks = 0  # the running guest's epoch deadline, in ticks
        self.running = False  # a guest runs (under `lock`)
        self.since = 0.0  # when it began: ticks owed from before are not its to pay
        self.parked = False  # waiting on `resume` (under `lock`)
        self.resume = threading.Event()

    def begin(self, watch: tuple[int, int] | None) -> None:
        """A guest starts: tick (waking a parked ticker), and watch its connection if given."""
        with self.lock:
            self.running, self.watched, self.since = True, watch, time.monotonic()
            if self.parked:
                self.parked = False
                self.resume.set()

    def end(self) -> None:
        with self.lock:
            self.running, self.watched = False, None

    def run(self) -> None:
        idle = 0
        park_after = max(1, round(PARK_AFTER_S / self.tick_s))
        last = time.monotonic()  # the epoch counts the ticks up to here
        while True:
            with self.lock:  # decided under the lock: a run starting now sees `parked` and wakes us
                idle = 0 if self.running else idle + 1
                self.parked = idle > park_after
            if self.parked:
                self.resume.wait()
                self.resume.clear()
                idle = 0
                last = time.monotonic()
                continue
            watched = self.watched
            if watched is None:
                time.sleep(self.tick_s)
            else:
                try:
                    readable, _, _ = select.select([watched[1]], [], [], self.tick_s)
                except (OSError, ValueError):  # closed since: that run is over
                    readable = []
                    time.sleep(self.tick_s)
                if readable:
                    self._stop(watched[0])
            last = max(last, self.since)
            due = int((time.monotonic() - last) / self.tick_s)
            last += due * self.tick_s
            for _ in range(due):
                self.engine.increment_epoch()

    def _stop(self, run: int) -> None:
        with self.lock:  # the run may have ended (and the next begun) since the select
            if self.watched is None or self.watched[0] != run:
                return
            self.watched, self.stopped = None, run
            # past the guest's deadline: it traps at its next epoch check (a call or a loop edge)
            for _ in range(self.ticks + 1):
                self.engine.increment_epoch()


class GuestRunner:
    def __init__(
        self, engine: wasmtime.Engine, artifacts: ArtifactCache, host: HostAbi | None, tick_ms: int,
        memory: GuestMemory | None = None,
    ) -> None:
        """`memory`: the guest memories `engine` was made with (app/runtime/engine.py), if any;
        a host call then finds its guest's memory in the region it lives in, without an FFI call."""
        self.engine = engine
        self.memory = memory
        self._region: Region | None = None  # the running instance's exported memory, once found
        self.artifacts = artifacts
        self.host = host
        self.tick_ms = tick_ms
        self.linker = wasmtime.Linker(engine)
        self.linker.define_wasi()
        self.linker.allow_shadowing = True
        self._keepalive: list[Any] = []
        define_raw(self.linker, WASI, "fd_write", ("i32",) * 4, ("i32",), self._fd_write_raw, self._keepalive, SLOTS_BY_ADDRESS)
        self._files = GuestFiles(engine, self.linker, self._keepalive, BundleStore(artifacts.base))
        if host is not None:
            host.define(self.linker)
        # loaded modules: sha256 -> (InstancePre, has no start function: may be built ahead)
        self._pres: OrderedDict[str, tuple[wasmtime.InstancePre, bool]] = OrderedDict()
        self._stdout = _Sink()
        self._stderr = _Sink()
        self.on_stdout: Callable[[bytes], None] | None = None  # where a streamed call's stdout goes
        self._ticker = _Ticker(engine, tick_ms / 1000)
        self._ticker.start()
        self._runs = 0
        self._wasi = WasiContexts()
        self._ready: _Ready | None = None
        self._spent: wasmtime.Store | None = None  # the last call's store, closed after its reply (`finish`)

    # -- module cache -------------------------------------------------------------------------
    def _instance_pre(self, sha256: str) -> wasmtime.InstancePre:
        loaded = self._pres.get(sha256)
        if loaded is not None:
            self._pres.move_to_end(sha256)
            return loaded[0]
        pre = self.linker.instantiate_pre(self.artifacts.load(self.engine, sha256))
        self._pres[sha256] = (pre, self.artifacts.has_no_start_function(sha256))
        if len(self._pres) > 64:
            self._pres.popitem(last=False)
        return pre

    def forget_modules(self) -> None:
        self._pres.clear()
        self.discard_ready()

    # -- the next call's instance, built ahead ----------------------------------------------------
    def prepare(self, req: Run) -> None:
        """Build a fresh instance for a next call like `req` now, off any caller's path (after
        the reply and the memory scrub), if its module is loaded already and has no start
        function. A failure (the module needs more memory than the limit) leaves it to the call,
        which reports it."""
        self.finish()
        self.discard_ready()
        loaded = self._pres.get(req.sha256)
        if loaded is None or not loaded[1]:
            return
        pre = loaded[0]
        store = wasmtime.Store(self.engine)
        try:
            store.set_limits(memory_size=req.wasm_memory_bytes)
            store.set_epoch_deadline(_AHEAD_DEADLINE_TICKS)
            instance = pre.instantiate(store)
            start = export_func(store, instance, b"_start")
        except (wasmtime.WasmtimeError, wasmtime.Trap):
            store.close()
            return
        region = None  # its memory, read here so the call's writes need not ask wasmtime
        if self.memory is not None and (base := instance_memory(store, instance)) is not None:
            region = self.memory.live_region(base)
        self._ready = _Ready((req.sha256, req.wasm_memory_bytes), store, instance, start, region, context_address(store))

    def finish(self) -> None:
        """After a call's reply: its store closed, which gives its linear memory back to the
        worker's pool for the scrub (a call that finds it still open closes it first)."""
        spent, self._spent = self._spent, None
        if spent is not None:
            spent.close()

    def discard_ready(self) -> None:
        """Drop the instance built ahead, giving its linear memory back to the worker's pool."""
        ready, self._ready = self._ready, None
        if ready is not None:
            ready.store.close()

    # -- WASI stdout/stderr -------------------------------------------------------------------
    def _fd_write_raw(self, _env: Any, caller: int, slots: int, n: int) -> int:
        # caller and value slots as bare addresses (SLOTS_BY_ADDRESS): the four i32 parameters
        # read in one step, the memory found without pointer objects (linking.guest_memory_at)
        try:
            fd, iovs, iovs_len, nwritten = _FD_WRITE_PARAMS.unpack_from(ADDRESS_SPACE, slots)
            if fd > 2 and self._files.active:  # one of the function's files
                return self._files.fd_write(caller_pointer(caller), ctypes.cast(slots, _VALUES), n)
            _I32.pack_into(ADDRESS_SPACE, slots, self._fd_write(caller, fd, iovs, iovs_len, nwritten))
        except BaseException as exc:  # a cap crossed: the guest stops, `_start` raises `exc`
            return trap_with(exc)
        return 0

    def _fd_write(self, caller: int, fd: int, iovs: int, iovs_len: int, nwritten: int) -> int:
        if fd == 1:
            sink = self._stdout
        elif fd == 2:
            sink = self._stderr
        else:
            return _EBADF
        # wasm32 pointers and sizes are unsigned: read as signed i32, a "negative" one would
        # address memory below the guest's
        iovs, iovs_len, nwritten = iovs & 0xFFFFFFFF, iovs_len & 0xFFFFFFFF, nwritten & 0xFFFFFFFF
        if iovs_len > _IOV_MAX:
            return _EINVAL
        region = self._region
        if region is not None:  # its base never moves, its size follows memory.grow
            base, size = region.base, region.size
        else:
            base, size = guest_memory_at(caller)
            if self.memory is not None:
                self._region = self.memory.live_region(base)
        if iovs + 8 * iovs_len > size or nwritten + 4 > size:
            return _EFAULT
        total = 0
        at = base + iovs
        for ptr, length in _IOVEC.iter_unpack(ADDRESS_SPACE[at : at + 8 * iovs_len]):
            if ptr + length > size:
                return _EFAULT
            if length:
                sink.write(base + ptr, length)
                total += length
        _U32.pack_into(ADDRESS_SPACE, base + nwritten, min(total, 0xFFFFFFFF))
        return 0

    def warm_up(self) -> None:
        """Run a trivial guest once, so a tenant's first call does not pay wasmtime's and the
        memory creator's first-use costs (~0.6 ms, measured on the 2-core VM)."""
        pre = self.linker.instantiate_pre(wasmtime.Module(self.engine, _WARM_UP_WAT))
        req = Run("warm-up", "warm-up", "", {}, 1000, 1 << 20, 0, 0)
        result = RunResult(status=RunStatus.OK)
        self._stdout.reset(0, tail_only=False)
        self._stderr.reset(0, tail_only=True)
        self._ticker.begin(None)
        try:
            self._execute(pre, req, b"", result)
        finally:
            self._ticker.end()
            self.finish()
        if result.status != RunStatus.OK:
            raise RuntimeError(f"the worker's warm-up guest failed: {result.error}")

    # -- one invocation -----------------------------------------------------------------------
    def run(self, req: Run, stdin: bytes, watch: int | None = None) -> RunResult:
        """One invocation. `watch`: a descriptor that turns readable when the caller gives up,
        which stops the guest (status `cancelled`; the worker stays clean)."""
        started = time.perf_counter()
        self._runs += 1
        self._ticker.begin((self._runs, watch) if watch is not None else None)
        try:
            return self._run(req, stdin, started)
        finally:
            self._ticker.end()

    def _run(self, req: Run, stdin: bytes, started: float) -> RunResult:
        self._stdout.reset(req.stdout_limit, tail_only=False, emit=self.on_stdout if req.stream else None)
        self._stderr.reset(req.stderr_limit, tail_only=True)
        result = RunResult(status=RunStatus.OK)
        spans = SpanRecorder({"tensorwasm.function": req.function, "tensorwasm.invocation_id": req.invocation_id}) if req.traceparent else None
        if self.host is not None:
            self.host.begin(req.invocation_id, req.kernels)
            self.host.spans = spans
        try:
            try:
                pre = self._instance_pre(req.sha256)
            except ArtifactUnavailable as exc:  # a corrupt or missing artifact fails the call, not the worker
                result.status = RunStatus.ARTIFACT_ERROR
                result.error = f"the function's compiled code could not be loaded: {exc}"
            except wasmtime.WasmtimeError as exc:  # loaded, but it does not link
                result.status = RunStatus.ARTIFACT_ERROR
                result.error = f"the function's compiled code could not be linked: {without_host_paths(_first_line(str(exc)))}"
            else:
                self._execute(pre, req, stdin, result)
        finally:
            if self.host is not None:
                result.host = self.host.end()
        if result.host.get("device_error") and result.status in (RunStatus.OK, RunStatus.EXIT, RunStatus.TRAP):
            result.status = RunStatus.DEVICE_ERROR
            result.error = result.host.get("device_error_message") or "the GPU failed while running this invocation"
        # the buffers leave with the result: nothing of this run's output stays in the sinks
        result.stdout, self._stdout.buf = self._stdout.buf, bytearray()
        result.stderr, self._stderr.buf = bytes(self._stderr.buf), bytearray()
        result.duration_ms = (time.perf_counter() - started) * 1000
        if spans is not None:
            result.spans = spans.finish(result.status)
            if self.host is not None:
                self.host.spans = None
        return result

    def _execute(self, pre: wasmtime.InstancePre, req: Run, stdin: bytes, result: RunResult) -> None:
        self.finish()  # its memory goes back first: this call's instance may take it
        ready, self._ready = self._ready, None
        if ready is not None and ready.key != (req.sha256, req.wasm_memory_bytes):
            ready.store.close()  # first: its memory goes back for this call's instance
            ready = None
        self._ticker.ticks = ticks = max(1, -(-req.timeout_ms // self.tick_ms)) + 1
        if ready is not None:
            store, context = ready.store, ready.context
        else:
            store = wasmtime.Store(self.engine)
            store.set_limits(memory_size=req.wasm_memory_bytes)
            context = context_address(store)
        try:
            root = self._files.open(req)
            # WASI is read from the store at each WASI call; a start function runs under it at
            # instantiation (a module with one never has an instance built ahead)
            self._wasi.set(context, req.function, req.args, req.env, stdin, root)
            set_epoch_deadline(context, ticks)
            if ready is not None:
                instance, start = ready.instance, ready.start
                self._region = ready.region
            else:
                instance = pre.instantiate(store)
                start = export_func(store, instance, b"_start")
            if root is not None:
                self._files.attach(store, instance)
            call_export(store, start)
        except wasmtime.ExitTrap as exc:
            if exc.code != 0:
                result.status, result.exit_code = RunStatus.EXIT, exc.code
                result.error = f"guest exited with code {exc.code}"
            else:
                result.exit_code = 0
        except OutputLimitExceeded as exc:
            result.status, result.error = RunStatus.OUTPUT_LIMIT, str(exc)
        except wasmtime.Trap as exc:
            if exc.trap_code == wasmtime.TrapCode.INTERRUPT and self._ticker.stopped == self._runs:
                result.status, result.error = RunStatus.CANCELLED, "the caller went away; the guest was stopped"
            elif exc.trap_code == wasmtime.TrapCode.INTERRUPT:
                result.status = RunStatus.TIMEOUT
                result.error = f"the invocation exceeded its time limit of {req.timeout_ms} ms"
            else:
                result.status, result.error = RunStatus.TRAP, _trap_message(exc)
        except FilesUnavailable as exc:  # not the compiled module's fault: it is kept
            result.status, result.error = RunStatus.ERROR, str(exc)
        except wasmtime.WasmtimeError as exc:
            text = str(exc)
            if "wasm backtrace:" in text:  # raised while the guest ran, not at instantiation
                result.status, result.error = RunStatus.TRAP, without_host_paths(_error_in_guest(text))
            else:
                result.status, result.error = RunStatus.ERROR, _instantiate_error(text, req)
        finally:
            self._region = None  # released with the store
            self._files.close()  # a scratch copy goes with its call
            # closed after the reply (`finish`), not when collected: its memory is scrubbed then
            self._spent = store
        if result.exit_code is None and result.status == RunStatus.OK:
            result.exit_code = 0


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[0] if lines else "error"


_SHOWN_FRAMES = 4  # of a trap's backtrace, innermost first
# a frame of wasmtime's backtrace text: "  0:     0x32 - <unknown>!boom" (an error raised in a host
# call, a WASI one, carries its backtrace only as text)
_FRAME_LINE = re.compile(r"^\s*\d+:\s+(0x[0-9a-fA-F]+)\s+-\s+(?:[^!\n]*!)?(.*)$", re.M)


def _trap_message(exc: wasmtime.Trap) -> str:
    """'wasm `unreachable` instruction executed in boom (offset 0x32) ← _start (offset 0x36)':
    the cause, then where (see _where)."""
    frames = [(f.func_name or f"function {f.func_index}", f.module_offset) for f in exc.frames or ()]
    return f"trap: {_cause(str(exc))}{_where(frames)}"


def _error_in_guest(text: str) -> str:
    """An error raised while the guest ran (a WASI call that failed on the host side, e.g. an exit
    status out of range): its cause and the frames of its backtrace, read from the text."""
    frames = [
        (re.sub(r"^<wasm function (\d+)>$", r"function \1", name.strip()), int(offset, 16))
        for offset, name in _FRAME_LINE.findall(text.split("Caused by:", 1)[0])
    ]
    return f"trap: {_cause(text)}{_where(frames)}"


def _cause(text: str) -> str:
    """What wasmtime gives as the cause: every line after "Caused by:" (an error's chain), else
    the first line."""
    if "Caused by:" not in text:
        return _first_line(text).removeprefix("wasm trap: ")
    lines = [ln.strip() for ln in text.split("Caused by:", 1)[1].splitlines() if ln.strip()]
    return ": ".join(ln.split(": ", 1)[1] if re.match(r"\d+: ", ln) else ln for ln in lines).removeprefix("wasm trap: ")


def _where(frames: Sequence[tuple[str, int | None]]) -> str:
    """' in f (offset 0x32) ← g (offset 0x36) ← … 7 more': the innermost frames, a run of one
    function (a recursion) as one with its count. A frame wasmtime could not place (its offset is
    None or all ones, as the frame that overflowed the stack) gives only its name; a name is the
    module's to choose, so it is cut."""
    runs: list[tuple[str, int | None, int]] = []
    for name, offset in frames:
        if runs and runs[-1][0] == name:
            runs[-1] = (name, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((name, offset, 1))
    parts = []
    for name, offset, count in runs[:_SHOWN_FRAMES]:
        part = name[:_NAME_CHARS] + "…" if len(name) > _NAME_CHARS else name
        if offset is not None and offset < _NO_OFFSET:
            part += f" (offset {offset:#x})"
        parts.append(part + (f" ×{count}" if count > 1 else ""))
    if len(runs) > _SHOWN_FRAMES:
        parts.append(f"… {sum(c for _, _, c in runs[_SHOWN_FRAMES:])} more")
    return " in " + " ← ".join(parts) if parts else ""


def _instantiate_error(text: str, req: Run) -> str:
    if "memory" in text and ("limit" in text or "minimum" in text or "grow" in text):
        return f"the module needs more linear memory than the tenant's limit ({req.wasm_memory_bytes} bytes)"
    return without_host_paths(_first_line(text))

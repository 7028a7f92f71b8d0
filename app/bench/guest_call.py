"""`tensorwasm bench guest-call`: one guest call inside a worker, piece by piece, against plain
wasmtime-py running the same guest, in one process per backend.

On a GPU host the node's guest run of an echo call is about three times the dev box's (the
`c=1 mean us` line of `bench invoke`); this bench says which piece grows with the CUDA backend:

- bare: wasmtime-py as its documentation shows it (default engine, `Linker.define_wasi`, a
  `WasiConfig` with stdin from a file), instantiate and `_start`: the baseline;
- run: the worker's whole run of the call (`GuestRunner.run`: the host ABI's begin and end,
  the output sinks, the Store, WASI, the instance from a cached InstancePre, `_start`);
- end of call: the backend's part of that end (on CUDA, a stream synchronize);
- after: what the worker does after the reply, off the caller's path: the call's store closed,
  the guest memory made clean and the next call's instance built ahead;
- VMA: the page-protection work of one memory's life alone (mprotect, a touch, madvise, mprotect).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from app.bench.invoke import ECHO_WAT
from app.contract.messages import Run, RunStatus

BODY = b"hello"
FIGURES = ("bare", "run", "end_of_call", "after", "vma")


def _per_call_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(max(1, calls // 10)):  # warm: first uses, caches
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def measure(backend_kind: str, calls: int) -> dict[str, float]:
    """The figures of one backend, in this process (µs per call)."""
    with tempfile.TemporaryDirectory(prefix="tw-guest-call-") as work:
        return _measure(backend_kind, calls, Path(work))


def _measure(backend_kind: str, calls: int, work: Path) -> dict[str, float]:
    import wasmtime

    if backend_kind == "cuda":
        from app.gpu.cuda import CudaBackend

        backend: object = CudaBackend(work, "managed")
    else:
        from app.gpu.cpu import CpuBackend

        backend = CpuBackend()

    # the baseline: plain wasmtime-py, nothing of this project's runtime
    plain = wasmtime.Engine()
    linker = wasmtime.Linker(plain)
    linker.define_wasi()
    module = wasmtime.Module(plain, ECHO_WAT)
    stdin = work / "stdin"
    stdin.write_bytes(BODY)

    def bare() -> None:
        store = wasmtime.Store(plain)
        wasi = wasmtime.WasiConfig()
        wasi.argv = ["echo"]
        wasi.stdin_file = str(stdin)
        store.set_wasi(wasi)
        start = linker.instantiate(store, module).exports(store)["_start"]
        assert isinstance(start, wasmtime.Func)
        start(store)

    guest = EchoGuest(backend, work)

    def call() -> tuple[float, float]:
        t0 = time.perf_counter()
        out = guest.run(BODY)
        t1 = time.perf_counter()
        guest.after()
        if out != BODY:
            raise RuntimeError(f"the echo guest answered {out!r}")
        return t1 - t0, time.perf_counter() - t1

    for _ in range(max(1, calls // 10)):
        call()
    timed = [call() for _ in range(calls)]
    return {
        "bare": _per_call_us(bare, calls),
        "run": sum(r for r, _ in timed) / calls * 1e6,
        "end_of_call": _per_call_us(backend.end_invocation, calls),  # type: ignore[attr-defined]
        "after": sum(s for _, s in timed) / calls * 1e6,
        "vma": _vma_us(calls),
    }


class EchoGuest:
    """The echo guest as a worker runs it: the project's runner, host ABI and guest memory over
    `backend`, the instance built ahead after each reply. Also the far end of the one-hop floor
    that runs the guest (`app.bench.relay_app --guest`)."""

    def __init__(self, backend: object, work: Path) -> None:
        import wasmtime

        from app.gpu.abi import AbiHost
        from app.runtime.artifacts import ArtifactCache
        from app.runtime.engine import make_engine
        from app.runtime.memory import GuestMemory
        from app.runtime.runner import GuestRunner

        self.memory = GuestMemory(64 << 20)  # held as long as the engine: it holds its callbacks
        attach = getattr(backend, "attach_guest_memory", None)
        if attach is not None:
            attach(self.memory)
        host = AbiHost(backend, 1024, 64, self.memory)  # type: ignore[arg-type]
        self.engine = make_engine(self.memory)
        artifacts = ArtifactCache(work)
        sha = "0" * 64
        artifacts.store(sha, wasmtime.Module(self.engine, ECHO_WAT), start_function=False)
        self.runner = GuestRunner(self.engine, artifacts, host, tick_ms=5, memory=self.memory)
        self.runner.warm_up()
        self.memory.scrub()
        self.req = Run("bench", "echo", sha, {"GREETING": "hi"}, 10_000, 64 << 20, 1 << 20, 1 << 20)

    def run(self, body: bytes) -> bytes:
        """One call: the guest's stdout."""
        res = self.runner.run(self.req, body)
        if res.status != RunStatus.OK:
            raise RuntimeError(f"the echo guest failed: {res.status} {res.error}")
        return bytes(res.stdout)

    def after(self) -> None:
        """What a worker does after each reply: the call's store closed, the memory made clean,
        the next instance built."""
        self.runner.finish()
        self.memory.scrub()
        self.runner.prepare(self.req)


def _vma_us(calls: int) -> float:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    reserve, size = 8 << 30, 128 << 10  # a guest memory's reservation; an echo's 2 pages
    base = libc.mmap(None, reserve, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000), -1, 0)
    if base is None or base == ctypes.c_void_p(-1).value:
        raise OSError(ctypes.get_errno(), "mmap failed")

    def life() -> None:
        libc.mprotect(base, size, mmap.PROT_READ | mmap.PROT_WRITE)
        ctypes.memset(base, 1, 4096)
        libc.madvise(base, size, 4)  # MADV_DONTNEED
        libc.mprotect(base, size, 0)

    try:
        return _per_call_us(life, calls)
    finally:
        libc.munmap(base, reserve)


def _cuda_available() -> bool:
    try:
        from app.gpu.cuda import cuda_available

        return cuda_available()
    except Exception:
        return False


def bench_guest_call(args: argparse.Namespace) -> int:
    kinds = [k for k in args.backends.split(",") if k] or ["cpu"]
    if "auto" in kinds:
        kinds = ["cpu", "cuda"] if _cuda_available() else ["cpu"]
    results: dict[str, dict[str, float]] = {}
    for kind in kinds:  # one process each: a CUDA context changes the process it lives in
        out = subprocess.run(
            [sys.executable, "-m", "app.bench.guest_call", kind, str(args.calls)], capture_output=True, text=True, check=False,
        )
        if out.returncode != 0:
            print(f"{kind}: failed\n{out.stderr.strip()}", file=sys.stderr)
            return 1
        results[kind] = json.loads(out.stdout.strip().splitlines()[-1])
    if args.json:
        print(json.dumps(results, indent=2))
    _report(results)
    return 0


def _report(results: dict[str, dict[str, float]]) -> None:
    kinds = list(results)
    print(f"{'one echo call, us (mean of the calls)':44}" + "".join(f"{k:>12}" for k in kinds))
    names = {
        "bare": "bare wasmtime-py: instantiate + _start",
        "run": "worker's run of the call",
        "end_of_call": "  of which the backend's end of call",
        "after": "after the reply: store, scrub, next instance",
        "vma": "VMA work of one memory's life alone",
    }
    for key in FIGURES:
        print(f"{names[key]:44}" + "".join(f"{results[k][key]:>12.1f}" for k in kinds))
    print(f"{'run / bare':44}" + "".join(f"{results[k]['run'] / results[k]['bare']:>11.2f}x" for k in kinds))


if __name__ == "__main__":  # the child of one backend: its figures as one JSON line
    print(json.dumps(measure(sys.argv[1], int(sys.argv[2]))))

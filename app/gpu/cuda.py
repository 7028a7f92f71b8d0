"""CUDA backend through CuPy: one context per worker process, the tenant's buffers in a capped
managed-memory pool, kernels from NVRTC (RawModule), launches on the worker's non-blocking stream.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from app.gpu.backend import BackendError, DeviceInfo, DeviceLimits
from app.gpu.prefault import prefault
from app.gpu.probe import pci_bus_id
from app.gpu.signatures import FORMAT_PTX, Code
from app.kernels.std_numpy import STD

log = logging.getLogger(__name__)

_MAX_RESIDENT = 4096  # prefetched blocks remembered; past it, each is prefetched once more
# Copies between guest memory and a managed buffer at least this long go through a device block
# of the worker's (STAGE_BYTES at a time): host <-> device, then device <-> managed on the GPU
_STAGE_MIN = 256 * 1024
STAGE_BYTES = 4 * 1024 * 1024
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred (managed memory included)
_CTYPES: dict[str, type[ctypes._SimpleCData[Any]]] = {"i32": ctypes.c_int32, "i64": ctypes.c_int64, "f32": ctypes.c_float, "f64": ctypes.c_double}
_NP_CTYPES: dict[np.dtype[Any], type[ctypes._SimpleCData[Any]]] = {
    np.dtype(np.int32): ctypes.c_int32,
    np.dtype(np.int64): ctypes.c_int64,
    np.dtype(np.float32): ctypes.c_float,
    np.dtype(np.float64): ctypes.c_double,
}
Segments = Callable[[int, int], list[tuple[int, int, bool]]]


def _whole(addr: int, length: int) -> list[tuple[int, int, bool]]:
    return [(addr, length, False)]


# Runtime errors of a context creation the driver refuses for want of room: its per-device
# context limit or the memory a context needs (cudaErrorMemoryAllocation), or a device held
# exclusively by another process (cudaErrorDevicesUnavailable).
_REFUSALS = {2: "cudaErrorMemoryAllocation", 46: "cudaErrorDevicesUnavailable"}


class ContextRefused(RuntimeError):
    """The driver refused to create this worker's context (see _REFUSALS)."""


def is_refusal(exc: BaseException) -> bool:
    status = getattr(exc, "status", None)
    return status in _REFUSALS or any(name in str(exc) for name in (*_REFUSALS.values(), "CUDA_ERROR_OUT_OF_MEMORY"))


def cuda_available() -> bool:
    try:
        import cupy

        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:
        return False


class _Module:
    __slots__ = ("raw", "std")

    def __init__(self, raw: Any, std: bool) -> None:
        self.raw = raw
        self.std = std


class CudaBackend:
    def __init__(self, cache_dir: Path, memory_kind: str = "managed") -> None:
        import cupy

        self.cp = cupy
        self.rt = cupy.cuda.runtime
        # The worker sees one device, the one its CUDA_VISIBLE_DEVICES names: it is device 0 here.
        self.device_id = 0
        cupy.cuda.Device(self.device_id).use()
        try:
            self.rt.free(0)  # creates the context now, so a refusal is told apart from later failures
        except Exception as exc:
            if is_refusal(exc):
                raise ContextRefused(_short(exc)) from None
            raise
        props = self.rt.getDeviceProperties(self.device_id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        self.info = DeviceInfo(
            backend="cuda",
            name=name,
            compute_capability=f"{props['major']}{props['minor']}",
            total_memory_bytes=int(props["totalGlobalMem"]),
            limits=DeviceLimits(
                max_threads_per_block=int(props["maxThreadsPerBlock"]),
                max_block=tuple(int(v) for v in props["maxThreadsDim"]),  # type: ignore[arg-type]
                max_grid=tuple(int(v) for v in props["maxGridSize"]),  # type: ignore[arg-type]
                max_shared_bytes=int(props["sharedMemPerBlock"]),
            ),
            pci_bus_id=pci_bus_id(props),
        )
        # managed (default): buffers may exceed what is resident, the driver pages them;
        # device: plain cudaMalloc, faster host<->device copies (see the GPU benchmark).
        self.managed = memory_kind == "managed"
        self.pool = cupy.cuda.MemoryPool(cupy.cuda.malloc_managed if self.managed else None)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.stream.use()
        self._ptx_dir = cache_dir / "ptx"
        self._ptx_dir.mkdir(parents=True, exist_ok=True)
        # (format, source) -> RawModule, this worker's cache: a dict lookup, no hash of the source per call
        self._compiled: dict[tuple[int, bytes], Any] = {}
        self._functions: dict[tuple[int, str], Any] = {}  # (module, name) -> resolved CUfunction
        self._prefetch = True
        self._resident: set[tuple[int, int]] = set()  # managed blocks prefetched once (alloc)
        self._unzeroed: dict[int, int] = {}  # block address -> size: allocated, not yet zeroed
        self._segments: Segments = _whole  # guest-memory pieces, pinned where the worker allows
        self._stage: Any = None  # the device block managed copies go through (made at first use)
        self._stage_refused = False  # the device had no room for it: not asked again this call
        self.compile_hits = 0
        self.compile_misses = 0
        std_src = resources.files("app.kernels").joinpath("std.cu").read_text()
        self.std = self.cp.RawModule(code=std_src, options=("-std=c++17",))
        self.std.compile()
        # resolved once: looking a function up through RawModule re-keys the whole std source
        self._std_fns = {n: self._function(self.std.get_function(n)) for n in STD if n != "gemm_f32"}
        # cuBLAS's handle (~100 ms) is made in warm_idle, not here: a start is on the path of the
        # calls that wait for it, and the driver creates contexts one after another per host
        self._blas_ready = False
        self.deferred_used = False  # a gemm ran: the worker tells its supervisor (app/worker/stats.py)

    # -- memory ---------------------------------------------------------------------------
    def set_cap(self, cap_bytes: int) -> None:
        self.pool.set_limit(size=cap_bytes)

    def alloc(self, size: int) -> Any:
        try:
            mem = self.pool.malloc(size)
        except self.cp.cuda.memory.OutOfMemoryError:
            raise BackendError(
                Code.QUOTA_EXCEEDED, f"buffer_alloc: the device pool could not provide {size} bytes"
            ) from None
        if self._prefetch and self.managed and (mem.ptr, size) not in self._resident:
            # A pooled block comes back for the tenant's next call where its pages were left:
            # on the device (copies and kernels never move them to the host), unless the driver
            # evicted them under oversubscription, when the next kernel faults them back. So a
            # block is prefetched once, not at each alloc (~75 us of a 4 MiB path on an H200).
            try:
                self.rt.memPrefetchAsync(mem.ptr, size, self.device_id, self.stream.ptr)
            except Exception:  # older/newer runtimes differ in signature: prefetch is an optimisation
                self._prefetch = False
            else:
                if len(self._resident) >= _MAX_RESIDENT:
                    self._resident.clear()
                self._resident.add((mem.ptr, size))
        # Zeroed at its first use, unless that use is a write of the whole buffer: the guest
        # sees zeros wherever it did not write, and a buffer filled by one write is not zeroed
        # first (the zeroing was ~40-70 us of a 4 MiB path's alloc on an H200 host).
        self._unzeroed[mem.ptr] = size
        return mem

    def _zeroed(self, mem: Any, what: str) -> None:
        """Zero `mem` now if nothing has been done with it since its alloc (stream ordered)."""
        size = self._unzeroed.pop(mem.ptr, None)
        if size is not None:
            try:
                self.rt.memsetAsync(mem.ptr, 0, size, self.stream.ptr)
            except Exception as exc:
                raise BackendError(Code.DEVICE_ERROR, f"{what}: the device failed: {_short(exc)}") from None

    def free(self, buf: Any) -> None:
        # Dropping the last reference returns the block to the pool. CuPy's pool is stream
        # ordered, so a block still used by queued work on our stream is reused only after it.
        self._unzeroed.pop(buf.ptr, None)
        del buf

    def _memcpy(self, what: str, dst: int, src: int, length: int) -> None:
        try:
            self.rt.memcpyAsync(dst, src, length, _MEMCPY_DEFAULT, self.stream.ptr)
        except Exception as exc:  # a copy fails only once the context is broken
            raise BackendError(Code.DEVICE_ERROR, f"{what}: the device failed: {_short(exc)}") from None

    def attach_guest_memory(self, memory: Any) -> None:
        """Copy to and from guest memory through page-locked chunks (app/runtime/memory.py)."""
        memory.set_pinner(self._pin)
        self._segments = memory.segments

    def _pin(self, addr: int, length: int) -> None:
        self.rt.hostRegister(addr, length, 0)

    def write(self, buf: Any, offset: int, src_addr: int, length: int) -> None:
        size = self._unzeroed.get(buf.ptr)
        if size is not None:
            if offset == 0 and length >= size:
                del self._unzeroed[buf.ptr]  # every byte is written: nothing to zero
            else:
                self._zeroed(buf, "buffer_write")
        dst = buf.ptr + offset
        stage = self._staging(length)
        if stage is not None:
            self._staged_write(stage, dst, src_addr, length)
            return
        segments = self._segments(src_addr, length)
        for addr, n, _ in segments:
            self._memcpy("buffer_write", dst + addr - src_addr, addr, n)
        if any(pinned for _, _, pinned in segments):
            # from page-locked memory the copy is truly asynchronous; the guest may reuse its
            # memory as soon as buffer_write returns, so wait for it (pageable copies are staged)
            self.synchronize()

    def _staging(self, length: int) -> int | None:
        """The address of the worker's device block for a managed copy of `length` bytes, or None
        for a direct copy (a short one, device memory, or a device with no room for the block,
        asked again at a later call). Plain device memory outside the tenant's pool: its bytes are
        part of the context's overhead, as the stream's and the modules' are."""
        if not self.managed or length < _STAGE_MIN or self._stage_refused:
            return None
        if self._stage is None:
            try:
                self._stage = self.cp.cuda.Memory(STAGE_BYTES)
            except Exception as exc:  # out of device memory: managed copies still work, slower
                log.info("no staging block for managed copies in this call (%s): copying directly", _short(exc))
                self._stage_refused = True
                return None
        return int(self._stage.ptr)

    def _staged_write(self, stage: int, dst: int, src_addr: int, length: int) -> None:
        """Guest memory into a managed buffer through the staging block, a piece at a time: the
        copy engine writes device memory from the host about twice as fast as a managed range
        (bench gpu's write step), and device to managed is a copy on the GPU. One stream orders
        each piece's two copies and the next piece's reuse of the block."""
        for at in range(0, length, STAGE_BYTES):
            n = min(STAGE_BYTES, length - at)
            for addr, k, _ in self._segments(src_addr + at, n):
                self._memcpy("buffer_write", stage + addr - src_addr - at, addr, k)
            self._memcpy("buffer_write", dst + at, stage, n)
        self.synchronize()  # the guest may reuse its memory once buffer_write returns

    def read(self, buf: Any, offset: int, dst_addr: int, length: int) -> None:
        self._zeroed(buf, "buffer_read")
        src = buf.ptr + offset
        stage = self._staging(length)
        if stage is not None:
            for at in range(0, length, STAGE_BYTES):
                n = min(STAGE_BYTES, length - at)
                self._memcpy("buffer_read", stage, src + at, n)
                self._read_pieces(stage - dst_addr - at, dst_addr + at, n)
        else:
            self._read_pieces(src - dst_addr, dst_addr, length)
        self.synchronize()

    def _read_pieces(self, shift: int, dst_addr: int, length: int) -> None:
        """Device memory at `dst_addr + shift` into guest memory at `dst_addr`, piece by piece."""
        for addr, n, pinned in self._segments(dst_addr, length):
            if not pinned:
                prefault(addr, n)  # the driver's staging copy would otherwise fault page by page
            self._memcpy("buffer_read", addr, addr + shift, n)

    def copy(self, dst: Any, dst_offset: int, src: Any, src_offset: int, length: int) -> None:
        self._zeroed(dst, "buffer_copy")
        self._zeroed(src, "buffer_copy")
        self._memcpy("buffer_copy", dst.ptr + dst_offset, src.ptr + src_offset, length)

    def view(self, buf: Any, offset: int) -> Any:
        self._zeroed(buf, "launch")  # a std kernel's buffer argument
        return (buf, offset)

    # -- kernels --------------------------------------------------------------------------
    def load_module(self, source: bytes, fmt: int) -> _Module:
        raw = self._compiled.get((fmt, source))  # a guest loads the same source at every call
        if raw is not None:
            self.compile_hits += 1
            return _Module(raw, std=False)
        self.compile_misses += 1
        try:
            if fmt == FORMAT_PTX:
                path = self._ptx_dir / f"{hashlib.sha256(bytes([fmt]) + source).hexdigest()}.ptx"
                path.write_bytes(source)
                raw = self.cp.RawModule(path=str(path))
                raw.get_function  # noqa: B018 - loaded lazily; force below
                raw.module  # noqa: B018
            else:
                raw = self.cp.RawModule(code=source.decode("utf-8"), options=("-std=c++17",))
                raw.compile()
        except UnicodeDecodeError:
            raise BackendError(Code.COMPILE_FAILED, "module_load: CUDA source must be UTF-8 text") from None
        except Exception as exc:  # CompileException, CUDADriverError (bad PTX)
            raise BackendError(Code.COMPILE_FAILED, f"module_load: {_short(exc)}") from None
        self._compiled[(fmt, source)] = raw
        return _Module(raw, std=False)

    def get_function(self, module: _Module, name: str) -> Any:
        key = (id(module.raw), name)  # modules live in self._compiled for the worker's life
        fn = self._functions.get(key)
        if fn is None:
            try:
                fn = self._function(module.raw.get_function(name))
            except Exception:
                raise BackendError(Code.NOT_FOUND, f"function_get: no kernel named {name!r} in this module") from None
            self._functions[key] = fn
        return fn

    @staticmethod
    def _param(arg: Any) -> ctypes._SimpleCData:
        if isinstance(arg, tuple):  # (buffer, offset)
            return ctypes.c_uint64(arg[0].ptr + arg[1])
        return _NP_CTYPES[arg.dtype](arg.item())

    def prepare_std(self, name: str, grid: tuple[int, int, int], block: tuple[int, int, int], args: list[Any]) -> Callable[[], None]:
        if name == "gemm_f32":
            return lambda: self._gemm(args)
        params = STD[name].params
        values = [ctypes.c_uint64(a[0].ptr + a[1]) if p == "buf" else _CTYPES[p](a) for p, a in zip(params, args, strict=True)]
        return self._prepared(self._std_fns[name], grid, block, 0, values)

    def warm_idle(self) -> None:
        """Make cuBLAS's handle, so that a tenant's first gemm does not pay it (the worker calls
        this once it has waited a moment with nothing to do, as a spare or for a tenant that has
        used gemm; a gemm before makes it anyway)."""
        if not self._blas_ready:
            w = self.cp.ones((8, 8), dtype=self.cp.float32)
            self.cp.matmul(w, w)
            self.stream.synchronize()
            self._blas_ready = True

    def _gemm(self, args: list[Any]) -> None:
        self._blas_ready = self.deferred_used = True
        cp = self.cp
        (a, ao), (b, bo), (c, co), m, n, k = args
        if m == 0 or n == 0:
            return
        A = cp.ndarray((m, k), dtype=cp.float32, memptr=a + ao)
        B = cp.ndarray((k, n), dtype=cp.float32, memptr=b + bo)
        C = cp.ndarray((m, n), dtype=cp.float32, memptr=c + co)
        if k == 0:
            C.fill(0)
            return
        cp.matmul(A, B, out=C)

    def prepare(self, fn: Any, grid: tuple[int, int, int], block: tuple[int, int, int], shared: int, args: list[Any]) -> Callable[[], None]:
        for arg in args:
            if isinstance(arg, tuple):  # (buffer, offset): a kernel may read what it was never given
                self._zeroed(arg[0], "launch")
        return self._prepared(self._function(fn), grid, block, shared, [self._param(a) for a in args])

    @staticmethod
    def _function(raw_kernel: Any) -> Any:
        """cupy.cuda.function.Function of a RawKernel, resolved once (compiles if needed)."""
        try:
            return raw_kernel.kernel
        except Exception:
            return raw_kernel

    def _prepared(self, fn: Any, grid: tuple[int, int, int], block: tuple[int, int, int], shared: int, values: list[ctypes._SimpleCData]) -> Callable[[], None]:
        """A launch with its kernel-parameter array packed once: each call is one cuLaunchKernel
        (2.5 us on an H200, against 3.4 us through CuPy's per-call argument packing)."""
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values]) if values else None
        launch, error = self.cp.cuda.driver.launchKernel, self.cp.cuda.driver.CUDADriverError
        f, stream, p = fn.ptr, self.stream.ptr, ctypes.addressof(params) if params is not None else 0
        (gx, gy, gz), (bx, by, bz) = grid, block
        keep = (fn, values, params)  # the parameter storage lives as long as the prepared launch

        def run() -> None:
            try:
                launch(f, gx, gy, gz, bx, by, bz, shared, stream, p, 0)
            except error as exc:
                if _sticky(str(exc)):
                    raise BackendError(Code.DEVICE_ERROR, f"launch: {_short(exc)}") from None
                raise BackendError(Code.LAUNCH_FAILED, f"launch: {_short(exc)}") from None

        run.keep = keep  # type: ignore[attr-defined]
        return run

    def synchronize(self) -> None:
        try:
            self.stream.synchronize()
        except Exception as exc:
            raise BackendError(Code.DEVICE_ERROR, f"synchronize: the device failed: {_short(exc)}") from None

    def end_invocation(self) -> None:
        # Pooled blocks stay cached for the next call of the same tenant (a worker never
        # changes tenant); every new buffer is zeroed before its first use but a whole write,
        # so nothing carries over. This call's buffers are gone with its handles.
        self._unzeroed.clear()
        self._stage_refused = False
        self.synchronize()


def _sticky(message: str) -> bool:
    return any(s in message for s in ("ILLEGAL_ADDRESS", "LAUNCH_FAILED", "ILLEGAL_INSTRUCTION", "MISALIGNED", "HARDWARE_STACK", "INVALID_PC", "ASSERT"))


def _short(exc: BaseException) -> str:
    text = str(exc).strip()
    return text[:900] if text else type(exc).__name__

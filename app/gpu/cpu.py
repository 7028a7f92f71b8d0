"""CPU backend: buffers in host memory, `std` through the NumPy twins, no CUDA compiler."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np

from app.gpu.backend import BackendError, DeviceInfo, DeviceLimits
from app.gpu.prefault import prefault
from app.gpu.signatures import Code
from app.kernels.std_numpy import STD


class CpuBackend:
    deferred_used = False  # nothing is deferred

    def __init__(self) -> None:
        import os

        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        self.info = DeviceInfo("cpu", "cpu", "", pages, DeviceLimits())

    def set_cap(self, cap_bytes: int) -> None:
        pass  # the ABI host's accounting is the cap; host memory has no pool to limit

    def alloc(self, size: int) -> np.ndarray:
        try:
            return np.zeros(size, dtype=np.uint8)
        except MemoryError:
            raise BackendError(Code.QUOTA_EXCEEDED, f"buffer_alloc: the host could not allocate {size} bytes") from None

    def free(self, buf: np.ndarray) -> None:
        pass  # dropped with its last reference

    def write(self, buf: np.ndarray, offset: int, src_addr: int, length: int) -> None:
        ctypes.memmove(buf.ctypes.data + offset, src_addr, length)

    def read(self, buf: np.ndarray, offset: int, dst_addr: int, length: int) -> None:
        prefault(dst_addr, length)  # one madvise instead of a fault per page inside the copy
        ctypes.memmove(dst_addr, buf.ctypes.data + offset, length)

    def copy(self, dst: np.ndarray, dst_offset: int, src: np.ndarray, src_offset: int, length: int) -> None:
        # memmove semantics: overlapping ranges within one buffer copy correctly
        ctypes.memmove(dst.ctypes.data + dst_offset, src.ctypes.data + src_offset, length)

    def view(self, buf: np.ndarray, offset: int) -> np.ndarray:
        return buf[offset:]

    def load_module(self, source: bytes, fmt: int) -> Any:
        raise BackendError(Code.UNAVAILABLE, "module_load: this worker has no GPU; only the std module runs on the CPU backend")

    def get_function(self, module: Any, name: str) -> Any:
        raise BackendError(Code.UNAVAILABLE, "function_get: this worker has no GPU")

    def prepare_std(self, name: str, grid: tuple[int, int, int], block: tuple[int, int, int], args: list[Any]) -> Callable[[], None]:
        run = STD[name].run
        return lambda: run(args)

    def prepare(self, fn: Any, grid: tuple[int, int, int], block: tuple[int, int, int], shared: int, args: list[Any]) -> Callable[[], None]:
        raise BackendError(Code.UNAVAILABLE, "launch: this worker has no GPU")

    def synchronize(self) -> None:
        pass  # CPU work ran to completion at launch

    def end_invocation(self) -> None:
        pass

    def warm_idle(self) -> None:
        pass

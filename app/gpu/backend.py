"""What the ABI host needs from a device: the CPU and CUDA backends implement this."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from app.gpu.signatures import Code


class BackendError(Exception):
    """A failure the ABI reports to the guest as `code` with this message."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class DeviceLimits:
    max_threads_per_block: int = 1024
    max_block: tuple[int, int, int] = (1024, 1024, 64)
    max_grid: tuple[int, int, int] = (2**31 - 1, 65535, 65535)
    max_shared_bytes: int = 48 * 1024


@dataclass(frozen=True)
class DeviceInfo:
    backend: str  # "cuda" | "cpu"
    name: str
    compute_capability: str
    total_memory_bytes: int
    limits: DeviceLimits
    pci_bus_id: str = ""  # the physical device, whatever CUDA_VISIBLE_DEVICES numbered it


class Backend(Protocol):
    info: DeviceInfo
    deferred_used: bool  # a call has used what `warm_idle` makes (made then if it was not)

    def set_cap(self, cap_bytes: int) -> None: ...
    def alloc(self, size: int) -> Any: ...
    def free(self, buf: Any) -> None: ...
    def write(self, buf: Any, offset: int, src_addr: int, length: int) -> None: ...
    def read(self, buf: Any, offset: int, dst_addr: int, length: int) -> None: ...
    def copy(self, dst: Any, dst_offset: int, src: Any, src_offset: int, length: int) -> None: ...
    def load_module(self, source: bytes, fmt: int) -> Any: ...
    def get_function(self, module: Any, name: str) -> Any: ...
    # A prepared launch is a thunk: validated once, then replayed for identical launches.
    def prepare_std(self, name: str, grid: tuple[int, int, int], block: tuple[int, int, int], args: list[Any]) -> Callable[[], None]: ...
    def prepare(self, fn: Any, grid: tuple[int, int, int], block: tuple[int, int, int], shared: int, args: list[Any]) -> Callable[[], None]: ...
    def synchronize(self) -> None: ...
    def view(self, buf: Any, offset: int) -> Any: ...
    def end_invocation(self) -> None: ...
    def warm_idle(self) -> None: ...  # deferred set-up, done once the worker has nothing to do and wants it

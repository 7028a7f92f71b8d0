"""What one invocation's `tensorwasm` calls create: the handle table and the objects behind it
(buffers, modules, kernel functions), and the failure every ABI function maps to a code."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app.gpu.signatures import Code


class AbiFailure(Exception):
    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(eq=False)  # identity semantics: handles and caches compare the objects themselves
class Buffer:
    mem: Any
    size: int


@dataclass(eq=False)
class ModuleRef:
    std: bool
    name: str
    obj: Any = None


@dataclass(eq=False)
class FunctionRef:
    module: ModuleRef
    name: str
    obj: Any = None


class Instance:
    """Handles and errors of one invocation; handle numbers start at a random base so a handle
    remembered from another instance is almost surely unknown here."""

    def __init__(self, kernels: dict[str, str]) -> None:
        self.next_handle = (random.getrandbits(24) + 1) << 4  # as randint(1, 1 << 24), a third of its cost
        self._first_handle = self.next_handle
        self.handles: dict[int, Any] = {}
        self.buffers = 0
        self.modules = 0
        self.last_error = b""
        self.kernels = kernels
        self.launches = 0
        self.device_error: str | None = None
        self.region: Any = None  # that memory's GuestMemory region, when the worker provides it
        # prepared launches: (function handle, dims, raw args) -> (its function, buffers to
        # revalidate, thunk)
        self.launch_cache: dict[tuple[Any, ...], tuple[FunctionRef, tuple[tuple[int, Any], ...], Callable[[], None]]] = {}

    def made_handles(self) -> bool:
        """Whether this invocation made any handle: device work (a copy, a launch) needs a buffer
        or a function handle, so one that made none left nothing on the device to wait for."""
        return self.next_handle != self._first_handle

    def add(self, obj: Any) -> int:
        h = self.next_handle
        self.next_handle += 1
        self.handles[h] = obj
        return h


def get_handle(inst: Instance, fn: str, handle: int, kind: type, what: str) -> Any:
    """The live object of `kind` behind `handle`; anything else is INVALID_HANDLE."""
    obj = inst.handles.get(handle)
    if not isinstance(obj, kind):
        raise AbiFailure(Code.INVALID_HANDLE, f"{fn}: {handle} is not a live {what} handle of this instance")
    return obj

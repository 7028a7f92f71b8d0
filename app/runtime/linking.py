"""Host functions in a wasmtime linker as raw ("unchecked") functions.

wasmtime-py's generic trampoline builds a `Caller` and a `Val` for every parameter and result on
each call; a raw callback reads and writes the `wasmtime_val_raw` slots itself (the tensorwasm
ABI's functions: ~10x the cost of the work behind `launch`; WASI's `fd_write`: 15 of an echo
call's ~25 us in the guest). Types are still checked once, at link time.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable
from typing import Any

import wasmtime
from wasmtime import _bindings, _func
from wasmtime import _ffi as ffi  # wasmtime is pinned to one major version
from wasmtime._func import maybe_raise_last_exn

VALTYPES = {"i32": wasmtime.ValType.i32, "i64": wasmtime.ValType.i64}

# (env, caller pointer, value slots, slot count) -> 0, or the address of a trap to raise
RawCallback = Callable[[Any, Any, Any, int], int]

_MEMORY = ffi.WASMTIME_EXTERN_MEMORY.value
_FUNC = ffi.WASMTIME_EXTERN_FUNC.value
_NO_FINALIZER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _env: None)
# The same C signature with the caller and the value slots as bare addresses: ctypes then builds
# no pointer object per call, and the callback reads every slot in one `struct` step
# (app/gpu/linking.py); `caller_pointer` makes the caller's pointer where one is needed.
SLOTS_BY_ADDRESS = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_CALLER = ctypes.POINTER(ffi.wasmtime_caller_t)


# `wasmtime_memory_data` returning a bare address: through wasmtime-py's binding (a pointer
# object, then `ctypes.cast`) each call left a reference cycle for the collector
_memory_data = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(("wasmtime_memory_data", ffi.dll))
# The C functions a host call needs to find its caller's memory, bound with bare addresses (no
# pointer objects, no wasmtime-py wrapper frame): `guest_memory_at`
_caller_export_get = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p)(
    ("wasmtime_caller_export_get", ffi.dll)
)
_caller_context = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(("wasmtime_caller_context", ffi.dll))
_memory_data_size = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p)(("wasmtime_memory_data_size", ffi.dll))

_func_call = _bindings._wasmtime_func_call  # wasmtime_func_call without its wrapper's frame

# This process's memory as one buffer, so that a host call reads its value slots and a guest's
# bytes at an address with `struct`'s unpack_from / pack_into or a slice, each one C step: on the
# dev VM unpacking ten slots took 79 ns this way against 642 through ctypes.string_at, writing a result
# 71 against 197 for a c_int32 made at the address, and copying out 26 bytes 280 against 541. It
# is read and written only where string_at and memmove were before: at the value slots wasmtime
# hands a host call, and in guest ranges already checked against the guest memory's size.
ADDRESS_SPACE = memoryview((ctypes.c_char * sys.maxsize).from_address(0)).cast("B")


def caller_pointer(address: int) -> Any:
    return ctypes.cast(address, _CALLER)


def define_raw(
    linker: wasmtime.Linker, module: str, name: str, params: tuple[str, ...], results: tuple[str, ...],
    callback: RawCallback, keepalive: list[Any], native_type: Any = ffi.wasmtime_func_unchecked_callback_t,
) -> None:
    """Define `module.name` as `callback` (called through `native_type`: wasmtime's own callback
    type, or `SLOTS_BY_ADDRESS`). What the native side holds on to goes into `keepalive`, which
    must live as long as the linker and anything instantiated from it."""
    made = native_type(callback)
    native = made if native_type is ffi.wasmtime_func_unchecked_callback_t else ctypes.cast(made, ffi.wasmtime_func_unchecked_callback_t)
    keepalive.append(made)
    ty = wasmtime.FuncType([VALTYPES[p]() for p in params], [VALTYPES[r]() for r in results])
    keepalive += [native, ty]
    module_b, name_b = module.encode(), name.encode()
    err = ffi.wasmtime_linker_define_func_unchecked(
        linker.ptr(), ctypes.create_string_buffer(module_b), len(module_b),
        ctypes.create_string_buffer(name_b), len(name_b), ty.ptr(), native, None, _NO_FINALIZER,
    )
    if err:
        raise wasmtime.WasmtimeError._from_ptr(err)


def trap_with(exc: BaseException) -> int:
    """What a raw callback returns to stop the guest with `exc`: as for wasmtime-py's own host
    functions, the call into the guest then raises `exc` itself in Python."""
    _func.LAST_EXCEPTION = exc  # type: ignore[assignment]  # (an Exception there; BaseException works the same)
    trap = wasmtime.Trap("python exception")._consume()
    return ctypes.cast(trap, ctypes.c_void_p).value or 0


def guest_memory(caller: Any) -> tuple[int, int]:
    """Inside a raw callback given its caller as a pointer (wasmtime's own callback type): the
    calling guest's exported `memory`, as `guest_memory_at`."""
    return guest_memory_at(ctypes.addressof(caller.contents))


class _Export(threading.local):
    """An export's slot, reused: filled and read within one host call of this thread."""

    def __init__(self) -> None:
        self.item = ffi.wasmtime_extern_t()
        self.at = ctypes.addressof(self.item)
        self.memory_at = self.at + ffi.wasmtime_extern_t.of.offset


_export = _Export()


# `Store.set_epoch_deadline(ticks)` for a context given by its address (`context_address`),
# called as it is: no Python frame of its own on the call path
set_epoch_deadline: Callable[[int, int], None] = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64)(
    ("wasmtime_context_set_epoch_deadline", ffi.dll)
)


def context_address(store: wasmtime.Store) -> int:
    """The store's context as a bare address, fixed for the store's life."""
    return ctypes.addressof(store._context().contents)


def guest_memory_at(caller: int) -> tuple[int, int]:
    """Inside a raw callback, its caller given by address (SLOTS_BY_ADDRESS): the calling
    guest's exported `memory` (every deployed module has one), where it starts now and its size
    in bytes. ~1 us where wasmtime-py's typed bindings take ~5."""
    slot = _export
    if not _caller_export_get(caller, b"memory", 6, slot.at) or slot.item.kind != _MEMORY:
        raise wasmtime.WasmtimeError("the module exports no memory `memory`")
    ctx = _caller_context(caller)
    return _memory_data(ctx, slot.memory_at) or 0, _memory_data_size(ctx, slot.memory_at)


def instance_memory(store: wasmtime.Store, instance: wasmtime.Instance) -> int | None:
    """Where the instance's exported `memory` starts now; None when it exports none."""
    slot = _export
    found = ffi.wasmtime_instance_export_get(store._context(), ctypes.byref(instance._instance), b"memory", 6, ctypes.byref(slot.item))
    if not found or slot.item.kind != _MEMORY:
        return None
    return _memory_data(context_address(store), slot.memory_at) or 0


def export_func(store: wasmtime.Store, instance: wasmtime.Instance, name: bytes) -> Any:
    """The instance's exported function `name`, as the raw handle `call_export` takes: neither
    `Instance.exports()` (a wrapper for every export) nor a `Func` around it."""
    item = ffi.wasmtime_extern_t()
    found = ffi.wasmtime_instance_export_get(store._context(), ctypes.byref(instance._instance), name, len(name), ctypes.byref(item))
    if not found or item.kind != _FUNC:
        raise wasmtime.WasmtimeError(f"the module exports no function {name.decode()}")
    return item.of.func  # shares `item`'s buffer and keeps it alive


def call_export(store: wasmtime.Store, func: Any) -> None:
    """Call a `() -> ()` export (from `export_func`): what `Func.__call__` does, without
    rebuilding its type (params, results, a `Val` each) on every call, and what its
    `enter_wasm` does, inline (a generator-based context manager: ~1.5 us a call). Traps and
    exits raise as there: a host function's exception first, else the trap or error."""
    trap = ctypes.POINTER(ffi.wasm_trap_t)()
    try:
        err = _func_call(store._context(), ctypes.byref(func), None, 0, None, 0, ctypes.byref(trap))
        if err:
            raise wasmtime.WasmtimeError._from_ptr(err)
        if trap:
            trap_obj = wasmtime.Trap._from_ptr(trap)
            maybe_raise_last_exn()
            raise trap_obj
    except wasmtime.WasmtimeError:
        maybe_raise_last_exn()
        raise

"""Host functions into a wasmtime linker as raw ("unchecked") functions.

wasmtime-py's generic trampoline builds a `Val` for every parameter and the result on each call
(~10x the cost of the work behind `launch`); the raw callback reads the `wasmtime_val_raw` slots
directly. Types are still checked once, at link time.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeAlias

import wasmtime

from app.gpu.signatures import Code

if TYPE_CHECKING:
    from wasmtime._ffi import wasmtime_caller_t

# What wasmtime hands a host function: valid only during that call (wrap it in wasmtime.Caller).
CallerPtr: TypeAlias = "ctypes._Pointer[wasmtime_caller_t]"

log = logging.getLogger(__name__)

VALTYPES = {"i32": wasmtime.ValType.i32, "i64": wasmtime.ValType.i64}


def define_unchecked(
    linker: wasmtime.Linker,
    module_name: str,
    signatures: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]],
    impls: Mapping[str, Callable[..., int]],
    keepalive: list[Any],
) -> None:
    """Define `module_name.name` as `impls[name](caller_ptr, *params)` for every signature.

    What the native side holds on to (callbacks, types, the finalizer) goes into `keepalive`, which
    must live as long as the linker and anything instantiated from it.
    """
    from wasmtime import _ffi as ffi  # wasmtime is pinned to one major version

    finalizer = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _env: None)
    keepalive.append(finalizer)
    module = module_name.encode()
    for name, (params, results) in signatures.items():
        callback = ffi.wasmtime_func_unchecked_callback_t(raw_callback(impls[name], params, results[0]))
        keepalive.append(callback)
        ty = wasmtime.FuncType([VALTYPES[p]() for p in params], [VALTYPES[r]() for r in results])
        keepalive.append(ty)
        err = ffi.wasmtime_linker_define_func_unchecked(
            linker.ptr(), ctypes.create_string_buffer(module), len(module),
            ctypes.create_string_buffer(name.encode()), len(name), ty.ptr(), callback, None, finalizer,
        )
        if err:
            raise wasmtime.WasmtimeError._from_ptr(err)


def raw_callback(impl: Callable[..., int], params: tuple[str, ...], result: str) -> Callable[..., int]:
    # Specialised per signature (`impl(caller, v[0].i32, v[1].i64, ...)`): a generic loop over
    # the slots costs about a microsecond per call on `launch`'s ten parameters.
    read = ", ".join(f"v[{i}].{p}" for i, p in enumerate(params))
    call = eval(f"lambda impl, caller, v: impl(caller{', ' if read else ''}{read})")  # noqa: S307 - fixed text

    def callback(_env: Any, caller_ptr: Any, v: Any, _nvals: int) -> int:
        # the raw caller pointer travels down; a wasmtime.Caller is built only where needed
        try:
            setattr(v[0], result, call(impl, caller_ptr, v))
        except BaseException:  # impl never raises; a failure here must not unwind into wasm
            log.exception("tensorwasm host call failed")
            setattr(v[0], result, int(Code.INTERNAL))
        return 0  # no trap

    return callback

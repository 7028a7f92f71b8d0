"""The tensorwasm ABI's host functions as raw functions (app/runtime/linking.py): each is
called with the raw caller pointer and its parameters read straight from the value slots, and
answers a status code; it never traps."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeAlias

import wasmtime

from app.gpu.signatures import Code
from app.runtime.linking import define_raw

if TYPE_CHECKING:
    from wasmtime._ffi import wasmtime_caller_t

# What wasmtime hands a host function: valid only during that call (wrap it in wasmtime.Caller).
CallerPtr: TypeAlias = "ctypes._Pointer[wasmtime_caller_t]"

log = logging.getLogger(__name__)


def define_unchecked(
    linker: wasmtime.Linker,
    module_name: str,
    signatures: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]],
    impls: Mapping[str, Callable[..., int]],
    keepalive: list[Any],
) -> None:
    """Define `module_name.name` as `impls[name](caller_ptr, *params)` for every signature.

    What the native side holds on to goes into `keepalive`, which must live as long as the linker
    and anything instantiated from it.
    """
    for name, (params, results) in signatures.items():
        define_raw(linker, module_name, name, params, results, raw_callback(impls[name], params, results[0]), keepalive)


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

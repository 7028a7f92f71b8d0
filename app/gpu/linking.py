"""The tensorwasm ABI's host functions as raw functions (app/runtime/linking.py): each is
called with the raw caller pointer and its parameters read straight from the value slots, and
answers a status code; it never traps."""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import wasmtime

from app.gpu.signatures import Code
from app.runtime.linking import ADDRESS_SPACE, SLOTS_BY_ADDRESS, define_raw

# What wasmtime hands a host function: the address of its caller, valid only during that call
# (app/runtime/linking.py `caller_pointer`, then wasmtime.Caller, where one is needed).
CallerPtr: TypeAlias = int

log = logging.getLogger(__name__)


# (env, caller address, value slots' address, slot count) -> 0: a host function of this module,
# which reads its parameters from the slots and writes its result over the first (never a trap)
RawHost = Callable[[Any, int, int, int], int]


def define_unchecked(
    linker: wasmtime.Linker,
    module_name: str,
    signatures: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]],
    callbacks: Mapping[str, RawHost],
    keepalive: list[Any],
) -> None:
    """Define `module_name.name` as `callbacks[name]` (`raw_callback`, or one built from
    `Slots` as the ABI's are) for every signature.

    What the native side holds on to goes into `keepalive`, which must live as long as the linker
    and anything instantiated from it.
    """
    for name, (params, results) in signatures.items():
        define_raw(linker, module_name, name, params, results, callbacks[name], keepalive, SLOTS_BY_ADDRESS)


# each value slot is 16 bytes (wasmtime_val_raw_t); a parameter is the start of its slot
_SLOT = {"i32": "i12x", "i64": "q8x"}
_RESULT = {"i32": "<i", "i64": "<q"}


class Slots:
    """A signature's value slots, read and written in the process's memory (ADDRESS_SPACE): its
    parameters are `unpack(ADDRESS_SPACE, slots)`, one `struct` step (attribute reads slot by slot
    cost ~1 us on `launch`'s ten), and its result is `result(ADDRESS_SPACE, slots, value)`, over
    the first slot."""

    def __init__(self, params: tuple[str, ...], result: str) -> None:
        self.unpack = struct.Struct("<" + "".join(_SLOT[p] for p in params)).unpack_from
        self.result = struct.Struct(_RESULT[result]).pack_into


def raw_callback(impl: Callable[..., int], params: tuple[str, ...], result: str) -> RawHost:
    """`impl(caller, *params)` as a callback through SLOTS_BY_ADDRESS."""
    slots_of = Slots(params, result)
    unpack, out, memory = slots_of.unpack, slots_of.result, ADDRESS_SPACE

    def callback(_env: Any, caller_ptr: Any, slots: int, _nvals: int) -> int:
        # the raw caller pointer travels down; a wasmtime.Caller is built only where needed
        try:
            rc = impl(caller_ptr, *unpack(memory, slots))
        except BaseException:  # impl never raises; a failure here must not unwind into wasm
            log.exception("tensorwasm host call failed")
            rc = int(Code.INTERNAL)
        out(memory, slots, rc)
        return 0  # no trap

    return callback

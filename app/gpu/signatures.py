"""The `tensorwasm` import module of the guest ABI, version 1 (docs/guest-abi.md): names, wasm
signatures, codes, tags.

Frozen: extend only by adding entries.
"""

from __future__ import annotations

from enum import IntEnum

IMPORT_MODULE = "tensorwasm"

# name -> (params, results), in wasm value types.
SIGNATURES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "device_count": ((), ("i32",)),
    "device_info": (("i32", "i32"), ("i32",)),
    "last_error": (("i32", "i32"), ("i32",)),
    "buffer_alloc": (("i64",), ("i32",)),
    "buffer_free": (("i32",), ("i32",)),
    "buffer_size": (("i32",), ("i64",)),
    "buffer_write": (("i32", "i64", "i32", "i32"), ("i32",)),
    "buffer_read": (("i32", "i64", "i32", "i32"), ("i32",)),
    "buffer_copy": (("i32", "i64", "i32", "i64", "i64"), ("i32",)),
    "module_load": (("i32", "i32", "i32"), ("i32",)),
    "module_get": (("i32", "i32"), ("i32",)),
    "function_get": (("i32", "i32", "i32"), ("i32",)),
    "launch": (("i32",) * 10, ("i32",)),
    "synchronize": ((), ("i32",)),
}


class Code(IntEnum):
    OK = 0
    UNAVAILABLE = -1
    INVALID_POINTER = -2
    INVALID_HANDLE = -3
    COMPILE_FAILED = -4
    LAUNCH_FAILED = -5
    QUOTA_EXCEEDED = -6
    INVALID_ARGUMENT = -7
    NOT_FOUND = -8
    DEVICE_ERROR = -9
    INTERNAL = -10


class Tag(IntEnum):
    I32 = 0x01
    I64 = 0x02
    F32 = 0x03
    F64 = 0x04
    BUFFER = 0x10


MAX_ARG_RECORDS = 128
MAX_ARG_BYTES = 4096
LAST_ERROR_MAX_BYTES = 1024
FORMAT_CUDA = 0
FORMAT_PTX = 1

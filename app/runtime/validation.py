"""Deploy-time checks: a module must be a WASI command importing only what the guest ABI allows
(docs/guest-abi.md, section 1)."""

from __future__ import annotations

from dataclasses import dataclass

import wasmtime

from app.gpu.signatures import IMPORT_MODULE, SIGNATURES

WASI_MODULE = "wasi_snapshot_preview1"

# The functions of WASI preview 1 (wasi_snapshot_preview1), the only other import module.
WASI_FUNCTIONS = frozenset(
    """args_get args_sizes_get environ_get environ_sizes_get clock_res_get clock_time_get
    fd_advise fd_allocate fd_close fd_datasync fd_fdstat_get fd_fdstat_set_flags
    fd_fdstat_set_rights fd_filestat_get fd_filestat_set_size fd_filestat_set_times fd_pread
    fd_prestat_get fd_prestat_dir_name fd_pwrite fd_read fd_readdir fd_renumber fd_seek fd_sync
    fd_tell fd_write path_create_directory path_filestat_get path_filestat_set_times path_link
    path_open path_readlink path_remove_directory path_rename path_symlink path_unlink_file
    poll_oneoff proc_exit proc_raise sched_yield random_get sock_accept sock_recv sock_send
    sock_shutdown""".split()
)


class InvalidModule(ValueError):
    """The module cannot be deployed; the message says why, for the tenant."""


@dataclass(frozen=True)
class ModuleInfo:
    imports: list[str]
    uses_gpu: bool
    start_function: bool = False  # instantiating it runs guest code (the module's start section)


_START_SECTION = 8


def has_start_function(wasm: bytes) -> bool:
    """Whether a module (valid: compiled already) has a start section, which instantiation runs.

    wasmtime-py does not expose it, so this walks the section headers: an id byte, then the
    section's size as unsigned LEB128.
    """
    pos = 8  # magic and version
    while pos < len(wasm):
        section = wasm[pos]
        pos += 1
        size = shift = 0
        while True:
            byte = wasm[pos]
            pos += 1
            size |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                break
        if section == _START_SECTION:
            return True
        pos += size
    return False


def _valtype_names(types: list[wasmtime.ValType]) -> tuple[str, ...]:
    return tuple(str(t) for t in types)


WASM_MAGIC = b"\0asm"
HOW_TO_BUILD = (
    "build one, e.g. from C with `python3 -m ziglang cc -target wasm32-wasi -O2 -s guest.c -o guest.wasm` "
    "(pip install ziglang), or from WAT text with `wat2wasm guest.wat` (WAT text may also be uploaded as it is)"
)


def _looks_like_wat(data: bytes) -> bool:
    """Text whose first token, past blanks and `;;` line comments, opens a parenthesis (a
    module, or a `(;` block comment): wasmtime's WAT parser is then the one to judge it."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    for line in text.splitlines():
        stripped = line.strip().lstrip("\ufeff")
        if not stripped or stripped.startswith(";;"):
            continue
        return stripped.startswith("(")
    return False


def check_module_shape(data: bytes) -> None:
    """Refuse what is neither a WebAssembly binary (its `\\0asm` magic) nor plausibly WAT text,
    saying how to build a module, before a parser reports its first unexpected character."""
    if data.startswith(WASM_MAGIC) or _looks_like_wat(data):
        return
    what = "an empty body" if not data else f"{len(data)} bytes starting {data[:8]!r}"
    raise InvalidModule(
        f"this is not a WebAssembly module ({what}; a module is a binary starting with \\0asm, or WAT text): {HOW_TO_BUILD}"
    )


def compile_module(engine: wasmtime.Engine, wasm: bytes) -> wasmtime.Module:
    check_module_shape(wasm)
    try:
        return wasmtime.Module(engine, wasm)
    except wasmtime.WasmtimeError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "invalid module"
        raise InvalidModule(f"not a valid WebAssembly module: {first}") from None


def check_module(module: wasmtime.Module) -> ModuleInfo:
    imports: list[str] = []
    uses_gpu = False
    for imp in module.imports:
        where = f"{imp.module}.{imp.name}"
        imports.append(where)
        ty = imp.type
        if imp.module == WASI_MODULE:
            if imp.name not in WASI_FUNCTIONS or not isinstance(ty, wasmtime.FuncType):
                raise InvalidModule(f"import {where} is not a WASI preview 1 function")
        elif imp.module == IMPORT_MODULE:
            expected = SIGNATURES.get(imp.name or "")
            if expected is None:
                raise InvalidModule(f"import {where} is not part of the tensorwasm ABI")
            if not isinstance(ty, wasmtime.FuncType):
                raise InvalidModule(f"import {where} must be a function")
            got = (_valtype_names(ty.params), _valtype_names(ty.results))
            if got != expected:
                raise InvalidModule(
                    f"import {where} has signature {_fmt(got)}, the ABI defines {_fmt(expected)}"
                )
            uses_gpu = True
        else:
            raise InvalidModule(
                f"import {where} is not allowed: only {WASI_MODULE} and {IMPORT_MODULE} may be imported"
            )

    exports = {e.name: e.type for e in module.exports}
    start = exports.get("_start")
    if not isinstance(start, wasmtime.FuncType) or start.params or start.results:
        raise InvalidModule("not a WASI command: it must export a function `_start` of type () -> ()")
    if not isinstance(exports.get("memory"), wasmtime.MemoryType):
        raise InvalidModule("not a WASI command: it must export its linear memory as `memory`")
    return ModuleInfo(imports=imports, uses_gpu=uses_gpu)


def _fmt(sig: tuple[tuple[str, ...], tuple[str, ...]]) -> str:
    return f"({', '.join(sig[0])}) -> ({', '.join(sig[1])})"

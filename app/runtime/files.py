"""A call's files in the guest: its function's bundle preopened as `/`, read-only, or a scratch
copy (app/runtime/bundles.py) whose growth stops at the tenant's scratch_bytes with ENOSPC.

The runner's linker defines WASI's `fd_write` itself (the caps on stdout and stderr), so a
guest's writes to its files and the WASI calls that make a scratch copy grow must reach
wasmtime's own implementation some other way: each call with files gets a small helper instance
in its store that imports the guest's memory and wasmtime's original functions, and re-exports
both. The runner's functions check the scratch copy's room, then call the helper's export, which
calls wasmtime's with the guest's memory, as the guest's own call would have. A function without
files never reaches the helper: it has no descriptor past stderr, so these calls answer EBADF as
wasmtime's would.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable
from typing import Any

import wasmtime
from wasmtime import _ffi as ffi  # wasmtime is pinned to one major version

from app.contract.messages import Run
from app.runtime.bundles import ENTRY_BYTES, BundleStore, ScratchDir, scratch_root, usage
from app.runtime.linking import ADDRESS_SPACE, define_raw, export_func, guest_memory, trap_with

WASI = "wasi_snapshot_preview1"
_EBADF, _ENOSPC = 8, 51
_CREAT = 1  # path_open's oflags
_IOVEC = struct.Struct("<II")

# WASI's calls that may make a scratch copy grow, by their parameter types (results: one i32)
_GROWING: dict[str, tuple[str, ...]] = {
    "fd_pwrite": ("i32", "i32", "i32", "i64", "i32"),
    "fd_allocate": ("i32", "i64", "i64"),
    "fd_filestat_set_size": ("i32", "i64"),
    "path_open": ("i32", "i32", "i32", "i32", "i32", "i64", "i64", "i32", "i32"),
    "path_create_directory": ("i32", "i32", "i32"),
    "path_symlink": ("i32", "i32", "i32", "i32", "i32"),
    "path_link": ("i32", "i32", "i32", "i32", "i32", "i32", "i32"),
}
_DELEGATED = {"fd_write": ("i32", "i32", "i32", "i32"), **_GROWING}


def _helper_wat() -> str:
    imports, exports = [], []
    for i, (name, params) in enumerate(_DELEGATED.items()):
        sig = f"(param {' '.join(params)}) (result i32)"
        imports.append(f'(import "{WASI}" "{name}" (func $f{i} {sig}))')
        gets = " ".join(f"(local.get {k})" for k in range(len(params)))
        exports.append(f'(func (export "{name}") {sig} (call $f{i} {gets}))')
    return f'(module (import "env" "memory" (memory 0)) {" ".join(imports)} (export "memory" (memory 0)) {" ".join(exports)})'


class FilesUnavailable(Exception):
    """The function's files cannot be given to this call (not unpacked here, or no room for a
    scratch copy); the message names no host path."""


class GuestFiles:
    """The files of the call running now (one at a time: a worker runs one call)."""

    def __init__(self, engine: wasmtime.Engine, linker: wasmtime.Linker, keepalive: list[Any], bundles: BundleStore) -> None:
        self.bundles = bundles
        self._wasi = wasmtime.Linker(engine)  # wasmtime's own WASI, which the helper calls
        self._wasi.define_wasi()
        self._helper = wasmtime.Module(engine, _helper_wat())
        self._funcs: dict[str, Any] | None = None  # the helper's exports, while a call with files runs
        self._scratch: ScratchDir | None = None
        self._cap = 0
        self._used = 0
        for name, params in _GROWING.items():
            define_raw(linker, WASI, name, params, ("i32",), self._raw(name), keepalive)

    @property
    def active(self) -> bool:
        return self._funcs is not None

    def open(self, req: Run) -> tuple[str, bool] | None:
        """Before the call's WASI context: the directory to preopen as `/` and whether it is
        writable (a fresh scratch copy), or None for a function without files."""
        if not req.files:
            return None
        bundle = self.bundles.path_for(req.files)
        if not bundle.is_dir():
            raise FilesUnavailable("the function's files are not unpacked on this node")
        if req.scratch_bytes <= 0:
            return str(bundle), False
        try:
            self._scratch = ScratchDir(bundle, scratch_root())
        except OSError as exc:  # the scratch directory is full: this call fails, not the worker
            raise FilesUnavailable(f"no room for the call's scratch copy of its files ({exc.strerror})") from None
        self._cap = req.scratch_bytes
        self._used = usage(self._scratch.path)
        return str(self._scratch.path), True

    def attach(self, store: wasmtime.Store, instance: wasmtime.Instance) -> None:
        """After instantiation, before `_start`: the helper instance over the guest's memory."""
        memory = instance.exports(store)["memory"]
        imports: list[Any] = [memory] + [self._wasi.get(store, WASI, name) for name in _DELEGATED]
        helper = wasmtime.Instance(store, self._helper, imports)
        self._funcs = {name: export_func(store, helper, name.encode()) for name in _DELEGATED}

    def close(self) -> None:
        """After the call: the scratch copy is removed, nothing of it reaches the next call."""
        self._funcs = None
        scratch, self._scratch = self._scratch, None
        if scratch is not None:
            scratch.close()

    # -- the calls ----------------------------------------------------------------------------
    def fd_write(self, caller: Any, v: Any, n: int) -> int:
        """The runner's `fd_write` for a descriptor past stderr (this call has files)."""
        return self._call("fd_write", caller, v, n, lambda: _iov_bytes(caller, v[1].i32, v[2].i32))

    def _raw(self, name: str) -> Callable[[Any, Any, Any, int], int]:
        need = _NEEDS[name]

        def callback(_env: Any, caller: Any, v: Any, n: int) -> int:
            try:
                if self._funcs is None:  # no files: no descriptor these could name
                    v[0].i32 = _EBADF
                    return 0
                return self._call(name, caller, v, n, lambda: need(caller, v))
            except BaseException as exc:
                return trap_with(exc)

        return callback

    def _call(self, name: str, caller: Any, v: Any, n: int, need: Callable[[], int]) -> int:
        """Call wasmtime's `name` with the guest's arguments in `v` (its result lands there too),
        unless a scratch copy has no room for what the call may add: ENOSPC."""
        if self._scratch is not None and not self._room(need()):
            v[0].i32 = _ENOSPC
            return 0
        assert self._funcs is not None
        trap = ctypes.POINTER(ffi.wasm_trap_t)()
        ctx = ffi.wasmtime_caller_context(caller)
        err = ffi.wasmtime_func_call_unchecked(ctx, ctypes.byref(self._funcs[name]), v, n, ctypes.byref(trap))
        if err:
            return trap_with(wasmtime.WasmtimeError._from_ptr(err))
        if trap:
            return ctypes.cast(trap, ctypes.c_void_p).value or 0  # handed on: the guest stops with it
        return 0

    def _room(self, need: int) -> bool:
        """Whether the scratch copy may grow by `need` bytes; counts them if so. The count runs
        ahead of the copy (an overwrite counts as growth), so it is taken again from the
        directory before anything is refused."""
        if self._used + need > self._cap:
            assert self._scratch is not None
            self._used = usage(self._scratch.path)
            if self._used + need > self._cap:
                return False
        self._used += need
        return True


def _iov_bytes(caller: Any, iovs: int, count: int) -> int:
    """The bytes an iovec table in guest memory asks to write (0 where the table is out of
    bounds: wasmtime refuses it itself)."""
    iovs, count = iovs & 0xFFFFFFFF, count & 0xFFFFFFFF
    base, size = guest_memory(caller)
    if count > 1024 or iovs + 8 * count > size:
        return 0
    at = base + iovs
    return sum(length for _, length in _IOVEC.iter_unpack(ADDRESS_SPACE[at : at + 8 * count]))


_NEEDS: dict[str, Callable[[Any, Any], int]] = {
    "fd_pwrite": lambda caller, v: _iov_bytes(caller, v[1].i32, v[2].i32),
    "fd_allocate": lambda _caller, v: max(0, v[2].i64),
    "fd_filestat_set_size": lambda _caller, v: max(0, v[1].i64),  # the new size: the old is not known here
    "path_open": lambda _caller, v: ENTRY_BYTES if v[4].i32 & _CREAT else 0,
    "path_create_directory": lambda _caller, v: ENTRY_BYTES,
    "path_symlink": lambda _caller, v: ENTRY_BYTES + (v[1].i32 & 0xFFFFFFFF),
    "path_link": lambda _caller, v: ENTRY_BYTES,
}

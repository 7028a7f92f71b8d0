"""A call's WASI context (argv, env, stdin, the preopened `/`) through wasmtime's C API in one piece.

wasmtime-py builds it from a `WasiConfig` one setter at a time, each converting its arguments
(a `c_char_p` per string, a cast per array) through typed bindings: ~15 us of an echo call's
~55 us run on the dev VM. Here the same C functions are bound once more with untyped pointer
arguments, so the arrays built per call go in as they are. wasmtime-py's own bindings are left
untouched (a prototype over the same symbol is a separate object).
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from typing import Any

import wasmtime
from wasmtime import _ffi as ffi  # wasmtime is pinned to one major version

_P = ctypes.c_void_p


def _bind(name: str, restype: object, *argtypes: object) -> Any:
    return ctypes.CFUNCTYPE(restype, *argtypes)((name, ffi.dll))  # type: ignore[arg-type]


_config_new = _bind("wasi_config_new", _P)
_config_delete = _bind("wasi_config_delete", None, _P)
_set_argv = _bind("wasi_config_set_argv", ctypes.c_bool, _P, ctypes.c_size_t, _P)
_set_env = _bind("wasi_config_set_env", ctypes.c_bool, _P, ctypes.c_size_t, _P, _P)
_byte_vec_new = _bind("wasm_byte_vec_new", None, _P, ctypes.c_size_t, ctypes.c_char_p)
_set_stdin_bytes = _bind("wasi_config_set_stdin_bytes", None, _P, _P)
_set_wasi = _bind("wasmtime_context_set_wasi", _P, _P, _P)
# (config, host path, guest path, mutable): not mutable = read-only directories and files
_preopen_dir = _bind("wasi_config_preopen_dir", ctypes.c_bool, _P, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_bool)


class WasiContexts:
    """Sets a store's WASI context per call. argv arrays are kept per function name (a few)."""

    def __init__(self, argv_cache: int = 64) -> None:
        self._argv: OrderedDict[str, ctypes.Array[ctypes.c_char_p]] = OrderedDict()
        self._argv_cache = argv_cache
        # a function's environment is the same at each call: its arrays are built once
        self._env: OrderedDict[tuple[tuple[str, str], ...], tuple[ctypes.Array[ctypes.c_char_p], ctypes.Array[ctypes.c_char_p]]] = OrderedDict()

    def _argv0(self, name: str) -> ctypes.Array[ctypes.c_char_p]:
        argv = self._argv.get(name)
        if argv is None:
            argv = self._argv[name] = (ctypes.c_char_p * 1)(name.encode())
            if len(self._argv) > self._argv_cache:
                self._argv.popitem(last=False)
        return argv

    def _env_arrays(self, env: dict[str, str]) -> tuple[ctypes.Array[ctypes.c_char_p], ctypes.Array[ctypes.c_char_p]]:
        key = tuple(env.items())
        arrays = self._env.get(key)
        if arrays is None:
            n = len(env)
            names = (ctypes.c_char_p * n)(*[k.encode() for k in env])
            values = (ctypes.c_char_p * n)(*[v.encode() for v in env.values()])
            arrays = self._env[key] = (names, values)  # each array holds its strings
            if len(self._env) > self._argv_cache:
                self._env.popitem(last=False)
        return arrays

    def set(
        self, context: int, argv0: str, args: list[str], env: dict[str, str], stdin: bytes,
        root: tuple[str, bool] | None = None,
    ) -> None:
        """argv `[argv0, *args]`, `env`, and `stdin` as bytes the guest reads from memory (empty:
        no stdin, reads see EOF); `root`: (host directory, writable) preopened as the guest's
        `/`, else no preopened directory. stdout and stderr are the linker's."""
        config = _config_new()
        try:
            if args:
                argv = (ctypes.c_char_p * (1 + len(args)))(argv0.encode(), *[a.encode() for a in args])
                ok = _set_argv(config, len(argv), argv)
            else:
                ok = _set_argv(config, 1, self._argv0(argv0))
            if ok and env:
                names, values = self._env_arrays(env)
                ok = _set_env(config, len(env), names, values)
            if not ok:
                raise wasmtime.WasmtimeError("failed to configure the guest's argv or environment")
            if root is not None and not _preopen_dir(config, root[0].encode(), b"/", root[1]):
                raise wasmtime.WasmtimeError("failed to open the function's files")
            if stdin:
                vec = ffi.wasm_byte_vec_t()
                _byte_vec_new(ctypes.byref(vec), len(stdin), stdin)  # a copy wasmtime owns
                _set_stdin_bytes(config, ctypes.byref(vec))  # takes the vector over
        except BaseException:
            _config_delete(config)
            raise
        err = _set_wasi(context, config)  # takes the config over, even on error
        if err:
            raise wasmtime.WasmtimeError._from_ptr(ctypes.cast(err, ctypes.POINTER(ffi.wasmtime_error_t)))

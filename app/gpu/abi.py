"""The `tensorwasm` host functions (docs/guest-abi.md, section 4) over a Backend.

State lives per invocation (handles, buffers, last error) and is torn down in `end()`, however
the guest ended. Every host function returns an ABI code and never raises into the guest.
"""

from __future__ import annotations

import ctypes
import json
import logging
import random
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import wasmtime

from app.gpu.backend import Backend, BackendError
from app.gpu.signatures import (
    IMPORT_MODULE,
    LAST_ERROR_MAX_BYTES,
    MAX_ARG_BYTES,
    MAX_ARG_RECORDS,
    SIGNATURES,
    Code,
    Tag,
)
from app.runtime.memory import GuestMemory
from app.kernels.std_numpy import NON_NEGATIVE, STD

log = logging.getLogger(__name__)

_PAYLOAD = {Tag.I32: ("<i", 4, "i32"), Tag.I64: ("<q", 8, "i64"), Tag.F32: ("<f", 4, "f32"), Tag.F64: ("<d", 8, "f64")}
_BUF_PAYLOAD = struct.Struct("<iq")
_STD_TYPES = {"i32": Tag.I32, "f32": Tag.F32, "buf": Tag.BUFFER}
_VALTYPES = {"i32": wasmtime.ValType.i32, "i64": wasmtime.ValType.i64}


class AbiFailure(Exception):
    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(eq=False)  # identity semantics: handles and caches compare the objects themselves
class _Buffer:
    mem: Any
    size: int


@dataclass(eq=False)
class _ModuleRef:
    std: bool
    name: str
    obj: Any = None


@dataclass(eq=False)
class _FunctionRef:
    module: _ModuleRef
    name: str
    obj: Any = None


class _Instance:
    """Handles and errors of one invocation; handle numbers start at a random base so a handle
    remembered from another instance is almost surely unknown here."""

    def __init__(self, kernels: dict[str, str]) -> None:
        self.next_handle = random.randint(1, 1 << 24) << 4
        self.handles: dict[int, Any] = {}
        self.buffers = 0
        self.modules = 0
        self.last_error = b""
        self.kernels = kernels
        self.launches = 0
        self.device_error: str | None = None
        self.memory: wasmtime.Memory | None = None  # the guest's exported memory, looked up once
        self.region: Any = None  # that memory's GuestMemory region, when the worker provides it
        # prepared launches: (fn, dims, raw args) -> (buffers to revalidate, thunk)
        self.launch_cache: dict[tuple[Any, ...], tuple[tuple[tuple[int, Any], ...], Callable[[], None]]] = {}

    def add(self, obj: Any) -> int:
        h = self.next_handle
        self.next_handle += 1
        self.handles[h] = obj
        return h


class AbiHost:
    def __init__(
        self,
        backend: Backend,
        max_buffers: int = 1024,
        max_modules: int = 64,
        guest_memory: GuestMemory | None = None,
    ) -> None:
        self.backend = backend
        self.guest_memory = guest_memory
        self.max_buffers = max_buffers
        self.max_modules = max_modules
        self.cap = 0
        self.used = 0
        self.peak = 0
        self.tenant_kernels: dict[str, str] = {}
        self.launches_total = 0
        self.inst: _Instance | None = None
        self.usage_hook: Callable[[int], None] | None = None
        self.poisoned: str | None = None  # a sticky device error: the context is unusable
        self.spans: Any = None  # a SpanRecorder while the invocation is traced
        self._compile_seen = (0, 0)

    # -- lifecycle ----------------------------------------------------------------------------
    def bind(self, cap_bytes: int) -> None:
        self.cap = cap_bytes
        self.backend.set_cap(cap_bytes)

    def set_kernels(self, kernels: dict[str, str]) -> None:
        self.tenant_kernels = dict(kernels)

    def begin(self, invocation_id: str, kernels: dict[str, str] | None) -> None:
        if kernels is not None:
            self.set_kernels(kernels)
        self.inst = _Instance(self.tenant_kernels)
        self.peak = self.used

    def end(self) -> dict[str, Any]:
        inst, self.inst = self.inst, None
        hits, misses = getattr(self.backend, "compile_hits", 0), getattr(self.backend, "compile_misses", 0)
        stats: dict[str, Any] = {
            "gpu_peak_bytes": self.peak,
            "launches": inst.launches if inst else 0,
            "compile_hits": hits - self._compile_seen[0],
            "compile_misses": misses - self._compile_seen[1],
        }
        self._compile_seen = (hits, misses)
        if inst is not None:
            try:
                if self.poisoned is None:
                    self.backend.end_invocation()
            except BackendError as exc:
                self.poisoned = exc.message
            inst.handles.clear()  # drops every buffer and module reference
            self.used = 0
            self._report()
        if self.poisoned is not None:
            stats["device_error"] = True
            stats["device_error_message"] = self.poisoned
        return stats

    def _report(self) -> None:
        if self.usage_hook is not None:
            self.usage_hook(self.used)

    # -- linking ------------------------------------------------------------------------------
    def define(self, linker: wasmtime.Linker) -> None:
        """Register every ABI function as a raw ("unchecked") host function.

        wasmtime-py's generic trampoline builds a `Val` for every parameter and the result on
        each call (~10x the cost of the work behind `launch`); the raw callback reads the
        `wasmtime_val_raw` slots directly. Types are still checked once, at link time.
        """
        from wasmtime import _ffi as ffi  # wasmtime is pinned to one major version

        self._keepalive: list[Any] = []
        finalizer = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _env: None)
        self._keepalive.append(finalizer)
        module = IMPORT_MODULE.encode()
        for name, (params, results) in SIGNATURES.items():
            impl = self._wrap(name, getattr(self, f"_{name}"))
            callback = ffi.wasmtime_func_unchecked_callback_t(_raw_callback(impl, params, results[0]))
            self._keepalive.append(callback)
            ty = wasmtime.FuncType([_VALTYPES[p]() for p in params], [_VALTYPES[r]() for r in results])
            self._keepalive.append(ty)
            err = ffi.wasmtime_linker_define_func_unchecked(
                linker.ptr(), ctypes.create_string_buffer(module), len(module),
                ctypes.create_string_buffer(name.encode()), len(name), ty.ptr(), callback, None, finalizer,
            )
            if err:
                raise wasmtime.WasmtimeError._from_ptr(err)

    def _wrap(self, name: str, impl: Callable[..., int]) -> Callable[..., int]:
        """One layer around every ABI function: the instance, the poisoned-context guard, error
        mapping (a host failure never traps the guest) and, while traced, the span timing."""
        always = name in ("last_error", "device_count", "device_info")

        def host(caller: int, *args: int) -> int:
            inst = self.inst
            if inst is None:
                return int(Code.INTERNAL)
            rec = self.spans
            t0 = time.time_ns() if rec is not None else 0
            try:
                if self.poisoned is not None and not always:
                    raise AbiFailure(Code.DEVICE_ERROR, f"{name}: {self.poisoned}; this instance should stop")
                rc = int(impl(caller, inst, *args))
            except AbiFailure as exc:
                rc = self._fail(inst, exc.code, exc.message)
            except BackendError as exc:
                if exc.code == Code.DEVICE_ERROR:
                    self.poisoned = exc.message
                rc = self._fail(inst, exc.code, exc.message)
            except Exception as exc:
                log.exception("tensorwasm.%s failed", name)
                rc = self._fail(inst, Code.INTERNAL, f"{name}: internal error ({type(exc).__name__})")
            if rec is not None:
                rec.abi_call(name, t0, time.time_ns(), rc < 0)
            return rc

        return host

    @staticmethod
    def _fail(inst: _Instance, code: Code, message: str) -> int:
        raw = message.encode()[:LAST_ERROR_MAX_BYTES]
        inst.last_error = raw.decode("utf-8", "ignore").encode()
        return int(code)

    # -- guest memory -------------------------------------------------------------------------
    def _mem(self, caller: int, fn: str, ptr: int, length: int) -> int:
        """Host address of guest range [ptr, ptr+length), bounds-checked."""
        if length < 0:
            raise AbiFailure(Code.INVALID_ARGUMENT, f"{fn}: length {length} is negative")
        inst = self.inst
        region = inst.region if inst is not None else None
        if region is not None:  # the worker's own memory: base and live size without an FFI call
            base, size = region.base, region.size
        else:
            base, size = self._memory_view(caller, fn, inst)
        ptr &= 0xFFFFFFFF  # wasm32 pointers are unsigned
        if ptr + length > size:
            raise AbiFailure(
                Code.INVALID_POINTER,
                f"{fn}: range [{ptr}, {ptr + length}) is outside linear memory ({size} bytes)",
            )
        return base + ptr

    def _memory_view(self, caller_ptr: int, fn: str, inst: _Instance | None) -> tuple[int, int]:
        """(base, size) of the guest's exported memory through wasmtime; when that memory is one
        of the worker's reused regions, later calls of this instance read the region instead."""
        caller = wasmtime.Caller(caller_ptr)
        try:
            mem = inst.memory if inst is not None else None
            if mem is None:
                mem = caller["memory"]
                if not isinstance(mem, wasmtime.Memory):
                    raise AbiFailure(Code.INVALID_POINTER, f"{fn}: the module exports no memory")
                if inst is not None:
                    inst.memory = mem
            size = mem.data_len(caller)
            base = ctypes.addressof(mem.data_ptr(caller).contents)
        finally:
            caller._invalidate()  # valid only during this host call
        if inst is not None and self.guest_memory is not None:
            inst.region = self.guest_memory.live_region(base)
        return base, size

    def _read_guest(self, caller: int, fn: str, ptr: int, length: int) -> bytes:
        return ctypes.string_at(self._mem(caller, fn, ptr, length), length)

    def _write_out(self, caller: int, fn: str, dst: int, dst_len: int, data: bytes) -> int:
        if dst_len < 0:
            raise AbiFailure(Code.INVALID_ARGUMENT, f"{fn}: dst_len {dst_len} is negative")
        n = min(dst_len, len(data))
        addr = self._mem(caller, fn, dst, n)
        ctypes.memmove(addr, data, n)
        return len(data)

    # -- handles ------------------------------------------------------------------------------
    @staticmethod
    def _get(inst: _Instance, fn: str, handle: int, kind: type, what: str) -> Any:
        obj = inst.handles.get(handle)
        if not isinstance(obj, kind):
            raise AbiFailure(Code.INVALID_HANDLE, f"{fn}: {handle} is not a live {what} handle of this instance")
        return obj

    def _gpu_allowed(self, fn: str) -> None:
        if self.cap <= 0:
            raise AbiFailure(Code.UNAVAILABLE, f"{fn}: this tenant has no GPU access (gpu_memory_bytes quota is 0)")

    @staticmethod
    def _range(fn: str, buf: _Buffer, offset: int, length: int, what: str = "buffer") -> None:
        if offset < 0 or length < 0 or offset + length > buf.size:
            raise AbiFailure(
                Code.INVALID_ARGUMENT,
                f"{fn}: range [{offset}, {offset + length}) is outside the {what} ({buf.size} bytes)",
            )

    # -- 2.1 device and errors ----------------------------------------------------------------
    def _device_count(self, caller: int, inst: _Instance) -> int:
        return 1 if self.backend.info.backend == "cuda" and self.cap > 0 else 0

    def _device_info(self, caller: int, inst: _Instance, dst: int, dst_len: int) -> int:
        info = self.backend.info
        doc = {
            "backend": info.backend,
            "name": info.name,
            "compute_capability": info.compute_capability,
            "memory_cap_bytes": self.cap,
            "memory_used_bytes": self.used,
        }
        return self._write_out(caller, "device_info", dst, dst_len, json.dumps(doc, separators=(",", ":")).encode())

    def _last_error(self, caller: int, inst: _Instance, dst: int, dst_len: int) -> int:
        if not inst.last_error:
            return 0
        return self._write_out(caller, "last_error", dst, dst_len, inst.last_error)

    # -- 2.2 buffers --------------------------------------------------------------------------
    def _buffer_alloc(self, caller: int, inst: _Instance, size: int) -> int:
        self._gpu_allowed("buffer_alloc")
        if size <= 0:
            raise AbiFailure(Code.INVALID_ARGUMENT, f"buffer_alloc: size must be positive, got {size}")
        if self.used + size > self.cap:
            raise AbiFailure(
                Code.QUOTA_EXCEEDED,
                f"buffer_alloc: {size} bytes would exceed the tenant GPU memory cap ({self.cap} bytes, {self.used} in use)",
            )
        if inst.buffers >= self.max_buffers:
            raise AbiFailure(Code.QUOTA_EXCEEDED, f"buffer_alloc: at most {self.max_buffers} live buffers per instance")
        mem = self.backend.alloc(size)
        self.used += size
        self.peak = max(self.peak, self.used)
        inst.buffers += 1
        self._report()
        return inst.add(_Buffer(mem, size))

    def _buffer_free(self, caller: int, inst: _Instance, handle: int) -> int:
        buf = self._get(inst, "buffer_free", handle, _Buffer, "buffer")
        del inst.handles[handle]
        self.backend.free(buf.mem)
        self.used -= buf.size
        inst.buffers -= 1
        self._report()
        return 0

    def _buffer_size(self, caller: int, inst: _Instance, handle: int) -> int:
        return self._get(inst, "buffer_size", handle, _Buffer, "buffer").size  # type: ignore[no-any-return]

    def _buffer_write(self, caller: int, inst: _Instance, handle: int, offset: int, src: int, length: int) -> int:
        buf = self._get(inst, "buffer_write", handle, _Buffer, "buffer")
        addr = self._mem(caller, "buffer_write", src, length)
        self._range("buffer_write", buf, offset, length)
        if length:
            self.backend.write(buf.mem, offset, addr, length)
        return 0

    def _buffer_read(self, caller: int, inst: _Instance, handle: int, offset: int, dst: int, length: int) -> int:
        buf = self._get(inst, "buffer_read", handle, _Buffer, "buffer")
        addr = self._mem(caller, "buffer_read", dst, length)
        self._range("buffer_read", buf, offset, length)
        if length:
            self.backend.read(buf.mem, offset, addr, length)
        else:
            self.backend.synchronize()
        return 0

    def _buffer_copy(self, caller: int, inst: _Instance, dst: int, dst_offset: int, src: int, src_offset: int, length: int) -> int:
        d = self._get(inst, "buffer_copy", dst, _Buffer, "buffer")
        s = self._get(inst, "buffer_copy", src, _Buffer, "buffer")
        self._range("buffer_copy", d, dst_offset, length, "destination buffer")
        self._range("buffer_copy", s, src_offset, length, "source buffer")
        if length:
            self.backend.copy(d.mem, dst_offset, s.mem, src_offset, length)
        return 0

    # -- 2.3 kernels --------------------------------------------------------------------------
    def _add_module(self, inst: _Instance, ref: _ModuleRef) -> int:
        if inst.modules >= self.max_modules:
            raise AbiFailure(Code.QUOTA_EXCEEDED, f"at most {self.max_modules} modules per instance")
        inst.modules += 1
        return inst.add(ref)

    def _module_load(self, caller: int, inst: _Instance, src: int, src_len: int, fmt: int) -> int:
        self._gpu_allowed("module_load")
        if fmt not in (0, 1):
            raise AbiFailure(Code.INVALID_ARGUMENT, f"module_load: unknown format {fmt} (0 = CUDA C++, 1 = PTX)")
        if src_len <= 0:
            raise AbiFailure(Code.INVALID_ARGUMENT, "module_load: the source is empty")
        source = self._read_guest(caller, "module_load", src, src_len)
        obj = self.backend.load_module(source, fmt)
        return self._add_module(inst, _ModuleRef(std=False, name="<loaded>", obj=obj))

    def _module_get(self, caller: int, inst: _Instance, name_ptr: int, name_len: int) -> int:
        name = self._read_guest(caller, "module_get", name_ptr, name_len).decode("utf-8", "replace")
        if name == "std":
            self._gpu_allowed("module_get")
            return self._add_module(inst, _ModuleRef(std=True, name="std"))
        source = inst.kernels.get(name)
        if source is None:
            raise AbiFailure(Code.NOT_FOUND, f"module_get: no module named {name!r} (std, or a kernel registered with PUT /v1/kernels/{{name}})")
        self._gpu_allowed("module_get")
        obj = self.backend.load_module(source.encode(), 0)
        return self._add_module(inst, _ModuleRef(std=False, name=name, obj=obj))

    def _function_get(self, caller: int, inst: _Instance, module: int, name_ptr: int, name_len: int) -> int:
        mod = self._get(inst, "function_get", module, _ModuleRef, "module")
        name = self._read_guest(caller, "function_get", name_ptr, name_len).decode("utf-8", "replace")
        if mod.std:
            if name not in STD:
                raise AbiFailure(Code.NOT_FOUND, f"function_get: std has no function {name!r}; it has {', '.join(STD)}")
            return inst.add(_FunctionRef(mod, name))
        if not name.isidentifier() or not name.isascii():
            raise AbiFailure(Code.NOT_FOUND, f"function_get: {name!r} is not a valid kernel name")
        return inst.add(_FunctionRef(mod, name, self.backend.get_function(mod.obj, name)))

    def _parse_args(self, inst: _Instance, raw: bytes) -> list[tuple[Tag, Any]]:
        out: list[tuple[Tag, Any]] = []
        pos = 0
        while pos < len(raw):
            if len(out) >= MAX_ARG_RECORDS:
                raise AbiFailure(Code.INVALID_ARGUMENT, f"launch: more than {MAX_ARG_RECORDS} argument records")
            tag = raw[pos]
            pos += 1
            if tag == Tag.BUFFER:
                if pos + 12 > len(raw):
                    raise AbiFailure(Code.INVALID_ARGUMENT, f"launch: record {len(out)} (buffer) is truncated")
                handle, offset = _BUF_PAYLOAD.unpack_from(raw, pos)
                pos += 12
                buf = self._get(inst, "launch", handle, _Buffer, "buffer")
                if offset < 0 or offset > buf.size:
                    raise AbiFailure(Code.INVALID_ARGUMENT, f"launch: record {len(out)}: offset {offset} is outside the buffer ({buf.size} bytes)")
                out.append((Tag.BUFFER, (buf, offset)))
            elif tag in _PAYLOAD:
                fmt, size, _ = _PAYLOAD[Tag(tag)]
                if pos + size > len(raw):
                    raise AbiFailure(Code.INVALID_ARGUMENT, f"launch: record {len(out)} is truncated")
                out.append((Tag(tag), struct.unpack_from(fmt, raw, pos)[0]))
                pos += size
            else:
                raise AbiFailure(Code.INVALID_ARGUMENT, f"launch: record {len(out)} has unknown tag 0x{tag:02x}")
        return out

    def _check_dims(self, grid: tuple[int, int, int], block: tuple[int, int, int], shared: int) -> None:
        lim = self.backend.info.limits
        if min(grid) < 1 or min(block) < 1:
            raise AbiFailure(Code.INVALID_ARGUMENT, f"launch: grid {grid} and block {block} must all be >= 1")
        if any(g > m for g, m in zip(grid, lim.max_grid)):
            raise AbiFailure(Code.INVALID_ARGUMENT, f"launch: grid {grid} exceeds the device maximum {lim.max_grid}")
        if any(b > m for b, m in zip(block, lim.max_block)) or block[0] * block[1] * block[2] > lim.max_threads_per_block:
            raise AbiFailure(
                Code.INVALID_ARGUMENT,
                f"launch: block {block} exceeds the device maximum {lim.max_block} / {lim.max_threads_per_block} threads",
            )
        if shared < 0 or shared > lim.max_shared_bytes:
            raise AbiFailure(Code.INVALID_ARGUMENT, f"launch: shared_bytes must be 0..{lim.max_shared_bytes}, got {shared}")

    def _launch(self, caller: int, inst: _Instance, fn: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int, args: int, args_len: int) -> int:
        ref = self._get(inst, "launch", fn, _FunctionRef, "kernel function")
        if not 0 <= args_len <= MAX_ARG_BYTES:
            raise AbiFailure(Code.INVALID_ARGUMENT, f"launch: argument records must be 0..{MAX_ARG_BYTES} bytes, got {args_len}")
        raw = self._read_guest(caller, "launch", args, args_len)
        key = (ref, gx, gy, gz, bx, by, bz, shared, raw)
        hit = inst.launch_cache.get(key)
        # A repeated launch (same kernel, shape and argument bytes) reuses its validated, prepared
        # form, provided every buffer it names is still the same live buffer.
        if hit is not None:
            handles = inst.handles
            for h, b in hit[0]:
                if handles.get(h) is not b:
                    hit = None
                    break
        if hit is not None:
            hit[1]()
        else:
            grid, block = (gx, gy, gz), (bx, by, bz)
            self._check_dims(grid, block, shared)
            records = self._parse_args(inst, raw)
            if ref.module.std:
                thunk = self._prepare_std(ref.name, grid, block, records)
            else:
                kargs = [(v[0].mem, v[1]) if t == Tag.BUFFER else _typed(t, v) for t, v in records]
                thunk = self.backend.prepare(ref.obj, grid, block, shared, kargs)
            thunk()
            if len(inst.launch_cache) < 256:
                used = tuple((h, inst.handles[h]) for h in _buffer_handles(raw))
                inst.launch_cache[key] = (used, thunk)
        inst.launches += 1
        self.launches_total += 1
        return 0

    def _prepare_std(self, name: str, grid: tuple[int, int, int], block: tuple[int, int, int], records: list[tuple[Tag, Any]]) -> Callable[[], None]:
        spec = STD[name]
        if len(records) != len(spec.params) or any(t != _STD_TYPES[p] for (t, _), p in zip(records, spec.params)):
            want = ", ".join(spec.params)
            got = ", ".join(Tag(t).name.lower() for t, _ in records)
            raise AbiFailure(Code.INVALID_ARGUMENT, f"launch: std.{name} takes ({want}), got ({got})")
        values = [v for _, v in records]
        for i in NON_NEGATIVE[name]:
            if values[i] < 0:
                raise AbiFailure(Code.INVALID_ARGUMENT, f"launch: std.{name} argument {i} must be >= 0, got {values[i]}")
        for i, need in spec.needs(values).items():
            buf, offset = values[i]
            if offset + need > buf.size:
                raise AbiFailure(
                    Code.INVALID_ARGUMENT,
                    f"launch: std.{name} argument {i} needs {need} bytes from offset {offset}, the buffer has {buf.size}",
                )
        args = [self.backend.view(v[0].mem, v[1]) if p == "buf" else v for p, v in zip(spec.params, values)]
        return self.backend.prepare_std(name, grid, block, args)

    def _synchronize(self, caller: int, inst: _Instance) -> int:
        self.backend.synchronize()
        return 0


def _buffer_handles(raw: bytes) -> list[int]:
    """Handles named by the 0x10 records of an already validated record stream."""
    out, pos = [], 0
    while pos < len(raw):
        tag = raw[pos]
        if tag == Tag.BUFFER:
            out.append(_BUF_PAYLOAD.unpack_from(raw, pos + 1)[0])
            pos += 13
        else:
            pos += 1 + _PAYLOAD[Tag(tag)][1]
    return out


def _raw_callback(impl: Callable[..., int], params: tuple[str, ...], result: str) -> Callable[..., int]:
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


def _typed(tag: Tag, value: Any) -> Any:
    import numpy as np

    return {Tag.I32: np.int32, Tag.I64: np.int64, Tag.F32: np.float32, Tag.F64: np.float64}[tag](value)

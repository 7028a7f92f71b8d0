"""The `tensorwasm` host functions (docs/guest-abi.md, section 4) over a Backend.

State lives per invocation (handles, buffers, last error) and is torn down in `end()`, however
the guest ended. Every host function returns an ABI code and never raises into the guest.
Beside it: the handle table (handles.py), launch-record checks (launch_args.py) and the raw
wasmtime linking (linking.py).
"""

from __future__ import annotations

import ctypes
import json
import logging
import struct
import time
from collections.abc import Callable
from typing import Any

import wasmtime

from app.gpu.backend import Backend, BackendError
from app.gpu.handles import AbiFailure, Buffer, FunctionRef, Instance, ModuleRef, get_handle
from app.gpu.launch_args import buffer_handles, check_dims, check_std, parse_args, typed
from app.gpu.linking import CallerPtr, RawHost, Slots, define_unchecked
from app.gpu.share import ContextShare
from app.gpu.signatures import (
    IMPORT_MODULE,
    LAST_ERROR_MAX_BYTES,
    MAX_ARG_BYTES,
    SIGNATURES,
    Code,
    Tag,
)
from app.kernels.std_numpy import STD
from app.runtime.linking import ADDRESS_SPACE, guest_memory_at
from app.runtime.memory import GuestMemory

log = logging.getLogger(__name__)

_LAUNCH = (SIGNATURES["launch"][0], SIGNATURES["launch"][1][0])


class _RecordReads(dict[int, Callable[[Any, int], tuple[bytes]]]):
    """Argument records read as bytes by length: a struct `Ns` read is 78 ns where a slice of
    the address space made into bytes is 195 (dev VM, 22 bytes)."""

    def __missing__(self, n: int) -> Callable[[Any, int], tuple[bytes]]:
        read = self[n] = struct.Struct(f"{n}s").unpack_from
        return read


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
        self.inst: Instance | None = None
        self.usage_hook: Callable[[int], None] | None = None
        self.poisoned: str | None = None  # a sticky device error: the context is unusable
        self.spans: Any = None  # a SpanRecorder while the invocation is traced
        self.share: ContextShare | None = None  # the device's time by tenant weight (app/gpu/share.py)
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
        self.inst = Instance(self.tenant_kernels)
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
                # a guest that made no handle (most never import the ABI) enqueued nothing: no
                # stream to wait for (an echo call had waited on an idle one every time)
                if self.poisoned is None and inst.made_handles():
                    self.backend.end_invocation()
                    self._idle()
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
        """Register every ABI function, through `_wrap`, as a raw host function (app/gpu/linking.py)."""
        self._keepalive: list[Any] = []
        callbacks = {name: self._wrap(name, getattr(self, f"_{name}")) for name in SIGNATURES}
        callbacks["launch"] = self._repeat_launch(callbacks["launch"])
        define_unchecked(linker, IMPORT_MODULE, SIGNATURES, callbacks, self._keepalive)

    def _wrap(self, name: str, impl: Callable[..., int]) -> RawHost:
        """Every ABI function as its raw callback, in one frame around `impl` (app/gpu/linking.py):
        its parameters from the value slots, the instance, the poisoned-context guard, error
        mapping (a host failure never traps the guest) and, while traced, the span timing."""
        always = name in ("last_error", "device_count", "device_info")
        params, results = SIGNATURES[name]
        slots_of = Slots(params, results[0])
        unpack, out, memory = slots_of.unpack, slots_of.result, ADDRESS_SPACE

        def callback(_env: Any, caller: CallerPtr, slots: int, _nvals: int) -> int:
            inst = self.inst
            rec = self.spans
            t0 = time.time_ns() if rec is not None else 0
            try:
                if inst is None:
                    rc = int(Code.INTERNAL)
                else:
                    try:
                        if self.poisoned is not None and not always:
                            raise AbiFailure(Code.DEVICE_ERROR, f"{name}: {self.poisoned}; this instance should stop")
                        rc = int(impl(caller, inst, *unpack(memory, slots)))
                    except Exception as exc:
                        rc = self._failed(inst, name, exc)
                    if rec is not None:
                        rec.abi_call(name, t0, time.time_ns(), rc < 0)
            except BaseException:  # never unwinds into wasm
                log.exception("tensorwasm host call failed")
                rc = int(Code.INTERNAL)
            out(memory, slots, rc)
            return 0  # no trap

        return callback

    def _repeat_launch(self, general: RawHost) -> RawHost:
        """`launch`'s callback: a repeated launch (same kernel handle, shape and argument bytes,
        every buffer it names the same live buffer) runs its prepared form in this one frame;
        anything else, or a call while traced or with the context poisoned, goes `general`'s way
        (`_launch` through `_wrap`). A guest's launch loop spends its host time here: this frame
        and a struct read of the records took the host path of a repeated launch
        (`abi_launch_ns`) from 1.8-2.2 to 1.2-1.4 us on the dev VM."""
        slots_of = Slots(*_LAUNCH)
        unpack, out, memory = slots_of.unpack, slots_of.result, ADDRESS_SPACE
        read = _RecordReads()

        def callback(env: Any, caller: CallerPtr, slots: int, nvals: int) -> int:
            inst = self.inst
            if inst is None or self.poisoned is not None or self.spans is not None:
                return general(env, caller, slots, nvals)
            fn, gx, gy, gz, bx, by, bz, shared, args, args_len = unpack(memory, slots)
            region = inst.region
            if region is None or not 0 <= args_len <= MAX_ARG_BYTES or (args & 0xFFFFFFFF) + args_len > region.size:
                return general(env, caller, slots, nvals)
            hit = inst.launch_cache.get((fn, gx, gy, gz, bx, by, bz, shared, read[args_len](memory, region.base + (args & 0xFFFFFFFF))[0]))
            handles = inst.handles
            if hit is None or handles.get(fn) is not hit[0]:
                return general(env, caller, slots, nvals)
            for h, b in hit[1]:
                if handles.get(h) is not b:
                    return general(env, caller, slots, nvals)
            try:
                share = self.share
                if share is not None and (not share.busy or time.monotonic() >= share.next_check):
                    share.launch()  # may hold the launch while the tenant is above its share
                hit[2]()
                inst.launches += 1
                self.launches_total += 1
                rc = 0
            except Exception as exc:
                rc = self._failed(inst, "launch", exc)
            except BaseException:  # never unwinds into wasm
                log.exception("tensorwasm host call failed")
                rc = int(Code.INTERNAL)
            out(memory, slots, rc)
            return 0  # no trap

        return callback

    def _failed(self, inst: Instance, name: str, exc: Exception) -> int:
        """The code (and last error) an ABI function answers when it raised `exc`."""
        if isinstance(exc, AbiFailure):
            return self._fail(inst, exc.code, exc.message)
        if isinstance(exc, BackendError):
            if exc.code == Code.DEVICE_ERROR:
                self.poisoned = exc.message
            return self._fail(inst, exc.code, exc.message)
        log.error("tensorwasm.%s failed", name, exc_info=exc)
        return self._fail(inst, Code.INTERNAL, f"{name}: internal error ({type(exc).__name__})")

    @staticmethod
    def _fail(inst: Instance, code: Code, message: str) -> int:
        raw = message.encode()[:LAST_ERROR_MAX_BYTES]
        inst.last_error = raw.decode("utf-8", "ignore").encode()
        return int(code)

    # -- guest memory -------------------------------------------------------------------------
    def _mem(self, caller: CallerPtr, fn: str, ptr: int, length: int) -> int:
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

    def _memory_view(self, caller_ptr: CallerPtr, fn: str, inst: Instance | None) -> tuple[int, int]:
        """(base, size) of the guest's exported memory, read through wasmtime's C API (a few
        calls: building a wasmtime.Caller and Memory took ~80 us of a call on a GPU host); when
        that memory is one of the worker's reused regions, later calls of this instance read
        the region instead."""
        try:
            base, size = guest_memory_at(caller_ptr)
        except wasmtime.WasmtimeError:
            raise AbiFailure(Code.INVALID_POINTER, f"{fn}: the module exports no memory") from None
        if inst is not None and self.guest_memory is not None:
            inst.region = self.guest_memory.live_region(base)
        return base, size

    def _read_guest(self, caller: CallerPtr, fn: str, ptr: int, length: int) -> bytes:
        at = self._mem(caller, fn, ptr, length)
        return bytes(ADDRESS_SPACE[at : at + length])

    def _write_out(self, caller: CallerPtr, fn: str, dst: int, dst_len: int, data: bytes) -> int:
        if dst_len < 0:
            raise AbiFailure(Code.INVALID_ARGUMENT, f"{fn}: dst_len {dst_len} is negative")
        n = min(dst_len, len(data))
        addr = self._mem(caller, fn, dst, n)
        ctypes.memmove(addr, data, n)
        return len(data)

    # -- checks -------------------------------------------------------------------------------
    def _gpu_allowed(self, fn: str) -> None:
        if self.cap <= 0:
            raise AbiFailure(Code.UNAVAILABLE, f"{fn}: this tenant has no GPU access (gpu_memory_bytes quota is 0)")

    @staticmethod
    def _range(fn: str, buf: Buffer, offset: int, length: int, what: str = "buffer") -> None:
        if offset < 0 or length < 0 or offset + length > buf.size:
            raise AbiFailure(
                Code.INVALID_ARGUMENT,
                f"{fn}: range [{offset}, {offset + length}) is outside the {what} ({buf.size} bytes)",
            )

    # -- 2.1 device and errors ----------------------------------------------------------------
    def _device_count(self, caller: CallerPtr, inst: Instance) -> int:
        return 1 if self.backend.info.backend == "cuda" and self.cap > 0 else 0

    def _device_info(self, caller: CallerPtr, inst: Instance, dst: int, dst_len: int) -> int:
        info = self.backend.info
        doc = {
            "backend": info.backend,
            "name": info.name,
            "compute_capability": info.compute_capability,
            "memory_cap_bytes": self.cap,
            "memory_used_bytes": self.used,
        }
        return self._write_out(caller, "device_info", dst, dst_len, json.dumps(doc, separators=(",", ":")).encode())

    def _last_error(self, caller: CallerPtr, inst: Instance, dst: int, dst_len: int) -> int:
        if not inst.last_error:
            return 0
        return self._write_out(caller, "last_error", dst, dst_len, inst.last_error)

    # -- 2.2 buffers --------------------------------------------------------------------------
    def _buffer_alloc(self, caller: CallerPtr, inst: Instance, size: int) -> int:
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
        return inst.add(Buffer(mem, size))

    def _buffer_free(self, caller: CallerPtr, inst: Instance, handle: int) -> int:
        buf = get_handle(inst, "buffer_free", handle, Buffer, "buffer")
        del inst.handles[handle]
        self.backend.free(buf.mem)
        self.used -= buf.size
        inst.buffers -= 1
        self._report()
        return 0

    def _buffer_size(self, caller: CallerPtr, inst: Instance, handle: int) -> int:
        return get_handle(inst, "buffer_size", handle, Buffer, "buffer").size

    def _buffer_write(self, caller: CallerPtr, inst: Instance, handle: int, offset: int, src: int, length: int) -> int:
        buf = get_handle(inst, "buffer_write", handle, Buffer, "buffer")
        addr = self._mem(caller, "buffer_write", src, length)
        self._range("buffer_write", buf, offset, length)
        if length:
            self.backend.write(buf.mem, offset, addr, length)
        return 0

    def _buffer_read(self, caller: CallerPtr, inst: Instance, handle: int, offset: int, dst: int, length: int) -> int:
        buf = get_handle(inst, "buffer_read", handle, Buffer, "buffer")
        addr = self._mem(caller, "buffer_read", dst, length)
        self._range("buffer_read", buf, offset, length)
        if length:
            self.backend.read(buf.mem, offset, addr, length)
        else:
            self.backend.synchronize()
        self._idle()
        return 0

    def _buffer_copy(self, caller: CallerPtr, inst: Instance, dst: int, dst_offset: int, src: int, src_offset: int, length: int) -> int:
        d = get_handle(inst, "buffer_copy", dst, Buffer, "buffer")
        s = get_handle(inst, "buffer_copy", src, Buffer, "buffer")
        self._range("buffer_copy", d, dst_offset, length, "destination buffer")
        self._range("buffer_copy", s, src_offset, length, "source buffer")
        if length:
            self.backend.copy(d.mem, dst_offset, s.mem, src_offset, length)
        return 0

    # -- 2.3 kernels --------------------------------------------------------------------------
    def _add_module(self, inst: Instance, ref: ModuleRef) -> int:
        if inst.modules >= self.max_modules:
            raise AbiFailure(Code.QUOTA_EXCEEDED, f"at most {self.max_modules} modules per instance")
        inst.modules += 1
        return inst.add(ref)

    def _module_load(self, caller: CallerPtr, inst: Instance, src: int, src_len: int, fmt: int) -> int:
        self._gpu_allowed("module_load")
        if fmt not in (0, 1):
            raise AbiFailure(Code.INVALID_ARGUMENT, f"module_load: unknown format {fmt} (0 = CUDA C++, 1 = PTX)")
        if src_len <= 0:
            raise AbiFailure(Code.INVALID_ARGUMENT, "module_load: the source is empty")
        source = self._read_guest(caller, "module_load", src, src_len)
        obj = self.backend.load_module(source, fmt)
        return self._add_module(inst, ModuleRef(std=False, name="<loaded>", obj=obj))

    def _module_get(self, caller: CallerPtr, inst: Instance, name_ptr: int, name_len: int) -> int:
        name = self._read_guest(caller, "module_get", name_ptr, name_len).decode("utf-8", "replace")
        if name == "std":
            self._gpu_allowed("module_get")
            return self._add_module(inst, ModuleRef(std=True, name="std"))
        source = inst.kernels.get(name)
        if source is None:
            raise AbiFailure(Code.NOT_FOUND, f"module_get: no module named {name!r} (std, or a kernel registered with PUT /v1/kernels/{{name}})")
        self._gpu_allowed("module_get")
        obj = self.backend.load_module(source.encode(), 0)
        return self._add_module(inst, ModuleRef(std=False, name=name, obj=obj))

    def _function_get(self, caller: CallerPtr, inst: Instance, module: int, name_ptr: int, name_len: int) -> int:
        mod = get_handle(inst, "function_get", module, ModuleRef, "module")
        name = self._read_guest(caller, "function_get", name_ptr, name_len).decode("utf-8", "replace")
        if mod.std:
            if name not in STD:
                raise AbiFailure(Code.NOT_FOUND, f"function_get: std has no function {name!r}; it has {', '.join(STD)}")
            return inst.add(FunctionRef(mod, name))
        if not name.isidentifier() or not name.isascii():
            raise AbiFailure(Code.NOT_FOUND, f"function_get: {name!r} is not a valid kernel name")
        return inst.add(FunctionRef(mod, name, self.backend.get_function(mod.obj, name)))

    def _launch(
        self, caller: CallerPtr, inst: Instance, fn: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int, args: int, args_len: int
    ) -> int:
        # the hot path inlined (a launch is a few microseconds; each call here costs ~0.1)
        ref = inst.handles.get(fn)
        if type(ref) is not FunctionRef:
            ref = get_handle(inst, "launch", fn, FunctionRef, "kernel function")
        if not 0 <= args_len <= MAX_ARG_BYTES:
            raise AbiFailure(Code.INVALID_ARGUMENT, f"launch: argument records must be 0..{MAX_ARG_BYTES} bytes, got {args_len}")
        region = inst.region
        if region is not None and (args & 0xFFFFFFFF) + args_len <= region.size:
            at = region.base + (args & 0xFFFFFFFF)
            raw = bytes(ADDRESS_SPACE[at : at + args_len])
        else:
            raw = self._read_guest(caller, "launch", args, args_len)
        key = (fn, gx, gy, gz, bx, by, bz, shared, raw)
        hit = inst.launch_cache.get(key)
        # A repeated launch (same kernel, shape and argument bytes) reuses its validated, prepared
        # form, provided its kernel and every buffer it names are still the same live objects
        # (`_repeat_launch` makes the same check inline, in the callback's own frame).
        if hit is not None:
            handles = inst.handles
            if hit[0] is not ref:
                hit = None
            else:
                for h, b in hit[1]:
                    if handles.get(h) is not b:
                        hit = None
                        break
        share = self.share
        if share is not None and (not share.busy or time.monotonic() >= share.next_check):
            share.launch()  # may hold the launch while the tenant is above its share
        if hit is not None:
            hit[2]()
        else:
            grid, block = (gx, gy, gz), (bx, by, bz)
            check_dims(self.backend.info.limits, grid, block, shared)
            records = parse_args(inst, raw)
            if ref.module.std:
                thunk = self._prepare_std(ref.name, grid, block, records)
            else:
                kargs = [(v[0].mem, v[1]) if t == Tag.BUFFER else typed(t, v) for t, v in records]
                thunk = self.backend.prepare(ref.obj, grid, block, shared, kargs)
            thunk()
            if len(inst.launch_cache) < 256:
                used = tuple((h, inst.handles[h]) for h in buffer_handles(raw))
                inst.launch_cache[key] = (ref, used, thunk)
        inst.launches += 1
        self.launches_total += 1
        return 0

    def _prepare_std(self, name: str, grid: tuple[int, int, int], block: tuple[int, int, int], records: list[tuple[Tag, Any]]) -> Callable[[], None]:
        spec = STD[name]
        values = check_std(name, spec, records)
        args = [self.backend.view(v[0].mem, v[1]) if p == "buf" else v for p, v in zip(spec.params, values, strict=True)]
        return self.backend.prepare_std(name, grid, block, args)

    def _synchronize(self, caller: CallerPtr, inst: Instance) -> int:
        self.backend.synchronize()
        self._idle()
        return 0

    def _idle(self) -> None:
        """The context's work is drained (every path that synchronizes ends here)."""
        if self.share is not None:
            self.share.idle()

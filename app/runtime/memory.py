"""Guest linear memories the worker keeps and reuses, through wasmtime's host memory creator.

wasmtime's default gives every instance a fresh mapping, so each call of a guest page-faults its
memory in again, and a GPU copy from or into it runs through the driver's pageable staging path
(4 MiB: 340 us in, 1.7 ms out into fresh pages, on an H200). A worker runs one guest at a time,
so it can keep one reserved region and hand it to each new instance instead:

- a region is one virtual reservation (wasmtime's `reserved` size plus its guard), PROT_NONE
  except the accessible prefix [0, size), so out-of-bounds accesses still trap exactly as before;
- after a call the region is scrubbed off the hot path (`scrub()`, run after the reply is
  sent). A small memory (up to 1 MiB used) is zeroed with memset and its prefix stays
  accessible, so the next instance of the same size needs no page-protection change at all;
  a larger one has its pinned chunks zeroed with memset, the rest dropped with MADV_DONTNEED
  (reads back as zeros), and goes back to PROT_NONE. Each mprotect or madvise of a worker (a
  process of several threads) costs a TLB shootdown: in a node, the scrub and the next
  instance's mprotect cost ~20 us a call. `new_memory` then opens or closes only the difference
  to the minimum it is asked for, so bytes past the memory's size always trap. A region is never
  handed out dirty: `new_memory` scrubs first if `scrub()` has not run;
- a backend may pin (page-lock) 2 MiB chunks of a region for DMA on first use (`segments()`),
  within a byte budget. Pinned chunks stay mapped to the same pages for the worker's life, so
  later calls copy at full bus speed (4 MiB: ~90 us each way), with no registration cost.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import wasmtime

log = logging.getLogger(__name__)

CHUNK = 2 << 20  # pinning granularity; aligned to the address, not the region
MIN_PIN_COPY = 256 << 10  # smaller copies go through the driver's staging path unchanged
ZERO_IN_PLACE = 1 << 20  # a memory used up to this is zeroed with memset and stays accessible
_MAX_WASM32 = 4 << 30

_PROT_NONE, _PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
_MADV_DONTNEED = 4
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_mprotect = _libc.mprotect
_mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_madvise = _libc.madvise
_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise OSError(ctypes.get_errno(), f"{what} failed")


@dataclass
class Region:
    """One reserved guest memory; host calls read its base and size while its instance runs."""

    base: int
    reserve: int  # bytes the memory may grow to without moving
    guard: int
    size: int = 0  # the memory's size now
    high: int = 0  # most accessible bytes since the last scrub
    open: int = 0  # bytes [0, open) readable and writable; the rest of the reservation PROT_NONE
    live: bool = False
    dirty: bool = False
    pinned: set[int] = field(default_factory=set)  # chunk addresses


Pin = Callable[[int, int], None]


class GuestMemory:
    """The worker's host memory creator: install() it on the Config before the Engine is made."""

    def __init__(self, pin_budget_bytes: int = 0) -> None:
        self.pin_budget_bytes = pin_budget_bytes
        self.pinned_bytes = 0
        self._pin: Pin | None = None
        self._regions: dict[int, Region] = {}  # base address -> region, for the worker's life
        self._live: Region | None = None  # the instance running now (one at a time)
        # ctypes callbacks must outlive every Engine that holds them
        self._cb_new = wasmtime._ffi.wasmtime_new_memory_callback_t(self._new_memory)
        self._cb_get = wasmtime._ffi.wasmtime_memory_get_callback_t(self._get_memory)
        self._cb_grow = wasmtime._ffi.wasmtime_memory_grow_callback_t(self._grow_memory)
        self._cb_free = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(self._release)
        self._creator = wasmtime._ffi.wasmtime_memory_creator_t(None, self._cb_new)  # no finalizer

    def install(self, config: wasmtime.Config) -> None:
        # copy-on-write data-segment images only work on wasmtime's own mappings (make_config
        # turns them off); segments are copied in at instantiation, into resident pages
        config.memory_init_cow = False
        wasmtime._ffi.wasmtime_config_host_memory_creator_set(config.ptr(), ctypes.byref(self._creator))

    def set_pinner(self, pin: Pin | None) -> None:
        """`pin(addr, length)` page-locks a range for DMA (the CUDA backend's cudaHostRegister)."""
        self._pin = pin

    # -- wasmtime callbacks (must never raise into Rust) ---------------------------------------
    def _new_memory(self, _env: Any, _ty: Any, minimum: int, maximum: int, reserved: int, guard: int, ret: Any) -> int:
        try:
            reserve = reserved or _MAX_WASM32  # a "dynamic" memory: reserve wasm32's limit, never move
            if minimum > reserve:
                return _error(f"memory minimum of {minimum} bytes exceeds the reservation of {reserve}")
            region = self._take(reserve, guard)
            if region.open < minimum:
                _check(_mprotect(region.base + region.open, minimum - region.open, _PROT_RW), "mprotect")
            elif region.open > minimum:  # left open by a larger memory before: past the size traps
                _check(_mprotect(region.base + minimum, region.open - minimum, _PROT_NONE), "mprotect")
            region.size = region.high = region.open = minimum
            region.live = True
            self._live = region
            out = ret.contents
            out.env = ctypes.c_void_p(region.base)
            out.get_memory = self._cb_get
            out.grow_memory = self._cb_grow
            out.finalizer = self._cb_free
            return 0
        except Exception as exc:  # wasmtime reports it as an instantiation error
            log.exception("creating a guest memory failed")
            return _error(f"creating the guest memory failed: {exc}")

    def _get_memory(self, env: int, size_out: Any, capacity_out: Any) -> int:
        region = self._regions[env]
        size_out[0] = region.size
        capacity_out[0] = region.reserve
        return region.base

    def _grow_memory(self, env: int, new_size: int) -> int:
        try:
            region = self._regions[env]
            if new_size > region.reserve:
                return _error(f"memory cannot grow past its reservation of {region.reserve} bytes")
            if new_size > region.size:
                _check(_mprotect(region.base + region.size, new_size - region.size, _PROT_RW), "mprotect")
            region.size = region.open = new_size
            region.high = max(region.high, new_size)
            return 0
        except Exception as exc:
            log.exception("growing a guest memory failed")
            return _error(f"growing the guest memory failed: {exc}")

    def _release(self, env: int) -> None:
        region = self._regions.get(env)
        if region is not None:
            region.live = False
            region.dirty = True
            if self._live is region:
                self._live = None

    def live_region(self, base: int) -> Region | None:
        """The in-use region starting at `base`: its `base` never moves and its `size` follows
        memory.grow, so a host function can bounds-check without asking wasmtime."""
        region = self._regions.get(base)
        return region if region is not None and region.live else None

    # -- regions ------------------------------------------------------------------------------
    def _take(self, reserve: int, guard: int) -> Region:
        for region in self._regions.values():
            if not region.live and region.reserve == reserve and region.guard == guard:
                if region.dirty:
                    self._scrub(region)
                return region
        base = _mmap(None, reserve + guard, _PROT_NONE, _MAP_FLAGS, -1, 0)
        if base is None or base == _MAP_FAILED:
            raise OSError(ctypes.get_errno(), "mmap of a guest memory reservation failed")
        region = Region(base=base, reserve=reserve, guard=guard)
        self._regions[base] = region
        return region

    def scrub(self) -> None:
        """Zero and protect every released region (call between invocations, off the hot path)."""
        for region in self._regions.values():
            if region.dirty and not region.live:
                self._scrub(region)

    def _scrub(self, region: Region) -> None:
        if region.high <= ZERO_IN_PLACE:  # zeroed in place, left open (two syscalls fewer a call)
            ctypes.memset(region.base, 0, region.high)
            region.open = region.high
            region.size = region.high = 0
            region.dirty = False
            return
        end = region.base + region.high
        pos = region.base
        for chunk in sorted(c for c in region.pinned if c < end):
            if chunk > pos:
                _check(_madvise(pos, chunk - pos, _MADV_DONTNEED), "madvise")
            ctypes.memset(chunk, 0, CHUNK)  # locked pages cannot be dropped: zero them in place
            pos = chunk + CHUNK
        if end > pos:
            _check(_madvise(pos, end - pos, _MADV_DONTNEED), "madvise")
        if region.high:
            _check(_mprotect(region.base, region.high, _PROT_NONE), "mprotect")
        region.size = region.high = region.open = 0
        region.dirty = False

    # -- DMA ----------------------------------------------------------------------------------
    def segments(self, addr: int, length: int) -> list[tuple[int, int, bool]]:
        """[(addr, length, pinned)] covering the range, split so no piece straddles a pinned
        chunk's edge; chunks of the live memory are pinned on first use while the budget lasts."""
        region = self._live
        if region is None or self._pin is None or length < MIN_PIN_COPY:
            return [(addr, length, False)]
        lo, hi = region.base, region.base + region.size
        if addr < lo or addr + length > hi:
            return [(addr, length, False)]
        out: list[tuple[int, int, bool]] = []
        pos, end = addr, addr + length
        while pos < end:
            chunk = pos & ~(CHUNK - 1)
            nxt = min(end, chunk + CHUNK)
            pinned = chunk in region.pinned or self._try_pin(region, chunk, lo, hi)
            if out and not pinned and not out[-1][2]:
                a, n, _ = out[-1]
                out[-1] = (a, n + nxt - pos, False)
            else:
                out.append((pos, nxt - pos, pinned))
            pos = nxt
        return out

    def _try_pin(self, region: Region, chunk: int, lo: int, hi: int) -> bool:
        if self._pin is None or chunk < lo or chunk + CHUNK > hi or self.pinned_bytes + CHUNK > self.pin_budget_bytes:
            return False
        try:
            self._pin(chunk, CHUNK)
        except Exception as exc:  # pinning is an optimisation: copy through staging instead
            log.warning("pinning guest memory failed, copies stay pageable: %s", exc)
            self._pin = None
            return False
        region.pinned.add(chunk)
        self.pinned_bytes += CHUNK
        return True


def _error(message: str) -> int:
    err = wasmtime._ffi.wasmtime_error_new(ctypes.create_string_buffer(message.encode()))
    return ctypes.cast(err, ctypes.c_void_p).value or 0

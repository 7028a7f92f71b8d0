"""Reused guest memories: every instance must still see a fresh, zeroed, bounds-checked memory."""

from __future__ import annotations

import ctypes

import pytest
import wasmtime

from app.runtime.engine import make_engine
from app.runtime.memory import CHUNK, MIN_PIN_COPY, ZERO_IN_PLACE, GuestMemory

PAGE = 65536
WAT = """(module
  (memory (export "memory") 1)
  (data (i32.const 16) "seed")
  (func (export "peek") (param i32) (result i32) (i32.load (local.get 0)))
  (func (export "poke") (param i32 i32) (i32.store (local.get 0) (local.get 1)))
  (func (export "grow") (param i32) (result i32) (memory.grow (local.get 0))))"""


class Guest:
    def __init__(self, engine: wasmtime.Engine, module: wasmtime.Module, limit: int = 64 << 20) -> None:
        self.store = wasmtime.Store(engine)
        self.store.set_limits(memory_size=limit)
        self.store.set_epoch_deadline(1 << 30)
        exports = wasmtime.Instance(self.store, module, []).exports(self.store)
        self.peek, self.poke, self.grow = exports["peek"], exports["poke"], exports["grow"]
        self.memory = exports["memory"]
        assert isinstance(self.memory, wasmtime.Memory)

    def base(self) -> int:
        return ctypes.addressof(self.memory.data_ptr(self.store).contents)

    def size(self) -> int:
        return self.memory.data_len(self.store)


@pytest.fixture
def memory() -> GuestMemory:
    return GuestMemory()


def setup(memory: GuestMemory) -> tuple[wasmtime.Engine, wasmtime.Module]:
    engine = make_engine(memory)
    return engine, wasmtime.Module(engine, WAT)


@pytest.mark.parametrize("scrub_between", [True, False])
def test_each_instance_starts_zeroed_with_its_data_segments(memory: GuestMemory, scrub_between: bool) -> None:
    engine, module = setup(memory)
    bases = set()
    for _ in range(3):
        g = Guest(engine, module)
        bases.add(g.base())
        assert g.size() == PAGE
        assert g.peek(g.store, 16) == int.from_bytes(b"seed", "little")
        assert g.peek(g.store, 1000) == 0
        assert g.grow(g.store, 3) == 1
        assert g.peek(g.store, 3 * PAGE + 8) == 0  # grown pages: zero, even where the last call wrote
        g.poke(g.store, 16, 0x41414141)
        g.poke(g.store, 1000, 7)
        g.poke(g.store, 3 * PAGE + 8, 9)
        del g
        if scrub_between:
            memory.scrub()
    assert len(bases) == 1  # the same region every time: that is the point


def test_out_of_bounds_still_traps_after_an_earlier_call_grew_the_memory(memory: GuestMemory) -> None:
    engine, module = setup(memory)
    g = Guest(engine, module)
    assert g.grow(g.store, 8) == 1
    g.poke(g.store, 8 * PAGE, 1)
    del g
    memory.scrub()
    g = Guest(engine, module)
    with pytest.raises(wasmtime.Trap, match="out of bounds"):
        g.peek(g.store, PAGE)
    with pytest.raises(wasmtime.Trap, match="out of bounds"):
        g.poke(g.store, 8 * PAGE, 1)


def test_a_small_memory_is_zeroed_in_place_and_the_next_instance_of_its_size_changes_no_protection(
    memory: GuestMemory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each mprotect or madvise of a worker costs a TLB shootdown: a repeated call of the same
    small guest makes none, and still starts zeroed and still traps past its size."""
    from app.runtime import memory as memory_module

    calls: list[str] = []
    for name in ("_mprotect", "_madvise"):
        real = getattr(memory_module, name)
        monkeypatch.setattr(memory_module, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    engine, module = setup(memory)
    g = Guest(engine, module)
    g.poke(g.store, 1000, 7)
    del g
    memory.scrub()
    calls.clear()
    g = Guest(engine, module)
    assert g.peek(g.store, 1000) == 0 and g.peek(g.store, 16) == int.from_bytes(b"seed", "little")
    with pytest.raises(wasmtime.Trap, match="out of bounds"):
        g.peek(g.store, PAGE)
    del g
    memory.scrub()
    assert calls == []


def test_a_memory_used_past_a_mebibyte_is_dropped_and_closed_as_before(memory: GuestMemory) -> None:
    engine, module = setup(memory)
    g = Guest(engine, module)
    assert g.grow(g.store, ZERO_IN_PLACE // PAGE) == 1
    g.poke(g.store, ZERO_IN_PLACE, 5)
    base = g.base()
    del g
    memory.scrub()
    assert memory._regions[base].open == 0  # all of it PROT_NONE again, its pages given back
    g = Guest(engine, module)
    assert g.peek(g.store, 1000) == 0
    with pytest.raises(wasmtime.Trap, match="out of bounds"):
        g.peek(g.store, ZERO_IN_PLACE)


def test_growth_respects_the_store_limit_and_the_live_region_follows_it(memory: GuestMemory) -> None:
    engine, module = setup(memory)
    g = Guest(engine, module, limit=4 * PAGE)
    region = memory.live_region(g.base())
    assert region is not None and region.size == PAGE
    assert g.grow(g.store, 3) == 1
    assert g.grow(g.store, 1) == -1
    assert g.size() == region.size == 4 * PAGE
    base = g.base()
    del g
    assert memory.live_region(base) is None  # released with its store


def test_segments_pin_whole_chunks_inside_the_live_memory_within_budget() -> None:
    memory = GuestMemory(pin_budget_bytes=2 * CHUNK)
    pinned: list[tuple[int, int]] = []
    memory.set_pinner(lambda addr, n: pinned.append((addr, n)))
    engine, module = setup(memory)
    g = Guest(engine, module, limit=64 << 20)
    assert g.grow(g.store, (16 << 20) // PAGE) == 1
    base = g.base()
    first = (base + CHUNK) & ~(CHUNK - 1)  # a whole chunk with memory before it
    # small copies are left to the driver
    assert memory.segments(first, MIN_PIN_COPY - 1) == [(first, MIN_PIN_COPY - 1, False)]
    start = first + 4096  # mid-chunk: the piece up to the chunk's edge is its own segment
    segs = memory.segments(start, 3 * CHUNK)
    assert pinned == [(first, CHUNK), (first + CHUNK, CHUNK)]  # the budget stops at two chunks
    assert segs == [
        (start, CHUNK - 4096, True),
        (first + CHUNK, CHUNK, True),
        (first + 2 * CHUNK, CHUNK + 4096, False),  # unpinned pieces merge into one copy
    ]
    # ranges outside the live memory are never pinned
    assert memory.segments(base + g.size(), CHUNK) == [(base + g.size(), CHUNK, False)]
    # pinned chunks are zeroed in place at scrub (they must not be dropped)
    ctypes.memset(first, 0x5A, CHUNK)
    del g
    memory.scrub()
    g = Guest(engine, module, limit=64 << 20)
    assert g.grow(g.store, (16 << 20) // PAGE) == 1
    assert ctypes.string_at(first, CHUNK) == bytes(CHUNK)
    assert memory.segments(first, CHUNK) == [(first, CHUNK, True)]
    assert len(pinned) == 2  # still pinned from before: no second registration


def test_a_failing_pinner_turns_pinning_off_and_copies_stay_correct() -> None:
    memory = GuestMemory(pin_budget_bytes=64 << 20)

    def refuse(addr: int, n: int) -> None:
        raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered")

    memory.set_pinner(refuse)
    engine, module = setup(memory)
    g = Guest(engine, module)
    assert g.grow(g.store, (8 << 20) // PAGE) == 1
    base = g.base()
    assert memory.segments(base, 4 << 20) == [(base, 4 << 20, False)]
    assert memory.pinned_bytes == 0

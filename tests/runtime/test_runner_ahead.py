"""The next call's instance built ahead (`GuestRunner.prepare`): only for a module without a start
function, always fresh, dropped for a call of another function or memory limit, and a call on it
keeps its own deadline, output and errors."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from app.contract.messages import Run
from app.runtime.artifacts import ArtifactCache
from app.runtime.engine import make_engine
from app.runtime.memory import GuestMemory
from app.runtime.runner import GuestRunner
from app.runtime.validation import has_start_function
from tests.helpers import compile_artifact, counter_module, wat

MiB = 1 << 20


@dataclass
class Guests:
    runner: GuestRunner
    memory: GuestMemory
    cache: ArtifactCache
    sha: dict[str, str]

    def req(self, guest: str, memory_bytes: int = MiB, timeout_ms: int = 10_000) -> Run:
        return Run("inv", guest, self.sha[guest], {}, timeout_ms, memory_bytes, 1 << 20, 1 << 16)

    def ahead(self, guest: str, memory_bytes: int = MiB) -> Run:
        """A call's request, its module loaded and its instance built ahead."""
        req = self.req(guest, memory_bytes)
        self.runner.run(req, b"")
        self.runner.prepare(req)
        assert self.runner._ready is not None
        return req


@pytest.fixture(scope="module")
def memory() -> GuestMemory:
    return GuestMemory()  # module scope: its callbacks outlive the engine that holds them


@pytest.fixture
def guests(tmp_path: Path, memory: GuestMemory) -> Iterator[Guests]:
    cache = ArtifactCache(tmp_path)
    binaries = {
        "counter": counter_module(),
        "big": counter_module(pages=2),
        "started": counter_module(start_function=True),
        **{name: wat(name) for name in ("loop", "trap", "echo")},
    }
    runner = GuestRunner(make_engine(memory), cache, None, 5, memory)
    yield Guests(runner, memory, cache, {k: compile_artifact(cache, v) for k, v in binaries.items()})
    runner.finish()
    runner.discard_ready()


def test_only_a_module_without_a_start_function_is_built_ahead(guests: Guests, c_guest: Callable[[str], bytes]) -> None:
    assert not has_start_function(counter_module())
    assert has_start_function(counter_module(start_function=True))
    assert not has_start_function(c_guest("hello.c"))  # a C command: data segments, no start
    assert guests.cache.has_no_start_function(guests.sha["counter"])
    assert not guests.cache.has_no_start_function(guests.sha["started"])
    r = guests.runner
    req = guests.req("started")
    for _ in range(3):
        r.prepare(req)
        assert r._ready is None
        res = r.run(req, b"")
        assert res.status == "ok" and bytes(res.stdout) == b"2"  # its start function ran at the call
    r.prepare(guests.req("counter"))
    assert r._ready is None  # not loaded yet: prepare reads no artifact


def test_every_call_gets_a_fresh_instance(guests: Guests) -> None:
    r = guests.runner
    req = guests.ahead("counter")
    for _ in range(5):
        assert r._ready is not None
        res = r.run(req, b"")
        assert r._ready is None  # used by this call
        assert res.status == "ok" and bytes(res.stdout) == b"1"
        guests.memory.scrub()
        r.prepare(req)


def test_a_call_of_another_function_drops_the_ready_instance_first(guests: Guests) -> None:
    r = guests.runner
    guests.ahead("counter")
    regions = len(guests.memory._regions)
    res = r.run(guests.req("echo"), b"hi")
    assert res.status == "ok" and bytes(res.stdout) == b"hi"
    assert r._ready is None
    assert len(guests.memory._regions) == regions  # its memory went back before the call's


def test_a_call_under_another_memory_limit_is_not_run_on_the_ready_instance(guests: Guests) -> None:
    r = guests.runner
    guests.ahead("big", 4 * MiB)
    res = r.run(guests.req("big", 64 << 10), b"")  # the module needs two pages
    assert res.status == "error"
    assert res.error == "the module needs more linear memory than the tenant's limit (65536 bytes)"
    r.prepare(guests.req("big", 64 << 10))  # fails ahead: left to the call, which reports it
    assert r._ready is None
    assert r.run(guests.req("big", 64 << 10), b"").error == res.error
    res = r.run(guests.req("big", 4 * MiB), b"")
    assert res.status == "ok" and bytes(res.stdout) == b"1"


def test_a_call_on_a_ready_instance_keeps_its_own_time_limit(guests: Guests) -> None:
    r = guests.runner
    req = guests.req("loop", timeout_ms=200)
    r.run(guests.req("loop", timeout_ms=50), b"")  # loads it
    r.prepare(req)
    assert r._ready is not None
    t0 = time.monotonic()
    res = r.run(req, b"")
    assert res.status == "timeout" and "time limit of 200 ms" in (res.error or "")
    assert time.monotonic() - t0 < 2.0


def test_a_trap_on_a_ready_instance_is_reported_and_the_next_call_is_clean(guests: Guests) -> None:
    r = guests.runner
    req = guests.ahead("trap")
    first = r.run(req, b"")
    assert first.status == "trap"
    r.prepare(req)
    again = r.run(req, b"")
    assert (again.status, again.error) == (first.status, first.error)
    guests.ahead("counter")
    res = r.run(guests.req("counter"), b"")
    assert res.status == "ok" and bytes(res.stdout) == b"1"


def test_a_calls_store_closes_after_its_reply_and_one_memory_serves_every_call(guests: Guests) -> None:
    r, memory = guests.runner, guests.memory
    req = guests.req("counter")
    first = r.run(req, b"")
    assert first.status == "ok"
    live = [region for region in memory._regions.values() if region.live]
    assert len(live) == 1  # the call's store stays open until `finish`: its memory is not scrubbed yet
    r.finish()
    assert not any(region.live for region in memory._regions.values())
    regions = len(memory._regions)
    for _ in range(5):  # without `finish`, the next call closes the last store first and reuses its memory
        assert r.run(req, b"").status == "ok"
    r.finish()
    assert len(memory._regions) == regions

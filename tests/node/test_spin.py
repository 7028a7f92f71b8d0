"""Polling instead of sleeping after a message (app/node/spin.py): for its stretch, stopped at
the first yield that hands the core to another process, never while every core is taken or when
switched off; and a front's loop kept turning while it polls, then left to sleep. The
involuntary switches and the host's load are values the tests set, so no test depends on what
else runs on the host."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.node import spin as spin_module
from app.node.spin import Awake, Spin


@pytest.fixture(autouse=True)
def full(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """Whether every core of the host has a runnable process (none, unless a test says so)."""
    flag = [False]
    monkeypatch.setattr(spin_module, "_host_full", lambda: flag[0])
    yield flag


@pytest.fixture
def switches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    count = [0]
    monkeypatch.setattr(spin_module, "_switches", lambda: count[0])
    yield count


def test_switched_off_it_never_polls(switches: list[int]) -> None:
    s = Spin(0.0)
    assert not s.start(100.0) and not s.keep(100.0)


def test_it_polls_for_its_stretch_from_the_last_message(switches: list[int]) -> None:
    s = Spin(0.001)
    assert s.start(100.0)
    assert s.keep(100.0005)
    assert s.start(100.0008)  # a message within the stretch: it runs from there
    assert s.keep(100.0015)
    assert not s.keep(100.0019)


def test_a_yield_that_gives_the_core_away_ends_the_stretch(switches: list[int]) -> None:
    s = Spin(0.001)
    assert s.start(100.0) and s.keep(100.0001)
    switches[0] += 1  # another process took the core at the yield
    assert not s.keep(100.0002)
    assert not s.keep(100.0003)  # ... and it stays ended
    assert s.start(100.0004) and s.keep(100.0005)  # the next message starts a new one, counted from there


def test_no_stretch_starts_while_every_core_is_taken(switches: list[int], full: list[bool]) -> None:
    s = Spin(0.001)
    full[0] = True
    assert not s.start(100.0) and not s.keep(100.0001)
    full[0] = False
    assert not s.start(100.0005)  # the load is read at most every LOAD_EVERY_S
    assert s.start(100.0 + spin_module.LOAD_EVERY_S) and s.keep(100.0011)


def test_the_load_is_read_from_procfs(tmp_path: Path) -> None:
    load = spin_module._Load()
    assert load._fd is not None and isinstance(load.full(), bool)  # the host's own file reads
    for running, full in ((spin_module._CORES, True), (spin_module._CORES - 1, False)):
        loadavg = tmp_path / "loadavg"
        loadavg.write_bytes(b"0.50 0.40 0.30 %d/300 12345\n" % running)
        load._fd = os.open(loadavg, os.O_RDONLY)
        assert load.full() is full, running
        os.close(load._fd)


async def test_a_poked_loop_turns_while_it_polls_then_sleeps(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = [0]  # each poll reads the switches once (and the stretch's start once)

    def unswitched() -> int:
        reads[0] += 1
        return 0

    monkeypatch.setattr(spin_module, "_switches", unswitched)
    awake = Awake(0.02)
    awake.poke()
    awake.poke()  # a second poke while ticking adds no second ticker
    t0 = time.monotonic()
    await asyncio.sleep(0.01)
    # asleep, the loop would have turned once, for the sleep's timer, and read the switches only
    # at the stretch's start; polling, it turns and reads them at every tick (hundreds on a quiet
    # host, 24 on CI's busy 2 cores, where each yield gives the core away for a while)
    assert reads[0] > 5, reads
    await asyncio.sleep(0.03)
    assert not awake._ticking and time.monotonic() - t0 >= 0.02
    settled = reads[0]
    await asyncio.sleep(0.01)
    assert reads[0] == settled  # past its stretch, nothing ticks


async def test_a_switched_off_loop_is_never_ticked(switches: list[int]) -> None:
    awake = Awake(0.0)
    awake.poke()
    assert not awake._ticking

"""The node's turns at SQLite's write lock (app/db/write_turn.py): two turns on one file stand for
two fronts (each open of the file is its own holder)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from app.db.write_turn import WriteTurn


async def test_a_turn_waits_for_the_holder_and_runs_the_moment_it_lets_go(tmp_path: Path) -> None:
    a, b = WriteTurn(tmp_path / "db.write-turn"), WriteTurn(tmp_path / "db.write-turn")
    order: list[str] = []
    release = asyncio.Event()

    async def first() -> None:
        async with a:
            order.append("a in")
            await release.wait()
            order.append("a out")

    async def second() -> None:
        async with b:
            order.append("b in")

    holder = asyncio.create_task(first())
    await asyncio.sleep(0.05)
    waiter = asyncio.create_task(second())
    await asyncio.sleep(0.2)
    assert order == ["a in"]  # b waits while a holds the turn
    release.set()
    await asyncio.wait_for(asyncio.gather(holder, waiter), 5)
    assert order == ["a in", "a out", "b in"]
    a.close(), b.close()


async def test_a_waiter_cancelled_gives_back_the_turn_it_gets_later(tmp_path: Path) -> None:
    path = tmp_path / "db.write-turn"
    a, b, c = WriteTurn(path), WriteTurn(path), WriteTurn(path)
    release = asyncio.Event()

    async def hold() -> None:
        async with a:
            await release.wait()

    async def wait_turn(turn: WriteTurn) -> None:
        async with turn:
            pass

    holder = asyncio.create_task(hold())
    await asyncio.sleep(0.05)
    waiter = asyncio.create_task(wait_turn(b))
    await asyncio.sleep(0.1)
    waiter.cancel()  # its thread still waits in the kernel, and gets the turn once a lets go
    await asyncio.gather(waiter, return_exceptions=True)
    release.set()
    await holder
    # b's late turn was given back: c, another front, gets one
    await asyncio.wait_for(wait_turn(c), 5)
    a.close(), b.close(), c.close()


async def test_writers_of_one_process_take_turns_too(tmp_path: Path) -> None:
    """One process's writers share its file (a second lock of it would not wait): its own lock
    orders them first. In-memory SQLite has that lock alone; PostgreSQL none."""
    for turn in (WriteTurn(tmp_path / "db.write-turn"), WriteTurn.for_url("sqlite://")):
        inside = 0
        most = 0

        async def write(turn: WriteTurn = turn) -> None:
            nonlocal inside, most
            async with turn:
                inside += 1
                most = max(most, inside)
                await asyncio.sleep(0.01)
                inside -= 1

        await asyncio.gather(*(write() for _ in range(5)))
        assert most == 1
        turn.close()
    free = WriteTurn.for_url("postgresql://u@127.0.0.1/db")
    entered = asyncio.Barrier(3)

    async def at_once() -> None:
        async with free:
            await asyncio.wait_for(entered.wait(), 5)  # all three inside at once

    await asyncio.gather(*(at_once() for _ in range(3)))


def test_only_a_sqlite_file_has_a_turn_file(tmp_path: Path) -> None:
    turn = WriteTurn.for_url(f"sqlite:///{tmp_path}/tensorwasm.db")
    assert turn.path == tmp_path / "tensorwasm.db.write-turn" and turn.path.exists()
    turn.close()
    for url in ("sqlite://", "sqlite:///:memory:", "postgresql://u@127.0.0.1/db"):
        assert WriteTurn.for_url(url).path is None

"""A call's deadline (app/node/deadline.py): TimeoutError for its own expiry only, a block that
ends in time untouched, a `check` that may let the block run on, nesting as asyncio.timeout
nests, and the task left uncancelled afterwards in every case."""

from __future__ import annotations

import asyncio

import pytest

from app.node.deadline import Deadline


async def _after(seconds: float, value: str = "done") -> str:
    await asyncio.sleep(seconds)
    return value


async def test_a_block_that_ends_in_time_is_untouched() -> None:
    with Deadline(1.0) as d:
        got = await _after(0.01)
    assert got == "done" and not d.expired
    await asyncio.sleep(0)  # no cancellation left pending on the task
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_its_expiry_is_a_timeout_and_the_task_runs_on() -> None:
    with pytest.raises(TimeoutError), Deadline(0.01) as d:
        await _after(5)
    assert d.expired
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
    assert await _after(0.001, "next") == "next"  # the task is not cancelled again


async def test_a_past_deadline_expires_at_the_first_await() -> None:
    with pytest.raises(TimeoutError), Deadline(-1.0):
        await _after(5)


async def test_a_check_that_says_no_lets_the_block_run_on() -> None:
    asked: list[bool] = []

    def check() -> bool:
        asked.append(True)
        return False

    with Deadline(0.01, check) as d:
        got = await _after(0.05)
    assert got == "done" and asked == [True] and not d.expired


async def test_a_cancellation_from_elsewhere_passes_through() -> None:
    async def guarded() -> None:
        with Deadline(5.0):
            await _after(5)

    task = asyncio.create_task(guarded())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()


async def test_the_inner_of_two_deadlines_that_expire_together_leaves_it_to_the_outer() -> None:
    # as asyncio.timeout: each turns only its own cancellation into TimeoutError
    inner_expired = False
    with pytest.raises(TimeoutError), Deadline(0.0) as outer:
        try:
            with Deadline(0.0) as inner:
                await _after(5)
        except TimeoutError:
            pytest.fail("the inner deadline claimed a cancellation the outer one also asked for")
        finally:
            inner_expired = inner.expired
    assert outer.expired and inner_expired
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_an_inner_deadline_expiring_alone_is_the_inners() -> None:
    with Deadline(5.0) as outer:
        with pytest.raises(TimeoutError), Deadline(0.01):
            await _after(5)
        assert await _after(0.001, "after") == "after"
    assert not outer.expired


async def test_a_deadline_needs_a_task() -> None:
    loop = asyncio.get_running_loop()
    raised: asyncio.Future[BaseException | None] = loop.create_future()

    def callback() -> None:  # on the loop, in no task
        try:
            with Deadline(1.0):
                pass
        except RuntimeError as exc:
            raised.set_result(exc)
        else:
            raised.set_result(None)

    loop.call_soon(callback)
    assert "task" in str(await raised)

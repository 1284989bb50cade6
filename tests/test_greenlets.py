"""Synchronous code run from the event loop in kept greenlets (`services/scheduler/greenlets.py`):
what SQLAlchemy's `greenlet_spawn` does, without a new greenlet per call."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import weakref

import greenlet
import pytest
from sqlalchemy.util.concurrency import await_only, in_greenlet

from services.scheduler.greenlets import run


def where() -> greenlet.greenlet:
    return greenlet.getcurrent()


async def test_calls_one_after_another_share_one_greenlet_that_sqlalchemy_may_wait_in() -> None:
    main = greenlet.getcurrent()
    seen = {await run(where) for _ in range(10)}
    assert len(seen) == 1 and main not in seen

    def waits(value: int) -> tuple[bool, int]:
        return in_greenlet(), await_only(asyncio.sleep(0, result=value)) + 1

    assert [await run(waits, n) for n in range(3)] == [(True, 1), (True, 2), (True, 3)]
    assert await run(where) in seen


async def test_errors_reach_the_caller_and_the_greenlet_serves_on() -> None:
    first = await run(where)

    def fails() -> None:
        raise ValueError("no such row")

    with pytest.raises(ValueError, match="no such row"):
        await run(fails)

    async def refused() -> int:
        raise LookupError("the driver said no")

    def handles() -> str:
        try:
            await_only(refused())
        except LookupError as error:
            return f"handled: {error}"
        return "not thrown"

    assert await run(handles) == "handled: the driver said no"
    assert await run(where) is first


async def test_a_cancelled_caller_throws_into_the_call_which_cleans_up() -> None:
    """As a statement cut short by a cancellation rolls its transaction back: the
    cancellation is raised inside the call where it waits, the call's own handling
    runs (and may wait again), and the caller ends cancelled; the greenlet is kept."""
    kept = await run(where)
    waiting = asyncio.get_running_loop().create_future()
    cleaned: list[str] = []

    def statement() -> None:
        try:
            await_only(waiting)
        except asyncio.CancelledError:
            await_only(asyncio.sleep(0))  # a ROLLBACK's own trip
            cleaned.append("rolled back")
            raise

    task = asyncio.create_task(run(statement))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned == ["rolled back"]
    assert await run(where) is kept


async def test_calls_at_once_each_have_a_greenlet_and_then_share_them() -> None:
    gates = [asyncio.Event() for _ in range(2)]

    def held(gate: asyncio.Event) -> greenlet.greenlet:
        await_only(gate.wait())
        return greenlet.getcurrent()

    async def both() -> set[greenlet.greenlet]:
        calls = [asyncio.create_task(run(held, gate)) for gate in gates]
        await asyncio.sleep(0)
        for gate in gates:
            gate.set()
        used = set(await asyncio.gather(*calls))
        for gate in gates:
            gate.clear()
        return used

    first = await both()
    assert len(first) == 2
    assert await both() == first


async def test_the_call_sees_its_callers_context() -> None:
    user: contextvars.ContextVar[str] = contextvars.ContextVar("user", default="nobody")

    async def as_user(name: str) -> str:
        user.set(name)
        return await run(user.get)

    assert await asyncio.gather(as_user("alice"), as_user("bob")) == ["alice", "bob"]


async def test_an_idle_greenlet_keeps_nothing_of_its_last_call_alive() -> None:
    class Rows:
        pass

    def fetch() -> Rows:
        return Rows()

    rows = await run(fetch)
    kept = weakref.ref(rows)
    del rows
    gc.collect()
    assert kept() is None

    def fails() -> None:
        raise LookupError(Rows())

    with pytest.raises(LookupError) as raised:
        await run(fails)
    kept = weakref.ref(raised.value.args[0])
    del raised
    gc.collect()
    assert kept() is None

    runner = await run(where)
    assert runner.gr_context is None  # not the last caller's context, with its variables

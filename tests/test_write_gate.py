"""SQLite's one writer in turns: a waiting client goes first, background work is never
starved, and a waiter cancelled at any moment leaves the gate working."""

from __future__ import annotations

import asyncio

from services.scheduler.db import Database
from services.scheduler.write_gate import WriteGate


async def holder(gate: WriteGate, name: str, urgent: bool, order: list[str]) -> None:
    async with gate.turn(urgent):
        order.append(name)
        await asyncio.sleep(0)


async def queued(gate: WriteGate, *writers: tuple[str, bool]) -> list[str]:
    """Runs the writers, each asking for its turn while the gate is held, in this order;
    returns the order they got it in."""
    order: list[str] = []
    release = asyncio.Event()

    async def first() -> None:
        async with gate.turn(False):
            await release.wait()

    tasks = [asyncio.create_task(first())]
    await asyncio.sleep(0)
    for name, urgent in writers:
        tasks.append(asyncio.create_task(holder(gate, name, urgent, order)))
        await asyncio.sleep(0)
    assert gate.waiting == len(writers)
    release.set()
    await asyncio.gather(*tasks)
    assert gate.waiting == 0
    return order


async def test_a_lone_writer_goes_at_once() -> None:
    gate = WriteGate()
    order: list[str] = []
    await asyncio.wait_for(holder(gate, "a", False, order), 1)
    await asyncio.wait_for(holder(gate, "b", True, order), 1)
    assert order == ["a", "b"]


async def test_a_waiting_client_goes_before_waiting_background_work() -> None:
    gate = WriteGate()
    order = await queued(gate, ("report", False), ("admission", False), ("submit", True))
    assert order == ["submit", "report", "admission"]


async def test_background_work_gets_every_other_turn_under_a_stream_of_clients() -> None:
    gate = WriteGate()
    writers = [("s1", True), ("r1", False), ("s2", True), ("s3", True), ("r2", False)]
    assert await queued(gate, *writers) == ["s1", "r1", "s2", "r2", "s3"]


async def test_a_cancelled_waiter_is_skipped() -> None:
    gate = WriteGate()
    order: list[str] = []
    release = asyncio.Event()

    async def first() -> None:
        async with gate.turn(False):
            await release.wait()

    held = asyncio.create_task(first())
    await asyncio.sleep(0)
    gone = asyncio.create_task(holder(gate, "gone", True, order))
    kept = asyncio.create_task(holder(gate, "kept", False, order))
    await asyncio.sleep(0)
    gone.cancel()
    release.set()
    await asyncio.gather(held, kept)
    assert order == ["kept"] and gone.cancelled() and gate.waiting == 0
    # The gate is free again.
    await asyncio.wait_for(holder(gate, "after", True, order), 1)


async def test_a_waiter_cancelled_as_it_is_handed_the_turn_passes_it_on() -> None:
    gate = WriteGate()
    order: list[str] = []
    release = asyncio.Event()
    tasks: dict[str, asyncio.Task[None]] = {}

    async def first() -> None:
        async with gate.turn(False):
            await release.wait()
        # In the same step as the hand-over: `handed` holds the turn but has not run.
        tasks["handed"].cancel()

    held = asyncio.create_task(first())
    await asyncio.sleep(0)
    tasks["handed"] = asyncio.create_task(holder(gate, "handed", True, order))
    next_one = asyncio.create_task(holder(gate, "next", False, order))
    await asyncio.sleep(0)
    release.set()
    await held
    await asyncio.wait_for(next_one, 1)
    assert order == ["next"] and tasks["handed"].cancelled() and gate.waiting == 0


def test_only_sqlite_has_a_gate(tmp_path: object) -> None:
    assert Database.open(f"sqlite:///{tmp_path}/x.db").gate is not None
    assert Database.open("postgresql://postgres@127.0.0.1:5432/test").gate is None

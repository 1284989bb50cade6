"""The database's writers in turns (`db/turns.py`): a waiting client goes first,
background work is never starved, a quiet turn waits for the writes under way and
goes before those asked for after it, and a waiter cancelled at any moment leaves
the turns working."""

from __future__ import annotations

import asyncio
import functools

import pytest

from services.common import settings
from services.scheduler.db import Database
from services.scheduler.db.turns import Turns
from services.scheduler.main import SETTINGS


async def holder(gate: Turns, name: str, urgent: bool, order: list[str]) -> None:
    async with gate.turn(urgent):
        order.append(name)
        await asyncio.sleep(0)


async def background(gate: Turns, release: asyncio.Event) -> None:
    """Background work that holds the gate until `release` is set."""
    async with gate.turn(False):
        await release.wait()


async def queued(gate: Turns, *writers: tuple[str, bool]) -> list[str]:
    """Runs the writers, each asking for its turn while the gate is held, in this order;
    returns the order they got it in."""
    order: list[str] = []
    release = asyncio.Event()
    tasks = [asyncio.create_task(background(gate, release))]
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
    gate = Turns()
    order: list[str] = []
    await asyncio.wait_for(holder(gate, "a", False, order), 1)
    await asyncio.wait_for(holder(gate, "b", True, order), 1)
    assert order == ["a", "b"]


async def test_a_waiting_client_goes_before_waiting_background_work() -> None:
    gate = Turns()
    order = await queued(gate, ("report", False), ("admission", False), ("submit", True))
    assert order == ["submit", "report", "admission"]


async def test_background_work_gets_every_other_turn_under_a_stream_of_clients() -> None:
    gate = Turns()
    writers = [("s1", True), ("r1", False), ("s2", True), ("s3", True), ("r2", False)]
    assert await queued(gate, *writers) == ["s1", "r1", "s2", "r2", "s3"]


async def test_a_cancelled_waiter_is_skipped() -> None:
    gate = Turns()
    order: list[str] = []
    release = asyncio.Event()
    held = asyncio.create_task(background(gate, release))
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
    gate = Turns()
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


async def test_sqlite_has_one_writer_and_postgresql_as_many_as_asked(tmp_path: object) -> None:
    """One by default on both; PostgreSQL may have more, or no limit (0)."""
    sqlite = Database.open(f"sqlite:///{tmp_path}/x.db", writers=0)
    assert sqlite.turns.writers == 1
    await sqlite.close()
    postgres = "postgresql://postgres@127.0.0.1:5432/test"
    for writers in (0, 1, 3):
        assert Database.open(postgres, writers=writers).turns.writers == writers
    assert Database.open(postgres).turns.writers == 1


async def test_a_gate_of_two_writers_lets_two_in_and_queues_the_third() -> None:
    gate = Turns(writers=2)
    inside: list[str] = []
    release = asyncio.Event()

    async def writer(name: str) -> None:
        async with gate.turn(False):
            inside.append(name)
            await release.wait()

    tasks = [asyncio.create_task(writer(name)) for name in "abc"]
    await asyncio.sleep(0)
    assert inside == ["a", "b"] and gate.waiting == 1
    release.set()
    await asyncio.gather(*tasks)
    assert inside == ["a", "b", "c"] and gate.waiting == 0
    # Every turn was given back: two go in at once again.
    release.clear()
    tasks = [asyncio.create_task(writer(name)) for name in "de"]
    await asyncio.sleep(0)
    assert inside[3:] == ["d", "e"] and gate.waiting == 0
    release.set()
    await asyncio.gather(*tasks)


async def test_a_quiet_turn_waits_for_the_writes_under_way_and_goes_before_later_ones() -> None:
    """Under a stream of writes (two writers, always one more waiting), a quiet turn
    comes as soon as the writes under way end: the writes asked for after it wait."""
    turns = Turns(writers=2)
    order: list[str] = []
    releases = {name: asyncio.Event() for name in ("a", "b", "c", "d")}

    async def writer(name: str, client: bool = False) -> None:
        async with turns.turn(client):
            order.append(name)
            await releases[name].wait()
        order.append(f"/{name}")

    async def quiet() -> None:
        async with turns.quiet():
            assert turns.holders == 0
            order.append("quiet")
            await asyncio.sleep(0)
        order.append("/quiet")

    a, b = (asyncio.create_task(writer(n)) for n in "ab")
    await asyncio.sleep(0)
    q = asyncio.create_task(quiet())
    await asyncio.sleep(0)
    c = asyncio.create_task(writer("c", client=True))
    d = asyncio.create_task(writer("d"))
    await asyncio.sleep(0)
    assert order == ["a", "b"]  # the quiet turn waits, and so do c and d behind it
    releases["a"].set()
    await a
    assert order == ["a", "b", "/a"]  # still b under way: neither c nor d got in
    releases["b"].set()
    await q
    assert order[:5] == ["a", "b", "/a", "/b", "quiet"]
    releases["c"].set()
    releases["d"].set()
    await asyncio.gather(b, c, d)
    assert order.index("c") > order.index("/quiet") and order.index("d") > order.index("/quiet")


async def test_a_quiet_turn_cancelled_while_it_waits_lets_the_writes_go_on() -> None:
    turns = Turns()
    release = asyncio.Event()
    held = asyncio.create_task(background(turns, release))
    await asyncio.sleep(0)

    async def quiet() -> None:
        async with turns.quiet():
            raise AssertionError("never granted: cancelled first")

    waiting = asyncio.create_task(quiet())
    await asyncio.sleep(0)
    order: list[str] = []
    later = asyncio.create_task(holder(turns, "later", False, order))
    await asyncio.sleep(0)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    release.set()
    await asyncio.wait_for(asyncio.gather(held, later), 1)
    assert order == ["later"] and turns.waiting == 0


def test_db_writers_is_a_flag_and_a_variable_and_refuses_a_negative_count(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parse = functools.partial(settings.parse, "mj-scheduler", "", SETTINGS)
    assert parse([], {}).db_writers == 1
    assert parse([], {"MJ_DB_WRITERS": "0"}).db_writers == 0
    assert parse(["--db-writers", "4"], {"MJ_DB_WRITERS": "0"}).db_writers == 4
    with pytest.raises(SystemExit):
        parse(["--db-writers", "-1"], {})
    assert "--db-writers: not a whole number: '-1'" in capsys.readouterr().err

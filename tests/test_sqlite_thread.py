"""Writes on SQLite: one round trip to aiosqlite's worker thread per statement in the
background, with the answers SQLite gave (rows, RETURNING, row counts, errors), and
none on the event loop's own connections."""

from __future__ import annotations

import asyncio
import functools
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiosqlite
import greenlet
import pytest
from sqlalchemy import func, select, text, update
from sqlalchemy.exc import IntegrityError
from test_store import new_job

from services.common.statuses import ScheduleState
from services.scheduler.db import Database
from services.scheduler.events import EventBus
from services.scheduler.models import JobRow
from services.scheduler.sqlite_checkpoint import Checkpointer
from services.scheduler.store import Store

St = ScheduleState


@contextmanager
def trips_and_statements() -> Iterator[tuple[list[str], list[str]]]:
    """Round trips to aiosqlite's worker threads, and the statements SQLite ran on
    their connections, while the block runs."""
    trips: list[str] = []
    statements: list[str] = []
    traced: list[aiosqlite.Connection] = []
    original = aiosqlite.Connection._execute

    async def counted(self: aiosqlite.Connection, fn: Any, *args: Any, **kwargs: Any) -> Any:
        trips.append(getattr(fn, "__name__", repr(fn)))
        if self not in traced:  # the trace sees each statement, however many a trip runs
            self._conn.set_trace_callback(statements.append)
            traced.append(self)
        return await original(self, fn, *args, **kwargs)

    aiosqlite.Connection._execute = counted  # type: ignore[method-assign]
    try:
        yield trips, statements
    finally:
        aiosqlite.Connection._execute = original  # type: ignore[method-assign]
        for connection in traced:
            connection._conn.set_trace_callback(None)


async def test_a_background_write_makes_one_trip_per_statement(sqlite_store: Store) -> None:
    """An admission-like transaction: BEGIN, a read, an UPDATE ... RETURNING, a plain
    UPDATE and COMMIT are five statements and five trips, and each answers as SQLite
    did (aiosqlite's own cursor took three to four trips per statement)."""
    ids = [job_id for job_id, _ in await sqlite_store.submit_many([new_job() for _ in range(3)])]
    with trips_and_statements() as (trips, statements):
        async with sqlite_store.db.write() as session:
            queued = (
                await session.execute(
                    select(JobRow.id).where(JobRow.schedule_state == St.WAITING).order_by(JobRow.id)
                )
            ).scalars()
            assert list(queued) == ids
            moved = (
                await session.execute(
                    update(JobRow)
                    .where(JobRow.id.in_(ids[:2]))
                    .values(epoch=JobRow.epoch + 1)
                    .returning(JobRow.id, JobRow.epoch),
                )
            ).all()
            assert sorted(moved) == [(ids[0], 1), (ids[1], 1)]
            touched = await session.execute(
                update(JobRow).where(JobRow.id >= ids[1]).values(wait_reason="x"),
            )
            assert touched.rowcount == 2  # type: ignore[attr-defined]
    ran = [s.split()[0] for s in statements]
    assert ran == ["BEGIN", "SELECT", "UPDATE", "UPDATE", "COMMIT"]
    assert len(trips) == len(statements)
    async with sqlite_store.db.read() as session:
        epochs = await session.execute(select(JobRow.id, JobRow.epoch).order_by(JobRow.id))
        assert list(epochs) == [(ids[0], 1), (ids[1], 1), (ids[2], 0)]


async def test_a_failed_statement_rolls_its_transaction_back_and_the_writer_goes_on(
    sqlite_store: Store,
) -> None:
    """SQLite's error reaches the writer as SQLAlchemy's (an integrity error here), the
    transaction's earlier statements are undone, and the next background write works."""
    [(job_id, _)] = await sqlite_store.submit_many([new_job()])
    with pytest.raises(IntegrityError):
        async with sqlite_store.db.write() as session:
            await session.execute(
                update(JobRow).where(JobRow.id == job_id).values(wait_reason="half done")
            )
            await session.execute(text("INSERT INTO jobs (id) VALUES (:id)"), {"id": job_id})
    async with sqlite_store.db.write() as session:
        await session.execute(update(JobRow).where(JobRow.id == job_id).values(epoch=7))
    async with sqlite_store.db.read() as session:
        row = (await session.execute(select(JobRow.wait_reason, JobRow.epoch))).one()
        assert tuple(row) == ("", 7)
        assert await session.scalar(select(func.count()).select_from(JobRow)) == 1


@contextmanager
def greenlet_switches() -> Iterator[list[tuple[str, greenlet.greenlet]]]:
    """Every greenlet switch while the block runs, and the greenlet it went to
    (SQLAlchemy's synchronous core runs in a greenlet, left to await the driver)."""
    seen: list[tuple[str, greenlet.greenlet]] = []

    def trace(event: str, args: Any) -> None:
        seen.append((event, args[1]))

    previous = greenlet.settrace(trace)
    try:
        yield seen
    finally:
        greenlet.settrace(previous)


async def test_a_statement_leaves_for_the_event_loop_only_for_its_trip(
    sqlite_store: Store,
) -> None:
    """On the event loop's connections (a client's write, a read) a statement runs
    where it is called, with no greenlet at all (`session.py`). On the worker's, it
    runs in SQLAlchemy's greenlet, which it leaves once, for its trip to the thread:
    into the greenlet, out to wait, back in, and out with the answer, four switches
    (the aiosqlite dialect's cursor waited three to four times per statement). The
    greenlet is the same for every statement and every transaction (`greenlets.py`:
    SQLAlchemy's own makes a new one per call)."""
    [(job_id, _)] = await sqlite_store.submit_many([new_job()])
    query = select(JobRow.epoch).where(JobRow.id == job_id)
    for write, switches_per_statement in ((sqlite_store.db.read, 0), (sqlite_store.db.write, 4)):
        async with write() as session:
            await session.execute(query)  # the transaction begun
            with greenlet_switches() as switches:
                for _ in range(5):
                    assert (await session.execute(query)).scalar() == 0
            assert len(switches) == 5 * switches_per_statement
    main = greenlet.getcurrent()
    with greenlet_switches() as switches:
        for _ in range(3):
            async with sqlite_store.db.write() as session:
                assert (await session.execute(query)).scalar() == 0
    runners = {target for _, target in switches if target is not main}
    assert len(switches) >= 3 * 4 and len(runners) == 1


async def test_a_transaction_on_the_loops_connections_never_gives_the_loop_a_turn(
    sqlite_store: Store,
) -> None:
    """A read and a client's write, from the writer's turn to the connection back in
    its pool, run without yielding: nothing else ready on the event loop runs before
    the caller goes on (SQLAlchemy's asyncio connection closed in a task of its own
    and resumed its caller two turns later). One that fails is rolled back just as
    well, and its connection serves the next write."""
    [(job_id, _)] = await sqlite_store.submit_many([new_job()])
    db = sqlite_store.db
    turns: list[str] = []
    asyncio.get_running_loop().call_soon(turns.append, "a turn")
    async with db.read() as session:
        assert await session.scalar(select(JobRow.epoch).where(JobRow.id == job_id)) == 0
    async with db.write(urgent=True) as session:
        await session.execute(update(JobRow).where(JobRow.id == job_id).values(epoch=3))
    with pytest.raises(IntegrityError):
        async with db.write(urgent=True) as session:
            await session.execute(update(JobRow).where(JobRow.id == job_id).values(epoch=4))
            await session.execute(text("INSERT INTO jobs (id) VALUES (:id)"), {"id": job_id})
    async with db.write(urgent=True) as session:
        assert await session.scalar(select(JobRow.epoch).where(JobRow.id == job_id)) == 3
    assert turns == []
    await asyncio.sleep(0)
    assert turns == ["a turn"]


async def test_a_background_write_ends_without_a_task_of_its_own(sqlite_store: Store) -> None:
    """A background write's connection goes back to its pool as its COMMIT or ROLLBACK
    returns, not in a task that hands the writer's turn on only turns of the loop
    later; and the next background write finds it ready."""
    [(job_id, _)] = await sqlite_store.submit_many([new_job()])
    loop = asyncio.get_running_loop()
    created: list[str] = []

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        created.append(getattr(coro, "__qualname__", repr(coro)))
        return asyncio.Task(coro, loop=loop, **kwargs)

    loop.set_task_factory(factory)
    try:
        async with sqlite_store.db.write() as session:
            await session.execute(update(JobRow).where(JobRow.id == job_id).values(epoch=5))
        with pytest.raises(IntegrityError):
            async with sqlite_store.db.write() as session:
                await session.execute(update(JobRow).where(JobRow.id == job_id).values(epoch=6))
                await session.execute(text("INSERT INTO jobs (id) VALUES (:id)"), {"id": job_id})
        async with sqlite_store.db.write() as session:
            assert await session.scalar(select(JobRow.epoch).where(JobRow.id == job_id)) == 5
    finally:
        loop.set_task_factory(None)
    assert created == []


async def test_writes_hold_sqlites_writer_from_their_start_and_each_commit_is_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both writers' transactions open with BEGIN IMMEDIATE: SQLite's write lock is
    theirs before their first statement, so what a write reads stays true until it
    commits; a read's does not take it. Every COMMIT of either writer, and nothing else,
    counts toward the next checkpoint (`sqlite_checkpoint.py`)."""
    counted: list[str] = []
    monkeypatch.setattr(Checkpointer, "committed", lambda self: counted.append("commit"))
    path = tmp_path / "locks.db"
    db = Database.open(f"sqlite:///{path}")
    await db.migrate()
    store = Store(db, EventBus())
    [(job_id, _)] = await store.submit_many([new_job()])
    other = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:

        def writer_free() -> bool:
            try:
                other.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as error:
                assert "locked" in str(error)
                return False
            other.execute("ROLLBACK")
            return True

        counted.clear()
        for write in (functools.partial(db.write, urgent=True), db.write):
            async with write():
                assert not writer_free()
            assert writer_free()
        async with db.read() as session:
            assert await session.scalar(select(JobRow.epoch).where(JobRow.id == job_id)) == 0
            assert writer_free()
        with pytest.raises(IntegrityError):
            async with db.write() as session:
                await session.execute(text("INSERT INTO jobs (id) VALUES (:id)"), {"id": job_id})
        assert counted == ["commit", "commit"]
    finally:
        other.close()
        await db.close()

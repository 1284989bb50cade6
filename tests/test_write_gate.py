"""SQLite's one writer in turns: a waiting client goes first, background work is never
starved, and a waiter cancelled at any moment leaves the gate working. A client's
write runs on the event loop's thread, background writes on aiosqlite's worker, and
the inline one never holds the loop long for a lock another process holds."""

from __future__ import annotations

import asyncio
import functools
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import event, func, select, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncSession
from test_store import accepted, assign, new_job, transition

from services.common import settings
from services.common.errors import Unavailable
from services.common.statuses import JobStatus
from services.scheduler.db import INLINE_BUSY_MS, Database
from services.scheduler.events import EventBus
from services.scheduler.health import unavailable
from services.scheduler.main import SETTINGS, SchedulerApp
from services.scheduler.models import JobRow
from services.scheduler.store import Store
from services.scheduler.write_gate import WriteGate


async def holder(gate: WriteGate, name: str, urgent: bool, order: list[str]) -> None:
    async with gate.turn(urgent):
        order.append(name)
        await asyncio.sleep(0)


async def background(gate: WriteGate, release: asyncio.Event) -> None:
    """Background work that holds the gate until `release` is set."""
    async with gate.turn(False):
        await release.wait()


async def queued(gate: WriteGate, *writers: tuple[str, bool]) -> list[str]:
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


def test_sqlite_has_one_writer_and_postgresql_as_many_as_asked(tmp_path: object) -> None:
    """One by default on both; PostgreSQL may have more, or no limit (no gate)."""
    sqlite = Database.open(f"sqlite:///{tmp_path}/x.db", writers=0)
    assert sqlite.gate is not None and sqlite.gate.writers == 1
    postgres = "postgresql://postgres@127.0.0.1:5432/test"
    for writers in (1, 3):
        gate = Database.open(postgres, writers=writers).gate
        assert gate is not None and gate.writers == writers
    assert Database.open(postgres).gate is not None
    assert Database.open(postgres, writers=0).gate is None


async def test_a_gate_of_two_writers_lets_two_in_and_queues_the_third() -> None:
    gate = WriteGate(writers=2)
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


async def traced(store: Store) -> dict[str, set[int]]:
    """The threads SQLite runs each writer connection's statements on, from now on:
    "inline" (clients' writes) and "worker" (background work)."""
    ran_on: dict[str, set[int]] = {"inline": set(), "worker": set()}
    engines = {"inline": store.db.inline_engine, "worker": store.db.write_engine}
    for kind, engine in engines.items():
        assert engine is not None
        async with engine.connect() as conn:  # each engine's one writer connection
            raw = (await conn.get_raw_connection()).driver_connection
            threads = ran_on[kind]
            # The sqlite3 connection (beneath the worker's): called on the thread that runs
            # a statement.
            sqlite = getattr(raw, "sqlite", raw)
            sqlite.set_trace_callback(lambda _sql, t=threads: t.add(threading.get_ident()))
    return ran_on


async def test_a_clients_write_runs_on_the_loops_thread_and_reports_on_the_worker(
    sqlite_store: Store,
) -> None:
    """A submission's statements run where the event loop does (no thread hand-off per
    statement, nothing else interleaved); a batch of reports', even of one report, run
    on the worker thread, so the loop gathers the next batch meanwhile. Seen
    from SQLite itself: the thread each statement runs on."""
    ran_on = await traced(sqlite_store)
    loop_thread = threading.get_ident()
    ids = [job_id for job_id, _ in await sqlite_store.submit_many([new_job() for _ in range(9)])]
    assert ran_on == {"inline": {loop_thread}, "worker": set()}
    epochs = [await assign(sqlite_store, job_id) for job_id in ids]  # background, on the worker
    assert ran_on["worker"] and loop_thread not in ran_on["worker"]
    ran_on["inline"].clear()
    ran_on["worker"].clear()

    await accepted(sqlite_store, "c1", transition(ids[0], epochs[0], JobStatus.STARTING))
    assert ran_on["inline"] == set()
    assert ran_on["worker"] and loop_thread not in ran_on["worker"]
    ran_on["worker"].clear()

    pairs = zip(ids[1:], epochs[1:], strict=True)
    many = [transition(j, e, JobStatus.STARTING, attempt=1) for j, e in pairs]
    await accepted(sqlite_store, "c1", *many)
    assert ran_on["inline"] == set()
    assert ran_on["worker"] and loop_thread not in ran_on["worker"]


async def test_a_clients_write_gives_up_soon_on_a_lock_held_by_another_process(
    sqlite_store: Store, tmp_path: Path
) -> None:
    """Only another process can hold SQLite's write lock (the scheduler's writes take
    turns). The inline writer waits for it at most INLINE_BUSY_MS (the loop stands still
    meanwhile), then fails as a database that is away: UNAVAILABLE, nothing stored."""
    assert sqlite_store.db.inline_engine is not None
    async with AsyncSession(sqlite_store.db.inline_engine) as session:
        busy = (await session.execute(text("PRAGMA busy_timeout"))).scalar()
        await session.rollback()
    assert busy == INLINE_BUSY_MS
    other = sqlite3.connect(tmp_path / "writers.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(OperationalError, match="locked") as raised:
            await sqlite_store.submit_many([new_job()])
        assert isinstance(unavailable(raised.value), Unavailable)
    finally:
        other.execute("ROLLBACK")
        other.close()
    async with sqlite_store.db.read() as session:
        assert await session.scalar(select(func.count()).select_from(JobRow)) == 0
    # The lock released, the next submission goes through.
    assert len(await sqlite_store.submit_many([new_job()])) == 1


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


async def within_turns(condition: Callable[[], bool], turns: int = 20) -> bool:
    """Whether `condition` holds within `turns` turns of the event loop."""
    for _ in range(turns):
        if condition():
            return True
        await asyncio.sleep(0)
    return condition()


async def test_a_lone_client_waits_only_while_no_other_clients_writes_gather() -> None:
    gate = WriteGate()
    gathering = False
    gate.gathering = lambda: gathering
    release = asyncio.Event()
    held = asyncio.create_task(background(gate, release))
    await asyncio.sleep(0)
    assert not gate.lone_client_waiting  # background work waits for nobody
    client = asyncio.create_task(holder(gate, "client", True, []))
    await asyncio.sleep(0)
    assert gate.lone_client_waiting
    gathering = True  # more submissions queued behind it: let the batch grow
    assert not gate.lone_client_waiting
    release.set()
    await asyncio.gather(held, client)
    assert not gate.lone_client_waiting


async def test_background_work_finishes_on_the_loops_thread_once_a_lone_client_waits(
    tmp_path: Path,
) -> None:
    """A background transaction runs its statements on the worker thread until a client's
    write waits for the writer; then the rest (and its COMMIT) on the event loop's thread,
    and both commit."""
    db = Database.open(f"sqlite:///{tmp_path / 'hurry.db'}")

    def thread_function(dbapi_connection: sqlite3.Connection, _record: object) -> None:
        dbapi_connection.create_function("thread", 0, threading.get_ident)

    for engine in db.write_engines:
        event.listen(engine.sync_engine, "connect", thread_function)
    await db.migrate()
    store = Store(db, EventBus())
    assert db.gate is not None
    loop_thread = threading.get_ident()
    try:
        async with db.write() as session:
            before = (await session.execute(text("SELECT thread()"))).scalar_one()
            client = asyncio.create_task(store.submit(new_job()))
            assert await within_turns(lambda: db.gate is not None and db.gate.lone_client_waiting)
            after = (await session.execute(text("SELECT thread()"))).scalar_one()
            await session.execute(text("CREATE TABLE hurried (n INTEGER)"))
        job_id, _ = await client
        assert before != loop_thread and after == loop_thread
        async with db.read() as session:
            assert (await session.execute(text("SELECT count(*) FROM hurried"))).scalar_one() == 0
        assert await store.get_job(job_id) is not None
    finally:
        await db.close()


async def test_submissions_queued_in_the_intake_count_as_gathering(app: SchedulerApp) -> None:
    """As the scheduler wires them: a submission waiting alone for the writer is a lone
    client; once more queue behind it in the intake, they are gathering."""
    gate, intake = app.db.gate, app.job_api.intake
    assert gate is not None and gate.gathering == intake.gathering
    release = asyncio.Event()

    async def background() -> None:
        async with app.db.write():
            await release.wait()

    held = asyncio.create_task(background())
    await asyncio.sleep(0)
    first = asyncio.create_task(intake.submit(new_job(key="a")))
    assert await within_turns(lambda: gate.lone_client_waiting)
    second = asyncio.create_task(intake.submit(new_job(key="b")))
    await asyncio.sleep(0)
    assert gate.gathering() and not gate.lone_client_waiting
    release.set()
    await asyncio.gather(held, first, second)
    assert not gate.gathering()

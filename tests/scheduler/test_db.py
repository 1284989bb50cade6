"""The database layer's promises (`services/scheduler/db/`), on SQLite and on PostgreSQL.

- A write cancelled at any point, even during its COMMIT, is applied (events to
  watchers, counter moves) exactly when it committed.
- A COMMIT whose outcome is unknown marks doubt, and the scheduler reconciles at
  once; the reconcile cannot be put off by writes that never stop.
- A SubmitJobs call is stored whole or not at all.
- SQLite is durable by default (`synchronous=FULL`).
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from sqlalchemy import Connection, event, func, select, text, update

from harness.store import Followed, accepted, assign, new_job, transition
from managedjobs.v1 import job_pb2, job_service_pb2_grpc
from managedjobs.v1 import job_service_pb2 as jpb
from services.common import settings
from services.common.security.edge import ServerSecurity
from services.common.statuses import JobStatus, ScheduleState
from services.scheduler import queries
from services.scheduler.admission import Limits
from services.scheduler.counters import live_counts
from services.scheduler.db import Database, OutcomeUnknown
from services.scheduler.db.models import EventRow, JobRow
from services.scheduler.events import EventBus, Subscription
from services.scheduler.main import SETTINGS, SchedulerApp
from services.scheduler.reports import Reports
from services.scheduler.store import Store

S = JobStatus
St = ScheduleState


async def until(condition: Callable[[], Awaitable[bool]], turns: int = 5000) -> None:
    """Lets the event loop run until `condition` holds (failing after `turns` checks)."""
    for _ in range(turns):
        if await condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the condition never held")


def drained(subscription: Subscription) -> list[job_pb2.JobEvent]:
    events = list(subscription._queue)
    subscription._queue.clear()
    return events


async def a_running_report(store: Store) -> tuple[int, Callable[[], Awaitable[object]]]:
    """A job launching on c1, and the report that it runs and frees its slot (a write
    whose moves the counters follow)."""
    job_id, _ = await store.submit(new_job())
    epoch = await assign(store, job_id)
    await accepted(store, "c1", transition(job_id, epoch, S.STARTING))
    request = transition(job_id, epoch, S.RUNNING, attempt=1, release_slot=True)
    return job_id, functools.partial(Reports(store).apply, "c1", [request])


async def agree(store: Store, followed: Followed, seen: list[job_pb2.JobEvent]) -> None:
    """The database, the events a watcher was sent and the counters tell one story."""
    assert await followed.matches_a_recount(store)
    stored = await store.read(lambda conn: conn.execute(select(EventRow.id)).scalars().all())
    assert sorted(e.event_id for e in seen) == sorted(stored)


async def test_a_write_cancelled_at_any_await_point_is_seen_exactly_if_it_committed(
    store: Store, bus: EventBus
) -> None:
    followed = Followed(store)
    watcher = bus.subscribe()
    seen: list[job_pb2.JobEvent] = []
    outcomes = set()
    finished_first = 0
    step = 0
    while finished_first < 3:
        job_id, report = await a_running_report(store)
        task = asyncio.ensure_future(report())
        for _ in range(step):
            await asyncio.sleep(0)
        task.cancel()
        result = (await asyncio.gather(task, return_exceptions=True))[0]
        finished_first = finished_first + 1 if not isinstance(result, BaseException) else 0
        job = await store.read(queries.job, job_id)
        assert job is not None
        outcomes.add((isinstance(result, asyncio.CancelledError), job.status))
        seen += drained(watcher)
        await agree(store, followed, seen)
        step += 1
    # Some were cancelled before their write began, some after it committed.
    assert (True, S.STARTING) in outcomes
    assert (False, S.RUNNING) in outcomes
    watcher.close()


async def test_a_write_cancelled_during_its_commit_is_published_and_counted(
    store: Store, bus: EventBus
) -> None:
    """The caller is cancelled while the COMMIT runs (on SQLite's writer thread, or
    awaiting PostgreSQL's answer): the cancellation waits for the outcome, then the
    events reach watchers and the counters follow, and only then is it raised."""
    followed = Followed(store)
    watcher = bus.subscribe()
    seen: list[job_pb2.JobEvent] = []
    job_id, report = await a_running_report(store)
    seen += drained(watcher)
    loop = asyncio.get_running_loop()
    task: asyncio.Future[object] | None = None
    cancelled = threading.Event()

    def cancel() -> None:
        assert task is not None
        task.cancel()
        cancelled.set()

    def on_commit(conn: Connection) -> None:
        if threading.get_ident() == loop_thread:
            loop.call_soon(cancel)  # PostgreSQL: delivered while COMMIT is awaited
        else:
            loop.call_soon_threadsafe(cancel)  # SQLite: the writer waits until it is
            assert cancelled.wait(10)

    loop_thread = threading.get_ident()
    event.listen(store.db.write_engine, "commit", on_commit)
    try:
        task = asyncio.ensure_future(report())
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        event.remove(store.db.write_engine, "commit", on_commit)
    assert cancelled.is_set()
    job = await store.read(queries.job, job_id)
    assert job is not None and job.status == S.RUNNING and job.schedule_state == St.ALIVE
    seen += drained(watcher)
    assert [e.status for e in seen if e.job_id == job_id][-1] == S.RUNNING
    await agree(store, followed, seen)
    assert followed.counters.slots("c1").alive == 1 and followed.counters.slots("c1").launching == 0
    watcher.close()


def committed_then_lost(conn: Connection) -> None:
    """A COMMIT that happens, then the connection is lost before its answer."""
    conn.connection.dbapi_connection.commit()  # type: ignore[union-attr]
    raise conn.dialect.loaded_dbapi.OperationalError("connection lost during COMMIT")


async def test_a_commit_whose_outcome_is_unknown_raises_doubt_and_publishes_nothing(
    store: Store, bus: EventBus
) -> None:
    followed = Followed(store)
    doubts: list[int] = []
    store.db.on_doubt = lambda: doubts.append(1)
    job_id, report = await a_running_report(store)
    watcher = bus.subscribe()
    event.listen(store.db.write_engine, "commit", committed_then_lost)
    try:
        with pytest.raises(OutcomeUnknown, match="connection lost during COMMIT"):
            await report()
    finally:
        event.remove(store.db.write_engine, "commit", committed_then_lost)
    assert doubts == [1] and store.db.doubts == 1
    assert drained(watcher) == []  # nothing published: nobody knew it committed
    job = await store.read(queries.job, job_id)
    assert job is not None and job.status == S.RUNNING  # ... though it did
    assert not await followed.matches_a_recount(store)  # the drift a reconcile fixes
    assert await followed.counters.reconcile()
    assert await followed.matches_a_recount(store)
    watcher.close()


class Ticks:
    """An injected sleep that returns only when the test gives it a tick."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[None] = asyncio.Queue()

    async def sleep(self, seconds: float) -> None:
        await self.queue.get()


@pytest.fixture
async def ticking_app(database_url: str) -> AsyncIterator[tuple[SchedulerApp, Ticks]]:
    ticks = Ticks()
    app = SchedulerApp(
        database_url, Limits(), security=ServerSecurity.without_auth(), sleep=ticks.sleep
    )
    await app.start()
    yield app, ticks
    await app.close()


async def writes_that_never_stop(app: SchedulerApp, stop: asyncio.Event) -> int:
    """Two writers, always one write under way and one waiting; returns how many ran."""
    done = 0

    async def writer() -> None:
        nonlocal done
        while not stop.is_set():
            await app.store.transaction(lambda txn: txn.conn.execute(text("SELECT 1")))
            done += 1

    await asyncio.gather(writer(), writer())
    return done


async def test_counter_drift_is_corrected_at_the_next_tick_under_writes_that_never_stop(
    ticking_app: tuple[SchedulerApp, Ticks],
) -> None:
    app, ticks = ticking_app
    await app.store.submit_many([new_job() for _ in range(3)])
    stop = asyncio.Event()
    load = asyncio.create_task(writes_that_never_stop(app, stop))
    await until(lambda: _true(app.db.turns.waiting > 0))
    app.counters.counts[(None, St.WAITING)] += 5  # a move nobody saw
    corrections = app.counters.corrections
    ticks.queue.put_nowait(None)  # one reconcile interval passes
    try:
        await until(lambda: _true(app.counters.corrections > corrections))
    finally:
        stop.set()
        ran = await load
    assert app.counters.corrections == corrections + 5
    assert live_counts(app.counters.counts) == live_counts(await app.store.read(queries.recount))
    assert ran > 0


async def test_a_write_whose_outcome_is_unknown_is_reconciled_at_once(
    ticking_app: tuple[SchedulerApp, Ticks],
) -> None:
    """No tick comes (the interval never passes): the doubt alone brings the reconcile."""
    app, _ = ticking_app
    job_id, _ = await app.store.submit(new_job())

    def move_it(conn: Connection) -> None:
        conn.execute(update(JobRow).where(JobRow.id == job_id).values(schedule_state=St.DONE))

    event.listen(app.db.write_engine, "commit", committed_then_lost)
    try:
        with pytest.raises(OutcomeUnknown):
            await app.store.transaction(lambda txn: move_it(txn.conn))
    finally:
        event.remove(app.db.write_engine, "commit", committed_then_lost)
    await until(lambda: _true(app.counters.corrections == 1))
    assert live_counts(app.counters.counts) == live_counts(await app.store.read(queries.recount))


async def _true(value: bool) -> bool:
    return value


# --- SubmitJobs: all of a call, or none of it -----------------------------------------------


@pytest.fixture
async def served(database_url: str) -> AsyncIterator[tuple[SchedulerApp, Any]]:
    app = SchedulerApp(database_url, Limits(), security=ServerSecurity.without_auth())
    port = await app.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield app, job_service_pb2_grpc.JobServiceStub(channel)
    await app.close()


def failing_after(db: Database, rows: int) -> Callable[..., None]:
    """A hook that fails, once, the next statement of the transaction that inserted the
    `rows`-th job row (PostgreSQL's reads share the engine, and are left alone)."""
    inserted: dict[int, int] = {}
    failed = False

    def hook(conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool) -> None:
        nonlocal failed
        key = id(conn)
        if not failed and inserted.get(key, 0) >= rows:
            failed = True
            raise conn.dialect.loaded_dbapi.OperationalError("disk I/O error (injected)")
        if statement.lstrip().upper().startswith("INSERT INTO JOBS"):
            inserted[key] = inserted.get(key, 0) + (len(params) if many else 1)

    event.listen(db.write_engine, "before_cursor_execute", hook)
    return hook


async def test_submit_jobs_failing_midway_stores_nothing_and_its_retry_stores_one_copy(
    served: tuple[SchedulerApp, Any],
) -> None:
    app, client = served
    request = jpb.SubmitJobsRequest(
        jobs=[
            jpb.SubmitJobRequest(spec_yaml=f"name: j{i}\nrun: echo {i}\n", user="alice")
            for i in range(1000)
        ]
    )
    hook = failing_after(app.db, rows=600)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await client.SubmitJobs(request)
    finally:
        event.remove(app.db.write_engine, "before_cursor_execute", hook)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "disk I/O error (injected)" in (raised.value.details() or "")
    assert "nothing was changed" in (raised.value.details() or "")
    jobs = select(func.count()).select_from(JobRow)
    assert await app.store.read(lambda conn: conn.scalar(jobs)) == 0
    assert await app.store.read(lambda conn: conn.scalar(select(func.count(EventRow.id)))) == 0
    answer = await client.SubmitJobs(request)
    assert len(set(answer.job_ids)) == 1000
    assert await app.store.read(lambda conn: conn.scalar(jobs)) == 1000


# --- durability ---------------------------------------------------------------------------


async def synchronous(db: Database) -> int:
    level: int = await db.write(lambda conn: conn.exec_driver_sql("PRAGMA synchronous").scalar())
    return level


async def test_sqlite_commits_reach_the_disk_before_their_answer_unless_told_otherwise(
    tmp_path: object,
) -> None:
    full = Database.open(f"sqlite:///{tmp_path}/full.db")
    normal = Database.open(f"sqlite:///{tmp_path}/normal.db", sqlite_synchronous="normal")
    try:
        assert await synchronous(full) == 2  # FULL
        assert await synchronous(normal) == 1  # NORMAL
        reading = await full.read(lambda conn: conn.exec_driver_sql("PRAGMA synchronous").scalar())
        assert reading == 2
    finally:
        await full.close()
        await normal.close()


def test_sqlite_synchronous_is_a_flag_and_a_variable_and_refuses_other_values(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parse = functools.partial(settings.parse, "mj-scheduler", "", SETTINGS)
    assert parse([], {}).sqlite_synchronous == "full"
    assert parse([], {"MJ_SQLITE_SYNCHRONOUS": "NORMAL"}).sqlite_synchronous == "normal"
    assert parse(["--sqlite-synchronous", "full"], {}).sqlite_synchronous == "full"
    with pytest.raises(SystemExit):
        parse(["--sqlite-synchronous", "off"], {})
    assert "--sqlite-synchronous: must be one of full, normal, got 'off'" in capsys.readouterr().err


async def test_sqlite_reads_run_on_the_loop_and_every_write_on_one_writer_thread(
    sqlite_store: Store,
) -> None:
    ran_on: dict[str, set[int]] = {"read": set(), "write": set()}
    db = sqlite_store.db

    def tracer(kind: str) -> Callable[..., None]:
        return lambda *args: ran_on[kind].add(threading.get_ident())

    hooks = {"read": tracer("read"), "write": tracer("write")}
    event.listen(db.read_engine, "before_cursor_execute", hooks["read"])
    event.listen(db.write_engine, "before_cursor_execute", hooks["write"])
    try:
        ids = [j for j, _ in await sqlite_store.submit_many([new_job() for _ in range(3)])]
        for job_id in ids:
            await assign(sqlite_store, job_id)
        await sqlite_store.read(queries.jobs, ids)
    finally:
        event.remove(db.read_engine, "before_cursor_execute", hooks["read"])
        event.remove(db.write_engine, "before_cursor_execute", hooks["write"])
    assert ran_on["read"] == {threading.get_ident()}
    assert len(ran_on["write"]) == 1 and threading.get_ident() not in ran_on["write"]

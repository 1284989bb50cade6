"""The scheduler's store, reports and cancels, on SQLite and on PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import re
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import event, select, text, update

from harness.store import (
    Followed,
    accepted,
    assign,
    chain,
    count,
    finished,
    move_job,
    move_jobs,
    new_job,
    report,
    transition,
)
from managedjobs.v1 import scheduler_service_pb2 as pb
from services.common.statuses import JobStatus, ScheduleState
from services.scheduler import queries
from services.scheduler.cancels import Cancels, Targets
from services.scheduler.db import Database
from services.scheduler.db.models import EventRow, JobRow, TaskRow
from services.scheduler.db.sqlite import Checkpointer
from services.scheduler.db.statistics import ANALYZE_FIRST
from services.scheduler.deadlines import PendingDeadlines
from services.scheduler.events import EventBus
from services.scheduler.moves import move_many
from services.scheduler.outbox import Outbox
from services.scheduler.releases import release_replica
from services.scheduler.reports import Refusal, Reports
from services.scheduler.spec.parse import parse_job_spec
from services.scheduler.store import Store
from services.scheduler.submissions import NewJob
from services.scheduler.txn import Move

S = JobStatus
St = ScheduleState


async def test_submit_stores_job_tasks_and_first_event(store: Store, bus: EventBus) -> None:
    sub = bus.subscribe()
    job_id, created = await store.submit(new_job(chain(2)))
    assert created
    job = await store.read(queries.job, job_id, with_specs=True)
    assert job is not None
    assert job.name == "chain"
    assert [t.name for t in job.tasks] == ["t0", "t1"]
    assert job.tasks[1].spec.run == "echo 1"
    assert job.status == S.PENDING and job.schedule_state == St.WAITING
    event_ = await asyncio.wait_for(sub.next(), 1)
    assert (event_.job_id, event_.message) == (job_id, "submitted")
    assert await count(store, EventRow) == 1


async def test_idempotency_key_returns_the_first_job(store: Store) -> None:
    first, created = await store.submit(new_job(key="k1"))
    again, created_again = await store.submit(new_job(key="k1"))
    other_user, _ = await store.submit(new_job(key="k1", user="bob"))
    assert created and not created_again and first == again and other_user != first
    assert await count(store, JobRow) == 2


async def test_committed_moves_feed_the_counters(store: Store) -> None:
    followed = Followed(store)
    ids = [(await store.submit(new_job()))[0] for _ in range(3)]
    assert followed.counters.counts[(None, St.WAITING)] == 3
    await assign(store, ids[0], "c1")
    await assign(store, ids[1], "c2")
    assert followed.counters.slots("c1").launching == 1
    await Cancels(store, Outbox()).cancel(Targets(job_ids=[ids[2]]))
    assert followed.counters.counts[(None, St.WAITING)] == 0
    assert await followed.matches_a_recount(store)


async def test_a_batch_sees_its_own_earlier_reports(store: Store) -> None:
    """A report's conditional UPDATE or check runs on what the batch's earlier reports
    wrote: a slot released with the RUNNING report is not released again by a
    LaunchSlotRelease in the same batch, nor is a slot requested twice."""
    followed = Followed(store)
    job_id, _ = await store.submit(new_job())
    epoch = await assign(store, job_id)
    release = pb.ConnectControllerRequest(
        launch_slot_release=pb.LaunchSlotRelease(job_id=job_id, epoch=epoch)
    )
    await accepted(
        store, "c1",
        transition(job_id, epoch, S.STARTING),
        transition(job_id, epoch, S.RUNNING, attempt=1, release_slot=True),
        release,
    )  # fmt: skip
    assert followed.counters.slots("c1").launching == 0
    assert followed.counters.slots("c1").alive == 1
    assert await followed.matches_a_recount(store)
    rows = await store.read(lambda conn: conn.execute(select(EventRow.schedule_state)).all())
    # submitted, admitted, STARTING, RUNNING (which released the slot): no second release.
    assert [St(s) for (s,) in rows].count(St.ALIVE) == 1


async def test_move_is_conditional_on_state_epoch_and_holder(store: Store) -> None:
    job_id, _ = await store.submit(new_job())
    epoch = await assign(store, job_id)
    # Already assigned: a second assignment does not happen.
    moves = await move_jobs(store, [job_id], St.WAITING, St.LAUNCHING, assign_to="c2")
    assert moves == []
    assert await move_job(store, job_id, St.LAUNCHING, St.ALIVE, epoch=0, cid="c1") is None
    assert await move_job(store, job_id, St.LAUNCHING, St.ALIVE, epoch=epoch, cid="c2") is None
    moved = await move_job(store, job_id, St.LAUNCHING, St.ALIVE, epoch=epoch, cid="c1")
    assert moved == Move(job_id, "c1", "c1", epoch, St.LAUNCHING, St.ALIVE)


async def test_an_assignment_event_carries_the_new_epoch(store: Store) -> None:
    job_id, _ = await store.submit(new_job())
    epoch = await assign(store, job_id)
    query = select(EventRow.schedule_state, EventRow.epoch)
    rows = await store.read(lambda conn: conn.execute(query).all())
    assert (St.LAUNCHING, epoch) in [(St(s), e) for s, e in rows]


async def test_stale_and_invalid_reports_are_refused_apart(store: Store) -> None:
    job_id, _ = await store.submit(new_job())
    epoch = await assign(store, job_id)
    reports = Reports(store)
    applied = await reports.apply(
        "c1",
        [
            transition(job_id, epoch + 1, S.STARTING),
            transition(job_id, epoch, S.STARTING, task_id=5),
            transition(job_id, epoch, S.SUCCEEDED, task_id=0),
            transition(job_id, epoch, S.STARTING),
        ],
    )
    assert [(a.accepted, Refusal(a.refusal)) for a in applied.acks] == [
        (False, Refusal.STALE),
        (False, Refusal.INVALID),
        (False, Refusal.INVALID),  # PENDING -> SUCCEEDED is not in the table
        (True, Refusal.NONE),
    ]
    assert applied.revokes == [(job_id, epoch + 1)]
    assert (reports.refused_stale, reports.refused_invalid) == (1, 2)
    # A report from another replica with the right epoch is stale too.
    [ack] = await report(store, "c2", transition(job_id, epoch, S.RUNNING))
    assert ack.refusal == Refusal.STALE
    job = await store.read(queries.job, job_id)
    assert job is not None and job.status == S.STARTING


async def test_terminal_status_only_changes_to_failed_controller(store: Store) -> None:
    job_id, _ = await store.submit(new_job())
    epoch = await assign(store, job_id)
    for status in (S.STARTING, S.RUNNING, S.SUCCEEDED):
        await accepted(store, "c1", transition(job_id, epoch, status))
    [ack] = await report(store, "c1", transition(job_id, epoch, S.RUNNING))
    assert ack.refusal == Refusal.INVALID
    await accepted(
        store, "c1", transition(job_id, epoch, S.FAILED_CONTROLLER, failure_reason="leaked")
    )
    job = await store.read(queries.job, job_id)
    assert job is not None and job.status == S.FAILED_CONTROLLER
    assert job.failure_reason == "leaked"


async def test_job_shows_the_first_unfinished_task(store: Store) -> None:
    job_id, _ = await store.submit(new_job(chain(3)))
    epoch = await assign(store, job_id)
    for status in (S.STARTING, S.RUNNING, S.SUCCEEDED):
        await accepted(store, "c1", transition(job_id, epoch, status))
    job = await store.read(queries.job, job_id)
    assert job is not None and (job.current_task_id, job.status) == (1, S.PENDING)
    for status in (S.STARTING, S.RUNNING, S.FAILED):
        await accepted(
            store, "c1", transition(job_id, epoch, status, task_id=1, failure_reason="boom")
        )
    await accepted(store, "c1", transition(job_id, epoch, S.CANCELLED, task_id=2))
    job = await store.read(queries.job, job_id)
    assert job is not None
    assert (job.current_task_id, job.status, job.failure_reason) == (1, S.FAILED, "boom")
    # A cleanup that failed on the first task's cluster makes it the one shown.
    await accepted(store, "c1", transition(job_id, epoch, S.FAILED_CONTROLLER, task_id=0))
    job = await store.read(queries.job, job_id)
    assert job is not None and (job.current_task_id, job.status) == (0, S.FAILED_CONTROLLER)


async def test_a_condition_is_set_and_cleared_without_a_status_change(store: Store) -> None:
    job_id, _ = await store.submit(new_job())
    epoch = await assign(store, job_id)
    for status in (S.STARTING, S.RUNNING):
        await accepted(store, "c1", transition(job_id, epoch, status))
    await accepted(
        store, "c1", transition(job_id, epoch, S.RUNNING, condition="unreachable since 12:00")
    )
    job = await store.read(queries.job, job_id)
    assert job is not None and job.tasks[0].condition == "unreachable since 12:00"
    assert job.tasks[0].HasField("condition_time") and job.status == S.RUNNING
    await accepted(store, "c1", transition(job_id, epoch, S.RUNNING, condition=""))
    job = await store.read(queries.job, job_id)
    assert job is not None and job.tasks[0].condition == ""


@contextlib.contextmanager
def statements(store: Store) -> Iterator[list[str]]:
    """The SQL statements the store's writes send while inside."""
    seen: list[str] = []

    def record(conn: object, cursor: object, statement: str, *args: object) -> None:
        seen.append(statement)

    engines = [store.db.write_engine]
    for engine in engines:
        event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        for engine in engines:
            event.remove(engine, "before_cursor_execute", record)


# A plan step that reads a whole table, or sorts every row a state holds: a cost that
# grows with the number of jobs. (Steps over lists of constants are fine.)
WHOLE_TABLE = re.compile(r"^SCAN (jobs|tasks|attempts|events|secrets)\b|TEMP B-TREE")


async def test_hot_statements_use_indexes_on_sqlite(tmp_path: Path) -> None:
    """Submissions with keys, admission's reads and a batch of reports touch only the rows
    they name: no statement of theirs scans a table or sorts a whole schedule state."""
    db = Database.open(f"sqlite:///{tmp_path / 'plans.db'}")
    await db.migrate()
    store = Store(db, EventBus())
    seen: list[tuple[str, Any]] = []

    def record(
        conn: object, cursor: object, statement: str, parameters: Any, context: object, many: bool
    ) -> None:
        seen.append((statement, parameters[0] if many else parameters))

    engines = [db.write_engine, db.read_engine]
    for engine in engines:
        event.listen(engine, "before_cursor_execute", record)
    try:
        jobs = [new_job(key=f"k{i}", priority=i % 2) for i in range(4)]
        ids = [job_id for job_id, _ in await store.submit_many(jobs)]
        assert [j for j, _ in await store.submit_many(jobs[:1])] == ids[:1]
        assert len(await store.read(queries.queued_jobs, St.WAITING, None, 2)) == 2
        epochs = [await assign(store, job_id) for job_id in ids]
        for status in (S.STARTING, S.RUNNING):
            await accepted(
                store,
                "c1",
                *[transition(j, e, status, attempt=1) for j, e in zip(ids, epochs, strict=True)],
            )
        assert len(await store.read(queries.queued_jobs, St.LAUNCHING, "c1", 10)) == 4
    finally:
        for engine in engines:
            event.remove(engine, "before_cursor_execute", record)
        await db.close()
    raw = sqlite3.connect(tmp_path / "plans.db")
    wasteful = []
    for statement, parameters in seen:
        if not statement.lstrip().upper().startswith(("SELECT", "UPDATE", "DELETE")):
            continue
        plan = [row[3] for row in raw.execute("EXPLAIN QUERY PLAN " + statement, parameters)]
        if any(WHOLE_TABLE.search(step) for step in plan):
            wasteful.append((statement, plan))
    raw.close()
    assert len(seen) > 10
    assert not wasteful, wasteful


async def test_postgres_statistics_are_gathered_as_the_jobs_grow(store: Store) -> None:
    """PostgreSQL plans by statistics: without them a grown table is planned as a small
    one (a batch's keys were looked up by reading every job of the user: seconds per
    batch at 100,000 jobs, with autovacuum off). The store gathers them once it inserted
    ANALYZE_FIRST jobs, then each time that count grew ANALYZE_GROWTH times."""
    await store.submit_many([new_job(key=f"a-{i}") for i in range(ANALYZE_FIRST - 1)])
    assert store.statistics.analyzing is None
    await store.submit_many([new_job(key=f"a-{i}") for i in range(ANALYZE_FIRST + 1)])
    if store.db.is_sqlite:
        assert store.statistics.analyzing is None  # SQLite's planner needs none here
        return
    assert store.statistics.analyzing is not None
    await store.statistics.analyzing
    analyzed = await store.read(
        lambda conn: conn.scalar(
            text("SELECT analyze_count FROM pg_stat_user_tables WHERE relname = 'jobs'")
        )
    )
    rows = await store.read(
        lambda conn: conn.scalar(text("SELECT reltuples FROM pg_class WHERE relname = 'jobs'"))
    )
    assert analyzed == 1
    # The statistics know how many jobs there are (repeated keys were not stored again).
    assert rows == ANALYZE_FIRST + 1
    # The next time is after four times as many.
    first = store.statistics.analyzing
    await store.submit_many([new_job(key=f"b-{i}") for i in range(10)])
    assert store.statistics.analyzing is first


async def test_a_status_change_costs_the_same_whatever_the_chain_length(store: Store) -> None:
    """Each report reads and writes one job and one or two tasks: the same statements for a
    chain of 3 as for a chain of 300."""
    per_length: dict[int, list[int]] = {}
    for length in (3, 300):
        job_id, _ = await store.submit(new_job(chain(length)))
        epoch = await assign(store, job_id)
        sizes = per_length.setdefault(length, [])
        with statements(store) as seen:
            for task_id in range(2):
                for status in (S.STARTING, S.RUNNING, S.SUCCEEDED):
                    before = len(seen)
                    await accepted(store, "c1", transition(job_id, epoch, status, task_id=task_id))
                    sizes.append(len(seen) - before)
        job = await store.read(queries.job, job_id)
        assert job is not None
        assert (job.current_task_id, job.status) == (2, S.PENDING)
    assert per_length[3] == per_length[300], per_length


async def test_a_batch_of_finished_jobs_reads_their_tasks_in_one_statement(store: Store) -> None:
    """Each job of a batch ends as it would alone (a task cancelled in the same batch
    stays CANCELLED, a task never started is closed), with one read of unfinished tasks
    for the whole batch rather than one per job, and no write between the reads."""
    ids = [(await store.submit(new_job(chain(2))))[0] for _ in range(20)]
    epochs = [await assign(store, job_id) for job_id in ids]
    for status in (S.STARTING, S.RUNNING, S.CANCELLING):
        await accepted(
            store, "c1", *[transition(j, e, status) for j, e in zip(ids, epochs, strict=True)]
        )
    with statements(store) as seen:
        reports = []
        for job_id, epoch in zip(ids, epochs, strict=True):
            reports += [transition(job_id, epoch, S.CANCELLED), finished(job_id, epoch)]
        await accepted(store, "c1", *reports)
    task_reads = [q for q in seen if q.lstrip().startswith("SELECT") and "FROM tasks" in q]
    # The tasks the transitions name, then the unfinished tasks of the finished jobs.
    assert len(task_reads) == 2, task_reads
    for job_id in ids:
        job = await store.read(queries.job, job_id)
        assert job is not None and job.schedule_state == St.DONE
        assert [t.status for t in job.tasks] == [S.CANCELLED, S.CANCELLED]


async def test_finish_closes_unfinished_tasks_along_the_table(store: Store) -> None:
    followed = Followed(store)
    job_id, _ = await store.submit(new_job(chain(3)))
    epoch = await assign(store, job_id)
    for status in (S.STARTING, S.RUNNING):
        await accepted(store, "c1", transition(job_id, epoch, status))
    await Cancels(store, Outbox()).cancel(Targets(job_ids=[job_id]))
    # The lifecycle ended without a final status (a bug, or a refused report): a RUNNING
    # task cannot become CANCELLED (the table forbids it), so it fails with the reason.
    await accepted(store, "c1", finished(job_id, epoch, "the scheduler refused a report"))
    job = await store.read(queries.job, job_id)
    assert job is not None and job.schedule_state == St.DONE
    assert [t.status for t in job.tasks] == [S.FAILED_CONTROLLER, S.CANCELLED, S.CANCELLED]
    assert job.tasks[0].failure_reason == "the scheduler refused a report"
    assert job.status == S.FAILED_CONTROLLER
    assert await followed.matches_a_recount(store)
    # A repeat is harmless; a stale finish is refused.
    await accepted(store, "c1", finished(job_id, epoch))
    [ack] = await report(store, "c1", finished(job_id, epoch + 1))
    assert ack.refusal == Refusal.STALE


async def test_release_frees_slots_and_marks_starting_recovering(store: Store) -> None:
    followed = Followed(store)
    job_id, _ = await store.submit(new_job())
    epoch = await assign(store, job_id)
    await accepted(store, "c1", transition(job_id, epoch, S.STARTING))
    moves = await release_replica(store, "c1")
    assert [(m.old, m.new, m.new_controller) for m in moves] == [(St.LAUNCHING, St.ALIVE, None)]
    job = await store.read(queries.job, job_id)
    assert job is not None
    assert job.status == S.RECOVERING and job.controller_id == ""
    assert [o.id for o in await store.read(queries.orphans, 10)] == [job_id]
    # Released twice (two expiries racing): the second finds nothing and counts nothing.
    assert await release_replica(store, "c1") == []
    assert await followed.matches_a_recount(store)


async def test_a_report_applied_before_is_a_replay_and_a_new_assignment_numbers_afresh(
    store: Store,
) -> None:
    job_id, _ = await store.submit(new_job())
    epoch = await assign(store, job_id)
    starting = transition(job_id, epoch, S.STARTING, message="up")
    [first] = await report(store, "c1", starting)
    [again] = await report(store, "c1", starting)  # its answer was lost: sent again
    assert (first.accepted, first.replay) == (True, False)
    assert (again.accepted, again.replay, again.ack_seq) == (True, True, starting.seq)
    query = select(EventRow.message).where(EventRow.job_id == job_id)
    messages = await store.read(lambda conn: conn.execute(query).scalars().all())
    assert messages.count("up") == 1
    # Another holder numbers its reports its own way: they are judged from 0 again.
    await release_replica(store, "c1")
    [moved] = await move_jobs(store, [job_id], St.ALIVE, St.ALIVE, assign_to="c2")
    epoch = moved.epoch
    running = transition(job_id, epoch, S.RUNNING, attempt=1)
    running.seq = 1
    [fresh] = await report(store, "c2", running)
    assert (fresh.accepted, fresh.replay) == (True, False)
    assert (await store.read(queries.job, job_id)).tasks[0].status == S.RUNNING
    # A report without a number is refused, not taken for a replay.
    unnumbered = transition(job_id, epoch, S.SUCCEEDED)
    unnumbered.seq = 0
    [refused] = (await Reports(store).apply("c2", [unnumbered])).acks
    assert (refused.accepted, Refusal(refused.refusal)) == (False, Refusal.INVALID)
    assert "seq" in refused.reason


async def test_handback_releases_only_the_epochs_it_names(store: Store) -> None:
    followed = Followed(store)
    a, _ = await store.submit(new_job())
    b, _ = await store.submit(new_job())
    epoch_a, epoch_b = await assign(store, a), await assign(store, b)
    handback = pb.ConnectControllerRequest(
        job_handback=pb.JobHandback(
            jobs=[pb.HeldJob(job_id=a, epoch=epoch_a), pb.HeldJob(job_id=b, epoch=epoch_b + 1)]
        )
    )
    await accepted(store, "c1", handback)
    jobs = {j.job_id: j for j in await store.read(queries.jobs, [a, b])}
    assert (jobs[a].controller_id, jobs[b].controller_id) == ("", "c1")
    assert await followed.matches_a_recount(store)


async def test_reconcile_finds_and_fixes_a_move_nobody_saw(store: Store) -> None:
    followed = Followed(store)
    job_id, _ = await store.submit(new_job())
    # A commit whose outcome was in doubt: the row moved, the counters never heard.
    await store.db.write(
        lambda conn: conn.execute(
            update(JobRow)
            .where(JobRow.id == job_id)
            .values(schedule_state=St.LAUNCHING, controller_id="c1", epoch=1)
        )
    )
    assert not await followed.matches_a_recount(store)
    diff = await followed.counters.reconcile()
    assert diff == {(None, St.WAITING): -1, ("c1", St.LAUNCHING): 1}
    assert followed.counters.corrections == 2
    assert await followed.matches_a_recount(store)
    assert await followed.counters.reconcile() == {}


async def test_cancel_of_an_unstarted_job_is_immediate_and_idempotent(store: Store) -> None:
    followed = Followed(store)
    job_id, _ = await store.submit(new_job(chain(2)))
    cancels = Cancels(store, Outbox())
    assert await cancels.cancel(Targets(job_ids=[job_id])) == [job_id]
    assert await cancels.cancel(Targets(job_ids=[job_id])) == []
    job = await store.read(queries.job, job_id)
    assert job is not None
    assert job.status == S.CANCELLED and job.schedule_state == St.DONE
    assert {t.status for t in job.tasks} == {S.CANCELLED}
    assert await followed.matches_a_recount(store)


async def changes(store: Store, job_id: int, after: int) -> list[tuple[int, S, St, str, int]]:
    """The job's events after event `after`, as logged: (task, status, schedule state,
    message, epoch)."""
    columns = (EventRow.task_id, EventRow.status, EventRow.schedule_state, EventRow.message)
    query = (
        select(*columns, EventRow.epoch)
        .where(EventRow.job_id == job_id, EventRow.id > after)
        .order_by(EventRow.id)
    )
    rows = await store.read(lambda conn: conn.execute(query).all())
    return [(t, S(s), St(state), m, e) for t, s, state, m, e in rows]


async def test_a_chain_cancelled_before_start_has_an_event_for_each_task(
    store: Store, bus: EventBus
) -> None:
    job_id, _ = await store.submit(new_job(chain(3)))
    after, commits = await store.read(queries.last_event_id), store.db.commits
    watcher = bus.subscribe([job_id])
    await Cancels(store, Outbox()).cancel(Targets(job_ids=[job_id]))
    assert store.db.commits == commits + 1
    # Each task's change is its own event; the job's end (the one in DONE) comes last.
    why = "cancelled before start"
    assert await changes(store, job_id, after) == [
        (1, S.CANCELLED, St.WAITING, why, 0),
        (2, S.CANCELLED, St.WAITING, why, 0),
        (0, S.CANCELLED, St.DONE, why, 0),
    ]
    watched = await asyncio.wait_for(watcher.take(10), 1)
    assert [(e.task_id, e.schedule_state) for e in watched] == [
        (1, St.WAITING),
        (2, St.WAITING),
        (0, St.DONE),
    ]


async def test_a_chain_that_ends_early_has_an_event_for_each_later_task(store: Store) -> None:
    job_id, _ = await store.submit(new_job(chain(3)))
    epoch = await assign(store, job_id)
    for status in (S.STARTING, S.RUNNING, S.FAILED):
        await accepted(store, "c1", transition(job_id, epoch, status))
    after = await store.read(queries.last_event_id)
    await accepted(store, "c1", finished(job_id, epoch))
    assert await changes(store, job_id, after) == [
        (1, S.CANCELLED, St.LAUNCHING, "done", epoch),
        (2, S.CANCELLED, St.LAUNCHING, "done", epoch),
        (0, S.FAILED, St.DONE, "done", epoch),
    ]
    # A repeated finish changes nothing, so it writes nothing.
    after = await store.read(queries.last_event_id)
    await accepted(store, "c1", finished(job_id, epoch))
    assert await changes(store, job_id, after) == []


async def test_a_chain_past_its_max_pending_has_an_event_for_each_task(store: Store) -> None:
    parsed = parse_job_spec(f"max_pending: 60\n{chain(3)}")
    job_id, _ = await store.submit(
        NewJob("p", "alice", 0, "", "", parsed.tasks, (), parsed.timeouts)
    )
    after = await store.read(queries.last_event_id)
    deadlines = PendingDeadlines(store, lambda: "waiting for a replica")
    submitted = store.clock()
    store.clock = lambda: submitted + dt.timedelta(seconds=61)
    assert await deadlines.expire() == [job_id]
    why = "max_pending exceeded while waiting for a replica"
    assert await changes(store, job_id, after) == [
        (1, S.CANCELLED, St.WAITING, why, 0),
        (2, S.CANCELLED, St.WAITING, why, 0),
        (0, S.FAILED_NO_RESOURCE, St.DONE, why, 0),
    ]
    job = await store.read(queries.job, job_id)
    assert job is not None
    assert [t.status for t in job.tasks] == [S.FAILED_NO_RESOURCE, S.CANCELLED, S.CANCELLED]


async def test_cancel_of_many_jobs_is_one_transaction(store: Store) -> None:
    ids = [(await store.submit(new_job()))[0] for _ in range(30)]
    for job_id in ids[:10]:
        await assign(store, job_id, "c1")
    outbox = Outbox()
    stream = outbox.attach("c1")
    started = store.db.commits
    cancelled = await Cancels(store, outbox).cancel(Targets(user="alice"))
    assert cancelled == sorted(ids) and store.db.commits == started + 1
    told = [stream.queue.get_nowait() for _ in range(stream.queue.qsize())]
    assert sorted(m.cancel.job_id for m in told if m) == sorted(ids[:10])


async def test_a_cancel_is_durable_for_the_assignment_that_follows(store: Store) -> None:
    """Cancel committed first: the assignment read with the move carries it."""
    job_id, _ = await store.submit(new_job())
    await store.db.write(
        lambda conn: conn.execute(
            update(JobRow).where(JobRow.id == job_id).values(cancel_requested=True)
        )
    )
    _, jobs = await store.transaction(
        lambda txn: move_many(txn, [job_id], St.WAITING, St.LAUNCHING, assign_to="c1", fetch=True)
    )
    assert jobs[0].cancel_requested


async def test_a_cancel_after_an_assignment_is_sent_to_the_new_holder(store: Store) -> None:
    """Assignment committed first: the cancel goes to the holder with its epoch, even if
    the assignment message has not been sent yet (the replica keeps it for the assignment)."""
    job_id, _ = await store.submit(new_job())
    epoch = await assign(store, job_id, "c2")
    outbox = Outbox()
    stream = outbox.attach("c2")
    assert await Cancels(store, outbox).cancel(Targets(job_ids=[job_id])) == [job_id]
    message = stream.queue.get_nowait()
    assert message is not None and (message.cancel.job_id, message.cancel.epoch) == (
        job_id,
        epoch,
    )


async def test_list_jobs_pages_newest_first_and_filters(store: Store) -> None:
    ids = [(await store.submit(new_job(user="alice" if i % 2 else "bob")))[0] for i in range(5)]
    first = await store.read(queries.list_jobs, limit=2)
    assert [j.job_id for j in first] == ids[::-1][:2]
    rest = await store.read(queries.list_jobs, limit=10, before_id=first[-1].job_id)
    assert [j.job_id for j in rest] == ids[::-1][2:]
    alice = await store.read(queries.list_jobs, user="alice")
    assert {j.user for j in alice} == {"alice"} and len(alice) == 2


async def test_events_after_is_ordered_and_filtered(store: Store) -> None:
    a, _ = await store.submit(new_job())
    b, _ = await store.submit(new_job(user="bob"))
    await Cancels(store, Outbox()).cancel(Targets(job_ids=[a]))
    events = await store.read(queries.events_after, 0)
    assert [e.event_id for e in events] == sorted(e.event_id for e in events)
    assert [e.job_id for e in await store.read(queries.events_after, 0, [a])] == [a, a]
    assert [e.job_id for e in await store.read(queries.events_after, events[0].event_id, [b])] == [
        b
    ]
    assert {e.job_id for e in await store.read(queries.events_after, 0, user="bob")} == {b}


async def test_tasks_rows_cascade_with_job(store: Store) -> None:
    await store.submit(new_job(chain(2)))
    assert await count(store, TaskRow) == 2


async def test_secrets_and_timeouts_are_kept_with_the_job(store: Store) -> None:
    parsed = parse_job_spec(
        "name: s\nmax_pending: 2h\n---\nrun: a\nsecrets: {K: v1}\n---\nrun: b\n"
    )
    job = NewJob("s", "alice", 0, "", "", parsed.tasks, parsed.secrets, parsed.timeouts)
    job_id, _ = await store.submit(job)
    [first] = (await store.read(queries.secrets_of, [job_id]))[job_id]
    assert (first.task_id, dict(first.secrets)) == (0, {"K": "v1"})
    read = await store.read(queries.job, job_id, with_specs=True)
    assert read is not None and read.timeouts.max_pending_seconds == 7200
    assert b"v1" not in read.SerializeToString()


async def test_each_attempt_keeps_its_cluster_end_and_exit_code(store: Store) -> None:
    job_id, _ = await store.submit(new_job())
    epoch = await assign(store, job_id)

    def step(status: JobStatus, attempt: int, **kw: object) -> pb.ConnectControllerRequest:
        return transition(job_id, epoch, status, attempt=attempt, **kw)

    await accepted(
        store,
        "c1",
        step(S.STARTING, 1),
        step(S.RUNNING, 1, cluster_name="mj-1-0", region="r1"),
        step(S.RECOVERING, 1, message="restart 1 of 1", exit_code=75),
        step(S.RUNNING, 2, cluster_name="mj-1-0", region="r2", restart_count=1),
        step(S.FAILED, 2, message="user run exited non-zero", exit_code=3),
    )
    job = await store.read(queries.job, job_id)
    assert job is not None
    first, second = job.tasks[0].attempts
    assert (first.attempt, first.region, first.exit_code, first.outcome) == (
        1,
        "r1",
        75,
        "restart 1 of 1",
    )
    assert (second.attempt, second.region, second.exit_code) == (2, "r2", 3)
    assert second.HasField("end_time") and second.outcome == "user run exited non-zero"


async def test_sqlite_reads_run_on_the_event_loop_thread(tmp_path: Path) -> None:
    """Reads run on the event loop's own thread (no hop per read); writes run on the one
    writer thread, and reads see what they committed."""
    db = Database.open(f"sqlite:///{tmp_path / 'inline.db'}")
    await db.migrate()
    store = Store(db, EventBus())
    try:
        job_id, _ = await store.submit(new_job())  # the writer's connection and thread
        threads = {t.ident for t in threading.enumerate()}
        executed_on: list[int] = []

        def record(*args: object) -> None:
            executed_on.append(threading.get_ident())

        event.listen(db.read_engine, "before_cursor_execute", record)
        try:
            reads = await asyncio.gather(*(store.read(queries.job, job_id) for _ in range(5)))
        finally:
            event.remove(db.read_engine, "before_cursor_execute", record)
        assert all(job is not None and job.job_id == job_id for job in reads)
        assert set(executed_on) == {threading.get_ident()}
        assert {t.ident for t in threading.enumerate()} == threads  # no thread started
    finally:
        await db.close()


def test_checkpoints_copy_the_log_into_the_database_every_so_many_commits(
    tmp_path: Path,
) -> None:
    """The checkpointer's thread copies committed pages into the database file after every
    `every` commits, and only then; closing it takes a last checkpoint."""
    path = tmp_path / "wal.db"
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("PRAGMA journal_mode=WAL")
    writer.execute("PRAGMA wal_autocheckpoint=0")
    writer.execute("CREATE TABLE t (n INTEGER)")

    def rows_in_database_file() -> int:
        copy = tmp_path / "copy.db"  # the database file alone, without its log
        copy.write_bytes(path.read_bytes())
        with contextlib.closing(sqlite3.connect(copy)) as conn:
            tables = conn.execute("SELECT count(*) FROM sqlite_master WHERE name = 't'")
            if not tables.fetchone()[0]:
                return -1
            return int(conn.execute("SELECT count(*) FROM t").fetchone()[0])

    checkpointer = Checkpointer(str(path), "full", every=3)
    try:
        for n in range(3):
            writer.execute("INSERT INTO t VALUES (?)", (n,))
            checkpointer.committed()
        assert checkpointer.wait(1, timeout=10)
        assert rows_in_database_file() == 3
        for n in range(2):
            writer.execute("INSERT INTO t VALUES (?)", (n,))
            checkpointer.committed()
        assert checkpointer.taken == 1  # two commits: not woken
        assert rows_in_database_file() == 3
    finally:
        checkpointer.close()
    assert checkpointer.taken == 2
    assert rows_in_database_file() == 5
    writer.close()


async def test_the_schedulers_commits_never_checkpoint_and_wake_the_checkpointer(
    tmp_path: Path,
) -> None:
    db = Database.open(f"sqlite:///{tmp_path / 'ckpt.db'}")
    await db.migrate()
    store = Store(db, EventBus())
    checkpointer = db.checkpointer
    try:
        pragma = await db.write(lambda conn: conn.execute(text("PRAGMA wal_autocheckpoint")))
        assert pragma.scalar_one() == 0
        before = checkpointer.taken
        checkpointer.every = 2
        await store.submit(new_job())  # a client's write
        await store.transaction(lambda txn: txn.conn.execute(text("SELECT 1")))  # background
        assert await asyncio.to_thread(checkpointer.wait, before + 1, 10)
    finally:
        await db.close()
    assert checkpointer.taken == before + 2  # and the last one as it closed

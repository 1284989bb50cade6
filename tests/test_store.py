"""The scheduler's store, on SQLite and on PostgreSQL."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import func, select

from managedjobs.v1 import scheduler_service_pb2 as pb
from services.common.statuses import JobStatus, ScheduleState
from services.scheduler.events import EventBus
from services.scheduler.models import EventRow, JobRow, TaskRow
from services.scheduler.spec import parse_job_spec
from services.scheduler.store import NewJob, StaleReport, Store

S = JobStatus
St = ScheduleState


def new_job(
    spec: str = "name: hello\nrun: echo hi\n", user: str = "alice", key: str = "", priority: int = 0
) -> NewJob:
    parsed = parse_job_spec(spec)
    return NewJob(parsed.name, user, priority, "", key, parsed.tasks)


async def count(store: Store, model: type) -> int:
    async with store.db.read() as session:
        return int(await session.scalar(select(func.count()).select_from(model)) or 0)


async def assign(store: Store, job_id: int, controller: str = "c1") -> int:
    move = await store.move(job_id, [St.WAITING], St.LAUNCHING, assign_to=controller)
    assert move is not None
    return move.epoch


def transition(
    job_id: int, epoch: int, status: JobStatus, task_id: int = 0, **kw: object
) -> pb.TaskTransition:
    return pb.TaskTransition(job_id=job_id, epoch=epoch, task_id=task_id, status=int(status), **kw)  # type: ignore[arg-type]


async def test_submit_stores_job_tasks_and_first_event(store: Store, bus: EventBus) -> None:
    sub = bus.subscribe()
    chain = "name: pipeline\n---\nname: a\nrun: echo a\n---\nname: b\nrun: echo b\n"
    job_id, created = await store.submit(new_job(chain))
    assert created
    job = await store.get_job(job_id, with_specs=True)
    assert job is not None
    assert job.name == "pipeline"
    assert [t.name for t in job.tasks] == ["a", "b"]
    assert job.tasks[1].spec.run == "echo b"
    assert job.status == S.PENDING and job.schedule_state == St.WAITING
    event = await asyncio.wait_for(sub.next(), 1)
    assert (event.job_id, event.message) == (job_id, "submitted")
    assert await count(store, EventRow) == 1


async def test_idempotency_key_returns_the_first_job(store: Store) -> None:
    first, created = await store.submit(new_job(key="k1"))
    again, created_again = await store.submit(new_job(key="k1"))
    other_user, _ = await store.submit(new_job(key="k1", user="bob"))
    assert created and not created_again
    assert again == first
    assert other_user != first
    assert await count(store, JobRow) == 2


async def test_move_is_conditional_on_state_and_epoch(store: Store) -> None:
    job_id, _ = await store.submit(new_job())
    epoch = await assign(store, job_id)
    assert epoch == 1
    # Not in WAITING any more: a second admission does nothing.
    assert await store.move(job_id, [St.WAITING], St.LAUNCHING, assign_to="c2") is None
    # A stale epoch cannot release the slot.
    assert await store.move(job_id, [St.LAUNCHING], St.ALIVE, epoch=0, controller_id="c1") is None
    moved = await store.move(job_id, [St.LAUNCHING], St.ALIVE, epoch=1, controller_id="c1")
    assert moved is not None and (moved.old, moved.new) == (St.LAUNCHING, St.ALIVE)
    # DONE is final: the transition table refuses to leave it.
    await store.finish(job_id, 1, "c1")
    assert await store.move(job_id, [St.DONE], St.WAITING) is None


async def test_stale_epoch_report_is_refused(store: Store) -> None:
    job_id, _ = await store.submit(new_job())
    epoch = await assign(store, job_id)
    with pytest.raises(StaleReport):
        await store.apply_transition(transition(job_id, epoch + 1, S.STARTING), "c1")
    with pytest.raises(StaleReport):
        await store.apply_transition(transition(job_id, epoch, S.STARTING), "c2")
    job = await store.get_job(job_id)
    assert job is not None and job.status == S.PENDING


async def test_terminal_status_only_changes_to_failed_controller(store: Store) -> None:
    job_id, _ = await store.submit(new_job())
    epoch = await assign(store, job_id)
    for status in (S.STARTING, S.RUNNING, S.SUCCEEDED):
        await store.apply_transition(transition(job_id, epoch, status), "c1")
    with pytest.raises(ValueError, match="not allowed"):
        await store.apply_transition(transition(job_id, epoch, S.RUNNING), "c1")
    await store.apply_transition(
        transition(job_id, epoch, S.FAILED_CONTROLLER, failure_reason="cleanup failed"), "c1"
    )
    job = await store.get_job(job_id)
    assert job is not None
    assert job.status == S.FAILED_CONTROLLER
    assert job.failure_reason == "cleanup failed"


async def test_job_shows_the_first_unfinished_task(store: Store) -> None:
    chain = "name: c\n---\nname: a\nrun: x\n---\nname: b\nrun: y\n---\nname: d\nrun: z\n"
    job_id, _ = await store.submit(new_job(chain))
    epoch = await assign(store, job_id)
    for status in (S.STARTING, S.RUNNING, S.FAILED):
        await store.apply_transition(transition(job_id, epoch, status, failure_reason="boom"), "c1")
    for task_id in (1, 2):
        await store.apply_transition(transition(job_id, epoch, S.CANCELLED, task_id), "c1")
    job = await store.get_job(job_id)
    assert job is not None
    assert job.status == S.FAILED and job.current_task_id == 0
    assert job.failure_reason == "boom"


async def test_cancel_unstarted_job_is_immediate(store: Store) -> None:
    job_id, _ = await store.submit(new_job("name: c\n---\nname: a\nrun: x\n---\nname: b\nrun: y\n"))
    assert await store.cancel_unstarted(job_id)
    assert not await store.cancel_unstarted(job_id)
    job = await store.get_job(job_id)
    assert job is not None
    assert job.status == S.CANCELLED and job.schedule_state == St.DONE
    assert {t.status for t in job.tasks} == {S.CANCELLED}


async def test_finish_closes_unfinished_tasks(store: Store) -> None:
    job_id, _ = await store.submit(new_job())
    epoch = await assign(store, job_id)
    await store.apply_transition(transition(job_id, epoch, S.STARTING), "c1")
    move = await store.finish(job_id, epoch, "c1")
    assert move is not None and move.new == St.DONE
    job = await store.get_job(job_id)
    assert job is not None and job.status == S.FAILED_CONTROLLER


async def test_release_replica_frees_slots_and_marks_starting_recovering(store: Store) -> None:
    job_id, _ = await store.submit(new_job())
    epoch = await assign(store, job_id)
    await store.apply_transition(transition(job_id, epoch, S.STARTING), "c1")
    moves = await store.release_replica("c1")
    assert [(m.old, m.new, m.new_controller) for m in moves] == [(St.LAUNCHING, St.ALIVE, None)]
    job = await store.get_job(job_id)
    assert job is not None
    assert job.status == S.RECOVERING and job.controller_id == ""
    assert [o.id for o in await store.orphans(10)] == [job_id]


async def test_recount_matches_states(store: Store) -> None:
    ids = [(await store.submit(new_job()))[0] for _ in range(3)]
    await assign(store, ids[0], "c1")
    await assign(store, ids[1], "c2")
    counts = await store.recount()
    assert counts[("c1", St.LAUNCHING)] == 1
    assert counts[("c2", St.LAUNCHING)] == 1
    assert counts[(None, St.WAITING)] == 1


async def test_list_jobs_pages_newest_first_and_filters(store: Store) -> None:
    ids = [(await store.submit(new_job(user="alice" if i % 2 else "bob")))[0] for i in range(5)]
    first = await store.list_jobs(limit=2)
    assert [j.job_id for j in first] == ids[::-1][:2]
    rest = await store.list_jobs(limit=10, before_id=first[-1].job_id)
    assert [j.job_id for j in rest] == ids[::-1][2:]
    alice = await store.list_jobs(user="alice")
    assert {j.user for j in alice} == {"alice"} and len(alice) == 2


async def test_events_after_is_ordered_and_filtered(store: Store) -> None:
    a, _ = await store.submit(new_job())
    b, _ = await store.submit(new_job())
    await store.cancel_unstarted(a)
    events = await store.events_after(0)
    assert [e.event_id for e in events] == sorted(e.event_id for e in events)
    assert [e.job_id for e in await store.events_after(0, [a])] == [a, a]
    assert [e.job_id for e in await store.events_after(events[0].event_id, [b])] == [b]


async def test_tasks_rows_cascade_with_job(store: Store) -> None:
    await store.submit(new_job("name: c\n---\nname: a\nrun: x\n---\nname: b\n"))
    assert await count(store, TaskRow) == 2

"""Admission on the real store and counters: one job's payload never breaks a stream."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from harness.store import move_jobs
from managedjobs.v1 import job_pb2
from managedjobs.v1 import scheduler_service_pb2 as pb
from services.common.statuses import JobStatus, ScheduleState
from services.scheduler import queries
from services.scheduler.admission import Admission, Limits
from services.scheduler.counters import Counters, live_counts
from services.scheduler.outbox import Outbox, Stream
from services.scheduler.store import Store
from services.scheduler.submissions import NewJob

S = JobStatus
St = ScheduleState


def job(envs_bytes: int = 0) -> NewJob:
    spec = job_pb2.TaskSpec(name="j", run="echo", num_nodes=1)
    if envs_bytes:
        # Past what the spec parser accepts: built here to prove the last guard holds.
        spec.envs["BIG"] = "x" * envs_bytes
    return NewJob("j", "alice", 0, "", "", [spec])


def one_replica(store: Store, max_launches: int) -> tuple[Counters, Stream, Admission]:
    """Admission over the store with one replica "c1" connected (room for 9 jobs)."""
    counters = Counters(store)
    store.on_moves = counters.apply
    outbox = Outbox()
    stream = outbox.attach("c1")
    admission = Admission(store, counters, outbox, Limits())
    capacity = pb.Capacity(max_launches=max_launches, max_jobs=9)
    admission.connected(pb.ControllerHello(controller_id="c1", capacity=capacity))
    return counters, stream, admission


async def test_a_job_too_large_to_assign_fails_and_the_stream_carries_the_others(
    store: Store,
) -> None:
    counters, stream, admission = one_replica(store, max_launches=9)
    small, _ = await store.submit(job())
    huge, _ = await store.submit(job(envs_bytes=3_600_000))
    after, _ = await store.submit(job())
    await admission.schedule()
    sent = [stream.queue.get_nowait() for _ in range(stream.queue.qsize())]
    assigned = [m.assignment.job.job_id for m in sent if m and m.HasField("assignment")]
    assert assigned == [small, after]
    failed = await store.read(queries.job, huge)
    assert failed is not None and failed.schedule_state == St.DONE
    assert failed.status == S.FAILED_CONTROLLER and "cannot be assigned" in failed.failure_reason
    assert live_counts(counters.counts) == live_counts(await store.read(queries.recount))


async def test_new_jobs_go_to_the_replica_holding_fewest_not_the_one_freeing_slots_first(
    store: Store,
) -> None:
    """A replica that launches fast frees its launch slots first; jobs must still spread
    by how many each replica holds."""
    counters = Counters(store)
    store.on_moves = counters.apply
    outbox = Outbox()
    admission = Admission(store, counters, outbox, Limits())

    def hello(cid: str) -> None:
        outbox.attach(cid)
        capacity = pb.Capacity(max_launches=10, max_jobs=100)
        admission.connected(pb.ControllerHello(controller_id=cid, capacity=capacity))

    async def admit(count: int) -> list[int]:
        ids = [(await store.submit(job()))[0] for _ in range(count)]
        await admission.schedule()
        return ids

    hello("fast")
    for _ in range(5):  # 50 jobs running on "fast", every launch slot free again
        ids = await admit(10)
        moves = await move_jobs(store, ids, St.LAUNCHING, St.ALIVE, controller_id="fast")
        assert len(moves) == 10
    hello("slow")
    await admit(5)  # 5 jobs still launching on "slow"
    assert (counters.slots("fast").alive, counters.slots("slow").alive) == (50, 5)
    await admit(6)
    # "slow" holds far fewer: it takes jobs while it has a launch slot, "fast" the rest.
    assert (counters.slots("fast").alive, counters.slots("slow").alive) == (51, 10)
    assert counters.slots("slow").launching == 10
    assert live_counts(counters.counts) == live_counts(await store.read(queries.recount))


async def until(condition: Callable[[], bool], turns: int = 10_000) -> None:
    """Lets the event loop run until `condition` holds (failing after `turns` turns)."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


async def test_a_pass_that_waited_for_the_writer_admits_from_the_queue_as_it_is_then(
    store: Store,
) -> None:
    """A pass asks for the writer while another write holds it (SQLite's one writer, and
    PostgreSQL's by default), and a better job is submitted meanwhile (a client's
    submission goes first): the pass reads the queue in its own transaction, so it
    admits the better job, not the one it would have picked from a read made before
    it waited."""
    turns = store.db.turns
    assert turns.writers == 1
    _, stream, admission = one_replica(store, max_launches=1)
    first = await store.submit(job())
    await admission.schedule()  # `first` takes the only launch slot
    older, _ = await store.submit(job())
    await move_jobs(store, [first[0]], St.LAUNCHING, St.ALIVE, controller_id="c1")
    release = asyncio.Event()

    async def hold_the_writer() -> None:
        async with turns.turn():
            await release.wait()

    holder = asyncio.create_task(hold_the_writer())
    await until(lambda: turns.holders == 1)
    admitting = asyncio.create_task(admission.schedule())
    await until(lambda: turns.waiting == 1)  # the pass waits for the writer
    better = NewJob("j", "alice", 10, "", "", [job_pb2.TaskSpec(name="j", run="echo", num_nodes=1)])
    submitting = asyncio.create_task(store.submit(better))
    await until(lambda: turns.waiting == 2)
    release.set()
    await asyncio.gather(holder, admitting)
    better_id, _ = await submitting
    sent = [stream.queue.get_nowait() for _ in range(stream.queue.qsize())]
    granted = [m.assignment.job.job_id for m in sent if m and m.HasField("assignment")]
    assert granted[-1] == better_id
    assert (await store.read(queries.job, older)).schedule_state == St.WAITING  # type: ignore[union-attr]


async def test_a_pass_over_two_replicas_logs_its_admissions_in_queue_order(
    store: Store,
) -> None:
    """One pass spreads jobs over two replicas (a, b, a, b, ...) and moves each replica's
    share in one statement; the event log still lists the admissions in the order the
    queue ranked them, so a reader replaying it never sees a job admitted past one
    still waiting ahead of it."""
    counters = Counters(store)
    store.on_moves = counters.apply
    outbox = Outbox()
    admission = Admission(store, counters, outbox, Limits())
    for cid in ("a", "b"):
        outbox.attach(cid)
        capacity = pb.Capacity(max_launches=10, max_jobs=10)
        admission.connected(pb.ControllerHello(controller_id=cid, capacity=capacity))
    ids = [(await store.submit(job()))[0] for _ in range(5)]
    after = await store.read(queries.last_event_id)
    await admission.schedule()
    admitted = [
        e for e in await store.read(queries.events_after, after) if e.schedule_state == St.LAUNCHING
    ]
    assert [e.job_id for e in admitted] == ids
    # Spread over both replicas, so the order above is not one replica's statement.
    assert {e.message.removeprefix("admitted on ") for e in admitted} == {"a", "b"}


async def test_launch_slots_under_a_global_cap_go_in_admission_order_across_replicas(
    store: Store,
) -> None:
    """ALIVE_WAITING jobs on two replicas, each with launch room, and a global cap: the
    slots go by priority, then submission, whichever replica holds the job, and the
    event log lists the grants in that order."""
    counters = Counters(store)
    store.on_moves = counters.apply
    outbox = Outbox()
    admission = Admission(store, counters, outbox, Limits(global_launches=1))
    streams = {cid: outbox.attach(cid) for cid in ("a", "b")}
    for cid in streams:
        capacity = pb.Capacity(max_launches=5, max_jobs=10)
        admission.connected(pb.ControllerHello(controller_id=cid, capacity=capacity))

    async def asking(cid: str, priority: int) -> int:
        """A job `cid` holds that asks for a launch slot (its next task)."""
        job_id, _ = await store.submit(dataclasses.replace(job(), priority=priority))
        await move_jobs(store, [job_id], St.WAITING, St.LAUNCHING, assign_to=cid)
        await move_jobs(store, [job_id], St.LAUNCHING, St.ALIVE, controller_id=cid)
        await move_jobs(store, [job_id], St.ALIVE, St.ALIVE_WAITING, controller_id=cid)
        return job_id

    low, high = await asking("a", 0), await asking("b", 5)
    mid, second = await asking("a", 3), await asking("b", 2)
    after = await store.read(queries.last_event_id)
    await admission.schedule()
    granted = [
        (m.launch_slot_grant.job_id, cid)
        for cid, stream in streams.items()
        for m in drain(stream)
        if m.HasField("launch_slot_grant")
    ]
    assert granted == [(high, "b")]
    assert {await state(store, j) for j in (low, mid, second)} == {St.ALIVE_WAITING}
    # The cap rises: the others go in the queue's order (a, b, a: one statement per
    # replica), and the log lists them in that order.
    admission.limits.global_launches = 4
    await admission.schedule()
    logged = [
        e.job_id
        for e in await store.read(queries.events_after, after)
        if e.schedule_state == St.LAUNCHING
    ]
    assert logged == [high, mid, second, low]
    assert live_counts(counters.counts) == live_counts(await store.read(queries.recount))


async def state(store: Store, job_id: int) -> St:
    found = await store.read(queries.job, job_id)
    assert found is not None
    return St(found.schedule_state)


def drain(stream: Stream) -> list[pb.ConnectControllerResponse]:
    return [m for m in (stream.queue.get_nowait() for _ in range(stream.queue.qsize())) if m]

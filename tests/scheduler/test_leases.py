"""When a replica's lease ends, and when it does not (contract §9).

A real scheduler (SQLite and PostgreSQL) and raw `ConnectController` streams
playing the replicas:

- a stream the replica's side closes (its process died) has its jobs released at
  once, and they resume on another replica with the next epoch; the old holder,
  back on a new stream, is told to stop, and its late reports are refused;
- a replica that goes silent with its stream open keeps its jobs until the TTL;
- a watchdog that wakes late (a stalled event loop) gives the stream readers a
  turn first: heartbeats that came meanwhile keep the lease;
- a replica whose new stream replaces its old one keeps its jobs, and so do the
  replicas of a scheduler that shuts down.

The scheduler's clock and sleep are the test's (`Naps`): a lease runs out only
when the test moves the clock past it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
from sqlalchemy import select

from harness.replica_stream import Fuzzer, Held, Replica, hello
from harness.store import move_jobs
from harness.waiting import reached, wait_for
from managedjobs.v1 import job_service_pb2 as jpb
from managedjobs.v1 import job_service_pb2_grpc
from managedjobs.v1 import scheduler_service_pb2 as pb
from services.common.event_messages import LEASE_ENDED
from services.common.security.edge import ServerSecurity
from services.common.statuses import ScheduleState as St
from services.scheduler import queries
from services.scheduler.admission import Limits
from services.scheduler.db.models import EventRow
from services.scheduler.leases import WATCHDOG_TICK
from services.scheduler.main import SchedulerApp

TTL = 10.0
HEARTBEAT = 2.0


class Naps:
    """A clock and a sleep the test turns: a sleep ends once the clock passes its end."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeping: list[tuple[float, asyncio.Future[None]]] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        entry = (self.now + seconds, asyncio.get_running_loop().create_future())
        self.sleeping.append(entry)
        try:
            await entry[1]
        finally:
            self.sleeping.remove(entry)

    def advance(self, seconds: float) -> None:
        """Moves the clock on, ending the sleeps that are due."""
        self.now += seconds
        for end, done in self.sleeping:
            if end <= self.now and not done.done():
                done.set_result(None)

    def asleep_until(self, end: float) -> bool:
        return any(abs(e - end) < 1e-9 and not done.done() for e, done in self.sleeping)


@contextlib.asynccontextmanager
async def scheduler(database_url: str, naps: Naps | None = None) -> AsyncIterator[SchedulerApp]:
    kwargs = {} if naps is None else {"clock": naps.clock, "sleep": naps.sleep}
    app = SchedulerApp(
        database_url,
        Limits(),
        security=ServerSecurity.without_auth(),
        lease_ttl=TTL if naps is not None else 3600.0,
        heartbeat_interval=HEARTBEAT,
        **kwargs,  # type: ignore[arg-type]
    )
    await app.start()
    try:
        yield app
    finally:
        await app.close()


@contextlib.asynccontextmanager
async def replica_holding_a_job(
    app: SchedulerApp,
) -> AsyncIterator[tuple[Replica, job_service_pb2_grpc.JobServiceStub, Held]]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.server.port}") as channel:
        replica = Replica(channel)
        await replica.start(hello())
        jobs = job_service_pb2_grpc.JobServiceStub(channel)
        held = await Fuzzer(replica, jobs).hold_a_job()
        try:
            yield replica, jobs, held
        finally:
            replica.close()


async def job(jobs: job_service_pb2_grpc.JobServiceStub, job_id: int) -> jpb.Job:
    return (await jobs.GetJob(jpb.GetJobRequest(job_id=job_id), timeout=10)).job


def heartbeat() -> pb.ConnectControllerRequest:
    return pb.ConnectControllerRequest(heartbeat=pb.ControllerHeartbeat())


def kinds(replica: Replica) -> list[str]:
    return [m.WhichOneof("message") or "" for m in replica.received]


async def test_a_closed_streams_jobs_resume_elsewhere_at_once_with_the_next_epoch(
    database_url: str,
) -> None:
    """The lease is an hour long: only the stream's end can have moved the job."""
    async with (
        scheduler(database_url) as app,
        replica_holding_a_job(app) as (old, jobs, held),
        grpc.aio.insecure_channel(f"127.0.0.1:{app.server.port}") as channel,
    ):
        other = Replica(channel)
        await other.start(hello(controller_id="controller-2"))
        old.close()  # as a SIGKILL does: the connection goes, nothing more is said

        await reached(other.assigned.wait(), what="the job's assignment to controller-2")
        assert other.held == Held(held.job_id, held.epoch + 1)
        moved = await job(jobs, held.job_id)
        assert moved.controller_id == "controller-2"
        assert [cid for cid, _ in app.leases.expired] == ["controller-1"]

        # The old holder comes back still running the job: told at once it lost it, and
        # its late report at the old epoch changes nothing.
        back = Replica(channel)
        holding = [pb.HeldJob(job_id=held.job_id, epoch=held.epoch)]
        await back.start(hello(held_jobs=holding))
        answer = await back.report(heartbeat())
        assert answer.accepted
        revokes = [m.revoke for m in back.received if m.HasField("revoke")]
        assert [(r.job_id, r.epoch) for r in revokes] == [(held.job_id, held.epoch)]
        late = pb.LaunchSlotRelease(job_id=held.job_id, epoch=held.epoch)
        refused = await back.report(pb.ConnectControllerRequest(launch_slot_release=late))
        assert refused.refusal == pb.REPORT_REFUSAL_STALE_EPOCH
        assert (await job(jobs, held.job_id)).controller_id == "controller-2"
        other.close()
        back.close()


async def test_a_job_committed_to_a_replica_after_its_lease_ended_is_released_at_once(
    database_url: str,
) -> None:
    """An admission pass planned while the replica was there commits after its lease ended
    (here: one that never had a lease): nothing else would ever move the job."""
    async with (
        scheduler(database_url) as app,
        grpc.aio.insecure_channel(f"127.0.0.1:{app.server.port}") as channel,
    ):
        jobs = job_service_pb2_grpc.JobServiceStub(channel)
        submitted = await jobs.SubmitJob(jpb.SubmitJobRequest(spec_yaml="run: x\n"), timeout=10)
        [move] = await move_jobs(
            app.store, [submitted.job_id], St.WAITING, St.LAUNCHING, assign_to="controller-9"
        )
        assert move.new_controller == "controller-9"
        released = await wait_for(
            lambda: _released(jobs, submitted.job_id), what="the job released"
        )
        assert released.schedule_state == St.ALIVE
        query = select(EventRow.message).where(EventRow.job_id == submitted.job_id)
        messages = await app.store.read(lambda conn: conn.execute(query).scalars().all())
        assert LEASE_ENDED.format("controller-9") in messages


async def test_a_silent_replica_with_its_stream_open_keeps_its_jobs_until_the_ttl(
    database_url: str,
) -> None:
    naps = Naps()
    async with scheduler(database_url, naps) as app, replica_holding_a_job(app) as (_, jobs, held):
        naps.advance(TTL - 0.5)
        assert (await job(jobs, held.job_id)).controller_id == "controller-1"
        assert app.leases.expired == []
        naps.advance(0.5)
        released = await wait_for(
            lambda: _released(jobs, held.job_id), what="the job released from controller-1"
        )
        assert released.controller_id == ""
        assert [cid for cid, _ in app.leases.expired] == ["controller-1"]


async def _released(jobs: job_service_pb2_grpc.JobServiceStub, job_id: int) -> jpb.Job | None:
    found = await job(jobs, job_id)
    return found if not found.controller_id else None


async def test_a_late_watchdog_reads_the_waiting_heartbeats_before_it_judges_the_lease(
    database_url: str,
) -> None:
    """The event loop stalled past the lease deadline (a long synchronous step) while the
    replica kept sending heartbeats. The watchdog, waking late, naps one tick before
    judging; the heartbeat read meanwhile renews the lease, and nothing moves."""
    naps = Naps()
    async with (
        scheduler(database_url, naps) as app,
        replica_holding_a_job(app) as (
            replica,
            jobs,
            held,
        ),
    ):
        deadline = naps.now + TTL
        assert naps.asleep_until(deadline)
        naps.advance(TTL + 5.0)  # the stall: the watchdog wakes 5 s late
        await wait_for(lambda: _grace_or_expiry(app, naps), what="a nap, or an expiry")
        assert app.leases.expired == []
        # The heartbeat the stall held back is read, and answered.
        assert (await replica.report(heartbeat())).accepted
        naps.advance(WATCHDOG_TICK)
        # Judged again: renewed, the watchdog sleeps until the new deadline.
        renewed = naps.now - WATCHDOG_TICK + TTL
        await wait_for(lambda: _asleep_until(naps, renewed), what="a nap to the renewed deadline")
        assert app.leases.expired == []
        assert (await job(jobs, held.job_id)).controller_id == "controller-1"
        assert not any(m.HasField("revoke") for m in replica.received)


async def test_a_late_watchdog_still_expires_a_silent_replica(database_url: str) -> None:
    naps = Naps()
    async with scheduler(database_url, naps) as app, replica_holding_a_job(app) as (_, jobs, held):
        naps.advance(TTL + 5.0)
        await wait_for(lambda: _grace_or_expiry(app, naps), what="the watchdog's nap")
        assert app.leases.expired == []
        naps.advance(WATCHDOG_TICK)  # nothing came meanwhile
        await wait_for(lambda: _released(jobs, held.job_id), what="the job released")
        assert [cid for cid, _ in app.leases.expired] == ["controller-1"]


async def _grace_or_expiry(app: SchedulerApp, naps: Naps) -> bool:
    return bool(app.leases.expired) or naps.asleep_until(naps.now + WATCHDOG_TICK)


async def _asleep_until(naps: Naps, end: float) -> bool:
    return naps.asleep_until(end)


async def test_a_replica_whose_new_stream_replaces_its_old_one_keeps_its_jobs(
    database_url: str,
) -> None:
    """The replica saw its stream break before the scheduler did, and reconnects once the
    old stream has fallen silent (two heartbeats): the new stream takes over the lease;
    the old one's end releases nothing."""
    naps = Naps()
    async with (
        scheduler(database_url, naps) as app,
        replica_holding_a_job(app) as (old, jobs, held),
        grpc.aio.insecure_channel(f"127.0.0.1:{app.server.port}") as channel,
    ):
        naps.advance(2 * HEARTBEAT + 0.1)
        new = Replica(channel)
        holding = [pb.HeldJob(job_id=held.job_id, epoch=held.epoch)]
        await new.start(hello(held_jobs=holding))
        assert (await new.report(heartbeat())).accepted
        assert old.reader is not None
        await reached(old.reader, what="the old stream to end")
        assert kinds(new).count("revoke") == 0
        kept = await job(jobs, held.job_id)
        assert (kept.controller_id, app.leases.expired) == ("controller-1", [])
        assert app.leases.current["controller-1"].connected
        new.close()


async def test_a_scheduler_shutting_down_leaves_the_replicas_their_jobs(
    database_url: str,
) -> None:
    """Its streams end as the scheduler's doing: the next scheduler finds the jobs still
    assigned, at the same epoch, for the replicas to announce again."""
    async with scheduler(database_url) as app, replica_holding_a_job(app) as (replica, _, held):
        await app.close()
        assert replica.reader is not None
        await asyncio.wait([replica.reader], timeout=10)
        assert replica.reader.done()
    async with (
        scheduler(database_url) as again,
        grpc.aio.insecure_channel(f"127.0.0.1:{again.server.port}") as channel,
    ):
        kept = await job(job_service_pb2_grpc.JobServiceStub(channel), held.job_id)
        assert await again.store.read(queries.held_by, "controller-1") == {held.job_id: held.epoch}
    assert kept.controller_id == "controller-1"
    assert app.leases.expired == [] and again.leases.expired == []

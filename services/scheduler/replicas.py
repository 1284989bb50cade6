"""Controller replicas: their streams, their leases, and what they report (SPEC §9).

A replica's `ConnectController` stream is its lease. The hello carries its
capacity and the jobs it still runs; every message renews the lease. When the
stream breaks, the lease runs out TTL seconds after the last message, and the
replica's jobs move to other replicas with the next epoch. A watchdog task per
replica sleeps until the lease deadline; nothing polls.

Reports carry the job's epoch; a report with a stale epoch is answered
`accepted=false` and its job revoked on that replica, so a replica that lost its
lease stops acting for the job.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from managedjobs.v1 import scheduler_service_pb2 as pb
from managedjobs.v1 import scheduler_service_pb2_grpc
from services.common.errors import FailedPrecondition, rpc_errors
from services.common.statuses import ScheduleState
from services.scheduler.admission import Admission, ReplicaInfo
from services.scheduler.health import DbHealth
from services.scheduler.store import StaleReport, Store

log = logging.getLogger(__name__)
St = ScheduleState


@dataclasses.dataclass
class Session:
    """What the scheduler knows of one replica, across its reconnects."""

    controller_id: str
    address: str = ""
    deadline: float = 0.0
    connected: bool = False
    draining: bool = False
    queue: asyncio.Queue[pb.ConnectControllerResponse | None] = dataclasses.field(
        default_factory=asyncio.Queue
    )
    watchdog: asyncio.Task[None] | None = None
    generation: int = 0


class Replicas(scheduler_service_pb2_grpc.SchedulerServiceServicer):
    def __init__(
        self,
        store: Store,
        admission: Admission,
        health: DbHealth,
        lease_ttl: float = 10.0,
        heartbeat_interval: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.admission = admission
        self.health = health
        self.lease_ttl = lease_ttl
        self.heartbeat_interval = heartbeat_interval
        self.clock = clock
        self.sessions: dict[str, Session] = {}
        self.stale_reports = 0
        self.expired: list[tuple[str, float]] = []

    # --- sending ---------------------------------------------------------------------------

    def send(self, controller_id: str, message: pb.ConnectControllerResponse) -> bool:
        session = self.sessions.get(controller_id)
        if session is None or not session.connected:
            return False
        session.queue.put_nowait(message)
        return True

    # --- leases ----------------------------------------------------------------------------

    async def adopt_unknown(self) -> None:
        """After a scheduler start: replicas named in the database get one lease TTL to
        reconnect before their jobs move."""
        counts = await self.store.recount()
        for controller_id, state in counts:
            if controller_id is not None and state != St.DONE:
                self._session(controller_id)

    def _session(self, controller_id: str) -> Session:
        session = self.sessions.get(controller_id)
        if session is None:
            session = Session(controller_id)
            self.sessions[controller_id] = session
            session.deadline = self.clock() + self.lease_ttl
            session.watchdog = asyncio.create_task(self._watch_lease(session))
        return session

    def _renew(self, session: Session) -> None:
        session.deadline = self.clock() + self.lease_ttl

    async def _watch_lease(self, session: Session) -> None:
        while True:
            remaining = session.deadline - self.clock()
            if remaining > 0:
                await asyncio.sleep(remaining)
                continue
            if not self.health.ok:
                # Nothing can move while the database is away; leases restart when it is back.
                await self.health.wait_reachable()
                session.deadline = max(session.deadline, self.clock() + self.lease_ttl)
                continue
            await self._expire(session)
            return

    async def _expire(self, session: Session) -> None:
        log.warning("lease expired", extra={"controller_id": session.controller_id})
        if self.sessions.get(session.controller_id) is session:
            del self.sessions[session.controller_id]
        self.admission.replicas.pop(session.controller_id, None)
        session.connected = False
        session.queue.put_nowait(None)
        self.expired.append((session.controller_id, self.clock()))
        moves = await self.health.retry(
            lambda: self.store.release_replica(
                session.controller_id, reason=f"lease of {session.controller_id} expired"
            ),
            limit=float("inf"),
        )
        self.admission.applied(moves)

    def restart_leases(self) -> None:
        """Gives every replica a full lease from now (after the database came back)."""
        for session in self.sessions.values():
            session.deadline = max(session.deadline, self.clock() + self.lease_ttl)

    async def close(self) -> None:
        for session in list(self.sessions.values()):
            session.queue.put_nowait(None)
            if session.watchdog is not None:
                session.watchdog.cancel()

    # --- the stream ------------------------------------------------------------------------

    @rpc_errors
    async def ConnectController(
        self,
        request_iterator: AsyncIterator[pb.ConnectControllerRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ConnectControllerResponse]:
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("message") != "hello":
            raise FailedPrecondition("the first message on the stream must be a hello")
        hello = first.hello
        if not hello.controller_id:
            raise FailedPrecondition("hello.controller_id is required")
        session = self._session(hello.controller_id)
        # A reconnect replaces the previous stream of the same replica.
        session.queue.put_nowait(None)
        session.queue = asyncio.Queue()
        session.generation += 1
        generation = session.generation
        session.connected = True
        session.draining = False
        session.address = hello.address
        self._renew(session)
        self.admission.replicas[hello.controller_id] = ReplicaInfo(
            hello.controller_id, hello.capacity
        )
        log.info(
            "replica connected",
            extra={"controller_id": hello.controller_id, "held": len(hello.held_jobs)},
        )
        yield pb.ConnectControllerResponse(
            seq=0,
            welcome=pb.ControllerWelcome(
                lease_ttl_seconds=self.lease_ttl,
                heartbeat_interval_seconds=self.heartbeat_interval,
            ),
        )
        await self._reconcile(session, hello)
        reader = asyncio.create_task(self._read(session, request_iterator, generation))
        try:
            while True:
                message = await session.queue.get()
                if message is None:
                    break
                yield message
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            if session.generation == generation:
                session.connected = False
                info = self.admission.replicas.get(session.controller_id)
                if info is not None:
                    info.draining = True  # no new work until it reconnects
            log.info("replica stream closed", extra={"controller_id": session.controller_id})

    async def _reconcile(self, session: Session, hello: pb.ControllerHello) -> None:
        """The database is the only truth: revoke what the replica should not hold,
        re-send grants and cancels for what it does, and free what it lost."""
        truth = await self.store.held_by(session.controller_id)
        held = {h.job_id: h.epoch for h in hello.held_jobs}
        for job_id, epoch in held.items():
            if truth.get(job_id) != epoch:
                session.queue.put_nowait(
                    pb.ConnectControllerResponse(revoke=pb.JobRevoke(job_id=job_id, epoch=epoch))
                )
        lost = [job_id for job_id, epoch in truth.items() if held.get(job_id) != epoch]
        if lost:
            moves = await self.store.release_replica(
                session.controller_id, lost, reason="the replica no longer runs it"
            )
            self.admission.applied(moves)
        kept = [job_id for job_id, epoch in truth.items() if held.get(job_id) == epoch]
        for job in await self.store.get_jobs(kept):
            job_id, epoch = job.job_id, truth[job.job_id]
            if job.schedule_state == St.LAUNCHING:
                session.queue.put_nowait(
                    pb.ConnectControllerResponse(
                        launch_slot_grant=pb.LaunchSlotGrant(job_id=job_id, epoch=epoch)
                    )
                )
            if job.cancel_requested:
                session.queue.put_nowait(
                    pb.ConnectControllerResponse(cancel=pb.JobCancel(job_id=job_id, epoch=epoch))
                )
        self.admission.kick()

    async def _read(
        self,
        session: Session,
        request_iterator: AsyncIterator[pb.ConnectControllerRequest],
        generation: int,
    ) -> None:
        """Reads the replica's messages. Heartbeats are acked at once, even while the
        database is away, so a replica keeps its lease; everything else goes, in order,
        to a worker that retries while the database is unreachable."""
        work: asyncio.Queue[pb.ConnectControllerRequest] = asyncio.Queue()
        worker = asyncio.create_task(self._work(session, work, generation))
        try:
            async for request in request_iterator:
                if session.generation != generation:
                    return
                self._renew(session)
                if request.WhichOneof("message") == "heartbeat":
                    ack = pb.ReportAck(ack_seq=request.seq, accepted=True)
                    session.queue.put_nowait(pb.ConnectControllerResponse(ack=ack))
                else:
                    work.put_nowait(request)
            await work.join()
        except (asyncio.CancelledError, grpc.aio.AioRpcError, grpc.aio.AbortError):
            raise
        except Exception:
            log.exception("replica stream failed", extra={"controller_id": session.controller_id})
        finally:
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)
            if session.generation == generation:
                session.queue.put_nowait(None)

    async def _work(
        self,
        session: Session,
        work: asyncio.Queue[pb.ConnectControllerRequest],
        generation: int,
    ) -> None:
        while True:
            request = await work.get()
            try:
                if session.generation == generation:
                    ack = await self.health.retry(functools.partial(self._handle, session, request))
                    session.queue.put_nowait(pb.ConnectControllerResponse(ack=ack))
            except Exception:
                # Unacked, the replica sends it again on its next stream.
                log.exception("report failed", extra={"controller_id": session.controller_id})
                session.queue.put_nowait(None)
            finally:
                work.task_done()

    async def _handle(self, session: Session, request: pb.ConnectControllerRequest) -> pb.ReportAck:
        kind = request.WhichOneof("message")
        cid = session.controller_id
        try:
            if kind == "transition":
                await self.store.apply_transition(request.transition, cid)
            elif kind == "launch_slot_request":
                r = request.launch_slot_request
                await self._request_slot(session, r.job_id, r.epoch, r.reason)
            elif kind == "launch_slot_release":
                r2 = request.launch_slot_release
                move = await self.store.move(
                    r2.job_id,
                    [St.LAUNCHING],
                    St.ALIVE,
                    epoch=r2.epoch,
                    controller_id=cid,
                    wait_reason=r2.wait_reason,
                    message=r2.wait_reason or "launched",
                )
                if move is None:
                    # A repeat is harmless; a stale epoch is not.
                    await self.store.check_epoch(r2.job_id, r2.epoch, cid)
                self.admission.applied([move])
            elif kind == "job_finished":
                r3 = request.job_finished
                self.admission.applied([await self.store.finish(r3.job_id, r3.epoch, cid)])
            elif kind == "job_handback":
                r4 = request.job_handback
                await self.store.check_epoch(r4.job_id, r4.epoch, cid)
                moves = await self.store.release_replica(
                    cid, [r4.job_id], reason=f"handed back by {cid}"
                )
                self.admission.applied(moves)
            elif kind == "draining":
                session.draining = True
                info = self.admission.replicas.get(cid)
                if info is not None:
                    info.draining = True
            else:
                return pb.ReportAck(ack_seq=request.seq, accepted=False, reason=f"unknown {kind}")
        except StaleReport as stale:
            self.stale_reports += 1
            log.warning("stale report", extra={"controller_id": cid, "reason": str(stale)})
            job_id, epoch = _job_of(request)
            session.queue.put_nowait(
                pb.ConnectControllerResponse(revoke=pb.JobRevoke(job_id=job_id, epoch=epoch))
            )
            return pb.ReportAck(ack_seq=request.seq, accepted=False, reason=str(stale))
        except ValueError as bad:
            log.warning("rejected report", extra={"controller_id": cid, "reason": str(bad)})
            return pb.ReportAck(ack_seq=request.seq, accepted=False, reason=str(bad))
        return pb.ReportAck(ack_seq=request.seq, accepted=True)

    async def _request_slot(self, session: Session, job_id: int, epoch: int, reason: str) -> None:
        cid = session.controller_id
        move = await self.store.move(
            job_id,
            [St.ALIVE],
            St.ALIVE_WAITING,
            epoch=epoch,
            controller_id=cid,
            wait_reason=reason or "waiting for a launch slot",
            message="launch slot requested",
        )
        if move is None:
            await self.store.check_epoch(job_id, epoch, cid)
            job = await self.store.get_job(job_id)
            if job is not None and job.schedule_state == St.LAUNCHING:
                # Already holds a slot (a repeated request): grant again.
                self.send(
                    cid,
                    pb.ConnectControllerResponse(
                        launch_slot_grant=pb.LaunchSlotGrant(job_id=job_id, epoch=epoch)
                    ),
                )
            return
        self.admission.applied([move])

    # --- operators ------------------------------------------------------------------------

    @rpc_errors
    async def GetSchedulerState(
        self, request: pb.GetSchedulerStateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetSchedulerStateResponse:
        state = self.admission.state()
        state.stale_reports = self.stale_reports
        state.database_reachable = self.health.ok
        for cid, session in sorted(self.sessions.items()):
            info = self.admission.replicas.get(cid)
            slots = self.admission.slots(cid)
            replica = pb.ReplicaState(
                controller_id=cid,
                address=session.address,
                connected=session.connected,
                draining=session.draining,
                launching=slots.launching,
                alive=slots.alive,
            )
            if info is not None:
                replica.capacity.CopyFrom(info.capacity)
            replica.lease_expire_time.FromSeconds(
                int(time.time() + max(0.0, session.deadline - self.clock()))
            )
            state.replicas.append(replica)
        return state


def _job_of(request: pb.ConnectControllerRequest) -> tuple[int, int]:
    kind = request.WhichOneof("message")
    inner = getattr(request, kind) if kind else None
    return int(getattr(inner, "job_id", 0)), int(getattr(inner, "epoch", 0))

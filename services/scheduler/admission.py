"""Admission: who may start, who may launch, and on which replica (contract §5).

Admission owns the registry of replicas that may take work (`connected`,
`draining`, `gone`) and reads the counters (`counters.py`) to decide. A
scheduling pass runs whenever something may have freed or needed a slot (every
committed move kicks it); the kicks coalesce, so a burst of changes costs one
pass, and nothing polls. The counts tell a pass where there is work, so an idle
pass touches no database.

Order: ALIVE_WAITING before WAITING, each by priority then submission. An
ALIVE_WAITING job launches when its replica has launching < launch limit; a
WAITING job also needs a replica with alive < job limit, and goes to the one
with the most spare room. Jobs whose replica died ("orphans") are placed before
any new job. A pass moves jobs with conditional UPDATEs (the store's moves feed
the counters) and tells replicas through the outbox, with each job as committed
with its move (its cancel flag included).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence

from managedjobs.v1 import job_pb2
from managedjobs.v1 import scheduler_service_pb2 as pb
from services.common.background import Background
from services.common.event_messages import ADMITTED_ON, RESUMED_ON
from services.common.statuses import ALIVE_STATES, ScheduleState
from services.scheduler import metrics
from services.scheduler.counters import Counters
from services.scheduler.endings import finish
from services.scheduler.moves import move_many
from services.scheduler.outbox import Outbox, TooLarge
from services.scheduler.queries import ALIVE_WAITING_ON, ORPHANS, queued_jobs, secrets_of
from services.scheduler.store import Store
from services.scheduler.txn import Move, Txn

log = logging.getLogger(__name__)

St = ScheduleState
BATCH = 512
UNLIMITED = 1 << 30


@dataclasses.dataclass
class Limits:
    """Optional global caps (0 = none) and per-replica overrides (0 = the replica's own)."""

    global_launches: int = 0
    global_jobs: int = 0
    replica_launches: int = 0
    replica_jobs: int = 0


@dataclasses.dataclass
class ReplicaRoom:
    """What one replica may still take in a pass."""

    jobs: int
    launches: int
    # Alive jobs it holds, planned ones included: jobs go to the replica holding fewest.
    held: int
    # Takes no new jobs, but still launches the next tasks of those it holds.
    draining: bool = False


@dataclasses.dataclass
class Room:
    """Where a pass may place jobs: per replica that takes work, and globally."""

    replicas: dict[str, ReplicaRoom]
    launches: int
    jobs: int

    def best(self, need_launch: bool) -> str | None:
        """The replica holding the fewest jobs among those with room for one more (and a
        free launch slot, with `need_launch`), if any.

        Jobs spread by how many each replica holds, not by which replica frees its
        launch slots first: a faster replica would otherwise take ever more of them.
        """
        if need_launch and (self.launches <= 0 or self.jobs <= 0):
            return None
        best: str | None = None
        fewest = 0
        for cid, replica in self.replicas.items():
            if replica.draining or replica.jobs <= 0 or (need_launch and replica.launches <= 0):
                continue
            if best is None or replica.held < fewest:
                best, fewest = cid, replica.held
        return best

    def with_launch_room(self) -> list[str]:
        return sorted(cid for cid, replica in self.replicas.items() if replica.launches > 0)

    def take(self, cid: str, *, launch: bool, job: bool = True, new: bool = True) -> None:
        """Counts one job planned for `cid`: a launch slot and/or a place (`new`: one more
        alive job in all; an orphan was counted already)."""
        replica = self.replicas[cid]
        if launch:
            replica.launches -= 1
            self.launches -= 1
        if job:
            replica.jobs -= 1
            replica.held += 1
            if new:
                self.jobs -= 1


@dataclasses.dataclass
class ReplicaInfo:
    controller_id: str
    capacity: pb.Capacity
    draining: bool = False
    regions: tuple[str, ...] = ()


class Admission:
    def __init__(self, store: Store, counters: Counters, outbox: Outbox, limits: Limits) -> None:
        self.store = store
        self.counters = counters
        self.outbox = outbox
        self.limits = limits
        self.replicas: dict[str, ReplicaInfo] = {}
        self._kick = asyncio.Event()
        self._runner = Background("admission", self._run)
        self.passes = 0
        # Assignments of the last step that could not go on a stream: (cid, job, epoch, why).
        self._too_large: list[tuple[str, int, int, str]] = []

    # --- the registry ------------------------------------------------------------------------

    def connected(self, hello: pb.ControllerHello) -> None:
        """A replica said hello: it may take work up to its capacity."""
        self.replicas[hello.controller_id] = ReplicaInfo(
            hello.controller_id, hello.capacity, regions=tuple(hello.regions)
        )
        self.kick()

    def draining(self, controller_id: str) -> None:
        """The replica takes no new work (draining, or its stream broke)."""
        info = self.replicas.get(controller_id)
        if info is not None:
            info.draining = True

    def gone(self, controller_id: str) -> None:
        self.replicas.pop(controller_id, None)

    def regions(self) -> frozenset[str] | None:
        """Regions some connected replica's backend offers; None when none can say."""
        known = [r.regions for r in self.replicas.values() if r.regions]
        return frozenset(region for regions in known for region in regions) if known else None

    def waiting_reason(self) -> str:
        """Why WAITING jobs are waiting now, for a job that gives up (max_pending)."""
        if not any(not r.draining for r in self.replicas.values()):
            return "waiting for a controller replica to connect"
        if self._global_job_room() <= 0:
            return f"waiting: the global limit of {self.limits.global_jobs} jobs is reached"
        if self._global_launch_room() <= 0:
            return f"waiting: the global limit of {self.limits.global_launches} launches is reached"
        return "waiting for a launch slot: every replica is full"

    def limit_launches(self, replica: ReplicaInfo) -> int:
        return self.limits.replica_launches or replica.capacity.max_launches

    def limit_jobs(self, replica: ReplicaInfo) -> int:
        return self.limits.replica_jobs or replica.capacity.max_jobs

    # --- the pass ------------------------------------------------------------------------

    def moved(self, moves: Sequence[Move]) -> None:
        """Committed moves may have freed or asked for a slot: schedule soon."""
        self.kick()

    def kick(self) -> None:
        """Asks for a scheduling pass soon; many kicks make one pass."""
        self._kick.set()

    def start(self) -> None:
        self._runner.start()

    async def stop(self) -> None:
        await self._runner.stop()

    async def _run(self) -> None:
        while True:
            await self._kick.wait()
            self._kick.clear()
            try:
                await self.schedule()
            except asyncio.CancelledError:
                raise
            except Exception:
                # The database may be briefly away; the next change kicks again.
                log.exception("scheduling pass failed")

    async def schedule(self) -> None:
        self.passes += 1
        # Orphans first: they take no launch slot, and once placed they may need one.
        await self._place_orphans()
        await self._grant_alive_waiting()
        await self._admit_waiting()

    def _orphans(self) -> int:
        return sum(self.counters.counts[(None, s)] for s in ALIVE_STATES)

    def _global_launch_room(self) -> int:
        if not self.limits.global_launches:
            return UNLIMITED
        return self.limits.global_launches - self.counters.totals().launching

    def _global_job_room(self) -> int:
        if not self.limits.global_jobs:
            return UNLIMITED
        return self.limits.global_jobs - self.counters.totals().alive

    def room(self) -> Room:
        """Where there is room now, as the counters say.

        Taken on the event loop before a pass's transaction and used inside it: between
        the two only the pass itself adds jobs to a replica (every other move frees
        room), so the plan can only be short of room, never over it, and the moves
        that freed room kick another pass.
        """
        replicas = {}
        for replica in self.replicas.values():
            slots = self.counters.slots(replica.controller_id)
            replicas[replica.controller_id] = ReplicaRoom(
                jobs=self.limit_jobs(replica) - slots.alive,
                launches=self.limit_launches(replica) - slots.launching,
                held=slots.alive,
                draining=replica.draining,
            )
        return Room(replicas, self._global_launch_room(), self._global_job_room())

    async def _place_orphans(self) -> None:
        """Jobs whose replica died go to the replica with the most job room, before any
        new job: they were admitted already. They hold no launch slot (the store freed
        it), so only the job limit applies."""
        while self._orphans():
            room = self.room()
            if room.best(need_launch=False) is None:
                return
            planned = await self._pass(functools.partial(self._place, room=room))
            if not planned:
                return

    def _place(self, txn: Txn, room: Room) -> bool:
        rows = txn.conn.execute(ORPHANS, {"limit": BATCH}).all()
        plan: dict[tuple[str, ScheduleState], list[int]] = {}
        for row in rows:
            cid = room.best(need_launch=False)
            if cid is None:
                break
            room.take(cid, launch=False, new=False)
            plan.setdefault((cid, St(row.schedule_state)), []).append(int(row.id))
        for (cid, state), ids in plan.items():
            moves, jobs = move_many(
                txn, ids, state, state, assign_to=cid, message=f"{RESUMED_ON}{cid}", fetch=True
            )
            self._send(txn, cid, moves, jobs, granted=False)
        placed = sum(len(ids) for ids in plan.values())
        return bool(rows) and placed == len(rows)

    async def _grant_alive_waiting(self) -> None:
        """Launch slots for jobs their replicas asked one for, in admission order across
        replicas (priority, then submission), each within its replica's launch room and
        all within the global one."""
        while self.counters.total(St.ALIVE_WAITING):
            room = self.room()
            if room.launches <= 0 or not room.with_launch_room():
                return
            more = await self._pass(functools.partial(self._grant, room=room))
            if not more:
                return

    def _grant(self, txn: Txn, room: Room) -> bool:
        cids = room.with_launch_room()
        limit = min(BATCH, room.launches, sum(room.replicas[c].launches for c in cids))
        rows = txn.conn.execute(ALIVE_WAITING_ON, {"cids": cids, "limit": limit}).all()
        granted: dict[str, list[int]] = {}
        for row in rows:
            cid = row.controller_id
            if room.launches <= 0:
                break
            if room.replicas[cid].launches <= 0:
                continue
            room.take(cid, launch=True, job=False)
            granted.setdefault(cid, []).append(int(row.id))
        first_event = len(txn.events)
        for cid, ids in granted.items():
            moves, _ = move_many(
                txn, ids, St.ALIVE_WAITING, St.LAUNCHING, controller_id=cid,
                message="launch slot granted",
            )  # fmt: skip
            txn.after.append(functools.partial(self._grants, cid, moves))
        # One statement per replica; the event log lists the grants in queue order.
        txn.order_events(first_event, [row.id for row in rows])
        # Another page only if this one was full and room is left for its skipped rows.
        return len(rows) == limit and room.launches > 0 and bool(room.with_launch_room())

    def _grants(self, cid: str, moves: Sequence[Move]) -> None:
        for move in moves:
            self.outbox.grant(cid, move.job_id, move.epoch)

    async def _admit_waiting(self) -> None:
        while self.counters.counts[(None, St.WAITING)]:
            room = self.room()
            if min(room.launches, room.jobs) <= 0 or room.best(need_launch=True) is None:
                return
            if not await self._pass(functools.partial(self._admit, room=room)):
                return

    def _admit(self, txn: Txn, room: Room) -> bool:
        # The queue is read in the transaction that moves its jobs: no other write
        # commits in between, so a pass never admits past a job that was queued (and
        # ranked ahead) by the time its admissions commit.
        rows = queued_jobs(txn.conn, St.WAITING, None, min(room.launches, room.jobs, BATCH))
        plan: dict[str, list[int]] = {}
        for row in rows:
            cid = room.best(need_launch=True)
            if cid is None:
                break
            room.take(cid, launch=True)
            plan.setdefault(cid, []).append(row.id)
        first_event = len(txn.events)
        for cid, ids in plan.items():
            moves, jobs = move_many(
                txn, ids, St.WAITING, St.LAUNCHING, assign_to=cid,
                message=f"{ADMITTED_ON}{cid}", fetch=True,
            )  # fmt: skip
            self._send(txn, cid, moves, jobs, granted=True)
        # One statement per replica; the event log lists admissions in queue order.
        txn.order_events(first_event, [row.id for row in rows])
        placed = sum(len(ids) for ids in plan.values())
        return bool(rows) and placed == len(rows)

    async def _pass(self, body: Callable[[Txn], bool]) -> bool:
        """Runs one step of a pass in a transaction; then fails what could not be sent."""
        self._too_large.clear()
        more = await self.store.transaction(body)
        while self._too_large:
            cid, job_id, epoch, error = self._too_large.pop()
            log.error("assignment too large", extra={"job_id": job_id, "error": error})
            reason = f"cannot be assigned: {error}"
            await self.store.transaction(
                functools.partial(finish, cid=cid, job_id=job_id, epoch=epoch, reason=reason)
            )
        return more

    def _send(
        self, txn: Txn, cid: str, moves: list[Move], jobs: list[job_pb2.Job], granted: bool
    ) -> None:
        """Has the moved jobs' assignments sent once the transaction committed, with their
        secrets (read in it)."""
        if not jobs:
            return
        secrets = secrets_of(txn.conn, [job.job_id for job in jobs])
        txn.after.append(functools.partial(self._assign, cid, moves, jobs, secrets, granted))

    def _assign(
        self,
        cid: str,
        moves: list[Move],
        jobs: list[job_pb2.Job],
        secrets: dict[int, list[pb.TaskSecrets]],
        granted: bool,
    ) -> None:
        epochs = {m.job_id: m.epoch for m in moves}
        if granted:
            metrics.admitted(jobs)
        for job in jobs:
            epoch = epochs[job.job_id]
            try:
                self.outbox.assign(cid, job, epoch, granted, secrets.get(job.job_id))
            except TooLarge as error:
                # Never on the stream (it would break it for every job): this job fails.
                self._too_large.append((cid, job.job_id, epoch, str(error)))

    def state(self) -> pb.GetSchedulerStateResponse:
        totals = self.counters.totals()
        return pb.GetSchedulerStateResponse(
            global_limits=pb.Capacity(
                max_launches=self.limits.global_launches, max_jobs=self.limits.global_jobs
            ),
            launching=totals.launching,
            alive=totals.alive,
            waiting=self.counters.counts[(None, St.WAITING)],
            alive_waiting=self.counters.total(St.ALIVE_WAITING),
            counter_corrections=self.counters.corrections,
        )

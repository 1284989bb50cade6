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
import logging
from collections import Counter
from collections.abc import Sequence

from managedjobs.v1 import job_pb2
from managedjobs.v1 import scheduler_service_pb2 as pb
from services.common.statuses import ALIVE_STATES, ScheduleState
from services.scheduler import metrics
from services.scheduler.counters import Counters
from services.scheduler.outbox import Outbox, TooLarge
from services.scheduler.reports import finish
from services.scheduler.store import ADMITTED_ON, RESUMED_ON, Move, Queued, Store

log = logging.getLogger(__name__)

St = ScheduleState
BATCH = 512


@dataclasses.dataclass
class Limits:
    """Optional global caps (0 = none) and per-replica overrides (0 = the replica's own)."""

    global_launches: int = 0
    global_jobs: int = 0
    replica_launches: int = 0
    replica_jobs: int = 0


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
        self._task: asyncio.Task[None] | None = None
        self.passes = 0

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
        self._task = asyncio.create_task(self._run(), name="admission")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

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

    def _global_launch_room(self) -> int:
        if not self.limits.global_launches:
            return 1 << 30
        return self.limits.global_launches - self.counters.totals().launching

    def _global_job_room(self) -> int:
        if not self.limits.global_jobs:
            return 1 << 30
        return self.limits.global_jobs - self.counters.totals().alive

    async def _grant_alive_waiting(self) -> None:
        for replica in list(self.replicas.values()):
            cid = replica.controller_id
            if not self.counters.counts[(cid, St.ALIVE_WAITING)]:
                continue
            room = min(
                self.limit_launches(replica) - self.counters.slots(cid).launching,
                self._global_launch_room(),
            )
            if room <= 0:
                continue
            rows = await self.store.queued(St.ALIVE_WAITING, cid, min(room, BATCH))
            moves, _ = await self.store.move_many(
                [row.id for row in rows],
                St.ALIVE_WAITING,
                St.LAUNCHING,
                controller_id=cid,
                message="launch slot granted",
            )
            for move in moves:
                self.outbox.grant(cid, move.job_id, move.epoch)

    def _best_replica(
        self, need_launch_room: bool, pending: Counter[str] | None = None
    ) -> ReplicaInfo | None:
        """The non-draining replica holding the fewest jobs among those with room for one
        more (and a free launch slot, with `need_launch_room`), if any.

        Jobs spread by how many each replica holds, not by which replica frees its
        launch slots first: a faster replica would otherwise take ever more of them.
        `pending` counts jobs already planned for each replica in this pass.
        """
        best: ReplicaInfo | None = None
        best_held = 0
        for replica in self.replicas.values():
            if replica.draining:
                continue
            slots = self.counters.slots(replica.controller_id)
            planned = pending[replica.controller_id] if pending else 0
            held = slots.alive + planned
            if held >= self.limit_jobs(replica):
                continue
            if need_launch_room and slots.launching + planned >= self.limit_launches(replica):
                continue
            if best is None or held < best_held:
                best, best_held = replica, held
        return best

    def _orphans(self) -> int:
        return sum(self.counters.counts[(None, s)] for s in ALIVE_STATES)

    async def _place_orphans(self) -> None:
        """Jobs whose replica died go to the replica with the most job room, before any
        new job: they were admitted already. They hold no launch slot (the store freed
        it), so only the job limit applies."""
        while self._orphans() and self._best_replica(need_launch_room=False) is not None:
            rows = await self.store.orphans(BATCH)
            plan, placed = self._plan(rows, need_launch_room=False)
            for (cid, state), ids in plan.items():
                moves, jobs = await self.store.move_many(
                    ids, state, state, assign_to=cid, message=f"{RESUMED_ON}{cid}", fetch=True
                )
                secrets = await self.store.secrets([job.job_id for job in jobs])
                await self._assign(cid, moves, jobs, secrets, granted=False)
            if not rows or placed < len(rows):
                return

    async def _admit_waiting(self) -> None:
        while self.counters.counts[(None, St.WAITING)]:
            room = min(self._global_launch_room(), self._global_job_room())
            if room <= 0 or self._best_replica(need_launch_room=True) is None:
                return
            # The queue is read in the transaction that moves its jobs: on SQLite no other
            # write commits in between, so a pass never admits past a job that was queued
            # (and ranked ahead) by the time its admissions commit.
            moved: list[tuple[str, list[Move], list[job_pb2.Job]]] = []
            secrets: dict[int, list[pb.TaskSecrets]] = {}
            async with self.store.transaction() as txn:
                rows = await self.store.queued(St.WAITING, None, min(room, BATCH), txn)
                plan, placed = self._plan(rows, need_launch_room=True)
                first_event = len(txn.events)
                for (cid, _), ids in plan.items():
                    moves, jobs = await self.store.move_many(
                        ids, St.WAITING, St.LAUNCHING, assign_to=cid,
                        message=f"{ADMITTED_ON}{cid}", fetch=True, txn=txn,
                    )  # fmt: skip
                    moved.append((cid, moves, jobs))
                # One statement per replica; the event log lists admissions in queue order.
                txn.order_events(first_event, [row.id for row in rows])
                ids = [job.job_id for _, _, jobs in moved for job in jobs]
                secrets = await self.store.secrets(ids, txn)
            # Sent once committed.
            for cid, moves, jobs in moved:
                await self._assign(cid, moves, jobs, secrets, granted=True)
            if not rows or placed < len(rows):
                return

    def _plan(
        self, rows: Sequence[Queued], need_launch_room: bool
    ) -> tuple[dict[tuple[str, ScheduleState], list[int]], int]:
        """Which replica takes each job, in order, while one has room: job ids by
        (replica, schedule state), and how many jobs were placed."""
        plan: dict[tuple[str, ScheduleState], list[int]] = {}
        pending: Counter[str] = Counter()
        for row in rows:
            replica = self._best_replica(need_launch_room=need_launch_room, pending=pending)
            if replica is None:
                break
            pending[replica.controller_id] += 1
            plan.setdefault((replica.controller_id, row.schedule_state), []).append(row.id)
        return plan, sum(pending.values())

    async def _assign(
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
                log.error("assignment too large", extra={"job_id": job.job_id, "error": str(error)})
                async with self.store.transaction() as txn:
                    await finish(txn, cid, job.job_id, epoch, f"cannot be assigned: {error}")

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

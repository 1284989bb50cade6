"""Admission: who may start, who may launch, and on which replica (SPEC §5).

`launching` counts jobs in LAUNCHING, `alive` jobs in LAUNCHING, ALIVE or
ALIVE_WAITING, per replica and in total. The counters live in memory, change
only through `apply` (fed by the store's conditional updates, which are the
truth), and are rebuilt from the database at start.

A scheduling pass runs whenever something may have freed or needed a slot; the
kicks coalesce, so a burst of changes costs one pass, and nothing polls.
Order: ALIVE_WAITING before WAITING, each by priority then submission. An
ALIVE_WAITING job launches when its replica has launching < launch limit; a
WAITING job also needs a replica with alive < job limit, and goes to the one
with the most spare room.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Iterable

from managedjobs.v1 import scheduler_service_pb2 as pb
from services.common.statuses import ALIVE_STATES, ScheduleState
from services.scheduler.store import Move, Store

log = logging.getLogger(__name__)

St = ScheduleState
BATCH = 256


@dataclasses.dataclass
class Slots:
    launching: int = 0
    alive: int = 0


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


Send = Callable[[str, pb.ConnectControllerResponse], bool]


class Admission:
    def __init__(self, store: Store, limits: Limits, send: Send) -> None:
        self.store = store
        self.limits = limits
        self._send = send
        self.slots: dict[str | None, Slots] = {}
        self.replicas: dict[str, ReplicaInfo] = {}
        self._kick = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.passes = 0

    # --- counters ------------------------------------------------------------------------

    async def rebuild(self) -> None:
        """Counters from a recount of the database."""
        self.slots = counters_from(await self.store.recount())

    def apply(self, move: Move | None) -> None:
        if move is None:
            return
        if move.old in ALIVE_STATES:
            before = self.slots.setdefault(move.old_controller, Slots())
            before.alive -= 1
            before.launching -= move.old == St.LAUNCHING
        if move.new in ALIVE_STATES:
            after = self.slots.setdefault(move.new_controller, Slots())
            after.alive += 1
            after.launching += move.new == St.LAUNCHING

    def applied(self, moves: Iterable[Move | None]) -> None:
        for move in moves:
            self.apply(move)
        self.kick()

    def totals(self) -> Slots:
        return Slots(
            launching=sum(s.launching for s in self.slots.values()),
            alive=sum(s.alive for s in self.slots.values()),
        )

    def limit_launches(self, replica: ReplicaInfo) -> int:
        return self.limits.replica_launches or replica.capacity.max_launches

    def limit_jobs(self, replica: ReplicaInfo) -> int:
        return self.limits.replica_jobs or replica.capacity.max_jobs

    # --- the pass ------------------------------------------------------------------------

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
        await self._grant_alive_waiting()
        await self._place_orphans()
        await self._admit_waiting()

    def _global_launch_room(self) -> int:
        if not self.limits.global_launches:
            return 1 << 30
        return self.limits.global_launches - self.totals().launching

    def _global_job_room(self) -> int:
        if not self.limits.global_jobs:
            return 1 << 30
        return self.limits.global_jobs - self.totals().alive

    async def _grant_alive_waiting(self) -> None:
        for replica in list(self.replicas.values()):
            slots = self.slots.setdefault(replica.controller_id, Slots())
            room = min(self.limit_launches(replica) - slots.launching, self._global_launch_room())
            if room <= 0:
                continue
            for row in await self.store.queued(St.ALIVE_WAITING, replica.controller_id, room):
                move = await self.store.move(
                    row.id,
                    [St.ALIVE_WAITING],
                    St.LAUNCHING,
                    epoch=row.epoch,
                    controller_id=replica.controller_id,
                    wait_reason="",
                    message="launch slot granted",
                )
                self.apply(move)
                if move is not None:
                    self._send(
                        replica.controller_id,
                        pb.ConnectControllerResponse(
                            launch_slot_grant=pb.LaunchSlotGrant(job_id=row.id, epoch=row.epoch)
                        ),
                    )

    def _best_replica(self, need_launch_room: bool) -> ReplicaInfo | None:
        """The non-draining replica with the most room for one more job, if any has room."""
        best: ReplicaInfo | None = None
        best_room = 0
        for replica in self.replicas.values():
            if replica.draining:
                continue
            slots = self.slots.setdefault(replica.controller_id, Slots())
            room = self.limit_jobs(replica) - slots.alive
            if need_launch_room:
                room = min(room, self.limit_launches(replica) - slots.launching)
            if room > best_room:
                best, best_room = replica, room
        return best

    async def _place_orphans(self) -> None:
        """Jobs whose replica died go to the replica with the most job room, before any
        new job: they were admitted already. They hold no launch slot (the store freed
        it), so only the job limit applies."""
        while True:
            if self._best_replica(need_launch_room=False) is None:
                return
            rows = await self.store.orphans(BATCH)
            if not rows:
                return
            for row in rows:
                replica = self._best_replica(need_launch_room=False)
                if replica is None:
                    return
                state = row.schedule_state
                move = await self.store.move(
                    row.id,
                    [state],
                    state,
                    epoch=row.epoch,
                    assign_to=replica.controller_id,
                    message=f"resumed on {replica.controller_id}",
                )
                self.apply(move)
                if move is not None:
                    await self._assign(replica.controller_id, row.id, move.epoch, granted=False)

    async def _admit_waiting(self) -> None:
        while True:
            room = min(self._global_launch_room(), self._global_job_room())
            if room <= 0 or self._best_replica(need_launch_room=True) is None:
                return
            rows = await self.store.queued(St.WAITING, None, min(room, BATCH))
            if not rows:
                return
            for row in rows:
                if self._global_launch_room() <= 0 or self._global_job_room() <= 0:
                    return
                replica = self._best_replica(need_launch_room=True)
                if replica is None:
                    return
                move = await self.store.move(
                    row.id,
                    [St.WAITING],
                    St.LAUNCHING,
                    assign_to=replica.controller_id,
                    wait_reason="",
                    message=f"admitted on {replica.controller_id}",
                )
                self.apply(move)
                if move is not None:
                    await self._assign(replica.controller_id, row.id, move.epoch, granted=True)

    async def _assign(self, controller_id: str, job_id: int, epoch: int, granted: bool) -> None:
        job = await self.store.get_job(job_id, with_specs=True)
        if job is None:
            return
        self._send(
            controller_id,
            pb.ConnectControllerResponse(
                assignment=pb.JobAssignment(job=job, epoch=epoch, launch_granted=granted)
            ),
        )

    def state(self) -> pb.GetSchedulerStateResponse:
        totals = self.totals()
        return pb.GetSchedulerStateResponse(
            global_limits=pb.Capacity(
                max_launches=self.limits.global_launches, max_jobs=self.limits.global_jobs
            ),
            launching=totals.launching,
            alive=totals.alive,
        )


def counters_from(counts: Counter[tuple[str | None, ScheduleState]]) -> dict[str | None, Slots]:
    slots: dict[str | None, Slots] = {}
    for (controller, state), n in counts.items():
        if state in ALIVE_STATES:
            entry = slots.setdefault(controller, Slots())
            entry.alive += n
            entry.launching += n if state == St.LAUNCHING else 0
    return slots


__all__ = ["Admission", "Limits", "ReplicaInfo", "Slots", "counters_from"]

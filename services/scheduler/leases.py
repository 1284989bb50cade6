"""Replicas' leases: who holds one, until when, and what happens when it ends (contract §9).

A replica's `ConnectController` stream is its lease. The hello opens (or takes
back) the replica's lease; every message it sends renews it. The lease ends, and
the replica's jobs are released (`releases.py`) for other replicas with the next
epoch, in one of two ways:

- the replica's side closes the stream (its process died, its connection
  dropped, it shut down): at once, since nothing more can come on that stream.
  Every report and every backend call is fenced by epoch, so the old holder
  changes nothing once the jobs are assigned again; a replica that reconnects
  is told on its new stream which of its jobs it no longer holds;
- the stream stays open but falls silent: TTL seconds after the last message.

A stream the scheduler itself ends (a protocol breach, a failed batch, a
replacement, its own shutdown) keeps the TTL: the replica reconnects to a lease
that is still there.

A watchdog task per lease sleeps until the deadline (or until its stream
closes); nothing polls. A watchdog that wakes late (the event loop was busy: a
long synchronous step) first gives the stream readers a turn, so heartbeats that
arrived meanwhile and wait in the stream's buffer renew the lease before it is
judged. While the database is away nothing can move, so no lease ends; every
lease gets a full TTL from when it is back.

An admission pass that planned before a lease ended may commit jobs to that
replica afterwards: they are released as soon as the commit is seen (`moved`),
since no lease of that replica will end again to move them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from services.common.event_messages import LEASE_ENDED, LEASE_EXPIRED, STREAM_CLOSED
from services.common.statuses import ScheduleState
from services.scheduler import metrics, queries
from services.scheduler.admission import Admission
from services.scheduler.health import DbHealth
from services.scheduler.outbox import Outbox, Stream
from services.scheduler.releases import release_replica
from services.scheduler.store import Store
from services.scheduler.txn import Move

log = logging.getLogger(__name__)
St = ScheduleState
# A watchdog that wakes later than this after its deadline woke late: the event loop was
# busy. It naps this long once more before it judges the lease.
WATCHDOG_TICK = 0.1


@dataclasses.dataclass
class Lease:
    """What the scheduler knows of one replica's lease, across its reconnects."""

    controller_id: str
    address: str = ""
    deadline: float = 0.0
    # When the current stream last carried a message (monotonic seconds).
    heard: float = 0.0
    connected: bool = False
    draining: bool = False
    # The replica's side closed its last stream: nothing more can come on it.
    closed: bool = False
    watchdog: asyncio.Task[None] | None = None
    # Set to wake the watchdog before its deadline (the stream closed).
    wake: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    stream: Stream | None = None


class Leases:
    """The leases in force, by controller id, each with its watchdog."""

    def __init__(
        self,
        store: Store,
        admission: Admission,
        outbox: Outbox,
        health: DbHealth,
        ttl: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.store = store
        self.admission = admission
        self.outbox = outbox
        self.health = health
        self.ttl = ttl
        self.clock = clock
        self._sleep = sleep
        self.current: dict[str, Lease] = {}
        # (controller id, when): the leases that ended, in order.
        self.expired: list[tuple[str, float]] = []
        # The watchdogs releasing an ended lease's jobs now: a hello of that replica waits.
        self._ending: dict[str, asyncio.Task[None]] = {}
        # Releases of jobs committed to a replica after its lease ended (see `moved`).
        self._strays: set[asyncio.Task[None]] = set()
        self.closing = False

    async def adopt_unknown(self) -> None:
        """After a scheduler start: replicas named in the database get one lease TTL to
        reconnect before their jobs move."""
        counts = await self.store.read(queries.recount)
        for controller_id, state in counts:
            if controller_id is not None and state != St.DONE:
                self.lease(controller_id)

    def lease(self, controller_id: str) -> Lease:
        """The replica's lease; a new one (a full TTL, its watchdog started) if it has none."""
        lease = self.current.get(controller_id)
        if lease is None:
            lease = Lease(controller_id)
            self.current[controller_id] = lease
            lease.deadline = self.clock() + self.ttl
            lease.watchdog = asyncio.create_task(self._watch(lease))
        return lease

    def connected(self, controller_id: str, stream: Stream, address: str) -> Lease:
        """The replica's lease, now held through `stream` (renewed from now)."""
        lease = self.lease(controller_id)
        lease.stream = stream
        lease.connected = True
        lease.closed = False
        lease.draining = False
        lease.address = address
        self.renew(lease)
        return lease

    def renew(self, lease: Lease) -> None:
        lease.heard = self.clock()
        lease.deadline = lease.heard + self.ttl

    async def ended(self, controller_id: str) -> None:
        """Waits until the replica's last lease, if it is ending now, has released its jobs:
        what a new hello is told to stop is then what the replica lost."""
        ending = self._ending.get(controller_id)
        if ending is not None:
            await asyncio.wait([ending])

    def restart(self) -> None:
        """Gives every replica a full lease from now (after the database came back)."""
        for lease in self.current.values():
            lease.deadline = max(lease.deadline, self.clock() + self.ttl)

    def moved(self, moves: Sequence[Move]) -> None:
        """Releases at once the jobs a commit left with a replica whose lease has ended (an
        admission pass that planned before the lease ended): no lease of that replica will
        end again to move them. A replica that reconnects gets a new lease first."""
        if self.closing:
            return
        stray: dict[str, list[tuple[int, int]]] = {}
        for move in moves:
            cid = move.new_controller
            if cid is not None and move.new != St.DONE and cid not in self.current:
                stray.setdefault(cid, []).append((move.job_id, move.epoch))
        for cid, pairs in stray.items():
            log.warning(
                "jobs assigned to a replica whose lease had ended; releasing them",
                extra={"controller_id": cid, "jobs": [j for j, _ in pairs][:20]},
            )
            task = asyncio.create_task(self._release_strays(cid, pairs))
            self._strays.add(task)
            task.add_done_callback(self._strays.discard)

    def close(self) -> None:
        """Stops every watchdog and release under way: the scheduler is shutting down, and
        the replicas keep their jobs for the next one."""
        self.closing = True
        for lease in list(self.current.values()):
            if lease.watchdog is not None:
                lease.watchdog.cancel()
        for task in list(self._strays):
            task.cancel()

    async def _watch(self, lease: Lease) -> None:
        late = 0.0  # how late the last nap woke
        while True:
            now = self.clock()
            if not lease.closed:
                if lease.deadline > now:
                    late = await self._nap(lease, lease.deadline - now)
                    continue
                if late > WATCHDOG_TICK and now - lease.deadline < self.ttl:
                    # The loop was busy: what the replica sent meanwhile may wait unread.
                    late = await self._nap(lease, WATCHDOG_TICK)
                    continue
            if not self.health.ok:
                # Nothing can move while the database is away; leases restart when it is back.
                await self.health.wait_reachable()
                lease.deadline = max(lease.deadline, self.clock() + self.ttl)
                late = 0.0
                continue
            await self._end(lease)
            return

    async def _nap(self, lease: Lease, seconds: float) -> float:
        """Sleeps `seconds`, or until woken; returns how late it woke (0 when woken)."""
        due = self.clock() + seconds
        lease.wake.clear()
        napping = asyncio.ensure_future(self._sleep(seconds))
        woken = asyncio.ensure_future(lease.wake.wait())
        try:
            await asyncio.wait((napping, woken), return_when=asyncio.FIRST_COMPLETED)
        finally:
            napping.cancel()
            woken.cancel()
        return 0.0 if lease.wake.is_set() else max(0.0, self.clock() - due)

    async def _end(self, lease: Lease) -> None:
        """Ends the lease: the replica's jobs go back to admission."""
        cid = lease.controller_id
        if lease.closed:
            log.warning("replica stream closed; releasing its jobs", extra={"controller_id": cid})
            metrics.stream_lost()
            reason = STREAM_CLOSED.format(cid)
        else:
            log.warning("lease expired", extra={"controller_id": cid})
            metrics.lease_expired()
            reason = LEASE_EXPIRED.format(cid)
        if self.current.get(cid) is lease:
            del self.current[cid]
        self.admission.gone(cid)
        lease.connected = False
        self.outbox.detach(cid, lease.stream)
        self.expired.append((cid, self.clock()))
        task = asyncio.current_task()
        if task is not None:
            self._ending[cid] = task
        try:
            await self.health.retry(
                lambda: release_replica(self.store, cid, reason=reason), limit=float("inf")
            )
        finally:
            if self._ending.get(cid) is task:
                del self._ending[cid]

    async def _release_strays(self, cid: str, pairs: list[tuple[int, int]]) -> None:
        await self.health.retry(
            lambda: release_replica(self.store, cid, pairs=pairs, reason=LEASE_ENDED.format(cid)),
            limit=float("inf"),
        )

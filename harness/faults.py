"""Seeded fault schedules, and the threads that carry them out against a running system.

A schedule is a tuple of `Fault`s planned from a seed alone: when (seconds after
the run starts), what, against whom, for how long. The same seed gives the same
schedule; what a fault hits at run time (which cluster is live to be preempted,
which jobs a replica holds) depends on the run. Faults come in two sorts:

- episodes break a process and mend it: SIGKILL a replica and start it again
  with the same id (`KILL_REPLICA`), SIGSTOP one past its lease then SIGCONT it
  (`PAUSE_REPLICA`), restart the scheduler by SIGKILL or SIGTERM
  (`RESTART_SCHEDULER`), stop PostgreSQL and start it again (`DATABASE_OUTAGE`).
  They run one after another on one thread, never overlapping, so that the system
  is whole again after each;
- instants hit the cloud through its operator API: preempt one live cluster
  (`PREEMPT_CLUSTER`, during its launch too), one whose task has already finished
  but which is not torn down yet (`PREEMPT_FINISHED`: planned inside a replica's
  kill or pause, when its finished clusters wait for a holder), or every spot
  cluster of a region (`PREEMPT_REGION`). They run on their own thread, so they
  land while a replica is down or paused too.

`FaultRunner.records` says what each fault did and when (wall clock), with the
jobs a replica held when it was hit.
"""

from __future__ import annotations

import dataclasses
import enum
import random
import threading
import time
from collections.abc import Mapping, Sequence

import grpc

from harness.reliability import Client, EventLog, Log, PostgresServer, quiet
from managedjobs.simcloud.v1 import simcloud_service_pb2 as spb
from managedjobs.v1 import job_pb2
from services.common.event_messages import RESUMED_ON
from services.common.statuses import ScheduleState
from services.launcher.service import Service
from services.launcher.stack import Stack


class FaultKind(enum.StrEnum):
    KILL_REPLICA = "kill_replica"
    PAUSE_REPLICA = "pause_replica"
    RESTART_SCHEDULER = "restart_scheduler"
    DATABASE_OUTAGE = "database_outage"
    PREEMPT_CLUSTER = "preempt_cluster"
    PREEMPT_FINISHED = "preempt_finished"
    PREEMPT_REGION = "preempt_region"


EPISODES = (
    FaultKind.KILL_REPLICA,
    FaultKind.PAUSE_REPLICA,
    FaultKind.RESTART_SCHEDULER,
    FaultKind.DATABASE_OUTAGE,
)
LIVE = (spb.CLUSTER_STATUS_INIT, spb.CLUSTER_STATUS_UP)


@dataclasses.dataclass(frozen=True)
class Fault:
    # Seconds after the run starts.
    at: float
    kind: FaultKind
    # A replica's name, a region, or empty.
    target: str = ""
    # Seconds a replica stays down or paused, or the database away.
    duration: float = 0.0
    # A seeded number that chooses at run time: the cluster to preempt among those
    # live, SIGKILL (odd) or SIGTERM (even) for a scheduler restart.
    pick: int = 0


@dataclasses.dataclass
class FaultRecord:
    """What one fault did: wall-clock times, the jobs a hit replica held, and a detail."""

    fault: Fault
    # When it began; for a replica, the signal (sent once its jobs were listed).
    started: float
    ended: float = 0.0
    held: list[int] = dataclasses.field(default_factory=list)
    detail: str = ""

    @property
    def kind(self) -> FaultKind:
        return self.fault.kind

    @property
    def target(self) -> str:
        return self.fault.target


@dataclasses.dataclass(frozen=True)
class FaultConfig:
    """How many faults of each kind, over how long, and how long episodes last."""

    seconds: float
    counts: Mapping[FaultKind, int]
    lease_ttl: float
    # A killed replica is down this long (some come back before their lease ends).
    kill_down: tuple[float, float] = (0.5, 6.0)
    # A paused replica stays paused the lease TTL plus this long.
    pause_past_lease: tuple[float, float] = (1.0, 3.0)
    database_outage: tuple[float, float] = (2.0, 4.0)
    # Room left after each episode before the next one.
    settle: float = 2.0
    # Nothing happens before this many seconds (the first jobs are still launching).
    lead: float = 0.0


def plan_faults(
    seed: int, config: FaultConfig, replicas: Sequence[str], regions: Sequence[str]
) -> tuple[Fault, ...]:
    """A seeded schedule: the episodes in a random order at random gaps, never overlapping,
    and the instants at random times, all between `config.lead` and `config.seconds`
    when they fit."""
    rng = random.Random(f"faults-{seed}")
    kinds = [k for k in EPISODES for _ in range(config.counts.get(k, 0))]
    rng.shuffle(kinds)
    episodes: list[Fault] = []
    for kind in kinds:
        target, duration, pick = "", 0.0, 0
        if kind in (FaultKind.KILL_REPLICA, FaultKind.PAUSE_REPLICA):
            target = rng.choice(list(replicas))
        if kind == FaultKind.KILL_REPLICA:
            duration = rng.uniform(*config.kill_down)
        elif kind == FaultKind.PAUSE_REPLICA:
            duration = config.lease_ttl + rng.uniform(*config.pause_past_lease)
        elif kind == FaultKind.DATABASE_OUTAGE:
            duration = rng.uniform(*config.database_outage)
        else:
            pick = rng.randrange(2)
        episodes.append(Fault(0.0, kind, target, round(duration, 2), pick))
    busy = sum(f.duration + config.settle for f in episodes)
    room = max(0.0, config.seconds - config.lead - busy)
    starts = sorted(rng.uniform(0.0, room) for _ in episodes)
    planned: list[Fault] = []
    before = config.lead
    for start, fault in zip(starts, episodes, strict=True):
        planned.append(dataclasses.replace(fault, at=round(start + before, 2)))
        before += fault.duration + config.settle
    for _ in range(config.counts.get(FaultKind.PREEMPT_CLUSTER, 0)):
        at = round(rng.uniform(config.lead, config.seconds), 2)
        planned.append(Fault(at, FaultKind.PREEMPT_CLUSTER, pick=rng.randrange(1 << 30)))
    # While a replica is down or paused, the clusters of its finished tasks stay up.
    hold = [f for f in planned if f.kind in (FaultKind.KILL_REPLICA, FaultKind.PAUSE_REPLICA)]
    for _ in range(config.counts.get(FaultKind.PREEMPT_FINISHED, 0) if hold else 0):
        episode = rng.choice(hold)
        at = round(episode.at + rng.uniform(0.3, 0.9) * episode.duration, 2)
        planned.append(Fault(at, FaultKind.PREEMPT_FINISHED, pick=rng.randrange(1 << 30)))
    for _ in range(config.counts.get(FaultKind.PREEMPT_REGION, 0)):
        at = round(rng.uniform(config.lead, config.seconds), 2)
        planned.append(Fault(at, FaultKind.PREEMPT_REGION, target=rng.choice(list(regions))))
    return tuple(sorted(planned, key=lambda f: (f.at, f.kind)))


def plan_replica_faults(
    seed: int,
    seconds: float,
    replicas: Sequence[str],
    interval: tuple[float, float],
    restart_delay: tuple[float, float],
    pause_share: float = 0.0,
) -> tuple[Fault, ...]:
    """A replica hit every `interval` seconds for `seconds`, each down `restart_delay`:
    SIGKILLed, or SIGSTOPped for a `pause_share` of the faults."""
    rng = random.Random(seed)
    planned: list[Fault] = []
    at = rng.uniform(*interval)
    while at < seconds:
        victim = rng.choice(list(replicas))
        down = rng.uniform(*restart_delay)
        # Drawn only when asked for, so that a schedule of kills alone stays as it was.
        pause = pause_share > 0 and rng.random() < pause_share
        kind = FaultKind.PAUSE_REPLICA if pause else FaultKind.KILL_REPLICA
        planned.append(Fault(round(at, 2), kind, victim, round(down, 2)))
        at += rng.uniform(*interval)
    return tuple(planned)


def handed_elsewhere(by_job: Mapping[int, Sequence[job_pb2.JobEvent]], record: FaultRecord) -> bool:
    """Whether every job the hit replica held has, since the fault, been handed to
    another replica or is DONE, by the events seen of each job (`EventLog.by_job`)."""

    def away(job_id: int) -> bool:
        for event in by_job.get(job_id, []):
            if event.time.ToNanoseconds() / 1e9 < record.started:
                continue
            holder = event.message.removeprefix(RESUMED_ON).strip()
            moved = event.message.startswith(RESUMED_ON) and holder != record.target
            if moved or event.schedule_state == ScheduleState.DONE:
                return True
        return False

    return all(away(job_id) for job_id in record.held)


class FaultRunner:
    """Carries out a schedule: episodes on one thread, instants on another.

    With `events` and `hold`, a killed or paused replica stays down (or stopped)
    until every job it held was handed to another replica or is done, at most `hold`
    seconds, and only then for its fault's duration: its own return never cuts its
    jobs' move short. `stop` cuts the schedule short; either way every process is up
    and the database reachable once `stop` or `join` returns.
    """

    def __init__(
        self,
        stack: Stack,
        client: Client,
        plan: Sequence[Fault],
        log: Log = quiet,
        database: PostgresServer | None = None,
        events: EventLog | None = None,
        hold: float = 0.0,
    ) -> None:
        self.stack = stack
        self.client = client
        self.plan = tuple(plan)
        self.log = log
        self.database = database
        self.events = events
        self.hold = hold
        if database is None and any(f.kind == FaultKind.DATABASE_OUTAGE for f in self.plan):
            raise ValueError("a database outage needs the PostgresServer to stop")
        self.records: list[FaultRecord] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._start = 0.0
        episodes = [f for f in self.plan if f.kind in EPISODES]
        instants = [f for f in self.plan if f.kind not in EPISODES]
        self._threads = [
            threading.Thread(target=self._run, args=(episodes,), name="faults", daemon=True),
            threading.Thread(target=self._run, args=(instants,), name="preempts", daemon=True),
        ]

    def start(self) -> FaultRunner:
        self._start = time.monotonic()
        for thread in self._threads:
            thread.start()
        return self

    def join(self, timeout: float) -> bool:
        """Waits for the schedule to be carried out; True when it was."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        done = not any(t.is_alive() for t in self._threads)
        if not done:
            self.stop()
        return done

    def stop(self) -> None:
        """Skips what is left of the schedule and mends what the current episode broke."""
        self._stop.set()
        for thread in self._threads:
            thread.join(180)
        for service in [self.stack.scheduler, *self.stack.controllers]:
            service.resume()
            if not service.running:
                self._restart(service)
        if self.database is not None and not self.database.ready():
            self.database.start()

    def done(self, kind: FaultKind) -> int:
        """How many faults of a kind were carried out."""
        with self._lock:
            return sum(1 for r in self.records if r.kind == kind)

    def _run(self, faults: Sequence[Fault]) -> None:
        for fault in faults:
            if self._stop.wait(max(0.0, self._start + fault.at - time.monotonic())):
                return
            record = FaultRecord(fault, time.time())
            try:
                self._carry_out(record)
            except (grpc.RpcError, RuntimeError, TimeoutError, OSError) as error:
                self.errors.append(f"{fault.kind} at {fault.at:.1f}s failed: {error!r}")
            record.ended = time.time()
            with self._lock:
                self.records.append(record)
            self.log(f"{fault.kind} {fault.target} {record.detail}".strip())

    def _carry_out(self, record: FaultRecord) -> None:
        fault = record.fault
        kind = fault.kind
        if kind == FaultKind.KILL_REPLICA:
            victim = self.stack.service(fault.target)
            record.held = self._held(victim)
            record.started = time.time()
            victim.kill()
            self._until_handed_elsewhere(record)
            self._stop.wait(fault.duration)
            self._restart(victim)
        elif kind == FaultKind.PAUSE_REPLICA:
            victim = self.stack.service(fault.target)
            record.held = self._held(victim)
            record.started = time.time()
            victim.pause()
            try:
                self._until_handed_elsewhere(record)
                self._stop.wait(fault.duration)
            finally:
                victim.resume()
        elif kind == FaultKind.RESTART_SCHEDULER:
            crash = fault.pick % 2 == 1
            record.detail = "SIGKILL" if crash else "SIGTERM"
            self.client.restart_scheduler(kill=crash)
        elif kind == FaultKind.DATABASE_OUTAGE:
            assert self.database is not None
            self.database.stop()
            try:
                self._stop.wait(fault.duration)
            finally:
                self.database.start()
        elif kind in (FaultKind.PREEMPT_CLUSTER, FaultKind.PREEMPT_FINISHED):
            finished = kind == FaultKind.PREEMPT_FINISHED
            live = sorted(
                (
                    c
                    for c in self.client.inventory()
                    if c.status in LIVE and (c.HasField("task_end_time") or not finished)
                ),
                key=lambda c: c.cluster_id,
            )
            if not live:
                record.detail = "nothing live"
                return
            victim_cluster = live[fault.pick % len(live)]
            request = spb.PreemptClusterRequest(cluster_name=victim_cluster.name)
            preempted = self.client.retrying(
                lambda: self.client.cloud.PreemptCluster(request, timeout=10)
            ).preempted
            state = spb.ClusterStatus.Name(victim_cluster.status)
            record.detail = (
                f"{victim_cluster.name}#{victim_cluster.cluster_id} ({state}): {preempted}"
            )
        elif kind == FaultKind.PREEMPT_REGION:
            request_region = spb.PreemptRegionRequest(region=fault.target)
            names = self.client.retrying(
                lambda: self.client.cloud.PreemptRegion(request_region, timeout=10)
            ).cluster_names
            record.detail = f"{len(names)} clusters"

    def _until_handed_elsewhere(self, record: FaultRecord) -> None:
        if self.events is None or not self.hold:
            return
        events = self.events
        if not events.wait_for(lambda: handed_elsewhere(events.by_job, record), self.hold):
            record.detail = f"its jobs were not all elsewhere after {self.hold:.0f}s"

    def _held(self, victim: Service) -> list[int]:
        try:
            return self.client.held_by(victim.name)
        except grpc.RpcError as error:
            self.errors.append(f"cannot list the jobs of {victim.name}: {error.code()}")
            return []

    def _restart(self, service: Service) -> None:
        try:
            service.start()
            service.wait_serving(60)
        except (RuntimeError, TimeoutError) as error:
            self.errors.append(f"restart of {service.name} failed: {error}")

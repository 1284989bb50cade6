"""The chaos soak: seeded replica kills during a steady keyed workload, and its figures.

`run_soak` submits jobs with idempotency keys at a steady rate, SIGKILLs a random
replica at seeded random intervals and restarts it with the same controller id
after a seeded random delay, then waits (bounded) until every job is DONE;
`analyse_soak` judges the run with the invariants of `reliability` and computes
the kill-to-resume times. Used by `tests/test_reliability.py` and `bench/chaos.py`.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import random
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import grpc
from reliability import (
    ADMIN_URL,
    RESUMED_PREFIX,
    Client,
    Database,
    EventLog,
    EventRecord,
    Log,
    cloud_config,
    cloud_problems,
    event_problems,
    fresh_database,
    job_problems,
    job_spec,
    percentile,
    quiet,
    stale_reports_refused,
    start_stack,
)

from services.common.statuses import TERMINAL, JobStatus, ScheduleState
from services.stack import Service, Stack

# --- chaos --------------------------------------------------------------------------------


@dataclasses.dataclass
class Kill:
    """One SIGKILL of a replica: when (wall clock), which, the jobs it held."""

    controller_id: str
    time: float
    held: list[int]
    restarted_at: float = 0.0


class Chaos:
    """SIGKILLs a random replica at random intervals and restarts it with the same id.

    One thread, one seeded RNG: the victims and the intervals are the same for the
    same seed. Kills are sequential: the victim is serving again before the next
    kill, so at most one replica is down at a time.
    """

    def __init__(
        self,
        stack: Stack,
        client: Client,
        seed: int,
        interval: tuple[float, float],
        restart_delay: tuple[float, float],
        log: Log = quiet,
    ) -> None:
        self.stack = stack
        self.client = client
        self.rng = random.Random(seed)
        self.interval = interval
        self.restart_delay = restart_delay
        self.log = log
        self.kills: list[Kill] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos", daemon=True)

    def start(self) -> Chaos:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops the kills; every replica is serving when it returns."""
        self._stop.set()
        self._thread.join(120)
        for service in self.stack.controllers:
            if not service.running:
                self._restart(service)

    def _restart(self, service: Service) -> None:
        try:
            service.start()
            service.wait_serving(60)
        except (RuntimeError, TimeoutError) as error:
            self.errors.append(f"restart of {service.name} failed: {error}")

    def _run(self) -> None:
        next_kill = time.monotonic() + self.rng.uniform(*self.interval)
        while not self._stop.wait(max(0.0, next_kill - time.monotonic())):
            victim = self.rng.choice(self.stack.controllers)
            delay = self.rng.uniform(*self.restart_delay)
            gap = self.rng.uniform(*self.interval)
            try:
                held = self.client.held_by(victim.name)
            except grpc.RpcError as error:
                self.errors.append(f"cannot list the jobs of {victim.name}: {error}")
                held = []
            killed_at = time.monotonic()
            kill = Kill(victim.name, time.time(), held)
            victim.kill()
            self.kills.append(kill)
            self.log(f"killed {victim.name} holding {len(held)} jobs")
            self._stop.wait(delay)
            self._restart(victim)
            kill.restarted_at = time.time()
            next_kill = killed_at + gap


@dataclasses.dataclass(frozen=True)
class Resume:
    """When a job held by a killed replica was RUNNING again, and where."""

    job_id: int
    kill_time: float
    killed: str
    seconds: float
    resumed_on: str
    # True when the job moved because the lease expired, False when the restarted
    # replica came back first (its hello no longer named the job).
    lease_expired: bool


def resumes(kills: Sequence[Kill], events: Sequence[EventRecord]) -> tuple[list[Resume], list[str]]:
    """From the event log: for every job a killed replica held, the time until it RUNS again.

    After the kill, the scheduler hands the job to a replica ("resumed on X");
    the job is RUNNING again at that event when its task was RUNNING (it is
    watched again), else at its next RUNNING event (relaunched). Jobs that ended
    before being resumed give no sample. A held job that is never resumed and
    never ends is a problem.
    """
    by_job: dict[int, list[EventRecord]] = collections.defaultdict(list)
    for event in events:
        by_job[event.job_id].append(event)
    out: list[Resume] = []
    problems: list[str] = []
    for kill in kills:
        for job_id in kill.held:
            after = [e for e in by_job.get(job_id, []) if e.time >= kill.time]
            resumed_index = next(
                (i for i, e in enumerate(after) if e.message.startswith(RESUMED_PREFIX)), None
            )
            done_index = next(
                (i for i, e in enumerate(after) if e.schedule_state == ScheduleState.DONE), None
            )
            if resumed_index is None or (done_index is not None and done_index < resumed_index):
                if done_index is None:
                    problems.append(
                        f"job {job_id}, held by {kill.controller_id} when killed, was never resumed"
                    )
                continue
            resumed = after[resumed_index]
            expired = any("expired" in e.message for e in after[:resumed_index])
            running = next(
                (
                    e
                    for e in after[resumed_index:]
                    if e.status == JobStatus.RUNNING or e.status in TERMINAL
                ),
                None,
            )
            if running is None or running.status != JobStatus.RUNNING:
                continue
            out.append(
                Resume(
                    job_id=job_id,
                    kill_time=kill.time,
                    killed=kill.controller_id,
                    seconds=running.time - kill.time,
                    resumed_on=resumed.message[len(RESUMED_PREFIX) :].strip(),
                    lease_expired=expired,
                )
            )
    return out, problems


# --- the soak -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SoakConfig:
    """A chaos soak. Durations are real seconds unless named simulated."""

    jobs: int = 300
    replicas: int = 3
    seed: int = 1
    # Kills go on for at least this long, every `kill_interval` seconds.
    chaos_seconds: float = 125.0
    kill_interval: tuple[float, float] = (5.0, 10.0)
    restart_delay: tuple[float, float] = (0.5, 4.5)
    # Submissions are spread evenly over this window.
    submit_seconds: float = 105.0
    lease_ttl: float = 3.0
    heartbeat_interval: float = 0.5
    time_scale: float = 10.0
    # Simulated seconds a task runs, drawn uniformly.
    runtime_seconds: tuple[float, float] = (40.0, 120.0)
    chain_fraction: float = 0.2
    cancel_fraction: float = 0.05
    preemptions_per_hour: float = 20.0
    # After the chaos stops, the longest wait for every job to be DONE.
    drain_timeout: float = 180.0


@dataclasses.dataclass
class SoakReport:
    figures: dict[str, Any]
    problems: list[str]
    kills: list[Kill] = dataclasses.field(default_factory=list)
    resumes: list[Resume] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class _Action:
    at: float
    index: int
    cancel: bool


class Workload:
    """Submits the soak's jobs at a steady rate (with idempotency keys) and cancels a few."""

    def __init__(self, client: Client, config: SoakConfig, log: Log = quiet) -> None:
        self.client = client
        self.config = config
        self.log = log
        rng = random.Random(config.seed * 7919 + 1)
        self.run_id = uuid.uuid4().hex[:8]
        self.specs: list[str] = []
        actions: list[_Action] = []
        step = config.submit_seconds / max(1, config.jobs)
        for index in range(config.jobs):
            tasks = 2 if rng.random() < config.chain_fraction else 1
            runtimes = [rng.uniform(*config.runtime_seconds) for _ in range(tasks)]
            self.specs.append(job_spec(f"soak-{index}", runtimes))
            actions.append(_Action(index * step, index, False))
            if rng.random() < config.cancel_fraction:
                # Somewhere in the job's life: queued, launching, running or recovering.
                actions.append(_Action(index * step + rng.uniform(0.5, 10.0), index, True))
        self._actions = sorted(actions, key=lambda a: (a.at, a.cancel, a.index))
        self.job_ids: dict[int, int] = {}
        self.cancelled: set[int] = set()
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._run, name="workload", daemon=True)

    def key(self, index: int) -> str:
        return f"soak-{self.run_id}-{index}"

    def start(self) -> Workload:
        self._thread.start()
        return self

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        start = time.monotonic()
        heap = [(a.at, n, a) for n, a in enumerate(self._actions)]
        heapq.heapify(heap)
        while heap:
            at, _, action = heapq.heappop(heap)
            wait = start + at - time.monotonic()
            if wait > 0:
                time.sleep(wait)  # pacing the workload, not deciding an outcome
            try:
                if action.cancel:
                    job_id = self.job_ids.get(action.index)
                    if job_id is not None:
                        self.client.cancel([job_id])
                        self.cancelled.add(job_id)
                    continue
                job_id = self.client.submit(self.specs[action.index], self.key(action.index))
                self.job_ids[action.index] = job_id
            except grpc.RpcError as error:
                what = "cancel" if action.cancel else "submit"
                self.errors.append(f"{what} of job #{action.index} failed: {error.code()}")


def run_soak(
    config: SoakConfig, data_dir: Path, admin_url: str = ADMIN_URL, log: Log = quiet
) -> SoakReport:
    """Runs one chaos soak end to end on a fresh database and returns its figures and problems."""
    with fresh_database(admin_url) as url:
        stack = start_stack(
            data_dir,
            url,
            cloud_config(config.seed, config.time_scale, config.preemptions_per_hour),
            replicas=config.replicas,
            lease_ttl=config.lease_ttl,
            heartbeat_interval=config.heartbeat_interval,
        )
        client = Client(stack)
        events = EventLog(stack.scheduler_address, stack.client_security).start()
        chaos = Chaos(stack, client, config.seed, config.kill_interval, config.restart_delay, log)
        try:
            started = time.monotonic()
            workload = Workload(client, config, log).start()
            chaos.start()
            workload.join(config.submit_seconds + 300)
            chaos_left = started + config.chaos_seconds - time.monotonic()
            if chaos_left > 0:
                time.sleep(chaos_left)  # the soak's length: kills go on meanwhile
            chaos.stop()
            chaos_seconds = time.monotonic() - started
            log(f"chaos over after {chaos_seconds:.0f}s and {len(chaos.kills)} kills; draining")
            ids = set(workload.job_ids.values())
            not_done = events.wait_done(ids, config.drain_timeout, client, log)
            duration = time.monotonic() - started
            report = analyse_soak(config, stack, client, Database(url), chaos, workload, not_done)
            report.figures["chaos_seconds"] = round(chaos_seconds, 1)
            report.figures["duration_seconds"] = round(duration, 1)
            report.figures["watch_reconnects"] = events.reconnects
            return report
        finally:
            events.close()
            client.close()
            stack.stop()


def analyse_soak(
    config: SoakConfig,
    stack: Stack,
    client: Client,
    db: Database,
    chaos: Chaos,
    workload: Workload,
    not_done: set[int],
) -> SoakReport:
    problems: list[str] = [*chaos.errors, *workload.errors]
    ids = set(workload.job_ids.values())
    if len(workload.job_ids) != config.jobs:
        problems.append(f"{config.jobs - len(workload.job_ids)} submissions never got an id")
    if len(ids) != len(workload.job_ids):
        problems.append(f"{len(workload.job_ids) - len(ids)} keys were answered with another's id")
    if not_done:
        problems.append(f"{len(not_done)} jobs not DONE in time: {_diagnose(client, not_done)}")
    jobs = client.list_jobs()
    listed = {j.job_id for j in jobs}
    if listed != ids:
        problems.append(
            f"listed jobs differ from submitted: {len(listed - ids)} unexpected, "
            f"{len(ids - listed)} missing"
        )
    problems.extend(job_problems(jobs, workload.cancelled)[:50])
    events = db.events()
    problems.extend(event_problems(events, ids)[:50])
    cloud, cloud_figures = cloud_problems(client, db)
    problems.extend(cloud)
    samples, lost = resumes(chaos.kills, events)
    problems.extend(lost[:50])
    exited = [s.name for s in stack.exited()]
    if exited:
        problems.append(f"services exited: {', '.join(exited)}")
    seconds = [r.seconds for r in samples]
    after_expiry = [r.seconds for r in samples if r.lease_expired]
    statuses = collections.Counter(JobStatus(j.status).name for j in jobs)
    p50, p99 = percentile(seconds, 50), percentile(seconds, 99)
    figures: dict[str, Any] = {
        "jobs": len(jobs),
        "replicas": config.replicas,
        "seed": config.seed,
        "kills": len(chaos.kills),
        "jobs_held_at_kills": sum(len(k.held) for k in chaos.kills),
        "lease_ttl_seconds": config.lease_ttl,
        "resume_samples": len(samples),
        "resumed_elsewhere": sum(r.resumed_on != r.killed for r in samples),
        "resume_p50_seconds": _rounded(p50),
        "resume_p99_seconds": _rounded(p99),
        "resume_max_seconds": _rounded(max(seconds) if seconds else None),
        "resume_target_seconds": config.lease_ttl + 2.0,
        # Kills whose replica was still down when its lease ran out: the §15 figure proper.
        "resume_after_expiry_samples": len(after_expiry),
        "resume_after_expiry_p50_seconds": _rounded(percentile(after_expiry, 50)),
        "resume_after_expiry_p99_seconds": _rounded(percentile(after_expiry, 99)),
        **cloud_figures,
        "recoveries": sum(j.recovery_count for j in jobs),
        "cancel_requests": len(workload.cancelled),
        "statuses": dict(sorted(statuses.items())),
        "stale_reports_refused": stale_reports_refused(stack),
        "submit_retries": dict(client.retried),
        "events": len(events),
        "problems": len(problems),
    }
    return SoakReport(figures, problems, list(chaos.kills), samples)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _diagnose(client: Client, job_ids: Iterable[int], limit: int = 10) -> str:
    """A few stuck jobs, with where they are, for a failure message."""
    parts: list[str] = []
    for job_id in sorted(job_ids)[:limit]:
        try:
            job = client.get_job(job_id)
        except grpc.RpcError as error:
            parts.append(f"{job_id}: {error.code()}")
            continue
        parts.append(
            f"{job_id}: {JobStatus(job.status).name}/{ScheduleState(job.schedule_state).name} "
            f"on {job.controller_id or '-'}"
        )
    return "; ".join(parts)

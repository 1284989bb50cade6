"""Seeded workloads: jobs submitted with idempotency keys at planned times, some cancelled.

`plan_workload` turns a seed into a `WorkloadPlan`: when each job is submitted,
its tasks (a chain when several) and their simulated runtimes, whether it runs on
spot, and whether and when it is cancelled. The same seed gives the same plan.
`Workload` carries a plan out against a running system, on one thread (cancels
that an event triggers go to a small pool, off the event log's thread):

- a cancel `AFTER_SUBMIT` is sent the moment the submission is answered (the job
  is still queued, or being admitted);
- a cancel `WHILE_LAUNCHING` is sent when the job's first STARTING event arrives
  on the event log (its cluster is being launched);
- a cancel `LATER` is sent a planned delay after the submission (anywhere in its
  life: queued, launching, running or recovering).

Submissions and cancels are retried through outages (`Client`), and through
INTERNAL answers, which are recorded (`Workload.internal`: the API must never give
one) so that the run goes on and is judged whole; what they could not do is an
error of the run, never silently dropped.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import heapq
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import grpc

from harness.reliability import Client, EventLog, Log, job_spec, quiet
from managedjobs.v1 import job_pb2
from services.common.statuses import JobStatus, ScheduleState
from services.launcher.stack import Stack

T = TypeVar("T")


class Cancel(enum.StrEnum):
    NEVER = "never"
    AFTER_SUBMIT = "after_submit"
    WHILE_LAUNCHING = "while_launching"
    LATER = "later"


@dataclasses.dataclass(frozen=True)
class PlannedJob:
    index: int
    # Seconds after the workload starts.
    at: float
    # Simulated seconds each task runs: one task, or a chain.
    runtimes: tuple[float, ...]
    spot: bool = True
    cancel: Cancel = Cancel.NEVER
    # For `Cancel.LATER`: seconds after the submission.
    cancel_after: float = 0.0

    def spec(self, prefix: str) -> str:
        return job_spec(f"{prefix}-{self.index}", self.runtimes, spot=self.spot)


@dataclasses.dataclass(frozen=True)
class WorkloadPlan:
    seed: int
    prefix: str
    jobs: tuple[PlannedJob, ...]

    @property
    def seconds(self) -> float:
        return max((j.at for j in self.jobs), default=0.0)


def plan_workload(
    seed: int,
    jobs: int,
    submit_seconds: float,
    runtime_seconds: tuple[float, float],
    *,
    prefix: str = "job",
    chain_fraction: float = 0.0,
    chain_lengths: tuple[int, int] = (2, 2),
    cancel_fraction: float = 0.0,
    cancel_modes: Sequence[Cancel] = (Cancel.LATER,),
    cancel_delay: tuple[float, float] = (0.5, 10.0),
    long_jobs: int = 0,
) -> WorkloadPlan:
    """Jobs spread evenly over `submit_seconds`, drawn from one seeded generator.

    Args:
        seed: The plan's seed.
        jobs: How many ordinary jobs.
        submit_seconds: The window over which they are submitted.
        runtime_seconds: Simulated runtime of each task, drawn uniformly.
        prefix: Job names are `<prefix>-<index>`.
        chain_fraction: The share of jobs that are chains.
        chain_lengths: A chain's number of tasks, drawn uniformly (inclusive).
        cancel_fraction: The share of jobs cancelled, chosen at random.
        cancel_modes: The cancel moments, given in turn to the cancelled jobs (so each
            one occurs once there are as many cancels as moments).
        cancel_delay: For `LATER`, seconds after the submission, drawn uniformly.
        long_jobs: Extra on-demand jobs that run far longer than the run, submitted
            first, never cancelled by the plan (the run decides when they end).
    """
    rng = random.Random(f"workload-{seed}")
    planned: list[PlannedJob] = [
        PlannedJob(index=i, at=0.0, runtimes=(1e6,), spot=False) for i in range(long_jobs)
    ]
    chosen = rng.sample(range(jobs), round(cancel_fraction * jobs))
    moments = {n: cancel_modes[k % len(cancel_modes)] for k, n in enumerate(chosen)}
    step = submit_seconds / max(1, jobs)
    for n in range(jobs):
        tasks = rng.randint(*chain_lengths) if rng.random() < chain_fraction else 1
        runtimes = tuple(round(rng.uniform(*runtime_seconds), 1) for _ in range(tasks))
        cancel = moments.get(n, Cancel.NEVER)
        after = round(rng.uniform(*cancel_delay), 2) if cancel == Cancel.LATER else 0.0
        planned.append(PlannedJob(long_jobs + n, round(n * step, 3), runtimes, True, cancel, after))
    return WorkloadPlan(seed, prefix, tuple(planned))


@dataclasses.dataclass(frozen=True)
class _Action:
    at: float
    job: PlannedJob
    cancel: bool


def _starting(event: job_pb2.JobEvent) -> bool:
    return event.status == JobStatus.STARTING


class Workload:
    """Carries out a `WorkloadPlan`: submits with idempotency keys, cancels as planned."""

    def __init__(
        self, client: Client, events: EventLog, plan: WorkloadPlan, log: Log = quiet
    ) -> None:
        self.client = client
        self.events = events
        self.plan = plan
        self.log = log
        self.run_id = uuid.uuid4().hex[:8]
        self.job_ids: dict[int, int] = {}
        # Job ids whose cancel was sent (and answered).
        self.cancelled: set[int] = set()
        self.cancels_sent: dict[Cancel, int] = dict.fromkeys(Cancel, 0)
        self.errors: list[str] = []
        # Calls the scheduler answered INTERNAL (retried: submissions are keyed).
        self.internal: list[str] = []
        self._lock = threading.Lock()
        self._closed = False
        self._cancels = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="cancel")
        self._thread = threading.Thread(target=self._run, name="workload", daemon=True)

    def tasks(self) -> dict[int, int]:
        """job id -> how many tasks it was submitted with (the client's record of it)."""
        with self._lock:
            ids = dict(self.job_ids)
        return {ids[j.index]: len(j.runtimes) for j in self.plan.jobs if j.index in ids}

    def key(self, index: int) -> str:
        return f"{self.plan.prefix}-{self.run_id}-{index}"

    def start(self) -> Workload:
        self._thread.start()
        return self

    def join(self, timeout: float) -> bool:
        """Waits for every submission and timed cancel; True when all were made."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self) -> None:
        """Waits for the cancels under way; later triggers are ignored."""
        with self._lock:
            self._closed = True
        self._cancels.shutdown(wait=True)

    def _run(self) -> None:
        start = time.monotonic()
        actions = [_Action(j.at, j, False) for j in self.plan.jobs]
        actions += [
            _Action(j.at + j.cancel_after, j, True)
            for j in self.plan.jobs
            if j.cancel == Cancel.LATER
        ]
        heap = [(a.at, a.cancel, a.job.index, a) for a in actions]
        heapq.heapify(heap)
        while heap:
            at, _, _, action = heapq.heappop(heap)
            wait = start + at - time.monotonic()
            if wait > 0:
                time.sleep(wait)  # pacing the workload, not deciding an outcome
            if action.cancel:
                job_id = self.job_ids.get(action.job.index)
                if job_id is not None:
                    self._cancel(job_id, Cancel.LATER)
                continue
            self._submit(action.job)

    def _internal(self, what: str, call: Callable[[], T]) -> T:
        """Runs a keyed or idempotent call, retrying INTERNAL answers, which it records:
        the API never answers INTERNAL, but the run goes on, judged in full."""
        give_up = time.monotonic() + 60.0
        while True:
            try:
                return call()
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.INTERNAL or time.monotonic() > give_up:
                    raise
                with self._lock:
                    self.internal.append(f"{what}: INTERNAL {error.details()!r}"[:300])
            time.sleep(0.2)

    def _submit(self, job: PlannedJob) -> None:
        spec, key = job.spec(self.plan.prefix), self.key(job.index)
        try:
            job_id = self._internal(
                f"submit of job #{job.index}", lambda: self.client.submit(spec, key)
            )
        except grpc.RpcError as error:
            self.errors.append(f"submit of job #{job.index} failed: {error.code()}")
            return
        with self._lock:
            self.job_ids[job.index] = job_id
        if job.cancel == Cancel.AFTER_SUBMIT:
            self._cancel(job_id, Cancel.AFTER_SUBMIT)
        elif job.cancel == Cancel.WHILE_LAUNCHING:
            self.events.when(job_id, _starting, lambda: self._cancel_soon(job_id))

    def _cancel_soon(self, job_id: int) -> None:
        """Called on the event log's thread, which must not block on an RPC."""
        with self._lock:
            if not self._closed:
                self._cancels.submit(self._cancel, job_id, Cancel.WHILE_LAUNCHING)

    def _cancel(self, job_id: int, moment: Cancel) -> None:
        try:
            self._internal(f"cancel of job {job_id}", lambda: self.client.cancel([job_id]))
        except grpc.RpcError as error:
            self.errors.append(f"cancel ({moment}) of job {job_id} failed: {error.code()}")
            return
        with self._lock:
            self.cancelled.add(job_id)
            self.cancels_sent[moment] += 1
        self.log(f"cancelled job {job_id} ({moment})")


def run_problems(
    stack: Stack, client: Client, workload: Workload, not_done: Iterable[int]
) -> list[str]:
    """What went wrong around the jobs rather than in them: submissions lost or answered
    with another key's job, listed jobs that differ, jobs not DONE in time, exited services.
    (INTERNAL answers, retried, are `Workload.internal`.)"""
    problems = list(workload.errors)
    planned = len(workload.plan.jobs)
    ids = set(workload.job_ids.values())
    if len(workload.job_ids) != planned:
        problems.append(f"{planned - len(workload.job_ids)} submissions never got an id")
    if len(ids) != len(workload.job_ids):
        problems.append(f"{len(workload.job_ids) - len(ids)} keys were answered with another's id")
    not_done = set(not_done)
    if not_done:
        problems.append(f"{len(not_done)} jobs not DONE in time: {_diagnose(client, not_done)}")
    listed = {j.job_id for j in client.list_jobs()}
    if listed != ids:
        problems.append(
            f"listed jobs differ from submitted: {len(listed - ids)} unexpected, "
            f"{len(ids - listed)} missing"
        )
    exited = [s.name for s in stack.exited()]
    if exited:
        problems.append(f"services exited: {', '.join(exited)}")
    return problems


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

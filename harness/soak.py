"""The chaos soak: seeded replica faults during a steady keyed workload, and its figures.

`run_soak` submits jobs with idempotency keys at a steady rate (`workload.py`),
hits a random replica at seeded random intervals (`faults.plan_replica_faults`):
SIGKILL, so that its stream closes at once, or for a share of the faults SIGSTOP,
so that it goes silent with its stream open; it restarts (or SIGCONTs) it with the
same controller id after a seeded random delay, counted with `hold_until_moved`
from the moment its jobs were all handed elsewhere. It then waits (bounded) until
every job is DONE; `analyse_soak` judges the run from its durable record with the
history checker (`history.py`) and computes the fault-to-resume times, for each
kind of fault.
Used by `tests/system/test_reliability.py` and `bench/chaos.py`.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.faults import FaultKind, FaultRecord, FaultRunner, plan_replica_faults
from harness.history import (
    EventRecord,
    Kind,
    Violation,
    assignee,
    check,
    counts,
)
from harness.reliability import (
    ADMIN_URL,
    Client,
    Database,
    Log,
    cloud_config,
    cloud_figures,
    collect_history,
    counter_snapshot,
    explain,
    job_problems,
    percentile,
    quiet,
    stale_reports_refused,
    system,
)
from harness.workload import Workload, plan_workload, run_problems
from services.common.event_messages import (
    LEASE_EXPIRED,
    RESUMED_ON,
    STREAM_CLOSED,
)
from services.common.statuses import TERMINAL, JobStatus, ScheduleState
from services.launcher.stack import Stack

# What contract §16 promises of the soak (one terminal status, nothing redone, no duplicate
# launch, nothing left, counters equal to a recount and never corrected); the other kinds
# are counted in its figures.
SOAK_KINDS = frozenset(
    {
        Kind.TERMINAL_STATUS,
        Kind.RERUN_AFTER_SUCCESS,
        Kind.OVERLAPPING_CLUSTERS,
        Kind.CLUSTER_LEFT,
        Kind.COUNTER_DRIFT,
    }
)


# The replica faults of a soak, by their name in the figures.
FAULT_NAMES = {FaultKind.KILL_REPLICA: "kills", FaultKind.PAUSE_REPLICA: "pauses"}
# What each does to the replica's stream: closed at once, or open and silent (no
# heartbeats), when the lease's TTL decides.
RESUME_NAMES = {FaultKind.KILL_REPLICA: "stream_closed", FaultKind.PAUSE_REPLICA: "silent"}


@dataclasses.dataclass(frozen=True)
class Resume:
    """When a job held by a killed (or paused) replica was RUNNING again, and where."""

    job_id: int
    # When the replica was hit, and its name.
    fault_time: float
    replica: str
    seconds: float
    resumed_on: str
    # Why the job moved: the killed replica's stream closed (its lease ended at once),
    # its lease expired, or neither (the restarted replica came back first, its hello
    # no longer naming the job).
    stream_closed: bool
    lease_expired: bool


def resumes(
    hits: Sequence[FaultRecord], events: Sequence[EventRecord]
) -> tuple[list[Resume], list[str]]:
    """From the event log: for every job a hit replica held, the time until it RUNS again.

    After the fault, the scheduler hands the job to a replica ("resumed on X");
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
    for hit in hits:
        for job_id in hit.held:
            after = [e for e in by_job.get(job_id, []) if e.time >= hit.started]
            resumed_index = next(
                (i for i, e in enumerate(after) if e.message.startswith(RESUMED_ON)), None
            )
            done_index = next(
                (i for i, e in enumerate(after) if e.schedule_state == ScheduleState.DONE), None
            )
            if resumed_index is None or (done_index is not None and done_index < resumed_index):
                if done_index is None:
                    problems.append(
                        f"job {job_id}, held by {hit.target} when hit ({hit.kind}), "
                        "was never resumed"
                    )
                continue
            resumed = after[resumed_index]
            released = [e.message for e in after[:resumed_index]]
            closed = STREAM_CLOSED.format(hit.target) in released
            expired = LEASE_EXPIRED.format(hit.target) in released
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
                    fault_time=hit.started,
                    replica=hit.target,
                    seconds=running.time - hit.started,
                    resumed_on=assignee(resumed),
                    stream_closed=closed,
                    lease_expired=expired,
                )
            )
    return out, problems


# --- the soak -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SoakConfig:
    """A chaos soak. Durations are real seconds unless named simulated."""

    jobs: int = 80
    replicas: int = 3
    seed: int = 1
    # Faults go on for at least this long, every `fault_interval` seconds.
    chaos_seconds: float = 30.0
    fault_interval: tuple[float, float] = (5.0, 10.0)
    restart_delay: tuple[float, float] = (0.5, 4.5)
    # The share of faults that SIGSTOP the replica rather than SIGKILL it.
    pause_share: float = 0.0
    # When positive, a hit replica stays down until its jobs were all handed elsewhere
    # (at most this many seconds) before its `restart_delay`.
    hold_until_moved: float = 0.0
    # Submissions are spread evenly over this window.
    submit_seconds: float = 20.0
    lease_ttl: float = 3.0
    heartbeat_interval: float = 0.5
    time_scale: float = 10.0
    # Simulated seconds a task runs, drawn uniformly.
    runtime_seconds: tuple[float, float] = (20.0, 60.0)
    chain_fraction: float = 0.2
    cancel_fraction: float = 0.05
    preemptions_per_hour: float = 20.0
    # After the chaos stops, the longest wait for every job to be DONE.
    drain_timeout: float = 180.0


@dataclasses.dataclass
class SoakReport:
    figures: dict[str, Any]
    problems: list[str]
    # Violations of the kinds the soak promises to be free of (`SOAK_KINDS`).
    violations: list[Violation]
    # Those violations with the clusters, events and lifecycle logs of the first jobs.
    details: str
    faults: list[FaultRecord] = dataclasses.field(default_factory=list)
    resumes: list[Resume] = dataclasses.field(default_factory=list)


def run_soak(
    config: SoakConfig, data_dir: Path, admin_url: str = ADMIN_URL, log: Log = quiet
) -> SoakReport:
    """Runs one chaos soak end to end on a fresh database and returns its figures and problems."""
    cloud = cloud_config(config.seed, config.time_scale, config.preemptions_per_hour)
    plan = plan_workload(
        config.seed,
        config.jobs,
        config.submit_seconds,
        config.runtime_seconds,
        prefix="soak",
        chain_fraction=config.chain_fraction,
        cancel_fraction=config.cancel_fraction,
    )
    with system(
        data_dir,
        admin_url,
        cloud,
        replicas=config.replicas,
        lease_ttl=config.lease_ttl,
        heartbeat_interval=config.heartbeat_interval,
        log=log,
    ) as s:
        faults = plan_replica_faults(
            config.seed,
            config.chaos_seconds,
            [c.name for c in s.stack.controllers],
            config.fault_interval,
            config.restart_delay,
            config.pause_share,
        )
        chaos = FaultRunner(
            s.stack, s.client, faults, log, events=s.events, hold=config.hold_until_moved
        )
        workload = Workload(s.client, s.events, plan, log)
        started = time.monotonic()
        workload.start()
        chaos.start()
        workload.join(config.submit_seconds + 300)
        chaos.join(config.chaos_seconds + 300)
        workload.close()
        chaos_seconds = time.monotonic() - started
        log(f"chaos over after {chaos_seconds:.0f}s and {len(chaos.records)} faults; draining")
        ids = set(workload.job_ids.values())
        not_done = s.events.wait_done(ids, config.drain_timeout, s.client, log)
        duration = time.monotonic() - started
        report = analyse_soak(config, s.stack, s.client, s.db, chaos, workload, not_done)
        report.figures["chaos_seconds"] = round(chaos_seconds, 1)
        for kind, name in FAULT_NAMES.items():
            report.figures[f"{name}_planned"] = sum(f.kind == kind for f in faults)
        report.figures["duration_seconds"] = round(duration, 1)
        report.figures["watch_reconnects"] = s.events.reconnects
        return report


def analyse_soak(
    config: SoakConfig,
    stack: Stack,
    client: Client,
    db: Database,
    chaos: FaultRunner,
    workload: Workload,
    not_done: set[int],
) -> SoakReport:
    problems = [*chaos.errors, *run_problems(stack, client, workload, not_done)]
    jobs = [j for j in client.list_jobs() if j.job_id in set(workload.job_ids.values())]
    problems.extend(job_problems(jobs, workload.cancelled)[:50])
    # Once drained, nothing is in flight: the counters must equal a recount.
    snapshot = counter_snapshot(client, db, "after the drain")
    history = collect_history(client, db, workload.job_ids.values(), [snapshot], workload.tasks())
    violations = check(history)
    asserted = [v for v in violations if v.kind in SOAK_KINDS]
    hits = [r for r in chaos.records if r.kind in FAULT_NAMES]
    samples: list[Resume] = []
    resume: dict[str, dict[str, Any]] = {}
    for kind, name in RESUME_NAMES.items():
        of_kind = [r for r in hits if r.kind == kind]
        found, left = resumes(of_kind, history.events)
        problems.extend(left[:50])
        samples += found
        resume[name] = resume_figures(of_kind, found, left)
    statuses = collections.Counter(JobStatus(j.status).name for j in jobs)
    figures: dict[str, Any] = {
        "jobs": len(jobs),
        "replicas": config.replicas,
        "seed": config.seed,
        **{name: sum(r.kind == kind for r in hits) for kind, name in FAULT_NAMES.items()},
        "jobs_held_when_hit": sum(len(r.held) for r in hits),
        "lease_ttl_seconds": config.lease_ttl,
        "resume_samples": len(samples),
        # Fault -> the job RUNNING again, by how the replica's stream ended.
        "resume": resume,
        **cloud_figures(client),
        "counter_corrections": history.counter_corrections,
        "recoveries": sum(j.recovery_count for j in jobs),
        "cancel_requests": len(workload.cancelled),
        "statuses": dict(sorted(statuses.items())),
        "stale_reports_refused": stale_reports_refused(stack),
        "submit_retries": dict(client.retried),
        "events": len(history.events),
        "violations": counts(violations),
        "problems": len(problems) + len(asserted),
    }
    details = explain(client, db, asserted) if asserted else ""
    return SoakReport(figures, problems, asserted, details, hits, samples)


def resume_figures(
    hits: Sequence[FaultRecord], samples: Sequence[Resume], left: Sequence[str]
) -> dict[str, Any]:
    """Faults of one kind: the jobs they caught, how soon those ran again (p50/p99/max
    seconds from the signal, and the slowest of each fault), how many moved because a
    lease ran out, and how many were never resumed."""
    seconds = [r.seconds for r in samples]
    slowest = {r.fault_time: r.seconds for r in sorted(samples, key=lambda r: r.seconds)}
    return {
        "faults": len(hits),
        "jobs_held": sum(len(r.held) for r in hits),
        "samples": len(samples),
        "resumed_elsewhere": sum(r.resumed_on != r.replica for r in samples),
        "after_lease_expiry": sum(r.lease_expired for r in samples),
        "p50_s": _rounded(percentile(seconds, 50)),
        "p99_s": _rounded(percentile(seconds, 99)),
        "max_s": _rounded(max(seconds, default=None)),
        # None for a fault whose jobs all ended before they were resumed.
        "slowest_per_fault_s": [_rounded(slowest.get(r.started)) for r in hits],
        "left": len(left),
    }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)

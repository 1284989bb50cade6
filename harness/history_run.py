"""The randomized fault run: the whole system under a seeded fault schedule, judged by its history.

`run_history` starts the scheduler (on a fresh PostgreSQL database), three
controller replicas, logs and a seeded sim cloud (`reliability.system`), then at
once carries out a seeded workload (`workload.py`: jobs and chains, some cancelled
right after submit, while launching, or later) and a seeded fault schedule
(`faults.py`: replica SIGKILLs, a replica SIGSTOPped past its lease then
SIGCONTed, a scheduler restart, a PostgreSQL outage, spot preemptions of single
clusters, launching ones too, of finished ones waiting for a holder, and of a
whole region). Then it waits until the
system is quiet and reads its durable record:

1. every ordinary job DONE (bounded wait);
2. a first quiescent point: only the long jobs are left, RUNNING and watched, so
   the scheduler's counters are compared with a recount while they are not zero;
3. the long jobs are cancelled and DONE; a second quiescent point, everything zero;
4. the whole event log, the inventory, the cloud's counters and the counter
   corrections of every life of the scheduler, with the client's own record (how
   many tasks each job has, the cancels it sent and had answered), judged by
   `history.check`.

`plan` is a pure function of the config (the seed): the same seed gives the same
workload and the same fault schedule. Used by `tests/system/test_history.py` (a few
seeds, a minute each) and `bench/history.py` (longer, more seeds).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from harness.faults import Fault, FaultConfig, FaultKind, FaultRecord, FaultRunner, plan_faults
from harness.history import CounterSnapshot, Violation, check, counts
from harness.reliability import (
    ADMIN_URL,
    REGIONS,
    Log,
    PostgresServer,
    System,
    cloud_config,
    cloud_figures,
    collect_history,
    counter_snapshot,
    explain,
    lifecycle_lines,
    quiet,
    system,
)
from harness.workload import Cancel, Workload, WorkloadPlan, plan_workload, run_problems
from managedjobs.v1 import job_pb2
from services.common.statuses import JobStatus, ScheduleState

CI_FAULTS: Mapping[FaultKind, int] = {
    FaultKind.KILL_REPLICA: 2,
    FaultKind.PAUSE_REPLICA: 1,
    FaultKind.RESTART_SCHEDULER: 1,
    FaultKind.DATABASE_OUTAGE: 1,
    FaultKind.PREEMPT_CLUSTER: 4,
    FaultKind.PREEMPT_FINISHED: 2,
    FaultKind.PREEMPT_REGION: 1,
}
EVERY_MOMENT = (Cancel.AFTER_SUBMIT, Cancel.WHILE_LAUNCHING, Cancel.LATER)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One randomized run. Durations are real seconds unless named simulated."""

    seed: int = 1
    jobs: int = 24
    # On-demand jobs that outlive the faults; they make the first quiescent point.
    long_jobs: int = 3
    submit_seconds: float = 12.0
    # Faults happen from `fault_lead` to `fault_seconds` after the start.
    fault_lead: float = 2.0
    fault_seconds: float = 26.0
    faults: Mapping[FaultKind, int] = dataclasses.field(default_factory=lambda: CI_FAULTS)
    # Simulated seconds a task runs, drawn uniformly.
    runtime_seconds: tuple[float, float] = (20.0, 60.0)
    chain_fraction: float = 0.3
    chain_lengths: tuple[int, int] = (2, 3)
    cancel_fraction: float = 0.35
    cancel_modes: tuple[Cancel, ...] = EVERY_MOMENT
    cancel_delay: tuple[float, float] = (0.5, 8.0)
    replicas: int = 3
    lease_ttl: float = 3.0
    time_scale: float = 10.0
    # Simulated seconds from launch to UP: a second of real time to cancel or preempt in.
    launch_latency: float = 10.0
    preemptions_per_hour: float = 12.0
    drain_timeout: float = 60.0

    def fault_config(self) -> FaultConfig:
        return FaultConfig(
            seconds=self.fault_seconds,
            counts=self.faults,
            lease_ttl=self.lease_ttl,
            lead=self.fault_lead,
        )


@dataclasses.dataclass
class RunReport:
    config: RunConfig
    violations: list[Violation]
    # What went wrong around the jobs (lost submissions, jobs not DONE in time, ...).
    problems: list[str]
    # Client calls the scheduler answered INTERNAL (retried, so the run went on).
    internal: list[str]
    faults: list[FaultRecord]
    figures: dict[str, Any]
    # The violations with the clusters, events and lifecycle logs of the first jobs.
    details: str = ""


def replica_names(config: RunConfig) -> list[str]:
    """The replicas' controller ids, as `services.launcher.stack.Stack` names them."""
    return [f"controller-{i + 1}" for i in range(config.replicas)]


def plan(config: RunConfig) -> tuple[WorkloadPlan, tuple[Fault, ...]]:
    """The run's workload and fault schedule: a pure function of the config."""
    workload = plan_workload(
        config.seed,
        config.jobs,
        config.submit_seconds,
        config.runtime_seconds,
        prefix="history",
        chain_fraction=config.chain_fraction,
        chain_lengths=config.chain_lengths,
        cancel_fraction=config.cancel_fraction,
        cancel_modes=config.cancel_modes,
        cancel_delay=config.cancel_delay,
        long_jobs=config.long_jobs,
    )
    faults = plan_faults(config.seed, config.fault_config(), replica_names(config), REGIONS)
    return workload, faults


def _running(events: Sequence[job_pb2.JobEvent]) -> bool:
    """The job's latest event: its task RUNNING, its launch slot given back."""
    return bool(events) and (
        events[-1].status == JobStatus.RUNNING and events[-1].schedule_state == ScheduleState.ALIVE
    )


def run_history(
    config: RunConfig, data_dir: Path, admin_url: str = ADMIN_URL, log: Log = quiet
) -> RunReport:
    """Runs the system under the seeded workload and faults, then checks its history."""
    workload_plan, fault_plan = plan(config)
    outage = any(f.kind == FaultKind.DATABASE_OUTAGE for f in fault_plan)
    server = PostgresServer() if outage else None
    if server is not None and server.why_unavailable():
        raise RuntimeError(f"cannot cut the database: {server.why_unavailable()}")
    cloud = cloud_config(
        config.seed,
        config.time_scale,
        config.preemptions_per_hour,
        launch_latency=config.launch_latency,
    )
    with system(
        data_dir, admin_url, cloud, config.replicas, lease_ttl=config.lease_ttl, log=log
    ) as s:
        runner = FaultRunner(s.stack, s.client, fault_plan, log, server)
        workload = Workload(s.client, s.events, workload_plan, log)
        started = time.monotonic()
        try:
            workload.start()
            runner.start()
            workload.join(config.submit_seconds + 180)
            runner.join(config.fault_seconds + 180)
        finally:
            runner.stop()
        faulted = time.monotonic() - started
        log(f"faults over after {faulted:.0f}s; draining")
        return _judge(config, s, workload, runner, started)


def _judge(
    config: RunConfig, s: System, workload: Workload, runner: FaultRunner, started: float
) -> RunReport:
    problems = list(runner.errors)
    long_indexes = range(config.long_jobs)
    long_ids = [workload.job_ids[i] for i in long_indexes if i in workload.job_ids]
    ordinary = [j for i, j in workload.job_ids.items() if i not in long_indexes]
    not_done = s.events.wait_done(ordinary, config.drain_timeout, s.client)
    drained = time.monotonic() - started
    snapshots: list[CounterSnapshot] = []
    if not s.events.wait_for(lambda: all(_running(s.events.by_job[j]) for j in long_ids), 30):
        problems.append(f"the long jobs {long_ids} were not all RUNNING once the rest was done")
    snapshots.append(counter_snapshot(s.client, s.db, "only the long jobs running"))
    s.client.cancel(long_ids)
    not_done |= s.events.wait_done(long_ids, 60, s.client)
    workload.close()
    snapshots.append(counter_snapshot(s.client, s.db, "everything done"))
    problems.extend(run_problems(s.stack, s.client, workload, not_done))
    history = collect_history(
        s.client, s.db, workload.job_ids.values(), snapshots, workload.tasks()
    )
    violations = check(history)
    jobs = [j for j in s.client.list_jobs() if j.job_id in set(workload.job_ids.values())]
    planned = collections.Counter(f.kind.value for f in runner.plan)
    done = collections.Counter(r.kind.value for r in runner.records)
    figures: dict[str, Any] = {
        "seed": config.seed,
        "jobs": len(jobs),
        "chains": sum(len(j.runtimes) > 1 for j in workload.plan.jobs),
        "violations": counts(violations),
        "faults_planned": dict(sorted(planned.items())),
        "faults": dict(sorted(done.items())),
        "jobs_held_when_hit": sum(len(r.held) for r in runner.records),
        "cancels": {k.value: n for k, n in workload.cancels_sent.items() if k != Cancel.NEVER},
        "statuses": dict(
            sorted(collections.Counter(JobStatus(j.status).name for j in jobs).items())
        ),
        "recoveries": sum(j.recovery_count for j in jobs),
        "counter_corrections": history.counter_corrections,
        **cloud_figures(s.client),
        "events": len(history.events),
        "submit_retries": dict(s.client.retried),
        "internal_answers": len(workload.internal),
        "drain_seconds": round(drained, 1),
        "duration_seconds": round(time.monotonic() - started, 1),
        "problems": len(problems),
    }
    details = explain(s.client, s.db, violations) if violations else ""
    if history.cloud is not None and (
        history.cloud.stale_launches_rejected or history.cloud.stale_terminates_rejected
    ):
        # The cloud's counters name no job; the lifecycle logs name the refused calls.
        details += "\nrefused as stale by the cloud:\n" + "\n".join(
            lifecycle_lines(s.stack, "stale epoch")
        )
    return RunReport(
        config,
        violations,
        problems,
        list(workload.internal),
        list(runner.records),
        figures,
        details,
    )

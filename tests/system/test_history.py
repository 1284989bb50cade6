"""The whole system under a seeded fault schedule never loses or doubles work.

Each seed runs `history_run.run_history`: scheduler, three replicas, logs and the
sim cloud on PostgreSQL, a few dozen jobs (chains among them, some cancelled right
after submit, while launching, or later) under replica SIGKILLs, a replica paused
past its lease, a scheduler restart, a database outage and spot preemptions; then
the durable record (event log, inventory, the cloud's and the scheduler's
counters) is judged by `history.check`. A failure names each violation with its
evidence, then the first jobs' clusters, events and lifecycle logs.

Reproduce one seed: `CI=true .venv/bin/pytest -q tests/system/test_history.py -k 'seed-2' -s`;
longer runs and more seeds: `python bench/history.py --help`.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest

from harness.faults import EPISODES, FaultKind
from harness.history_run import CI_FAULTS, RunConfig, plan, run_history
from harness.prerequisites import missing
from harness.reliability import ADMIN_URL, PostgresServer, judge
from harness.workload import Cancel

# Two seeds keep the suite within its budget; `bench/history.py` runs as many as asked.
SEEDS = (1, 2)


def test_the_same_seed_gives_the_same_schedule() -> None:
    first, again, other = plan(RunConfig(seed=7)), plan(RunConfig(seed=7)), plan(RunConfig(seed=8))
    assert first == again
    assert first != other
    workload, faults = first
    # Every fault kind, every cancel moment, chains and the long jobs are in it.
    assert {f.kind for f in faults} == set(FaultKind)
    assert [f.kind for f in faults].count(FaultKind.PREEMPT_CLUSTER) == 4
    moments = {j.cancel for j in workload.jobs}
    assert {Cancel.AFTER_SUBMIT, Cancel.WHILE_LAUNCHING, Cancel.LATER} <= moments
    assert any(len(j.runtimes) > 1 for j in workload.jobs)
    assert [j.runtimes for j in workload.jobs[:3]] == [(1e6,)] * 3


@pytest.mark.parametrize("seed", range(1, 21))
def test_episodes_never_overlap_and_a_pause_outlasts_the_lease(seed: int) -> None:
    config = RunConfig(seed=seed)
    _, faults = plan(config)
    episodes = [f for f in faults if f.kind in EPISODES]
    assert sorted(f.kind for f in episodes) == sorted(
        k for k in EPISODES for _ in range(CI_FAULTS[k])
    )
    for before, after in itertools.pairwise(episodes):
        assert before.at + before.duration < after.at, (before, after)
    assert all(f.at >= config.fault_lead for f in faults)
    # Preemptions fall in the window; episodes too, unless they do not fit in it.
    instant = (FaultKind.PREEMPT_CLUSTER, FaultKind.PREEMPT_REGION)
    assert all(f.at <= config.fault_seconds for f in faults if f.kind in instant)
    assert episodes[0].at <= config.fault_seconds
    pause = next(f for f in episodes if f.kind == FaultKind.PAUSE_REPLICA)
    assert pause.duration > config.lease_ttl
    # Finished clusters are preempted while a replica is down or paused.
    holds = [f for f in episodes if f.kind in (FaultKind.KILL_REPLICA, FaultKind.PAUSE_REPLICA)]
    for fault in (f for f in faults if f.kind == FaultKind.PREEMPT_FINISHED):
        assert any(h.at < fault.at < h.at + h.duration for h in holds), fault


@pytest.fixture
def admin_url(postgres_base: str) -> str:
    """The PostgreSQL server's admin URL (skipped when unreachable, failed under CI)."""
    server = PostgresServer()
    reason = server.why_unavailable()
    if reason:
        missing(f"the fault run cuts PostgreSQL, which it cannot here: {reason}")
    return ADMIN_URL


@pytest.mark.e2e
@pytest.mark.postgres
@pytest.mark.timeout(200)
@pytest.mark.parametrize("seed", [pytest.param(s, id=f"seed-{s}") for s in SEEDS])
def test_a_randomized_fault_run_leaves_a_clean_history(
    seed: int, tmp_path: Path, admin_url: str
) -> None:
    report = run_history(
        RunConfig(seed=seed),
        tmp_path / f"history-{seed}",
        admin_url,
        log=lambda m: print(time.strftime("%X"), m),
    )
    print(json.dumps(report.figures))
    # The schedule was carried out in full: every planned fault happened.
    assert report.figures["faults"] == report.figures["faults_planned"], report.figures
    assert report.figures["jobs_held_when_hit"] > 0, report.figures
    assert not report.internal, report.internal  # no call was answered INTERNAL
    judge(report.problems, report.violations, (), report.details)

"""The chaos soak's own parts, without a system: its fault schedule, how it tells that a
hit replica's jobs went elsewhere, its resume figures per kind of fault, and the
harness's reads of a SQLite database (`bench/restarts.py` runs on one).

The soak itself runs in `test_reliability.py` and `bench/chaos.py`.
"""

from __future__ import annotations

import itertools
import sqlite3
from pathlib import Path

from harness.faults import Fault, FaultKind, FaultRecord, handed_elsewhere, plan_replica_faults
from harness.history import EventRecord
from harness.reliability import Database
from harness.soak import RESUME_NAMES, resume_figures, resumes
from managedjobs.v1 import job_pb2
from services.common.event_messages import LEASE_EXPIRED_PREFIX, RESUMED_ON
from services.common.statuses import JobStatus, ScheduleState

St = ScheduleState
REPLICAS = ("controller-1", "controller-2", "controller-3")


def plan(pause_share: float, seed: int = 4) -> tuple[Fault, ...]:
    return plan_replica_faults(seed, 600.0, REPLICAS, (10.0, 20.0), (1.0, 3.0), pause_share)


def test_a_share_of_the_replica_faults_are_pauses_and_the_seed_decides_which() -> None:
    kills = plan(0.0)
    assert {f.kind for f in kills} == {FaultKind.KILL_REPLICA}
    assert {f.kind for f in plan(1.0)} == {FaultKind.PAUSE_REPLICA}
    mixed = plan(0.5)
    assert mixed == plan(0.5)
    assert mixed != plan(0.5, seed=5)
    kinds = [f.kind for f in mixed]
    assert kinds.count(FaultKind.PAUSE_REPLICA) and kinds.count(FaultKind.KILL_REPLICA)
    for fault in mixed:
        assert fault.target in REPLICAS and 1.0 <= fault.duration <= 3.0 and fault.at < 600.0
    times = [f.at for f in mixed]
    # Planned times are rounded to the hundredth.
    assert all(10.0 - 0.01 <= b - a <= 20.0 + 0.01 for a, b in itertools.pairwise(times))


def job_event(
    job_id: int, at: float, message: str, state: ScheduleState = St.ALIVE
) -> job_pb2.JobEvent:
    event = job_pb2.JobEvent(
        job_id=job_id, status=JobStatus.RUNNING, schedule_state=state, message=message
    )
    event.time.FromNanoseconds(int(at * 1e9))
    return event


def test_a_hit_replicas_jobs_are_elsewhere_once_each_is_resumed_on_another_or_done() -> None:
    hit = FaultRecord(Fault(0.0, FaultKind.KILL_REPLICA, "controller-1"), started=100.0)
    hit.held = [1, 2]
    by_job = {
        # Handed to the same replica before the fault: not a move.
        1: [job_event(1, 90.0, f"{RESUMED_ON}controller-2")],
        2: [],
    }
    assert not handed_elsewhere(by_job, hit)
    by_job[1].append(job_event(1, 101.0, f"{RESUMED_ON}controller-1"))
    by_job[2].append(job_event(2, 101.5, f"{RESUMED_ON}controller-3"))
    # Job 1 went back to the replica that was hit (it came back first): not elsewhere yet.
    assert not handed_elsewhere(by_job, hit)
    by_job[1].append(job_event(1, 102.0, "", state=St.DONE))
    assert handed_elsewhere(by_job, hit)


def record(job_id: int, at: float, message: str, status: JobStatus = JobStatus.RUNNING,
           state: ScheduleState = St.ALIVE) -> EventRecord:  # fmt: skip
    return EventRecord(0, job_id, 0, status, state, at, message, 0)


def test_resume_figures_are_split_by_how_the_replicas_stream_ended() -> None:
    kill = FaultRecord(Fault(0.0, FaultKind.KILL_REPLICA, "controller-1"), started=100.0)
    kill.held = [1, 2, 3]
    pause = FaultRecord(Fault(0.0, FaultKind.PAUSE_REPLICA, "controller-2"), started=200.0)
    pause.held = [4, 5]
    events = [
        # Stream closed: moved at once, still running (watched again) ...
        record(1, 100.4, f"{RESUMED_ON}controller-2"),
        # ... or relaunched: RUNNING again at its next RUNNING event.
        record(2, 100.5, f"{RESUMED_ON}controller-3", JobStatus.RECOVERING, St.LAUNCHING),
        record(2, 101.5, "running", JobStatus.RUNNING),
        # Job 3 is never resumed and never ends: left.
        # Silent: its lease ran out first.
        record(4, 209.0, f"{LEASE_EXPIRED_PREFIX}controller-2 expired", state=St.ALIVE_WAITING),
        record(4, 209.2, f"{RESUMED_ON}controller-1"),
        # Ended before it was resumed: no sample, not left.
        record(5, 205.0, "succeeded", JobStatus.SUCCEEDED, St.DONE),
    ]
    figures = {}
    left_all: list[str] = []
    for kind, name in RESUME_NAMES.items():
        hits = [h for h in (kill, pause) if h.kind == kind]
        samples, left = resumes(hits, events)
        left_all += left
        figures[name] = resume_figures(hits, samples, left)
    closed, silent = figures["stream_closed"], figures["silent"]
    assert (closed["faults"], closed["jobs_held"], closed["samples"], closed["left"]) == (
        1,
        3,
        2,
        1,
    )
    assert (closed["p50_s"], closed["max_s"], closed["after_lease_expiry"]) == (0.4, 1.5, 0)
    assert closed["slowest_per_fault_s"] == [1.5]
    assert (silent["samples"], silent["left"], silent["after_lease_expiry"]) == (1, 0, 1)
    assert silent["p99_s"] == silent["max_s"] == 9.2
    assert len(left_all) == 1 and "job 3" in left_all[0]


def test_the_harness_reads_the_schedulers_sqlite_database(tmp_path: Path) -> None:
    path = tmp_path / "scheduler.db"
    with sqlite3.connect(path) as conn:
        conn.execute(
            'CREATE TABLE jobs (id INTEGER PRIMARY KEY, "user" TEXT, idempotency_key TEXT, '
            "controller_id TEXT, schedule_state TEXT, status TEXT)"
        )
        conn.executemany(
            'INSERT INTO jobs ("user", idempotency_key, controller_id, schedule_state, status) '
            "VALUES (?, ?, ?, ?, ?)",
            [
                ("ann", "k1", "controller-1", "ALIVE", "RUNNING"),
                ("ann", "k2", "controller-1", "ALIVE", "RUNNING"),
                ("ann", "k3", None, "WAITING", "PENDING"),
                ("bob", "k1", None, "DONE", "SUCCEEDED"),
            ],
        )
    db = Database(f"sqlite:///{path}")
    assert db.recount() == {
        ("controller-1", St.ALIVE): 2,
        (None, St.WAITING): 1,
        (None, St.DONE): 1,
    }
    assert db.statuses() == {JobStatus.RUNNING: 2, JobStatus.PENDING: 1, JobStatus.SUCCEEDED: 1}
    # PostgreSQL's numbered parameters, as every query of the harness is written.
    assert db.idempotency("ann") == (3, 3)
    assert db.query(
        'SELECT id FROM jobs WHERE "user" = $1 AND idempotency_key = $2', "bob", "k1"
    ) == [(4,)]

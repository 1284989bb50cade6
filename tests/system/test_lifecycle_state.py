"""A hypothesis state machine over the job lifecycle (contract §16), on the whole system.

The real scheduler (SQLite), controller replicas, the logs service and the sim
cloud run in this process with auth on (`lifecycle_world.World`). Each example
starts with a few jobs; its steps submit more (one task, a chain of two, code
that exits non-zero with and without restarts left), move the cloud's clock
(launches complete, runs end), preempt a cluster (launching or running), cancel
a job (not DONE, or DONE), kill a replica that holds jobs (another takes them
over once its lease runs out), start a replica, and restart the scheduler on
its database. After each step the system comes to rest (`World.settle`:
awaited, never slept for) and the invariants are checked on what was read then:
- no job lost: every submitted job is in the database and in ListJobs;
- no job run twice at once: at most one live cluster per job in the cloud, and
  no cluster left but the latest of its current task (none once it is DONE);
- statuses only move along the transition tables, by the events table;
- the counters equal a recount of the jobs table (`settle` waits for them to
  agree), and no replica is over its limits;
- a DONE job ended as its spec says (SUCCEEDED, or FAILED, with the restarts it
  had), or CANCELLED when it was cancelled before it ended; a DONE job cancelled
  again keeps its status;
- the history checker (tests/history.py) finds nothing in the events and the
  inventory: no stale report or launch, no overlapping clusters, no rerun.
At the end of each example every job is run to its end and judged again.
"""

from __future__ import annotations

import dataclasses
import sys

from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from harness.history import Kind, check, describe
from harness.lifecycle_world import LAUNCH, LIVE, RUN, Snapshot, World
from managedjobs.simcloud.v1 import simcloud_service_pb2 as spb
from services.common.statuses import (
    SCHEDULE_TRANSITIONS,
    JobStatus,
    ScheduleState,
    task_transition_allowed,
)

S = JobStatus
St = ScheduleState
REPLICAS = 2
MAX_REPLICAS = 3
# Jobs not DONE at most before another is submitted: the other steps get to act on them.
BUSY = 4
# Controller ids for replicas started later (one kept for the final run to the end).
SPARE = 4


@dataclasses.dataclass(frozen=True)
class JobKind:
    """A kind of job: its spec, and how it ends when nobody cancels it."""

    spec: str
    status: JobStatus
    restarts: int = 0
    tasks: int = 1


def _task(name: str, sim: str = "", recovery: str = "") -> str:
    text = f"name: {name}\nrun: train\nsim: {{runtime_seconds: {RUN:g}{sim}}}\n"
    if recovery:
        text += f"resources:\n  job_recovery: {recovery}\n"
    return text


KINDS = {
    "one": JobKind(_task("one"), S.SUCCEEDED),
    "chain": JobKind(
        f"name: chain\n---\n{_task('first')}---\n{_task('second')}", S.SUCCEEDED, tasks=2
    ),
    "fails": JobKind(_task("fails", ", exit_code: 1"), S.FAILED),
    "fails-once": JobKind(
        _task("fails-once", ", exit_code: 1, exit_code_runs: 1", "{max_restarts_on_errors: 1}"),
        S.SUCCEEDED,
        restarts=1,
    ),
    "keeps-failing": JobKind(
        _task("keeps-failing", ", exit_code: 1", "{max_restarts_on_errors: 1}"),
        S.FAILED,
        restarts=1,
    ),
}


def _few(n: int) -> str:
    """A count for the statistics of the examples: 0, 1, 2 or 3+."""
    return str(n) if n < 3 else "3+"


class LifecycleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.world = World.open(REPLICAS, SPARE)
        self.kinds: dict[int, str] = {}
        # Jobs cancelled while not DONE: they must end CANCELLED.
        self.cancelled: set[int] = set()
        self.steps: list[str] = []
        try:
            self.snap: Snapshot = self.world.settle()
        except BaseException:
            self.world.close()
            raise

    def teardown(self) -> None:
        # Hypothesis calls this in a `finally`: an exception on its way out (a step that
        # failed, or an example given up) means there is nothing to run on.
        try:
            if sys.exc_info()[1] is None:
                self._run_to_the_end()
        finally:
            self.world.close()

    # --- steps ---------------------------------------------------------------------------------

    def settle(self, step: str) -> None:
        """Waits for rest after a step; a failure names the steps so far (a failure that
        depends on timing may not replay, and then hypothesis cannot print them)."""
        self.steps.append(step)
        try:
            self.snap = self.world.settle()
        except AssertionError as error:
            raise AssertionError(f"{error}\nsteps: {'; '.join(self.steps)}") from None

    def not_done(self) -> list[int]:
        return sorted(j for j, row in self.snap.jobs.items() if row.schedule_state != St.DONE)

    def _submit(self, kind: str) -> int:
        job_id = self.world.submit(KINDS[kind].spec)
        self.kinds[job_id] = kind
        return job_id

    @initialize(kinds=st.lists(st.sampled_from(sorted(KINDS)), min_size=1, max_size=3))
    def start(self, kinds: list[str]) -> None:
        """Some jobs from the start, so that the first steps have something to act on."""
        jobs = [f"{kind} as job {self._submit(kind)}" for kind in kinds]
        self.settle(f"submit {', '.join(jobs)}")

    @precondition(lambda self: len(self.not_done()) < BUSY)
    @rule(kind=st.sampled_from(sorted(KINDS)))
    def submit(self, kind: str) -> None:
        self.settle(f"submit {kind} as job {self._submit(kind)}")

    @rule()
    def launches_complete(self) -> None:
        """Simulated time passes for a launch: every cluster being launched comes UP."""
        self.world.advance(LAUNCH)
        self.settle("launches complete")

    @rule()
    def runs_end(self) -> None:
        """Simulated time passes for a run: every task that was running ends."""
        self.world.advance(RUN)
        self.settle("runs end")

    def live_clusters(self) -> list[str]:
        return sorted(c.name for c in self.snap.clusters if c.status in LIVE)

    @precondition(lambda self: self.live_clusters())
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        """The cloud takes a cluster back (while it launches or while it runs)."""
        name = data.draw(st.sampled_from(self.live_clusters()), label="cluster")
        [cluster] = [c for c in self.snap.clusters if c.name == name and c.status in LIVE]
        event(f"preempt a cluster {spb.ClusterStatus.Name(cluster.status)}")
        assert self.world.preempt(name), f"{name} was live when preempted"
        self.settle(f"preempt {name}")

    def done(self) -> list[int]:
        return sorted(j for j in self.kinds if self.snap.jobs[j].schedule_state == St.DONE)

    @precondition(lambda self: self.not_done())
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        """A cancel of a job not DONE, wherever it is: it must end CANCELLED."""
        job_id = data.draw(st.sampled_from(self.not_done()), label="job")
        row = self.snap.jobs[job_id]
        event(f"cancel a job {row.status.name}/{row.schedule_state.name}")
        self.cancelled.add(job_id)
        self.world.cancel(job_id)
        self.settle(f"cancel job {job_id}")

    @precondition(lambda self: self.done())
    @rule(data=st.data())
    def cancel_done(self, data: st.DataObject) -> None:
        """A cancel of a DONE job changes nothing: it keeps the status it ended with."""
        job_id = data.draw(st.sampled_from(self.done()), label="job")
        self.world.cancel(job_id)
        self.settle(f"cancel job {job_id}, DONE")

    def holders(self) -> list[str]:
        """The live replicas that hold a job not DONE."""
        held = {self.snap.jobs[j].controller_id for j in self.not_done()}
        return sorted(cid for cid in self.world.replicas if cid in held)

    @precondition(lambda self: self.holders())
    @rule(data=st.data())
    def replica_dies(self, data: st.DataObject) -> None:
        """A replica holding jobs dies; once its lease runs out, they move to the others."""
        cid = data.draw(st.sampled_from(self.holders()), label="replica")
        held = sum(self.snap.jobs[j].controller_id == cid for j in self.not_done())
        event(f"a replica dies holding {_few(held)} jobs")
        self.world.kill_replica(cid)
        self.settle(f"{cid} dies")

    @precondition(lambda self: len(self.world.replicas) < MAX_REPLICAS and self.world.spare > 1)
    @rule()
    def replica_starts(self) -> None:
        self.settle(f"{self.world.start_replica()} starts")

    @precondition(lambda self: self.not_done())
    @rule()
    def scheduler_restarts(self) -> None:
        """The scheduler stops and starts again on the same database and port."""
        event(f"the scheduler restarts with {_few(len(self.not_done()))} jobs not done")
        self.world.restart_scheduler()
        self.settle("the scheduler restarts")

    # --- invariants ------------------------------------------------------------------------------

    @invariant()
    def checked(self) -> None:
        """Every invariant, on the last reading at rest."""
        snap = self.snap
        self._no_job_lost(snap)
        self._clusters(snap)
        self._legal_transitions(snap)
        self._limits(snap)
        self._ends(snap)
        self._history(snap)

    def _no_job_lost(self, snap: Snapshot) -> None:
        submitted = set(self.kinds)
        assert submitted <= set(snap.jobs), f"lost: {sorted(submitted - set(snap.jobs))}"
        assert submitted <= snap.listed, f"not listed: {sorted(submitted - snap.listed)}"
        for job_id in submitted:
            row = snap.jobs[job_id]
            assert row.status == snap.tasks[(job_id, row.current_task)].status or (
                row.schedule_state == St.DONE
            ), self.world.describe(snap, job_id)

    def _clusters(self, snap: Snapshot) -> None:
        """At most one live cluster per job; none left but its current task's latest (for
        whoever runs or resumes it), and none at all once the job is DONE."""
        for job_id in self.kinds:
            row = snap.jobs[job_id]
            live = [c for c in snap.clusters_of(job_id) if c.status in LIVE]
            assert len(live) <= 1, f"run twice at once\n{self.world.describe(snap, job_id)}"
            current = snap.latest(job_id, row.current_task)
            done = row.schedule_state == St.DONE
            kept = None if done or current is None else current.cluster_id
            left = [
                c
                for c in snap.clusters_of(job_id)
                if c.status != spb.CLUSTER_STATUS_TERMINATED and c.cluster_id != kept
            ]
            when = "after the end" if done else "behind"
            assert not left, f"clusters left {when}\n{self.world.describe(snap, job_id)}"

    def _legal_transitions(self, snap: Snapshot) -> None:
        tasks: dict[tuple[int, int], JobStatus] = {}
        states: dict[int, ScheduleState] = {}
        for e in snap.events:
            key = (e.job_id, e.task_id)
            old = tasks.get(key, S.PENDING)
            assert task_transition_allowed(old, e.status), (
                f"task {key}: {old.name} -> {e.status.name} at event {e.event_id}\n"
                + self.world.describe(snap, e.job_id)
            )
            tasks[key] = e.status
            before = states.get(e.job_id, St.WAITING)
            assert before == e.schedule_state or e.schedule_state in SCHEDULE_TRANSITIONS[before], (
                f"job {e.job_id}: {before.name} -> {e.schedule_state.name} at event {e.event_id}\n"
                + self.world.describe(snap, e.job_id)
            )
            states[e.job_id] = e.schedule_state

    def _limits(self, snap: Snapshot) -> None:
        assert snap.scheduler is not None
        for replica in snap.scheduler.replicas:
            capacity = replica.capacity
            assert replica.alive <= capacity.max_jobs, replica
            assert replica.launching <= capacity.max_launches, replica

    def _ends(self, snap: Snapshot) -> None:
        for job_id, kind in self.kinds.items():
            row = snap.jobs[job_id]
            if row.schedule_state != St.DONE:
                # At rest, a cancelled job not yet DONE waits for a replica to clean it up.
                if job_id in self.cancelled:
                    assert row.controller_id is None, self.world.describe(snap, job_id)
                continue
            if job_id in self.cancelled:
                assert row.status == S.CANCELLED, self.world.describe(snap, job_id)
                continue
            expected = KINDS[kind]
            assert row.status == expected.status, self.world.describe(snap, job_id)
            restarts = [t.restart_count for (j, _), t in snap.tasks.items() if j == job_id]
            assert max(restarts) == expected.restarts, self.world.describe(snap, job_id)

    def _history(self, snap: Snapshot) -> None:
        done = set(self.done())
        # A job not DONE yet is "never DONE" to the checker, which judges finished runs;
        # its terminal statuses are kept, by `_legal_transitions`.
        found = [
            v
            for v in check(snap.history({j: KINDS[k].tasks for j, k in self.kinds.items()}))
            if v.job_id in done or v.job_id is None or v.kind != Kind.TERMINAL_STATUS
        ]
        assert not found, (
            describe(found)
            + "\n"
            + "\n".join(self.world.describe(snap, v.job_id) for v in found if v.job_id is not None)
        )

    # --- the end ---------------------------------------------------------------------------------

    def _run_to_the_end(self) -> None:
        """Runs every job to its end (a replica is started if none is left), then judges.

        Each round moves the clock by a launch and a run: while jobs are left, every
        round must change something (the events grow), or they are stuck.
        """
        if not self.world.replicas:
            self.settle(f"{self.world.start_replica()} starts for the end")
        while self.not_done():
            events = len(self.snap.events)
            self.world.advance(LAUNCH + RUN)
            self.settle("to the end: a launch and a run")
            assert len(self.snap.events) > events, "stuck:\n" + "\n".join(
                self.world.describe(self.snap, j) for j in self.not_done()
            )
        self.checked()


LifecycleMachine.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=15,
    deadline=None,
    # A failure of the whole system may hang on timing, and each try of a smaller example
    # may wait out `settle`: it is reported as found, with its steps, rather than shrunk.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow],
)
TestLifecycle = LifecycleMachine.TestCase

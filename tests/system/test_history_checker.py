"""The history checker judged on hand-made histories: each bad one is caught, good ones pass.

Each history is written the way the scheduler and the sim cloud write theirs
(`Run` below mirrors the store's events, in the product's own words, the cloud's
inventory records and the client's record of its cancels), then one thing is
broken, and the checker must report exactly that violation, with its job and
evidence. No processes, no database: the checker is pure. The same violations
made by the real system with one protection turned off are
`tests/system/test_history_mutations.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest

from harness.history import (
    CallRecord,
    ClientCancels,
    CloudCounters,
    ClusterRecord,
    CounterSnapshot,
    EventRecord,
    History,
    Kind,
    Violation,
    check,
    counts,
    describe,
)
from services.common.event_messages import (
    ADMITTED_ON,
    CANCEL_REQUESTED,
    CANCELLED_BEFORE_START,
    HANDED_BACK,
    LEASE_EXPIRED,
    MAX_PENDING_EXCEEDED,
    RESUMED_ON,
    SUBMITTED,
)
from services.common.statuses import JobStatus, ScheduleState

S = JobStatus
St = ScheduleState


class Run:
    """Writes a history as the system does: events in id order, clusters as launched."""

    def __init__(self) -> None:
        self.events: list[EventRecord] = []
        self.clusters: dict[int, ClusterRecord] = {}
        self.now = 1_700_000_000.0
        self.state: dict[int, tuple[S, St, int]] = {}
        # What the client knows: each job's tasks, and the cancels it sent and had answered.
        self.tasks: dict[int, int] = {}
        self.cancels_sent: set[int] = set()
        self.cancels_answered: set[int] = set()
        # Each job's current assignment epoch, as the scheduler's moves of it carry.
        self.epochs: dict[int, int] = {}

    def tick(self, seconds: float = 1.0) -> float:
        self.now += seconds
        return self.now

    def event(
        self,
        job: int,
        message: str,
        *,
        status: S | None = None,
        state: St | None = None,
        task: int | None = None,
        epoch: int = 0,
        same_transaction: bool = False,
    ) -> EventRecord:
        """An event; with `same_transaction`, at the time of the one before (one commit)."""
        old_status, old_state, old_task = self.state.get(job, (S.PENDING, St.WAITING, 0))
        record = EventRecord(
            event_id=len(self.events) + 1,
            job_id=job,
            task_id=old_task if task is None else task,
            status=old_status if status is None else status,
            schedule_state=old_state if state is None else state,
            time=self.now if same_transaction else self.tick(),
            message=message,
            epoch=epoch,
        )
        self.events.append(record)
        self.state[job] = (record.status, record.schedule_state, record.task_id)
        return record

    # --- the scheduler's own events (epoch 0, but a held job's moves carry its epoch) -------

    def submit(self, job: int, tasks: int = 1) -> None:
        self.tasks[job] = tasks
        self.event(job, SUBMITTED, status=S.PENDING, state=St.WAITING, task=0)

    def admit(self, job: int, controller: str, epoch: int) -> None:
        self.epochs[job] = epoch
        self.event(job, f"{ADMITTED_ON}{controller}", state=St.LAUNCHING, epoch=epoch)

    def resume(self, job: int, controller: str, epoch: int) -> None:
        self.epochs[job] = epoch
        self.event(job, f"{RESUMED_ON}{controller}", epoch=epoch)

    def expire(self, job: int, controller: str, status: S | None = None) -> None:
        state = self.state[job][1]
        self.event(
            job,
            LEASE_EXPIRED.format(controller),
            status=status,
            state=St.ALIVE if state == St.LAUNCHING else state,
            epoch=self.epochs[job],
        )

    def slot(
        self, job: int, message: str, state: St, epoch: int | None = None, status: S | None = None
    ) -> None:
        """A move of the job's launch slot, with its epoch (the current one by default)."""
        epoch = self.epochs[job] if epoch is None else epoch
        self.event(job, message, state=state, epoch=epoch, status=status)

    def slot_released(self, job: int) -> None:
        self.slot(job, "launched", St.ALIVE)

    def cancel(self, job: int, message: str = CANCEL_REQUESTED, **fields: object) -> None:
        """A cancel the client sent and the server answered, and its event."""
        self.cancels_sent.add(job)
        self.cancels_answered.add(job)
        self.event(job, message, **fields)  # type: ignore[arg-type]

    def cancel_unstarted(self, job: int, tasks: int = 1) -> None:
        """Cancelled before start: in one transaction, an event for each later task, then
        the end naming task 0."""
        self.cancels_sent.add(job)
        self.cancels_answered.add(job)
        self.end_unstarted(job, S.CANCELLED, CANCELLED_BEFORE_START, tasks)

    def end_unstarted(self, job: int, first: S, message: str, tasks: int = 1) -> None:
        """The scheduler ends a job no replica took: its first task `first`, the others
        CANCELLED, each with its event, then the end, all in one transaction."""
        for task in range(1, tasks):
            self.event(job, message, status=S.CANCELLED, task=task, same_transaction=task > 1)
        self.event(job, message, status=first, state=St.DONE, task=0, same_transaction=tasks > 1)

    # --- a replica's reports --------------------------------------------------------------

    def report(self, job: int, status: S, epoch: int, task: int = 0, message: str = "") -> None:
        self.event(job, message or status.name, status=status, task=task, epoch=epoch)

    def done(self, job: int, epoch: int, cancelled: Sequence[int] = ()) -> None:
        """The job's end; before it, in its transaction, an event for each task of
        `cancelled` it ends."""
        status, _, task = self.state[job]
        for n, other in enumerate(cancelled):
            self.event(
                job, "done", status=S.CANCELLED, task=other, epoch=epoch, same_transaction=n > 0
            )
        self.event(
            job, "done", status=status, state=St.DONE, task=task, epoch=epoch,
            same_transaction=bool(cancelled),
        )  # fmt: skip

    # --- the cloud ------------------------------------------------------------------------

    def launch(self, job: int, epoch: int, task: int = 0) -> int:
        cluster_id = len(self.clusters) + 1
        self.clusters[cluster_id] = ClusterRecord(
            cluster_id=cluster_id,
            name=f"mj-{job}-{task}",
            job_id=job,
            task_id=task,
            epoch=epoch,
            launch_time=self.tick(0.5),
        )
        return cluster_id

    def update(self, cluster_id: int, **fields: object) -> None:
        self.clusters[cluster_id] = dataclasses.replace(self.clusters[cluster_id], **fields)  # type: ignore[arg-type]

    def finish_run(self, cluster_id: int, exit_code: int = 0) -> None:
        self.update(cluster_id, task_end_time=self.tick(0.5), exit_code=exit_code)

    def preempt(self, cluster_id: int) -> None:
        self.update(cluster_id, preempt_time=self.tick(0.5))

    def call(self, cluster_id: int, kind: str, epoch: int) -> None:
        """A terminate, stop or notice the cloud let through, kept with its epoch."""
        c = self.clusters[cluster_id]
        self.update(cluster_id, calls=(*c.calls, CallRecord(kind, epoch, self.tick(0.5))))

    def terminate(self, cluster_id: int, epoch: int | None = None) -> None:
        """Terminated by the holder (at the cluster's epoch, by default), with its call."""
        self.call(
            cluster_id, "terminate", self.clusters[cluster_id].epoch if epoch is None else epoch
        )
        self.update(cluster_id, terminate_time=self.tick(0.5))

    # --- whole lives ----------------------------------------------------------------------

    def succeed(self, job: int, controller: str = "controller-1", epoch: int = 1) -> int:
        """Submitted, admitted, launched, run and torn down: the plain good job."""
        self.submit(job)
        self.admit(job, controller, epoch)
        self.report(job, S.STARTING, epoch)
        cluster = self.launch(job, epoch)
        self.report(job, S.RUNNING, epoch)
        self.slot_released(job)
        self.finish_run(cluster)
        self.report(job, S.SUCCEEDED, epoch)
        self.terminate(cluster)
        self.done(job, epoch)
        return cluster

    def history(self, **fields: object) -> History:
        """The run's record, with the client's (every job's tasks, its cancels)."""
        record: dict[str, object] = {
            "tasks": dict(self.tasks),
            "cancels": ClientCancels(set(self.cancels_sent), set(self.cancels_answered)),
            **fields,
        }
        return History(events=list(self.events), clusters=list(self.clusters.values()), **record)  # type: ignore[arg-type]


def recovered_job(run: Run, job: int) -> None:
    """Admitted on controller-1, which dies while launching; controller-2 recovers the job."""
    run.submit(job)
    run.admit(job, "controller-1", 1)
    run.report(job, S.STARTING, 1)
    first = run.launch(job, 1)
    run.expire(job, "controller-1", status=S.RECOVERING)  # STARTING becomes RECOVERING
    run.resume(job, "controller-2", 2)
    run.terminate(first, epoch=2)  # the new holder tears down what the old one launched
    run.slot(job, "launch slot requested", St.ALIVE_WAITING)
    run.slot(job, "launch slot granted", St.LAUNCHING)
    second = run.launch(job, 2)
    run.report(job, S.RUNNING, 2, message="recovery 1: running")
    run.slot_released(job)
    run.preempt(second)
    run.report(job, S.RECOVERING, 2)
    run.terminate(second)
    third = run.launch(job, 2)
    run.report(job, S.RUNNING, 2)
    run.finish_run(third)
    run.report(job, S.SUCCEEDED, 2)
    run.terminate(third)
    run.done(job, 2)


def cancelled_job(run: Run, job: int) -> None:
    run.submit(job)
    run.admit(job, "controller-1", 1)
    run.report(job, S.STARTING, 1)
    cluster = run.launch(job, 1)
    run.report(job, S.RUNNING, 1)
    run.slot_released(job)
    run.cancel(job)
    run.report(job, S.CANCELLING, 1, message=CANCEL_REQUESTED)
    run.call(cluster, "stop", 1)
    run.terminate(cluster)
    run.report(job, S.CANCELLED, 1)
    run.done(job, 1)


def chain_job(run: Run, job: int) -> None:
    """Two tasks: the first succeeds, the second fails, nothing more runs."""
    run.submit(job, tasks=2)
    run.admit(job, "controller-3", 1)
    for task, outcome in ((0, S.SUCCEEDED), (1, S.FAILED)):
        run.report(job, S.STARTING, 1, task=task)
        cluster = run.launch(job, 1, task=task)
        run.report(job, S.RUNNING, 1, task=task)
        run.finish_run(cluster, exit_code=0 if outcome == S.SUCCEEDED else 3)
        run.report(job, outcome, 1, task=task)
        run.terminate(cluster)
    run.done(job, 1)


def good_run() -> Run:
    run = Run()
    run.succeed(1)
    recovered_job(run, 2)
    cancelled_job(run, 3)
    run.submit(4)
    run.cancel_unstarted(4)
    chain_job(run, 5)
    # A cancel of a job whose task already succeeded (its teardown under way) changes nothing.
    run.submit(6)
    run.admit(6, "controller-2", 1)
    run.report(6, S.STARTING, 1)
    cluster = run.launch(6, 1)
    run.report(6, S.RUNNING, 1)
    run.finish_run(cluster)
    run.report(6, S.SUCCEEDED, 1)
    run.cancel(6)
    run.terminate(cluster)
    run.done(6, 1)
    return run


def only(violations: list[Violation], kind: Kind, job_id: int | None) -> Violation:
    assert [(v.kind, v.job_id) for v in violations] == [(kind, job_id)], describe(violations)
    return violations[0]


def test_a_good_history_passes() -> None:
    run = good_run()
    snapshot = CounterSnapshot(
        "the end",
        {"launching": 0, "alive": 0, "waiting": 0, "alive_waiting": 0, "controller-1.alive": 0},
        {(None, St.DONE): 6},
    )
    history = run.history(job_ids=[1, 2, 3, 4, 5, 6], cloud=CloudCounters(), counters=[snapshot])
    assert check(history) == []
    assert set(counts([]).values()) == {0} and set(counts([])) == {k.value for k in Kind}


# --- terminal_status ------------------------------------------------------------------------


def test_a_job_that_never_ends_is_reported() -> None:
    run = good_run()
    run.submit(7)
    run.admit(7, "controller-1", 1)
    run.report(7, S.STARTING, 1)
    v = only(check(run.history()), Kind.TERMINAL_STATUS, 7)
    assert "never DONE" in v.evidence and "STARTING" in v.evidence


def test_a_job_done_twice_is_reported() -> None:
    run = good_run()
    run.succeed(7)
    run.done(7, 1)
    v = only(check(run.history()), Kind.TERMINAL_STATUS, 7)
    assert "1 events after its end" in v.evidence and "'done'" in v.evidence


def test_a_changed_terminal_status_is_reported() -> None:
    run = good_run()
    run.submit(7)
    run.admit(7, "controller-1", 1)
    run.report(7, S.STARTING, 1)
    cluster = run.launch(7, 1)
    run.report(7, S.RUNNING, 1)
    run.finish_run(cluster, exit_code=1)
    run.report(7, S.FAILED, 1)
    run.terminate(cluster)
    run.report(7, S.CANCELLED, 1)
    run.done(7, 1)
    v = only(check(run.history()), Kind.TERMINAL_STATUS, 7)
    assert v.task_id == 0 and "FAILED" in v.evidence and "became CANCELLED" in v.evidence


def test_a_task_left_unfinished_at_the_end_is_reported() -> None:
    run = good_run()
    run.submit(7, tasks=2)
    run.admit(7, "controller-1", 1)
    run.report(7, S.STARTING, 1, task=0)
    cluster = run.launch(7, 1, task=0)
    run.report(7, S.RUNNING, 1, task=0)
    run.report(7, S.RUNNING, 1, task=1)  # the second task started too
    run.report(7, S.CANCELLED, 1, task=0)
    run.terminate(cluster)
    run.done(7, 1)
    v = only(check(run.history()), Kind.TERMINAL_STATUS, 7)
    assert v.task_id == 1 and "with the task RUNNING" in v.evidence


def test_a_chain_that_ends_succeeded_before_its_last_task_ran_is_reported() -> None:
    """Only the client's record says the job has three tasks: by the log alone, two
    successes look like all of them."""
    run = good_run()
    run.submit(7, tasks=3)
    run.admit(7, "controller-1", 1)
    for task in (0, 1):
        run.report(7, S.STARTING, 1, task=task)
        cluster = run.launch(7, 1, task=task)
        run.report(7, S.RUNNING, 1, task=task)
        run.finish_run(cluster)
        run.report(7, S.SUCCEEDED, 1, task=task)
        run.terminate(cluster)
    run.done(7, 1)
    v = only(check(run.history()), Kind.TERMINAL_STATUS, 7)
    assert "of its 3 tasks [2] never succeeded" in v.evidence
    assert check(run.history(tasks=None)) == []


def test_an_event_of_a_task_the_job_does_not_have_is_reported() -> None:
    run = good_run()
    run.submit(7)
    run.admit(7, "controller-1", 1)
    run.report(7, S.STARTING, 1)
    run.report(7, S.FAILED_PRECHECKS, 1)
    run.report(7, S.CANCELLED, 1, task=1, message="a task it does not have")
    run.done(7, 1)
    v = only(check(run.history()), Kind.LOG_CONTRACT, 7)
    assert "names tasks [1] of a job submitted with 1" in v.evidence


def test_a_chains_end_has_an_event_for_each_task_it_ends() -> None:
    """Cancelled before start, or ended by its first task's failure: each later task's
    CANCELLED is an event of its own before the end, and is judged like any other."""
    run = good_run()
    run.submit(7, tasks=3)
    run.cancel_unstarted(7, tasks=3)
    for job, tasks, ended in ((8, 3, [1, 2]), (9, 2, [0, 1])):
        run.submit(job, tasks=tasks)
        run.admit(job, "controller-1", 1)
        run.report(job, S.STARTING, 1)
        cluster = run.launch(job, 1)
        run.report(job, S.RUNNING, 1)
        run.finish_run(cluster, exit_code=1)
        run.report(job, S.FAILED, 1)
        run.terminate(cluster)
        run.done(job, 1, cancelled=ended)  # job 9's end wrongly cancels its failed task
    v = only(check(run.history()), Kind.TERMINAL_STATUS, 9)
    assert v.task_id == 0 and "FAILED" in v.evidence and "became CANCELLED" in v.evidence


def test_a_lost_submission_is_reported() -> None:
    v = only(check(good_run().history(job_ids=[1, 2, 3, 4, 5, 6, 99])), Kind.TERMINAL_STATUS, 99)
    assert "no event at all" in v.evidence


# --- cancel_not_honoured --------------------------------------------------------------------


def test_a_cancel_accepted_while_running_must_end_cancelled() -> None:
    run = good_run()
    run.submit(7)
    run.admit(7, "controller-1", 1)
    run.report(7, S.STARTING, 1)
    cluster = run.launch(7, 1)
    run.report(7, S.RUNNING, 1)
    run.cancel(7)
    run.finish_run(cluster)
    run.report(7, S.SUCCEEDED, 1)
    run.terminate(cluster)
    run.done(7, 1)
    v = only(check(run.history()), Kind.CANCEL_NOT_HONOURED, 7)
    assert "cancel accepted at event" in v.evidence and "ended SUCCEEDED" in v.evidence


def test_a_cancel_may_end_failed_controller_only_when_cleanup_failed() -> None:
    def cancelled_then(message: str) -> list[Violation]:
        run = good_run()
        run.submit(7)
        run.admit(7, "controller-1", 1)
        run.report(7, S.STARTING, 1)
        run.launch(7, 1)
        run.report(7, S.RUNNING, 1)
        run.cancel(7)
        run.report(7, S.CANCELLING, 1, message=CANCEL_REQUESTED)
        run.report(7, S.FAILED_CONTROLLER, 1, message=message)
        run.done(7, 1)
        # The cluster the failed cleanup left is beside the point here.
        return check(run.history(), kinds=set(Kind) - {Kind.CLUSTER_LEFT})

    assert cancelled_then("cleanup failed: cluster mj-7-0 could not be terminated") == []
    found = cancelled_then("controller error: KeyError('x')")
    assert sorted(v.kind for v in found) == [Kind.CANCEL_NOT_HONOURED, Kind.CONTROLLER_FAILED]


# --- cancel_record --------------------------------------------------------------------------


def test_a_cancel_the_server_answered_but_the_log_does_not_show_is_reported() -> None:
    """The scheduler wrote its cancel in other words: the log shows no accepted cancel,
    and the job that was running on ends SUCCEEDED as if never cancelled. The client
    knows it was answered."""
    run = good_run()
    run.submit(7)
    run.admit(7, "controller-1", 1)
    run.report(7, S.STARTING, 1)
    cluster = run.launch(7, 1)
    run.report(7, S.RUNNING, 1)
    run.cancel(7, message="cancellation requested")
    run.finish_run(cluster)
    run.report(7, S.SUCCEEDED, 1)
    run.terminate(cluster)
    run.done(7, 1)
    v = only(check(run.history()), Kind.CANCEL_RECORD, 7)
    assert "the server answered its cancel, yet the log has no cancel event" in v.evidence
    assert check(run.history(cancels=None)) == []


def test_a_cancel_nobody_sent_is_reported() -> None:
    run = good_run()
    cancelled_job(run, 7)
    run.cancels_sent.discard(7)
    v = only(check(run.history()), Kind.CANCEL_RECORD, 7)
    assert "the client never asked to cancel the job" in v.evidence
    everything = ClientCancels(run.cancels_sent, run.cancels_answered, everything=True)
    assert check(run.history(cancels=everything)) == []


# --- rerun_after_success --------------------------------------------------------------------


def test_a_task_running_again_after_it_succeeded_is_reported() -> None:
    run = good_run()
    cluster = run.succeed(7)
    run.events.pop()  # not done yet: the task is watched again
    run.state[7] = (S.SUCCEEDED, St.ALIVE, 0)
    run.report(7, S.RUNNING, 1, message="resumed; watching mj-7-0")
    run.report(7, S.SUCCEEDED, 1)
    run.done(7, 1)
    v = only(check(run.history()), Kind.RERUN_AFTER_SUCCESS, 7)
    assert v.task_id == 0 and "after it SUCCEEDED" in v.evidence
    assert run.clusters[cluster].terminate_time is not None


def test_a_cluster_launched_after_the_success_event_is_reported() -> None:
    run = good_run()
    run.submit(7)
    run.admit(7, "controller-1", 1)
    run.report(7, S.STARTING, 1)
    cluster = run.launch(7, 1)
    run.report(7, S.RUNNING, 1)
    run.report(7, S.SUCCEEDED, 1)  # the cloud did not record the run's end
    run.terminate(cluster)
    late = run.launch(7, 1)
    run.terminate(late)
    run.done(7, 1)
    v = only(check(run.history()), Kind.RERUN_AFTER_SUCCESS, 7)
    assert f"mj-7-0#{late}" in v.evidence and "SUCCEEDED event" in v.evidence


def test_a_finished_run_whose_cluster_vanished_and_was_relaunched_is_reported() -> None:
    """The run ended with exit 0, then the cluster was preempted; the controller took it
    for a preemption and ran the task again: the log alone looks like a recovery."""
    run = good_run()
    run.submit(7)
    run.admit(7, "controller-1", 1)
    run.report(7, S.STARTING, 1)
    first = run.launch(7, 1)
    run.report(7, S.RUNNING, 1)
    run.finish_run(first)
    run.preempt(first)
    run.report(7, S.RECOVERING, 1)
    run.terminate(first)
    second = run.launch(7, 1)
    run.report(7, S.RUNNING, 1)
    run.finish_run(second)
    run.report(7, S.SUCCEEDED, 1)
    run.terminate(second)
    run.done(7, 1)
    v = only(check(run.history()), Kind.RERUN_AFTER_SUCCESS, 7)
    assert f"mj-7-0#{second}" in v.evidence and f"mj-7-0#{first} ended its run" in v.evidence


# --- overlapping_clusters -------------------------------------------------------------------


def test_two_live_clusters_of_one_task_are_reported() -> None:
    run = good_run()
    run.submit(7)
    run.admit(7, "controller-1", 1)
    run.report(7, S.STARTING, 1)
    first = run.launch(7, 1)
    second = run.launch(7, 1)
    run.report(7, S.RUNNING, 1)
    run.terminate(first)
    run.report(7, S.CANCELLED, 1)
    run.terminate(second)
    run.done(7, 1)
    v = only(check(run.history()), Kind.OVERLAPPING_CLUSTERS, 7)
    assert f"#{second}" in v.evidence and f"while cluster mj-7-0#{first}" in v.evidence


def test_a_launch_that_replaced_a_live_cluster_is_reported() -> None:
    run = good_run()
    run.submit(7)
    run.admit(7, "controller-1", 1)
    run.report(7, S.STARTING, 1)
    first = run.launch(7, 1)
    second = run.launch(7, 1)
    # The cloud ended the first at the very instant of the second launch.
    run.update(first, terminate_time=run.clusters[second].launch_time, replaced=True)
    run.report(7, S.RUNNING, 1)
    run.report(7, S.CANCELLED, 1)
    run.terminate(second)
    run.done(7, 1)
    v = only(check(run.history()), Kind.OVERLAPPING_CLUSTERS, 7)
    assert "replaced" in v.evidence and f"#{first}" in v.evidence


# --- stale_report ---------------------------------------------------------------------------


def paused_holder(run: Run, job: int) -> int:
    """Admitted on controller-1 (epoch 1) and RUNNING; its lease expires; resumed on
    controller-2 at epoch 2. Returns the cluster."""
    run.submit(job)
    run.admit(job, "controller-1", 1)
    run.report(job, S.STARTING, 1)
    cluster = run.launch(job, 1)
    run.report(job, S.RUNNING, 1)
    run.slot_released(job)
    run.expire(job, "controller-1")
    return cluster


def test_a_report_with_the_previous_epoch_is_reported() -> None:
    run = good_run()
    cluster = paused_holder(run, 7)
    run.resume(7, "controller-2", 2)
    run.report(7, S.RECOVERING, 1, message="mj-7-0 was lost")  # the paused one wakes up
    run.finish_run(cluster)
    run.report(7, S.SUCCEEDED, 2)
    run.terminate(cluster, epoch=2)
    run.done(7, 2)
    v = only(check(run.history()), Kind.STALE_REPORT, 7)
    assert "epoch 1" in v.evidence and "the current assignment epoch was 2" in v.evidence


def test_a_report_between_release_and_reassignment_is_reported() -> None:
    run = good_run()
    cluster = paused_holder(run, 7)
    run.report(7, S.RUNNING, 1, message="still here")
    run.resume(7, "controller-2", 2)
    run.finish_run(cluster)
    run.report(7, S.SUCCEEDED, 2)
    run.terminate(cluster, epoch=2)
    run.done(7, 2)
    v = only(check(run.history()), Kind.STALE_REPORT, 7)
    assert "no replica held the job" in v.evidence


def test_a_slot_request_of_a_replica_that_lost_the_job_is_reported() -> None:
    """The slot's move carries the epoch it was made for: after the release, none."""
    run = good_run()
    cluster = paused_holder(run, 7)
    run.slot(7, "launch slot requested", St.ALIVE_WAITING, epoch=1)
    run.resume(7, "controller-2", 2)
    run.finish_run(cluster)
    run.report(7, S.SUCCEEDED, 2)
    run.terminate(cluster, epoch=2)
    run.done(7, 2)
    v = only(check(run.history()), Kind.STALE_REPORT, 7)
    assert "'launch slot requested'" in v.evidence and "no replica held the job" in v.evidence


def test_a_release_of_an_epoch_that_was_not_current_is_reported() -> None:
    run = good_run()
    cluster = paused_holder(run, 7)
    run.resume(7, "controller-2", 2)
    run.event(7, HANDED_BACK.format("controller-1"), epoch=1)  # the old epoch given back
    run.resume(7, "controller-3", 3)
    run.finish_run(cluster)
    run.report(7, S.SUCCEEDED, 3)
    run.terminate(cluster, epoch=3)
    run.done(7, 3)
    v = only(check(run.history()), Kind.STALE_REPORT, 7)
    assert "released epoch 1 while the current assignment epoch was 2" in v.evidence


def test_a_job_past_its_max_pending_is_ended_by_the_scheduler_without_a_violation() -> None:
    """The scheduler ends a job no replica took: its first task FAILED_NO_RESOURCE, the
    others CANCELLED (with an event each, or only the first), the job DONE at epoch 0."""
    run = good_run()
    why = f"{MAX_PENDING_EXCEEDED} while waiting for a launch slot"
    run.submit(7)
    run.end_unstarted(7, S.FAILED_NO_RESOURCE, why)
    run.submit(8, tasks=3)
    run.end_unstarted(8, S.FAILED_NO_RESOURCE, why, tasks=3)
    assert check(run.history()) == []
    # Outside the end's transaction, the same event is no rule of the scheduler's.
    run.submit(9, tasks=2)
    run.event(9, why, status=S.CANCELLED, task=1)
    run.event(9, why, status=S.FAILED_NO_RESOURCE, state=St.DONE, task=0)
    v = only(check(run.history()), Kind.STALE_SCHEDULER_WRITE, 9)
    assert v.task_id == 1 and "records the task CANCELLED" in v.evidence


def test_a_scheduler_end_of_a_job_a_replica_holds_is_reported() -> None:
    run = good_run()
    run.submit(7)
    run.admit(7, "controller-1", 1)
    run.report(7, S.STARTING, 1)
    why = f"{MAX_PENDING_EXCEEDED} while waiting for a launch slot"
    run.event(7, why, status=S.FAILED_NO_RESOURCE, state=St.DONE)
    v = only(check(run.history()), Kind.STALE_SCHEDULER_WRITE, 7)
    assert "records the task FAILED_NO_RESOURCE, but the log had made it STARTING" in v.evidence


def test_a_report_after_the_end_is_reported() -> None:
    run = good_run()
    run.succeed(7)
    run.report(7, S.SUCCEEDED, 1, message="logs saved")
    v = only(check(run.history()), Kind.TERMINAL_STATUS, 7)
    assert "events after its end" in v.evidence and "'logs saved'" in v.evidence


def test_an_epoch_0_status_change_is_reported_once() -> None:
    """A release may turn STARTING into RECOVERING; a RUNNING task turned RECOVERING by
    the scheduler (a release computed from stale rows) is a write no epoch vouches for.
    The events after it echo the stale value until a report: one violation."""
    run = good_run()
    cluster = paused_holder(run, 7)
    run.events.pop()  # the release, written again from stale rows
    run.expire(7, "controller-1", status=S.RECOVERING)
    run.resume(7, "controller-2", 2)
    run.report(7, S.RUNNING, 2)
    run.finish_run(cluster)
    run.report(7, S.SUCCEEDED, 2)
    run.terminate(cluster, epoch=2)
    run.done(7, 2)
    v = only(check(run.history()), Kind.STALE_SCHEDULER_WRITE, 7)
    assert "records the task RECOVERING, but the log had made it RUNNING" in v.evidence
    assert "lease of controller-1" in v.evidence


def test_an_epoch_0_schedule_change_without_a_holder_is_reported() -> None:
    run = good_run()
    cluster = paused_holder(run, 7)
    run.event(7, "launch slot requested", state=St.ALIVE_WAITING)  # nobody holds the job
    run.resume(7, "controller-2", 2)
    run.finish_run(cluster)
    run.report(7, S.SUCCEEDED, 2)
    run.terminate(cluster, epoch=2)
    run.done(7, 2)
    v = only(check(run.history()), Kind.STALE_REPORT, 7)
    assert "while no replica held it" in v.evidence


def test_a_cancel_event_with_a_stale_status_is_reported_and_judged_by_the_log() -> None:
    """The cancel read the job before the task's SUCCEEDED committed, and recorded it
    RUNNING: by the log the job was terminal when the cancel was accepted, so ending
    SUCCEEDED honours it; the stale status itself is reported."""
    run = good_run()
    run.submit(7)
    run.admit(7, "controller-1", 1)
    run.report(7, S.STARTING, 1)
    cluster = run.launch(7, 1)
    run.report(7, S.RUNNING, 1)
    run.finish_run(cluster)
    run.report(7, S.SUCCEEDED, 1)
    run.cancel(7, status=S.RUNNING)
    run.slot(7, "launch slot requested", St.ALIVE_WAITING, status=S.SUCCEEDED)
    run.terminate(cluster)
    run.done(7, 1)
    v = only(check(run.history()), Kind.STALE_SCHEDULER_WRITE, 7)
    assert "'cancel requested'" in v.evidence


def test_a_cancel_between_the_tasks_of_a_chain_must_end_it_cancelled() -> None:
    run = good_run()
    run.submit(7, tasks=2)
    run.admit(7, "controller-1", 1)
    run.report(7, S.STARTING, 1, task=0)
    cluster = run.launch(7, 1, task=0)
    run.report(7, S.RUNNING, 1, task=0)
    run.finish_run(cluster)
    run.report(7, S.SUCCEEDED, 1, task=0)
    run.terminate(cluster)
    run.cancel(7, status=S.PENDING, task=1)
    run.report(7, S.STARTING, 1, task=1)
    second = run.launch(7, 1, task=1)
    run.report(7, S.RUNNING, 1, task=1)
    run.finish_run(second)
    run.report(7, S.SUCCEEDED, 1, task=1)
    run.terminate(second)
    run.done(7, 1)
    v = only(check(run.history()), Kind.CANCEL_NOT_HONOURED, 7)
    assert "ended SUCCEEDED" in v.evidence


# --- stale_call -----------------------------------------------------------------------------


def test_a_launch_with_the_previous_epoch_is_reported() -> None:
    run = good_run()
    cluster = paused_holder(run, 7)
    run.resume(7, "controller-2", 2)
    run.preempt(cluster)
    run.report(7, S.RECOVERING, 2)
    run.terminate(cluster, epoch=2)
    stale = run.launch(7, 1)  # the paused holder relaunches with its old epoch
    run.terminate(stale, epoch=2)
    fresh = run.launch(7, 2)
    run.report(7, S.RUNNING, 2)
    run.finish_run(fresh)
    run.report(7, S.SUCCEEDED, 2)
    run.terminate(fresh)
    run.done(7, 2)
    v = only(check(run.history()), Kind.STALE_CALL, 7)
    assert f"#{stale} (epoch 1" in v.evidence and "the assignment was epoch 2" in v.evidence


def test_a_launch_after_the_end_is_reported() -> None:
    run = good_run()
    run.submit(7)
    run.admit(7, "controller-1", 1)
    run.report(7, S.STARTING, 1)
    run.report(7, S.FAILED_PRECHECKS, 1)
    run.done(7, 1)
    late = run.launch(7, 1)
    run.terminate(late, epoch=0)  # by an operator
    v = only(check(run.history()), Kind.STALE_CALL, 7)
    assert "the job had ended" in v.evidence


@pytest.mark.parametrize("kind", ["terminate", "stop", "notice"])
def test_a_call_from_the_old_holder_of_an_adopted_cluster_is_reported(kind: str) -> None:
    """The new holder watches the cluster without launching, so the cloud's fence (the
    highest epoch launched) lets the old holder's call through; its record shows it."""
    run = good_run()
    cluster = paused_holder(run, 7)
    run.resume(7, "controller-2", 2)
    run.call(cluster, "notice", 2)  # the new holder passes a notice on
    run.call(cluster, kind, 1)  # the paused one wakes up and acts
    run.call(cluster, "notice", 0)  # an operator's
    run.finish_run(cluster)
    run.report(7, S.SUCCEEDED, 2)
    run.terminate(cluster, epoch=2)
    run.done(7, 2)
    v = only(check(run.history()), Kind.STALE_CALL, 7)
    assert f"a {kind} of cluster mj-7-0#{cluster}" in v.evidence
    assert "with epoch 1" in v.evidence and "the assignment was epoch 2" in v.evidence


@pytest.mark.parametrize(
    "field", ["stale_launches_rejected", "stale_terminates_rejected", "stale_notices_rejected"]
)
def test_calls_the_cloud_had_to_refuse_are_reported(field: str) -> None:
    cloud = CloudCounters(**{field: 2})
    v = only(check(good_run().history(cloud=cloud)), Kind.STALE_CALL, None)
    assert "refused 2" in v.evidence


# --- controller_failed, counter_drift, cluster_left, log_contract ---------------------------


def test_failed_controller_without_a_cleanup_failure_is_reported() -> None:
    run = good_run()
    run.submit(7)
    run.admit(7, "controller-1", 1)
    run.report(7, S.STARTING, 1)
    cluster = run.launch(7, 1)
    run.report(7, S.RUNNING, 1)
    run.report(7, S.FAILED_CONTROLLER, 1, message="unknown task status")
    run.terminate(cluster)
    run.done(7, 1)
    v = only(check(run.history()), Kind.CONTROLLER_FAILED, 7)
    assert "unknown task status" in v.evidence


def test_counters_that_differ_from_the_recount_are_reported() -> None:
    snapshot = CounterSnapshot(
        "quiescent",
        {"launching": 0, "alive": 3, "waiting": 0, "alive_waiting": 0, "controller-1.alive": 3},
        {("controller-1", St.ALIVE): 2, (None, St.DONE): 6},
    )
    found = check(good_run().history(counters=[snapshot]))
    assert [v.kind for v in found] == [Kind.COUNTER_DRIFT, Kind.COUNTER_DRIFT], describe(found)
    assert "alive is 3, the recount says 2" in found[0].evidence


def test_counter_corrections_are_reported() -> None:
    found = check(good_run().history(counter_corrections=2))
    assert [v.kind for v in found] == [Kind.COUNTER_DRIFT], describe(found)
    assert "corrected its counters 2 times" in found[0].evidence


def test_a_cluster_never_terminated_is_reported() -> None:
    """A preempted cluster still has to be terminated by its owner; this one never was."""
    run = good_run()
    run.submit(7)
    run.admit(7, "controller-1", 1)
    run.report(7, S.STARTING, 1)
    leaked = run.launch(7, 1)
    run.report(7, S.RUNNING, 1)
    run.preempt(leaked)
    run.cancel(7)
    run.report(7, S.CANCELLING, 1, message=CANCEL_REQUESTED)
    run.report(7, S.CANCELLED, 1)
    run.done(7, 1)
    v = only(check(run.history()), Kind.CLUSTER_LEFT, 7)
    assert f"#{leaked}" in v.evidence and "never terminated" in v.evidence


def test_a_cluster_of_an_unknown_job_is_a_leak_and_a_stale_call() -> None:
    run = good_run()
    ghost = run.launch(42, 3)
    found = check(run.history())
    assert sorted((v.kind, v.job_id) for v in found) == [
        (Kind.CLUSTER_LEFT, 42),
        (Kind.STALE_CALL, 42),
    ], describe(found)
    assert all(f"#{ghost}" in v.evidence for v in found)


def test_an_assignment_without_its_epoch_is_reported_and_the_epoch_inferred() -> None:
    run = good_run()
    cluster = paused_holder(run, 7)
    run.resume(7, "controller-2", 0)  # as logged before assignments carried their epoch
    run.report(7, S.RUNNING, 1, message="stale")
    run.finish_run(cluster)
    run.report(7, S.SUCCEEDED, 2)
    run.terminate(cluster, epoch=2)
    run.done(7, 2)
    found = check(run.history())
    assert [v.kind for v in found] == [Kind.LOG_CONTRACT, Kind.STALE_REPORT], describe(found)
    assert "taken as 2" in found[0].evidence


def test_kinds_restrict_the_answer() -> None:
    run = good_run()
    run.succeed(7)
    run.done(7, 1)
    assert check(run.history(), kinds={Kind.CLUSTER_LEFT}) == []
    assert [v.kind for v in check(run.history())] == [Kind.TERMINAL_STATUS]
    assert [v.kind for v in check(run.history(), kinds={Kind.TERMINAL_STATUS})] == [
        Kind.TERMINAL_STATUS
    ]

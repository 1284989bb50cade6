"""A Jepsen-style history checker: judges a finished run from its durable record alone.

The record is what outlives every process: the scheduler's event log (one row per
change, in id order, each with the epoch that wrote it) and the sim cloud's
inventory (every cluster ever launched, by which job, task and epoch, when it was
preempted and terminated, and every terminate, stop and notice it let through with
the caller's epoch), plus the cloud's fencing counters, snapshots of the
scheduler's counters taken at quiescent points and the corrections its reconcile
made, and what the client itself knows: how many tasks each job has, and which
cancels it sent and which the server answered. `check` reads a `History` and
returns every `Violation` it finds, each naming its job and the evidence (event
ids, cluster ids, times relative to the first record), so that a failed run can be
explained without its processes. It is pure: no I/O, no clock, no processes.

What the checker relies on (the event log's contract, contract §4, §5, §8, §9):

- a task status change reported by a replica is an event whose `status` is the
  task's new status, `task_id` the task, and `epoch` the reporting replica's
  assignment epoch (always > 0);
- an assignment of a job to a replica is an event whose message is
  `admitted on <controller>` or `resumed on <controller>` and whose epoch is the
  new assignment epoch;
- a move of a held job's launch slot (requested, granted, given back) is an event
  with the job's epoch, and its status is the task's as the move found it;
- a replica losing a job (lease expired, handed back, no longer announced) is an
  event whose message is one of `RELEASE_PREFIXES`, with the epoch released;
- an accepted cancel of a job not DONE writes `cancel requested` (or `cancelled
  before start` when no replica had taken the job), at epoch 0;
- the job's end is the (one) event with schedule state DONE, naming the task the
  job shows; just before it, in its transaction, each other task the end moved has
  an event of its own (with the end's message and epoch);
- every other event the scheduler makes (of jobs no replica holds) carries epoch 0.

Every message the checker reads meaning from is imported from the product's own
vocabulary (`services/common/event_messages.py`), never copied: renamed there, it
is renamed here. The client's record of its cancels is checked against the log's
cancel events too, so a cancel the log does not show as such is reported, whatever
its words.

The violation kinds (`Kind`) and what each one means:

- `terminal_status`: the job did not end DONE exactly once, ended in a status that
  is not terminal, left a task without a terminal status, changed a task's
  terminal status (only a later FAILED_CONTROLLER whose message says the cleanup
  failed is allowed, contract §4), or ended SUCCEEDED while one of its tasks (as
  many as the client submitted) never succeeded.
- `cancel_not_honoured`: a cancel was accepted while the job was not terminal
  (by the replicas' reports before it in the log: no task failed or was cancelled,
  and not every task of the job had succeeded) and the job ended other than
  CANCELLED. Decisions: FAILED_CONTROLLER is allowed only when an event of the
  job says the cleanup failed (contract §4: resources may have leaked). A job whose
  last task's run had already ended with exit 0 on the cloud (the inventory) when
  the cancel was accepted may end SUCCEEDED: a cancel stops work, it cannot undo
  work done, and the SUCCEEDED report was on its way.
- `cancel_record`: the client's record of its cancels and the log disagree: the
  server answered a cancel of a job whose log has no cancel event (a lost cancel,
  or one written in words the checker does not know), or the log has a cancel of a
  job the client never asked to cancel.
- `rerun_after_success`: a task ran again after it SUCCEEDED: a later STARTING,
  RUNNING or RECOVERING event of the task, or a cluster of the task launched after
  its success (the earlier of its SUCCEEDED event and a cluster of the task whose
  run ended with exit code 0 in the inventory).
- `overlapping_clusters`: two clusters of one task live at once (from launch to
  preemption or termination), or a launch that replaced a live cluster.
- `stale_report`: a replica event whose epoch is not the job's current assignment
  epoch at that point of the log (none is current between a release and the next
  assignment), a release of an epoch that was not current, or an epoch-0 event
  that moved the job's schedule state while no replica held it, other than the
  scheduler's end of a job no replica took (a cancel before start, max_pending).
- `stale_scheduler_write`: an epoch-0 event (the scheduler's own) that records a
  task status other than the one the log had reached, where no rule of the
  scheduler changes it (only a release turning STARTING into RECOVERING, and the
  end of a job no replica holds turning a PENDING task CANCELLED or
  FAILED_NO_RESOURCE, do): the scheduler wrote what it read before a report
  committed. Its table may then hold the same stale value (a lost update).
- `stale_call`: a launch, terminate, stop or notice whose epoch was not the job's
  assignment current at its time (by event times), one after the job ended, or
  any call the sim cloud had to refuse as stale: the controller's own fencing must
  stop stale calls before the cloud's fencing has to, and the cloud cannot refuse
  one at a cluster that the job's new holder adopted without launching.
- `controller_failed`: a task ended FAILED_CONTROLLER without a recorded cleanup
  failure: by contract §4, our bug.
- `counter_drift`: at a quiescent point the scheduler's counters differ from a
  recount of its jobs table, or its reconcile had to correct them at all (it
  repairs drift silently: a correction is a move committed and never counted).
- `cluster_left`: a cluster of a finished (or unknown) job was never terminated.
- `log_contract`: the log lacks what the rules above promise (an assignment event
  without its epoch, assignment epochs that do not increase, a task the job does
  not have). The checker goes on with the epoch the scheduler's rule implies (one
  more than the last), so the other checks still judge such a log.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
from collections.abc import Collection, Iterable, Mapping, Sequence

from services.common.event_messages import (
    ASSIGNMENT_PREFIXES,
    CANCEL_REQUESTED,
    CANCELLED_BEFORE_START,
    CLEANUP_FAILED,
    RELEASE_PREFIXES,
)
from services.common.statuses import ALIVE_STATES, TERMINAL, JobStatus, ScheduleState

S = JobStatus
St = ScheduleState

# --- reading meaning from the event log (the words are the product's own) -------------------

CANCEL_MESSAGES = (CANCEL_REQUESTED, CANCELLED_BEFORE_START)
# A task running again (a launch or a watch) rather than finishing.
RUN_STATUSES = frozenset({S.STARTING, S.RUNNING, S.RECOVERING})
# What the scheduler's end of a job no replica took makes of its PENDING tasks.
UNSTARTED_ENDS = frozenset({S.CANCELLED, S.FAILED_NO_RESOURCE})


def is_assignment(event: EventRecord) -> bool:
    return event.message.startswith(ASSIGNMENT_PREFIXES)


def is_release(event: EventRecord) -> bool:
    return event.message.startswith(RELEASE_PREFIXES)


def is_cancel(event: EventRecord) -> bool:
    """The scheduler's record of an accepted cancel (a replica's CANCELLING report may
    use the same words; it is not the acceptance)."""
    return event.epoch == 0 and event.message in CANCEL_MESSAGES


def is_cleanup_failure(event: EventRecord) -> bool:
    return event.message.startswith(CLEANUP_FAILED)


def assignee(event: EventRecord) -> str:
    """The controller an assignment event names."""
    for prefix in ASSIGNMENT_PREFIXES:
        if event.message.startswith(prefix):
            return event.message[len(prefix) :].strip()
    return ""


# --- the record -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class EventRecord:
    """One row of the scheduler's event log, with the epoch that wrote it."""

    event_id: int
    job_id: int
    task_id: int
    status: JobStatus
    schedule_state: ScheduleState
    time: float
    message: str
    epoch: int


@dataclasses.dataclass(frozen=True)
class CallRecord:
    """A terminate, stop or notice the sim cloud let through for a cluster."""

    kind: str  # "terminate", "stop" or "notice"
    # The caller's epoch (0: an operator, never judged).
    epoch: int
    time: float


@dataclasses.dataclass(frozen=True)
class ClusterRecord:
    """One inventory record of the sim cloud; times are Unix seconds, None when unset."""

    cluster_id: int
    name: str
    job_id: int
    task_id: int
    epoch: int
    launch_time: float
    task_end_time: float | None = None
    exit_code: int = 0
    preempt_time: float | None = None
    terminate_time: float | None = None
    replaced: bool = False
    calls: tuple[CallRecord, ...] = ()

    @property
    def end_time(self) -> float:
        """When it stopped being live (preempted or terminated); inf while live."""
        ends = [t for t in (self.preempt_time, self.terminate_time) if t is not None]
        return min(ends) if ends else math.inf

    @property
    def succeeded_at(self) -> float | None:
        """When its task's run ended with exit code 0, if it did."""
        return self.task_end_time if self.task_end_time is not None and not self.exit_code else None


@dataclasses.dataclass(frozen=True)
class CloudCounters:
    """The sim cloud's counters that only it can see (GetCloudState)."""

    stale_launches_rejected: int = 0
    stale_terminates_rejected: int = 0
    stale_notices_rejected: int = 0
    unterminated_clusters: int = 0


@dataclasses.dataclass(frozen=True)
class CounterSnapshot:
    """The scheduler's counters and a recount of its jobs table, read at one quiescent point.

    `reported` holds `launching`, `alive`, `waiting`, `alive_waiting` and, per
    replica, `<controller>.launching` and `<controller>.alive` (GetSchedulerState);
    `recount` is jobs per (controller, schedule state) from the jobs table.
    """

    label: str
    reported: Mapping[str, int]
    recount: Mapping[tuple[str | None, ScheduleState], int]


@dataclasses.dataclass(frozen=True)
class ClientCancels:
    """The client's own record of its cancels: the jobs it asked to cancel, and those the
    server's answers named as cancelled (every one of which the log must show).
    `everything`: it also cancelled by name or all of a user's jobs, so a cancel event of a
    job it never named is no surprise."""

    sent: Collection[int] = ()
    answered: Collection[int] = ()
    everything: bool = False


@dataclasses.dataclass(frozen=True)
class History:
    """Everything a finished run left behind.

    `job_ids`: the jobs that must be judged (those submitted); by default, every
    job in the log. A job submitted but absent from the log is a lost submission.
    `tasks`: how many tasks each job was submitted with (the client's record); by
    default, as many as its log names. `counter_corrections`: how many counter
    differences the scheduler's reconcile found and fixed during the run (every
    life of it, summed). `cancels`: the client's record of its cancels, when it kept one.
    """

    events: Sequence[EventRecord]
    clusters: Sequence[ClusterRecord] = ()
    job_ids: Collection[int] | None = None
    cloud: CloudCounters | None = None
    counters: Sequence[CounterSnapshot] = ()
    tasks: Mapping[int, int] | None = None
    counter_corrections: int = 0
    cancels: ClientCancels | None = None


class Kind(enum.StrEnum):
    TERMINAL_STATUS = "terminal_status"
    CANCEL_NOT_HONOURED = "cancel_not_honoured"
    CANCEL_RECORD = "cancel_record"
    RERUN_AFTER_SUCCESS = "rerun_after_success"
    OVERLAPPING_CLUSTERS = "overlapping_clusters"
    STALE_REPORT = "stale_report"
    STALE_SCHEDULER_WRITE = "stale_scheduler_write"
    STALE_CALL = "stale_call"
    CONTROLLER_FAILED = "controller_failed"
    COUNTER_DRIFT = "counter_drift"
    CLUSTER_LEFT = "cluster_left"
    LOG_CONTRACT = "log_contract"


@dataclasses.dataclass(frozen=True)
class Violation:
    kind: Kind
    job_id: int | None
    evidence: str
    task_id: int | None = None

    def __str__(self) -> str:
        where = "" if self.job_id is None else f" job {self.job_id}"
        if self.task_id is not None:
            where += f" task {self.task_id}"
        return f"[{self.kind}]{where}: {self.evidence}"


def counts(violations: Iterable[Violation]) -> dict[str, int]:
    """Violations per kind, every kind present (zeros included), for a JSON line."""
    found = collections.Counter(v.kind.value for v in violations)
    return {kind.value: found[kind.value] for kind in Kind}


def describe(violations: Sequence[Violation], limit: int = 10) -> str:
    """The counts per kind, then up to `limit` violations of each kind, for a failure message."""
    by_kind: dict[Kind, list[Violation]] = collections.defaultdict(list)
    for v in violations:
        by_kind[v.kind].append(v)
    found = {k: n for k, n in counts(violations).items() if n}
    lines = [f"{len(violations)} violations: {found}"] if violations else []
    for kind in Kind:
        some = by_kind.get(kind, [])
        lines.extend(str(v) for v in some[:limit])
        if len(some) > limit:
            lines.append(f"... and {len(some) - limit} more {kind}")
    return "\n".join(lines)


# --- reading one job's log --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Holding:
    """From `event` on, the job's valid assignment epoch (None: no replica holds it)."""

    event: EventRecord
    epoch: int | None


class _Clock:
    """Times relative to the first record, so evidence reads as a story."""

    def __init__(self, history: History) -> None:
        times = [e.time for e in history.events] + [c.launch_time for c in history.clusters]
        self.origin = min(times, default=0.0)

    def __call__(self, when: float | None) -> str:
        return "never" if when is None or math.isinf(when) else f"t+{when - self.origin:.3f}s"


def _event(e: EventRecord, t: _Clock) -> str:
    return (
        f"event {e.event_id} ({e.status.name}/{e.schedule_state.name} epoch {e.epoch} "
        f"at {t(e.time)}: {e.message!r})"
    )


def _holder(current: int | None) -> str:
    if current is None:
        return "no replica held the job"
    return f"the current assignment epoch was {current}"


def _cluster(c: ClusterRecord, t: _Clock) -> str:
    return f"cluster {c.name}#{c.cluster_id} (epoch {c.epoch}, launched {t(c.launch_time)})"


class JobLog:
    """One job's events in log order, read once: who held it when, and where it ended."""

    def __init__(
        self, job_id: int, events: Sequence[EventRecord], t: _Clock, num_tasks: int | None = None
    ) -> None:
        self.job_id = job_id
        self.events = list(events)
        self.end = next((e for e in self.events if e.schedule_state == St.DONE), None)
        # The end's transaction: the end and, just before it, the events of the other
        # tasks it moved (they share its time).
        self.closing = self._closing()
        # As many tasks as the client submitted, else as many as the log names.
        named = max((e.task_id for e in self.events), default=0) + 1
        self.num_tasks = num_tasks or named
        # The first accepted cancel, and whether the job was terminal then (by the log).
        self.cancel: EventRecord | None = None
        self.terminal_at_cancel = False
        self.holdings: list[Holding] = []
        self._diverged: set[int] = set()
        self.violations: list[Violation] = []
        self._read(t)

    def _closing(self) -> set[int]:
        if self.end is None:
            return set()
        ids = {self.end.event_id}
        for e in reversed([e for e in self.events if e.event_id < self.end.event_id]):
            if e.time != self.end.time:
                break
            ids.add(e.event_id)
        return ids

    def ends_unstarted(self, e: EventRecord) -> bool:
        """Whether the event is the scheduler's end of the job no replica took (a cancel
        before start, max_pending): of the end's transaction, at epoch 0, recording a
        task CANCELLED or FAILED_NO_RESOURCE."""
        return e.epoch == 0 and e.event_id in self.closing and e.status in UNSTARTED_ENDS

    def carries_status(self, e: EventRecord) -> bool:
        """Whether the event's status is its task's own: a replica's report (or its job's
        end, or a move of its launch slot, made at its epoch), or the scheduler's end of a
        job no replica took. The scheduler's other events (assignments, releases, its
        epoch-0 events) echo the job's status as it read it, which
        `stale_scheduler_write` judges."""
        if e.epoch > 0:
            return not is_assignment(e) and not is_release(e)
        return self.ends_unstarted(e)

    def _read(self, t: _Clock) -> None:
        """Follows the assignment epoch and the tasks' statuses through the log, in order;
        flags writes they do not vouch for."""
        current: int | None = None
        last_epoch = 0
        # Each task's status as the replicas reported it (and the scheduler's own rules
        # changed it): what the scheduler's epoch-0 events must agree with.
        tasks: dict[int, JobStatus] = {}
        state: ScheduleState | None = None
        foreign = sorted({e.task_id for e in self.events if e.task_id >= self.num_tasks})
        if foreign:
            self._flag(
                Kind.LOG_CONTRACT,
                f"the log names tasks {foreign} of a job submitted with {self.num_tasks}",
            )
        # Events after the end are `_terminal`'s to report: the job changed after it ended.
        for e in self.events:
            if self.cancel is None and is_cancel(e):
                self.cancel = e
                self.terminal_at_cancel = e.status in TERMINAL or self._terminal(tasks)
            if is_assignment(e):
                epoch = e.epoch
                if epoch == 0:
                    epoch = last_epoch + 1
                    self._flag(
                        Kind.LOG_CONTRACT,
                        f"assignment {_event(e, t)} carries no epoch; taken as {epoch}",
                    )
                elif epoch <= last_epoch:
                    self._flag(
                        Kind.LOG_CONTRACT,
                        f"assignment {_event(e, t)} does not raise the epoch above {last_epoch}",
                    )
                last_epoch = max(last_epoch, epoch)
                current = epoch
                self.holdings.append(Holding(e, epoch))
            elif is_release(e):
                if e.epoch and e.epoch != current:
                    self._flag(
                        Kind.STALE_REPORT,
                        f"{_event(e, t)} released epoch {e.epoch} while " + _holder(current),
                        e,
                    )
                current = None
                self.holdings.append(Holding(e, None))
            elif e.epoch > 0:
                if e.epoch != current:
                    self._flag(
                        Kind.STALE_REPORT, f"{_event(e, t)} accepted while {_holder(current)}", e
                    )
                tasks[e.task_id] = e.status
                self._diverged.discard(e.task_id)
            if e.epoch == 0 or is_assignment(e) or is_release(e):
                self._check_scheduler_event(e, tasks, state, current, t)
            if e is self.end:
                self.holdings.append(Holding(e, None))
                return
            state = e.schedule_state

    def _terminal(self, tasks: Mapping[int, JobStatus]) -> bool:
        """Whether the job was terminal with these task statuses: a task failed or was
        cancelled, or every task of the job succeeded."""
        if any(s in TERMINAL and s != S.SUCCEEDED for s in tasks.values()):
            return True
        return all(tasks.get(task) == S.SUCCEEDED for task in range(self.num_tasks))

    def _check_scheduler_event(
        self,
        e: EventRecord,
        tasks: dict[int, JobStatus],
        state: ScheduleState | None,
        current: int | None,
        t: _Clock,
    ) -> None:
        """An epoch-0 event may change a status only where the scheduler does so itself:
        a release turns STARTING into RECOVERING, and the end of a job no replica holds
        turns its PENDING tasks CANCELLED or FAILED_NO_RESOURCE."""
        before = tasks.get(e.task_id, S.PENDING)
        unstarted_end = self.ends_unstarted(e) and current is None
        if e.status != before and state is not None:
            if (unstarted_end and before == S.PENDING) or (
                is_release(e) and before == S.STARTING and e.status == S.RECOVERING
            ):
                tasks[e.task_id] = e.status
            elif e.task_id not in self._diverged:
                # Flagged once: later events may echo the same stale value until a report.
                self._diverged.add(e.task_id)
                self._flag(
                    Kind.STALE_SCHEDULER_WRITE,
                    f"{_event(e, t)} records the task {e.status.name}, but the log had made it "
                    f"{before.name}: the scheduler wrote what it read before that committed",
                    e,
                )
        moved = state is not None and e.schedule_state != state
        if moved and current is None and not (unstarted_end or is_release(e)):
            self._flag(
                Kind.STALE_REPORT,
                f"{_event(e, t)} moved the job from {state.name} while no replica held it",
                e,
            )

    def _flag(self, kind: Kind, evidence: str, e: EventRecord | None = None) -> None:
        task = e.task_id if e is not None else None
        self.violations.append(Violation(kind, self.job_id, evidence, task))

    def holding_at(self, when: float) -> Holding | None:
        """The last assignment, release or end whose event time is at or before `when`."""
        found = None
        for holding in self.holdings:
            if holding.event.time <= when:
                found = holding
        return found

    def task_events(self) -> dict[int, list[EventRecord]]:
        """Each task's status-bearing events (`carries_status`), in log order."""
        by_task: dict[int, list[EventRecord]] = collections.defaultdict(list)
        for e in self.events:
            if self.carries_status(e):
                by_task[e.task_id].append(e)
        return by_task

    @property
    def cleanup_failed(self) -> bool:
        return any(is_cleanup_failure(e) for e in self.events)


# --- the checks -------------------------------------------------------------------------------


def _terminal(job: JobLog, t: _Clock) -> list[Violation]:
    """DONE exactly once, in a terminal status; every task's terminal status kept."""
    out: list[Violation] = []

    def flag(kind: Kind, evidence: str, task_id: int | None = None) -> None:
        out.append(Violation(kind, job.job_id, evidence, task_id))

    if not job.events:
        flag(Kind.TERMINAL_STATUS, "no event at all: the submission is not in the log")
        return out
    end = job.end
    if end is None:
        flag(Kind.TERMINAL_STATUS, f"never DONE; last {_event(job.events[-1], t)}")
    else:
        after = [e for e in job.events if e.event_id > end.event_id]
        if after:
            flag(
                Kind.TERMINAL_STATUS,
                f"{len(after)} events after its end ({_event(end, t)}), the first "
                f"{_event(after[0], t)}",
            )
        if end.status not in TERMINAL:
            flag(
                Kind.TERMINAL_STATUS, f"ended in {end.status.name}, not terminal: {_event(end, t)}"
            )
        if end.status == S.SUCCEEDED:
            succeeded = {
                e.task_id
                for e in job.events
                if e.event_id <= end.event_id and job.carries_status(e) and e.status == S.SUCCEEDED
            }
            missing = [task for task in range(job.num_tasks) if task not in succeeded]
            if missing:
                flag(
                    Kind.TERMINAL_STATUS,
                    f"ended SUCCEEDED ({_event(end, t)}), yet of its {job.num_tasks} tasks "
                    f"{missing} never succeeded",
                )
    for task_id, events in sorted(job.task_events().items()):
        first: EventRecord | None = None
        for e in events:
            if first is None:
                if e.status in TERMINAL:
                    first = e
                continue
            if e.status == first.status:
                continue
            if e.status == S.FAILED_CONTROLLER and is_cleanup_failure(e):
                first = e
                continue
            if first.status == S.SUCCEEDED and e.status in RUN_STATUSES:
                flag(
                    Kind.RERUN_AFTER_SUCCESS,
                    f"{_event(e, t)} after it SUCCEEDED at {_event(first, t)}",
                    task_id,
                )
            else:
                flag(
                    Kind.TERMINAL_STATUS,
                    f"terminal {first.status.name} ({_event(first, t)}) became "
                    f"{e.status.name} ({_event(e, t)})",
                    task_id,
                )
            break
        if end is not None:
            until_end = [e for e in events if e.event_id <= end.event_id]
            last = until_end[-1] if until_end else None
            if last is not None and last.status not in TERMINAL:
                flag(
                    Kind.TERMINAL_STATUS,
                    f"the job ended ({_event(end, t)}) with the task {last.status.name} "
                    f"(last {_event(last, t)})",
                    task_id,
                )
            failed = next((e for e in until_end if e.status == S.FAILED_CONTROLLER), None)
            if failed is not None and not job.cleanup_failed:
                flag(
                    Kind.CONTROLLER_FAILED,
                    "ended FAILED_CONTROLLER with no cleanup failure recorded: "
                    + _event(failed, t),
                    task_id,
                )
    return out


def _cancel(job: JobLog, clusters: Sequence[ClusterRecord], t: _Clock) -> list[Violation]:
    """A cancel accepted while the job was not terminal ends it CANCELLED.

    Unless the work was already done: a job whose last task's run had ended with
    exit 0 (by the cloud's inventory) before the cancel was accepted may end
    SUCCEEDED, its report having been on its way.
    """
    accepted = job.cancel
    if job.end is None or accepted is None or accepted.event_id > job.end.event_id:
        return []  # `_terminal` reports a job that never ended
    if job.terminal_at_cancel and accepted.message != CANCELLED_BEFORE_START:
        return []
    final = job.end.status
    if final == S.CANCELLED or (final == S.FAILED_CONTROLLER and job.cleanup_failed):
        return []
    if final == S.SUCCEEDED:
        last = job.num_tasks - 1
        done = [c.succeeded_at for c in clusters if c.task_id == last and c.succeeded_at]
        if done and min(done) <= accepted.time:
            return []
    return [
        Violation(
            Kind.CANCEL_NOT_HONOURED,
            job.job_id,
            f"cancel accepted at {_event(accepted, t)}, yet the job ended {final.name} "
            f"at {_event(job.end, t)}",
        )
    ]


def _successes(job: JobLog, clusters: Sequence[ClusterRecord]) -> dict[int, tuple[float, str]]:
    """task -> (when it first succeeded, what says so), from the log and the inventory."""
    out: dict[int, tuple[float, str]] = {}

    def offer(task_id: int, when: float, what: str) -> None:
        if task_id not in out or when < out[task_id][0]:
            out[task_id] = (when, what)

    for e in job.events:
        if e.status == S.SUCCEEDED and e.epoch > 0:
            offer(e.task_id, e.time, f"its SUCCEEDED event {e.event_id}")
    for c in clusters:
        if c.succeeded_at is not None:
            offer(c.task_id, c.succeeded_at, f"{c.name}#{c.cluster_id} ended its run with exit 0")
    return out


def _reruns(job: JobLog, clusters: Sequence[ClusterRecord], t: _Clock) -> list[Violation]:
    """No cluster of a task launched after the task succeeded."""
    successes = _successes(job, clusters)
    out: list[Violation] = []
    for c in clusters:
        success = successes.get(c.task_id)
        if success is not None and c.launch_time > success[0]:
            out.append(
                Violation(
                    Kind.RERUN_AFTER_SUCCESS,
                    job.job_id,
                    f"{_cluster(c, t)} launched after the task succeeded at {t(success[0])} "
                    f"({success[1]})",
                    c.task_id,
                )
            )
    return out


def _overlaps(clusters: Sequence[ClusterRecord], t: _Clock) -> list[Violation]:
    """No two clusters of one (job, task) live at once; no launch replacing a live one."""
    by_task: dict[tuple[int, int], list[ClusterRecord]] = collections.defaultdict(list)
    for c in clusters:
        by_task[(c.job_id, c.task_id)].append(c)
    out: list[Violation] = []
    for (job_id, task_id), group in sorted(by_task.items()):
        live: ClusterRecord | None = None
        for c in sorted(group, key=lambda c: (c.launch_time, c.cluster_id)):
            if live is not None and live.end_time > c.launch_time:
                out.append(
                    Violation(
                        Kind.OVERLAPPING_CLUSTERS,
                        job_id,
                        f"{_cluster(c, t)} launched while {_cluster(live, t)} was live "
                        f"(until {t(live.end_time)})",
                        task_id,
                    )
                )
            elif c.replaced:
                out.append(
                    Violation(
                        Kind.OVERLAPPING_CLUSTERS,
                        job_id,
                        f"{_cluster(c, t)} was still live when a new launch of its name "
                        f"replaced it at {t(c.terminate_time)}",
                        task_id,
                    )
                )
            if live is None or c.end_time > live.end_time:
                live = c
    return out


def _stale_calls(job: JobLog, clusters: Sequence[ClusterRecord], t: _Clock) -> list[Violation]:
    """Every launch, terminate, stop and notice made with the assignment epoch current at
    its time (an operator's, at epoch 0, excepted)."""
    out: list[Violation] = []

    def judge(epoch: int, when: float, what: str, task_id: int) -> None:
        holding = job.holding_at(when)
        if holding is not None and holding.epoch == epoch:
            return
        if holding is None:
            why = "no assignment had been made yet"
        elif holding.event is job.end:
            why = f"the job had ended at {_event(holding.event, t)}"
        elif holding.epoch is None:
            why = f"no replica held the job since {_event(holding.event, t)}"
        else:
            why = f"the assignment was epoch {holding.epoch} since {_event(holding.event, t)}"
        out.append(Violation(Kind.STALE_CALL, job.job_id, f"{what} while {why}", task_id))

    for c in clusters:
        judge(c.epoch, c.launch_time, _cluster(c, t), c.task_id)
        for call in c.calls:
            if call.epoch:
                what = (
                    f"a {call.kind} of {_cluster(c, t)} with epoch {call.epoch} at {t(call.time)}"
                )
                judge(call.epoch, call.time, what, c.task_id)
    return out


def _left(
    job: JobLog | None, job_id: int, clusters: Sequence[ClusterRecord], t: _Clock
) -> list[Violation]:
    """Once a job ended (or for a job the log does not know), none of its clusters remain."""
    if job is not None and job.end is None:
        return []
    when = "" if job is None or job.end is None else f" after the job ended at {t(job.end.time)}"
    return [
        Violation(
            Kind.CLUSTER_LEFT,
            job_id,
            f"{_cluster(c, t)} never terminated{when} (preempted {t(c.preempt_time)})",
            c.task_id,
        )
        for c in clusters
        if c.terminate_time is None
    ]


def _cloud(cloud: CloudCounters, clusters: Sequence[ClusterRecord]) -> list[Violation]:
    out: list[Violation] = []
    for what, n in (
        ("launches", cloud.stale_launches_rejected),
        ("terminates or stops", cloud.stale_terminates_rejected),
        ("notices", cloud.stale_notices_rejected),
    ):
        if n:
            out.append(
                Violation(
                    Kind.STALE_CALL,
                    None,
                    f"the sim cloud refused {n} {what} with a stale epoch: the controller's own "
                    "fencing let them through",
                )
            )
    if not clusters and cloud.unterminated_clusters:
        out.append(
            Violation(
                Kind.CLUSTER_LEFT,
                None,
                f"the sim cloud counts {cloud.unterminated_clusters} clusters never terminated",
            )
        )
    return out


def _cancel_record(
    cancels: ClientCancels, jobs: Mapping[int, JobLog], t: _Clock
) -> list[Violation]:
    """Every cancel the server answered shows in the log as a cancel; every cancel in the
    log was asked for."""
    out: list[Violation] = []
    sent = set(cancels.sent)
    for job_id in sorted(set(cancels.answered)):
        job = jobs.get(job_id)
        if job is not None and job.cancel is None:
            out.append(
                Violation(
                    Kind.CANCEL_RECORD,
                    job_id,
                    "the server answered its cancel, yet the log has no cancel event "
                    f"({', '.join(repr(m) for m in CANCEL_MESSAGES)}): a lost cancel",
                )
            )
    if cancels.everything:
        return out
    for job_id, job in sorted(jobs.items()):
        if job.cancel is not None and job_id not in sent:
            out.append(
                Violation(
                    Kind.CANCEL_RECORD,
                    job_id,
                    f"{_event(job.cancel, t)}, yet the client never asked to cancel the job",
                )
            )
    return out


def _corrections(n: int) -> list[Violation]:
    if not n:
        return []
    return [
        Violation(
            Kind.COUNTER_DRIFT,
            None,
            f"the scheduler's reconcile corrected its counters {n} times: a move was "
            "committed without being counted (it repairs the drift silently)",
        )
    ]


def expected_counters(
    recount: Mapping[tuple[str | None, ScheduleState], int], replicas: Iterable[str]
) -> dict[str, int]:
    """What the scheduler's counters must be, computed from a recount of its jobs table."""
    states: collections.Counter[ScheduleState] = collections.Counter()
    for (_, state), n in recount.items():
        states[state] += n
    expected = {
        "launching": states[St.LAUNCHING],
        "alive": sum(states[s] for s in ALIVE_STATES),
        "waiting": states[St.WAITING],
        "alive_waiting": states[St.ALIVE_WAITING],
    }
    for cid in replicas:
        expected[f"{cid}.launching"] = recount.get((cid, St.LAUNCHING), 0)
        expected[f"{cid}.alive"] = sum(recount.get((cid, s), 0) for s in ALIVE_STATES)
    return expected


def counter_drift(snapshot: CounterSnapshot) -> list[Violation]:
    """The scheduler's counters against the recount, one violation per counter that differs."""
    replicas = {key.rsplit(".", 1)[0] for key in snapshot.reported if "." in key}
    expected = expected_counters(snapshot.recount, sorted(replicas))
    return [
        Violation(
            Kind.COUNTER_DRIFT,
            None,
            f"at {snapshot.label}: {key} is {snapshot.reported.get(key, 0)}, "
            f"the recount says {value}",
        )
        for key, value in sorted(expected.items())
        if snapshot.reported.get(key, 0) != value
    ]


def check(history: History, kinds: Collection[Kind] | None = None) -> list[Violation]:
    """Every violation in the history (of `kinds` only, when given), job by job.

    Args:
        history: The durable record of a finished run.
        kinds: Restricts the answer to these kinds.

    Returns:
        Violations ordered by job (those of no job last), then as found.
    """
    t = _Clock(history)
    by_job: dict[int, list[EventRecord]] = collections.defaultdict(list)
    for e in sorted(history.events, key=lambda e: e.event_id):
        by_job[e.job_id].append(e)
    clusters_of: dict[int, list[ClusterRecord]] = collections.defaultdict(list)
    for c in history.clusters:
        clusters_of[c.job_id].append(c)
    wanted = set(by_job) if history.job_ids is None else set(history.job_ids)
    # Clusters of a job the log never heard of are judged too: nobody may launch them.
    unknown = set(clusters_of) - set(by_job) - wanted
    out: list[Violation] = []
    for job_id in sorted(unknown):
        clusters = clusters_of[job_id]
        out.extend(_left(None, job_id, clusters, t))
        out.extend(
            Violation(
                Kind.STALE_CALL, job_id, f"{_cluster(c, t)}: the log has no such job", c.task_id
            )
            for c in clusters
        )
    jobs: dict[int, JobLog] = {}
    for job_id in sorted(wanted):
        clusters = clusters_of.get(job_id, [])
        tasks = None if history.tasks is None else history.tasks.get(job_id)
        job = jobs[job_id] = JobLog(job_id, by_job.get(job_id, []), t, tasks)
        out.extend(job.violations)
        out.extend(_terminal(job, t))
        out.extend(_cancel(job, clusters, t))
        out.extend(_reruns(job, clusters, t))
        out.extend(_stale_calls(job, clusters, t))
        out.extend(_left(job, job_id, clusters, t))
    out.extend(_overlaps([c for c in history.clusters if c.job_id in wanted | unknown], t))
    if history.cloud is not None:
        out.extend(_cloud(history.cloud, history.clusters))
    if history.cancels is not None:
        out.extend(_cancel_record(history.cancels, jobs, t))
    for snapshot in history.counters:
        out.extend(counter_drift(snapshot))
    out.extend(_corrections(history.counter_corrections))
    out.sort(key=lambda v: (v.job_id is None, v.job_id or 0))
    if kinds is not None:
        out = [v for v in out if v.kind in kinds]
    return out

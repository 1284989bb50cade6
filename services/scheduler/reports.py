"""What replicas report, applied to the database (contract §9).

A replica's reports (task transitions, launch-slot requests and releases, a
finished lifecycle, handed-back jobs) are applied in batches: one transaction
for many reports, in the order they arrived, so a burst of reports from many
jobs costs one commit. Each kind of report is one entry of `REPORTS`, by the
name of its field in the request's `message` oneof: where its typed message is,
the job it is about, the rows it touches, its checks, and its handler. Each
report is judged on its own inside the batch:

- a report whose epoch or controller is not the job's current assignment is
  refused as STALE (the replica must stop acting for the job, and is told so);
- a report that breaks a rule (a transition `TASK_TRANSITIONS` forbids, a task
  that does not exist, a field out of range: an unknown status, a negative count,
  a time outside 1970-9999), or that is no report at all, is refused as INVALID
  (the replica ends the job FAILED_CONTROLLER rather than pretend it was moved away);
- a report about a job applied before (its number, `seq`, is not
  above the job's `report_seq`: the replica sent it again on a new stream, its
  ack lost with the old one) is acknowledged as a replay and not applied twice;
- anything else is applied, and the job keeps its number in the same transaction.
  Nothing is written for a refused report: every field is checked before the
  first write.

Texts a report carries (messages, reasons, a region) are made storable rather than
refused (cut to their bounds, a NUL character replaced): a long message is no
reason to fail a job, nor to fail the batch it came in.

A batch reads every row its reports touch up front and writes back what changed
once (`batch_rows.py`), so its cost in round trips to the database does not grow
with its size.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from google.protobuf.message import Message

from managedjobs.v1 import scheduler_service_pb2 as pb
from services.common.errors import bound
from services.common.event_messages import HANDED_BACK
from services.common.statuses import IllegalTransition, ScheduleState
from services.scheduler import batch_rows, metrics, transitions
from services.scheduler.batch_rows import StaleReport, Wanted
from services.scheduler.db.rows import Tracked
from services.scheduler.endings import finish
from services.scheduler.moves import move_held
from services.scheduler.releases import release
from services.scheduler.store import Store
from services.scheduler.txn import Txn

St = ScheduleState
Request = pb.ConnectControllerRequest
M = TypeVar("M", bound=Message)
# Bytes kept of each text of a report (a message, a reason, a condition).
MAX_REPORT_TEXT = 16 * 1024
# The column of a task's region (characters).
MAX_REGION = 64


class Refusal(enum.IntEnum):
    NONE = pb.REPORT_REFUSAL_UNSPECIFIED
    STALE = pb.REPORT_REFUSAL_STALE_EPOCH
    INVALID = pb.REPORT_REFUSAL_INVALID


@dataclasses.dataclass
class Applied:
    """The outcome of a batch: an ack per report, and what to tell the replica after commit."""

    acks: list[pb.ReportAck] = dataclasses.field(default_factory=list)
    # (job_id, epoch): a repeated slot request of a job that holds its slot: grant again.
    grants: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # (job_id, epoch): stale reports; the replica must stop acting for these.
    revokes: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # Jobs a JobFinished the batch accepted was about: the replica holds them no more.
    finished: list[int] = dataclasses.field(default_factory=list)


class AboutAJob(Protocol):
    @property
    def job_id(self) -> int: ...
    @property
    def epoch(self) -> int: ...


def _job(message: AboutAJob) -> tuple[int, int]:
    return message.job_id, message.epoch


def _wants_job(message: AboutAJob, wanted: Wanted) -> None:
    wanted.jobs.add(message.job_id)


def _no_check(message: Message) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Report(Generic[M]):
    """One kind of report: its typed message, how it is checked and applied."""

    message: Callable[[Request], M]
    apply: Callable[[Txn, str, M, Applied], None]
    # The (job, epoch) of a report about one job: the job keeps its number (`seq`), so a
    # replay is known. None: a report about many jobs, not numbered by any.
    job: Callable[[M], tuple[int, int]] | None = None
    # The rows it touches, read up front for the batch (`batch_rows.prefetch`).
    wants: Callable[[M, Wanted], None] | None = None
    # Checks beyond its texts' (raises ValueError naming the field).
    check: Callable[[M], None] = _no_check
    # False: it changes only rows the batch read, so earlier reports' changes need not be
    # written back before it (its statements would not see them).
    statements: bool = True

    def job_of(self, request: Request) -> tuple[int, int] | None:
        return None if self.job is None else self.job(self.message(request))

    def want(self, request: Request, wanted: Wanted) -> None:
        if self.wants is not None:
            self.wants(self.message(request), wanted)

    def apply_to(self, txn: Txn, cid: str, request: Request, applied: Applied) -> None:
        """Checks the report and applies it as it may be stored.

        Raises:
            StaleReport: the replica does not hold the job at the report's epoch.
            IllegalTransition, ValueError: the report breaks a rule.
        """
        message = self.message(request)
        self.check(message)
        self.apply(txn, cid, storable(message), applied)


def _transition(txn: Txn, cid: str, report: pb.TaskTransition, applied: Applied) -> None:
    transitions.transition(txn, cid, report)


def _slot_request(txn: Txn, cid: str, report: pb.LaunchSlotRequest, applied: Applied) -> None:
    reason = report.reason or "waiting for a launch slot"
    move = move_held(txn, report.job_id, St.ALIVE, St.ALIVE_WAITING, report.epoch, cid, reason,
                     "launch slot requested")  # fmt: skip
    if move is None and batch_rows.current(txn, report.job_id, report.epoch, cid) == St.LAUNCHING:
        # Already holds a slot (a repeated request): grant again.
        applied.grants.append((report.job_id, report.epoch))


def _slot_release(txn: Txn, cid: str, report: pb.LaunchSlotRelease, applied: Applied) -> None:
    move = move_held(txn, report.job_id, St.LAUNCHING, St.ALIVE, report.epoch, cid,
                     report.wait_reason, report.wait_reason or "launched")  # fmt: skip
    if move is None:
        # A repeat is harmless; a stale epoch is not.
        batch_rows.current(txn, report.job_id, report.epoch, cid)


def _finished(txn: Txn, cid: str, report: pb.JobFinished, applied: Applied) -> None:
    finish(txn, cid, report.job_id, report.epoch, report.failure_reason)
    applied.finished.append(report.job_id)


def _wants_finish(report: pb.JobFinished, wanted: Wanted) -> None:
    wanted.finished.add(report.job_id)


def _handback(txn: Txn, cid: str, report: pb.JobHandback, applied: Applied) -> None:
    pairs = [(held.job_id, held.epoch) for held in report.jobs]
    release(txn, cid, pairs=pairs, reason=HANDED_BACK.format(cid))


TRANSITION = Report(
    lambda r: r.transition,
    _transition,
    job=_job,
    wants=transitions.wants,
    check=transitions.check,
    statements=False,
)
SLOT_REQUEST = Report(lambda r: r.launch_slot_request, _slot_request, job=_job, wants=_wants_job)
SLOT_RELEASE = Report(lambda r: r.launch_slot_release, _slot_release, job=_job, wants=_wants_job)
FINISHED = Report(lambda r: r.job_finished, _finished, job=_job, wants=_wants_finish)
HANDBACK = Report(lambda r: r.job_handback, _handback)
# Every kind of report, by its field's name in the request's `message` oneof; any other
# message there is no report (refused as INVALID).
REPORTS: dict[str, Report[Any]] = {
    "transition": TRANSITION,
    "launch_slot_request": SLOT_REQUEST,
    "launch_slot_release": SLOT_RELEASE,
    "job_finished": FINISHED,
    "job_handback": HANDBACK,
}


class Reports:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.refused_stale = 0
        self.refused_invalid = 0
        self.replayed = 0

    async def apply(self, controller_id: str, requests: Sequence[Request]) -> Applied:
        """Applies a replica's reports, in order, in one transaction."""
        return await self.store.transaction(
            functools.partial(self._apply, controller_id=controller_id, requests=requests)
        )

    def _apply(self, txn: Txn, controller_id: str, requests: Sequence[Request]) -> Applied:
        applied = Applied()
        wanted = Wanted()
        kinds = [(request, request.WhichOneof("message") or "empty") for request in requests]
        for request, name in kinds:
            if name in REPORTS:
                REPORTS[name].want(request, wanted)
        batch_rows.prefetch(txn, wanted)
        for request, name in kinds:
            report = REPORTS.get(name)
            if report is None or report.statements:
                # Its statements read or move rows earlier reports changed.
                txn.write_back()
            applied.acks.append(self._one(txn, controller_id, request, name, report, applied))
        return applied

    def _one(
        self,
        txn: Txn,
        cid: str,
        request: Request,
        name: str,
        report: Report[Any] | None,
        applied: Applied,
    ) -> pb.ReportAck:
        about = report.job_of(request) if report is not None else None
        job = _numbered_job(txn, cid, about) if about is not None else None
        if job is not None and 0 < request.seq <= job.report_seq:
            txn.after.append(functools.partial(self._counted, name, Refusal.NONE, True))
            reason = f"a replay: report {request.seq} of job {job.id} was applied before"
            return pb.ReportAck(ack_seq=request.seq, accepted=True, reason=reason, replay=True)
        refusal, reason = Refusal.NONE, ""
        try:
            if request.seq <= 0:
                raise ValueError(f"seq: a report is numbered from 1, got {request.seq}")
            if report is None:
                raise ValueError(f"a {name} message is not a report")
            report.apply_to(txn, cid, request, applied)
        except StaleReport as stale:
            refusal, reason = Refusal.STALE, str(stale)
            if about is not None:
                applied.revokes.append(about)
        except (IllegalTransition, ValueError) as bad:
            refusal, reason = Refusal.INVALID, str(bad)
        if refusal == Refusal.NONE and job is not None:
            job.report_seq = request.seq
        txn.after.append(functools.partial(self._counted, name, refusal))
        return pb.ReportAck(
            ack_seq=request.seq,
            accepted=refusal == Refusal.NONE,
            reason=reason,
            refusal=int(refusal),  # type: ignore[arg-type]
        )

    def _counted(self, kind: str, refusal: Refusal, replay: bool = False) -> None:
        """Counts a report once its batch committed (on the event loop)."""
        if replay:
            self.replayed += 1
            metrics.replayed(kind)
        if refusal == Refusal.STALE:
            self.refused_stale += 1
        elif refusal == Refusal.INVALID:
            self.refused_invalid += 1
        metrics.reported(kind, "" if refusal == Refusal.NONE else refusal.name.lower())


def _numbered_job(txn: Txn, cid: str, about: tuple[int, int]) -> Tracked | None:
    """The job a report is about and keeps the number of, when the replica holds it (a
    report about a job it does not hold is refused as stale)."""
    try:
        return batch_rows.held_job(txn, *about, cid)
    except StaleReport:
        return None


def storable(message: M) -> M:
    """The message as it may be stored: a NUL character (no database text holds one)
    becomes U+FFFD, a region is cut to its column, any other text to `MAX_REPORT_TEXT`
    bytes (a cluster name is a name, not a text: `transitions.check` refuses a long one)."""
    changes: dict[str, str] = {}
    for field, value in message.ListFields():
        if isinstance(value, str):
            stored = _storable(field.name, value)
            if stored != value:
                changes[field.name] = stored
    if not changes:
        return message
    cut = type(message)()
    cut.CopyFrom(message)
    for name, value in changes.items():
        setattr(cut, name, value)
    return cut


def _storable(name: str, text: str) -> str:
    text = text.replace("\x00", "\ufffd")
    if name == "region":
        return text[:MAX_REGION]
    return bound(text, MAX_REPORT_TEXT)

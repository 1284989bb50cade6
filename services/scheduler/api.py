"""JobService: the client API, served by the scheduler (contract §11).

Validation happens here, before anything is stored: a rejected request changes
nothing. Domain errors become status codes through `rpc_errors`.

Every input is bounded (contract §19): a request names at most `MAX_JOB_IDS` job ids,
each positive; a status filter is a set of known statuses; no text holds a NUL
character. A watch resumed after
an event id past the newest is OUT_OF_RANGE (reason EVENTS_AHEAD: the database was
replaced, or the id was never issued) rather than a wait for events that may never
come; a watcher that falls `--watch-queue-limit` events behind is cut off with
RESOURCE_EXHAUSTED (reason WATCHER_OVERFLOW) and ErrorInfo metadata
`resume_after_event_id`, the id to resume after without losing an event.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import grpc
from google.protobuf.message import Message

from managedjobs.v1 import job_pb2, job_service_pb2_grpc
from managedjobs.v1 import job_service_pb2 as pb
from services.common.bounds import MAX_INT64, BoundsError, check_pool, check_user, quote
from services.common.errors import (
    InvalidArgument,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    rpc_errors,
)
from services.common.security.access import current_principal, require_owner, require_user
from services.common.statuses import JobStatus, ScheduleState
from services.scheduler.admission import Admission
from services.scheduler.cancels import Cancels, Targets
from services.scheduler.events import EventBus, WatcherOverflow
from services.scheduler.intake import Intake
from services.scheduler.ownership import OwnedJobs
from services.scheduler.spec.cache import SpecCache
from services.scheduler.spec.parse import SpecError
from services.scheduler.store import NewJob, Store

DEFAULT_PAGE_SIZE = 100
MAX_BATCH = 1000
MAX_PAGE_SIZE = 1000
MAX_PRIORITY = 1000
MAX_KEY_CHARS = 256
# Job ids one request may name (CancelJobs, WatchJobs).
MAX_JOB_IDS = 1000
# Events in one response of a batched watch (a backlog page holds as many).
WATCH_BATCH = 1000
DEFAULT_USER = "default"


def _page_token(before_id: int) -> str:
    return base64.urlsafe_b64encode(f"before:{before_id}".encode()).decode()


def _parse_page_token(token: str) -> int:
    if not token:
        return 0
    try:
        text = base64.urlsafe_b64decode(token.encode()).decode()
        prefix, _, value = text.partition(":")
        if prefix != "before" or not value.isdigit() or not 0 < int(value) <= MAX_INT64:
            raise ValueError(text)
        return int(value)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise InvalidArgument(
            f"page_token: {quote(token)} is not a token this server issued",
            reason="PAGE_TOKEN_INVALID",
        ) from None


def _responses(events: Sequence[job_pb2.JobEvent], batched: bool) -> Iterator[pb.WatchJobsResponse]:
    """A watch's responses for events ready at once: one for all of them when batched,
    else one each."""
    if not batched:
        yield from (pb.WatchJobsResponse(event=event) for event in events)
    elif events:
        yield pb.WatchJobsResponse(events=events)


def _job_ids(values: Sequence[int], field: str = "job_ids") -> list[int]:
    """The distinct job ids a request names, ascending.

    Raises:
        InvalidArgument: more than `MAX_JOB_IDS` ids, or one that is not positive.
    """
    if len(values) > MAX_JOB_IDS:
        raise InvalidArgument(
            f"{field}: at most {MAX_JOB_IDS} job ids per request, got {len(values):,}",
            reason="TOO_MANY_JOB_IDS",
            field=field,
            limit=str(MAX_JOB_IDS),
        )
    for index, job_id in enumerate(values):
        if job_id <= 0:
            raise InvalidArgument(
                f"{field}[{index}]: job ids are positive, got {job_id}", field=f"{field}[{index}]"
            )
    return sorted(set(values))


def _no_nul(message: Message, prefix: str = "") -> None:
    """Refuses a NUL character in any text of the request: no field means one, and
    PostgreSQL cannot store one (it would fail the write, not the request).

    Raises:
        InvalidArgument: naming the field.
    """
    for field, value in message.ListFields():
        path = prefix + field.name
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            texts = [(f"{path}[{quote(k)}]", f"{k}{v}") for k, v in value.items()]
        elif field.type == field.TYPE_STRING:
            texts = [(path, v) for v in (value if field.is_repeated else [value])]
        elif field.type == field.TYPE_MESSAGE:
            for index, item in enumerate(value if field.is_repeated else [value]):
                _no_nul(item, f"{path}[{index}]." if field.is_repeated else f"{path}.")
            continue
        else:
            continue
        for where, text in texts:
            if "\x00" in text:
                raise InvalidArgument(
                    f"{where}: must not contain NUL characters", field=where, reason="NUL_CHARACTER"
                )


def _statuses(values: Sequence[int]) -> list[JobStatus]:
    """The distinct statuses of a filter.

    Raises:
        InvalidArgument: a value that is no status.
    """
    statuses: set[JobStatus] = set()
    for index, value in enumerate(values):
        try:
            statuses.add(JobStatus(value))
        except ValueError:
            raise InvalidArgument(
                f"statuses[{index}]: unknown status {value}", field=f"statuses[{index}]"
            ) from None
    return sorted(statuses)


def _user(user: str, field: str = "user") -> str:
    try:
        check_user(user, field)
    except BoundsError as error:
        raise InvalidArgument(str(error), field=error.field) from None
    return user or DEFAULT_USER


class SentEvents:
    """Ids of events a watcher was sent, forgetting those far below the newest."""

    KEEP = 100_000

    def __init__(self) -> None:
        self._ids: set[int] = set()
        self._top = 0

    def add(self, event_id: int) -> bool:
        """Records an id; False if it was sent already."""
        if event_id in self._ids:
            return False
        self._ids.add(event_id)
        self._top = max(self._top, event_id)
        if len(self._ids) > 2 * self.KEEP:
            floor = self._top - self.KEEP
            self._ids = {i for i in self._ids if i > floor}
        return True


class JobApi(job_service_pb2_grpc.JobServiceServicer):
    """The client API; every job a caller names must exist and be theirs (or they admin)."""

    def __init__(
        self,
        store: Store,
        bus: EventBus,
        admission: Admission,
        cancels: Cancels,
        on_pending_deadline: Callable[[], None] = lambda: None,
    ) -> None:
        # Told when a job with max_pending was stored: its deadline may be the nearest.
        self._on_pending_deadline = on_pending_deadline
        self.specs = SpecCache()
        self.store = store
        self.bus = bus
        self.admission = admission
        self.cancels = cancels
        self.intake = Intake(store)

    def _new_job(self, request: pb.SubmitJobRequest, prefix: str = "") -> NewJob:
        """The validated job of a submission, owned by the caller; errors name the field
        (under `prefix`).

        Raises:
            InvalidArgument: the submission can never run; nothing is stored.
        """
        if not -MAX_PRIORITY <= request.priority <= MAX_PRIORITY:
            raise InvalidArgument(
                f"{prefix}priority: must be within -{MAX_PRIORITY}..{MAX_PRIORITY}"
            )
        if len(request.idempotency_key) > MAX_KEY_CHARS:
            raise InvalidArgument(f"{prefix}idempotency_key: at most {MAX_KEY_CHARS} characters")
        principal = current_principal()
        user = _user(require_user(principal, request.user) or principal.user, f"{prefix}user")
        try:
            check_pool(request.pool, f"{prefix}pool")
            spec = self.specs.parse(
                request.spec_yaml,
                name_override=request.name,
                extra_envs=dict(request.envs),
                extra_secrets=dict(request.secrets),
                known_regions=self.admission.regions(),
            )
        except BoundsError as error:
            field = prefix + error.field if isinstance(error, SpecError) else error.field
            message = f"{prefix}{error}" if isinstance(error, SpecError) else str(error)
            reason = "SPEC_INVALID" if isinstance(error, SpecError) else "ARGUMENT_INVALID"
            raise InvalidArgument(message, reason=reason, field=field) from None
        return NewJob(
            name=spec.name,
            user=user,
            priority=request.priority,
            pool=request.pool,
            idempotency_key=request.idempotency_key,
            tasks=spec.tasks,
            secrets=spec.secrets,
            timeouts=spec.timeouts if spec.timeouts.ListFields() else None,
        )

    async def _owned(self, job_ids: Sequence[int]) -> None:
        """Raises NotFound for ids that name no job, PermissionDenied for another's job."""
        owners = await self.store.job_owners(job_ids)
        missing = sorted(set(job_ids) - set(owners))
        if missing:
            shown = ", ".join(map(str, missing[:20]))
            raise NotFound(f"job_ids: no job {shown}", reason="JOB_NOT_FOUND", job_ids=shown)
        principal = current_principal()
        for job_id, owner in owners.items():
            require_owner(principal, owner, f"job {job_id}")

    @rpc_errors
    async def SubmitJob(
        self, request: pb.SubmitJobRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.SubmitJobResponse:
        _no_nul(request)
        [job_id] = await self._submit([self._new_job(request)])
        return pb.SubmitJobResponse(job_id=job_id)

    async def _submit(self, jobs: list[NewJob]) -> list[int]:
        answers = await self.intake.submit_many(jobs)
        if any(job.timeouts and job.timeouts.HasField("max_pending_seconds") for job in jobs):
            self._on_pending_deadline()
        return [job_id for job_id, _ in answers]

    @rpc_errors
    async def SubmitJobs(
        self, request: pb.SubmitJobsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.SubmitJobsResponse:
        if not request.jobs:
            raise InvalidArgument("jobs: give at least one job")
        if len(request.jobs) > MAX_BATCH:
            raise InvalidArgument(f"jobs: at most {MAX_BATCH} per call, got {len(request.jobs)}")
        _no_nul(request)
        jobs = [self._new_job(job, f"jobs[{i}].") for i, job in enumerate(request.jobs)]
        return pb.SubmitJobsResponse(job_ids=await self._submit(jobs))

    @rpc_errors
    async def GetJob(
        self, request: pb.GetJobRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetJobResponse:
        if request.job_id <= 0:
            raise InvalidArgument("job_id: must be positive")
        job = await self.store.get_job(request.job_id)
        if job is None:
            raise NotFound(
                f"job {request.job_id} does not exist",
                reason="JOB_NOT_FOUND",
                job_id=str(request.job_id),
            )
        require_owner(current_principal(), job.user, f"job {job.job_id}")
        if job.schedule_state == ScheduleState.WAITING:
            ahead = await self.store.ahead_of(job.job_id, job.priority)
            job.wait_reason = (
                f"waiting for higher-priority jobs ({ahead} ahead)"
                if ahead
                else "waiting for a launch slot"
            )
        elif job.schedule_state == ScheduleState.ALIVE_WAITING and not job.wait_reason:
            job.wait_reason = "waiting for a launch slot"
        return pb.GetJobResponse(job=job)

    @rpc_errors
    async def ListJobs(
        self, request: pb.ListJobsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ListJobsResponse:
        if request.page_size < 0:
            raise InvalidArgument("page_size: must not be negative")
        _no_nul(request)
        size = min(request.page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        statuses = _statuses(request.statuses)
        jobs = await self.store.list_jobs(
            statuses,
            user=require_user(current_principal(), request.user),
            name=request.name,
            limit=size + 1,
            before_id=_parse_page_token(request.page_token),
            job_ids=_job_ids(request.job_ids),
        )
        token = _page_token(jobs[size - 1].job_id) if len(jobs) > size else ""
        return pb.ListJobsResponse(jobs=jobs[:size], next_page_token=token)

    @rpc_errors
    async def CancelJobs(
        self, request: pb.CancelJobsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.CancelJobsResponse:
        ways = sum([bool(request.job_ids), bool(request.name), request.all])
        if ways != 1:
            raise InvalidArgument("give exactly one of job_ids, name or all")
        _no_nul(request)
        job_ids = _job_ids(request.job_ids)
        principal = current_principal()
        user = require_user(principal, request.user)
        if request.all and not user:
            raise InvalidArgument("user: required with all")
        if job_ids:
            await self._owned(job_ids)
        targets = Targets(job_ids=job_ids, name=request.name, user=user)
        cancelled = await self.cancels.cancel(targets)
        return pb.CancelJobsResponse(cancelled_job_ids=cancelled)

    @rpc_errors
    async def WatchJobs(
        self, request: pb.WatchJobsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.WatchJobsResponse]:
        if request.after_event_id < 0:
            raise InvalidArgument("after_event_id: must not be negative", field="after_event_id")
        job_ids = _job_ids(request.job_ids)
        principal = current_principal()
        if job_ids:
            await self._owned(job_ids)
        await self._not_ahead(request.after_event_id)
        # A user's watch of every job shows their own jobs only.
        owned = None
        if not job_ids and not principal.sees_every_job:
            owned = OwnedJobs(self.store, principal.user)
        subscription = self.bus.subscribe(job_ids)
        try:
            # Transactions commit in id order but may publish out of it, so the live
            # part skips what was sent by id, not by "at most the last id sent".
            sent = SentEvents()
            last = request.after_event_id
            while True:
                backlog = await self.store.events_after(
                    last, job_ids, user=owned.user if owned else "", limit=WATCH_BATCH
                )
                for event in backlog:
                    sent.add(event.event_id)
                    last = event.event_id
                for response in _responses(backlog, request.batched):
                    yield response
                if len(backlog) < WATCH_BATCH:
                    break
            while True:
                try:
                    ready = await subscription.take(WATCH_BATCH if request.batched else 1)
                except WatcherOverflow as overflow:
                    resume = max(overflow.resume_after, request.after_event_id)
                    raise ResourceExhausted(
                        f"this watch fell more than {self.bus.queue_limit:,} events behind and "
                        f"was cut off; watch again with after_event_id={resume}",
                        reason="WATCHER_OVERFLOW",
                        resume_after_event_id=str(resume),
                    ) from None
                fresh = []
                for event in ready:
                    if event.event_id <= request.after_event_id or not sent.add(event.event_id):
                        continue
                    if owned is not None and not await owned.owns(event.job_id):
                        continue
                    fresh.append(event)
                for response in _responses(fresh, request.batched):
                    yield response
        finally:
            subscription.close()

    async def _not_ahead(self, after_event_id: int) -> None:
        """Raises OutOfRange for a resume point past the newest event: no such event was
        ever sent (the database was replaced since), so waiting would wait forever."""
        if not after_event_id:
            return
        head = await self.store.last_event_id()
        if after_event_id > head:
            raise OutOfRange(
                f"after_event_id: {after_event_id} is past the newest event ({head}); "
                "watch again from 0 or from an id you were sent",
                reason="EVENTS_AHEAD",
                field="after_event_id",
                head_event_id=str(head),
            )

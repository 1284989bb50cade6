"""The LogService: validates requests and routes them to the store, the backend and followers.

- ReadLogs serves a task's logs (stored, live, or both) or the job's controller
  log; with `follow` it streams until the job is over. With `attempt` it serves
  that attempt of the task only. Jobs are looked up in the scheduler (the
  `JobDirectory`): this service owns logs, never job state. Only the job's owner
  and admins may read them (`current_principal()`).
- FetchTaskLogs copies one attempt of a task off its cluster into the store;
  replicas call it right before every teardown, so a recovered task keeps the logs
  of every attempt. A repeat of the same attempt replaces its copy.
- BatchFetchTaskLogs does many FetchTaskLogs in one call (replicas' fetches asked
  for at once), each checked, done and answered on its own.
- AppendControllerLogs appends replicas' lifecycle lines to each job's log.

The two write RPCs refuse what is not the caller's, before anything is written (so
a refused call creates no folder): a job that does not exist is NOT_FOUND; a cluster
that is not the task's (`mj-<job>-<task>`) INVALID_ARGUMENT; a job the calling
replica does not hold at the epoch it gives PERMISSION_DENIED (`holders.Holders`).
AppendControllerLogs judges a batch job by job: the lines of held jobs are stored
and the others are listed in the response (`refused`); a batch none of whose lines
could be stored fails with its first refusal instead.

Bad input is INVALID_ARGUMENT naming the field, within the bounds of
`services.common.bounds` (lines per batch, bytes per line, tail lines, the handle's
size and nesting); an unknown job is NOT_FOUND.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from managedjobs.v1 import job_pb2, log_service_pb2, log_service_pb2_grpc
from services.backends.base import Backend, BackendUnreachableError, ClusterHandle, cluster_name
from services.common.bounds import (
    MAX_FETCH_BATCH,
    MAX_HANDLE_BYTES,
    MAX_JSON_DEPTH,
    MAX_LOG_BATCH_LINES,
    MAX_LOG_LINE_BYTES,
    MAX_TAIL_LINES,
    json_depth,
    quote,
)
from services.common.errors import (
    MAX_MESSAGE_BYTES,
    ApiError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
    bound,
    each_alone,
    rpc_errors,
)
from services.common.security.access import current_principal, require_owner
from services.logs.controller_logs import follow_controller_log, read_controller_log
from services.logs.directory import JobDirectory
from services.logs.holders import Holders
from services.logs.store import LogStore
from services.logs.task_logs import TaskLogFollower, current_attempt, read_task_logs
from services.logs.tracker import JobTracker

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]


class LogServicer(log_service_pb2_grpc.LogServiceServicer):
    """Serves every job's task and controller logs."""

    def __init__(
        self,
        store: LogStore,
        directory: JobDirectory,
        backend: Backend,
        *,
        resync_interval: float = 5.0,
        holders: Holders | None = None,
    ) -> None:
        self._store = store
        self._directory = directory
        self._backend = backend
        self._resync_interval = resync_interval
        self._holders = holders or Holders(directory)
        self._stopping = asyncio.Event()

    async def drain(self) -> None:
        """Ends every follow stream with UNAVAILABLE, so its client reconnects elsewhere."""
        self._stopping.set()

    @rpc_errors
    async def ReadLogs(
        self, request: log_service_pb2.ReadLogsRequest, context: Context
    ) -> AsyncIterator[log_service_pb2.ReadLogsResponse]:
        if request.job_id <= 0:
            raise InvalidArgument("job_id must be positive", field="job_id")
        if not 0 <= request.tail_lines <= MAX_TAIL_LINES:
            raise InvalidArgument(
                f"tail_lines must be between 0 and {MAX_TAIL_LINES:,}", field="tail_lines"
            )
        if request.HasField("attempt"):
            if request.attempt <= 0:
                raise InvalidArgument("attempt must be positive", field="attempt")
            if request.controller:
                raise InvalidArgument(
                    "attempt applies to a task's logs, not to the controller log", field="attempt"
                )
        stream = self._follow(request) if request.follow else self._read(request)
        async for response in stream:
            yield response

    async def _read(
        self, request: log_service_pb2.ReadLogsRequest
    ) -> AsyncIterator[log_service_pb2.ReadLogsResponse]:
        """The logs as they are now."""
        job_id = request.job_id
        job = await self._directory.get_job(job_id)
        if job is None:
            raise NotFound(f"job {job_id} not found", reason="JOB_NOT_FOUND", job_id=str(job_id))
        require_owner(current_principal(), job.user, f"job {job_id}")
        if request.controller:
            for chunk in read_controller_log(self._store, job_id, request.tail_lines):
                yield _response(job_id, 0, chunk)
            return
        task_id = _task_index(request, job)
        attempt = _attempt(request, job, task_id)
        async for chunk in read_task_logs(
            self._store, self._backend, job, task_id, request.tail_lines, attempt
        ):
            yield _response(job_id, task_id, chunk)

    async def _follow(
        self, request: log_service_pb2.ReadLogsRequest
    ) -> AsyncIterator[log_service_pb2.ReadLogsResponse]:
        """The logs now and as they grow, until the job (or the one task asked for) is over."""
        job_id = request.job_id
        tracker = JobTracker(
            self._directory,
            job_id,
            stopping=self._stopping,
            resync_interval=self._resync_interval,
        )
        try:
            job = await tracker.start()
            if job is None:
                raise NotFound(
                    f"job {job_id} not found", reason="JOB_NOT_FOUND", job_id=str(job_id)
                )
            require_owner(current_principal(), job.user, f"job {job_id}")
            if request.controller:
                async for chunk in follow_controller_log(self._store, tracker, request.tail_lines):
                    yield _response(job_id, 0, chunk)
                return
            first = _task_index(request, job)
            attempt = _attempt(request, job, first)
            # Without a task id, follow the chain from the current task to its end.
            last = first if request.HasField("task_id") or attempt else len(job.tasks) - 1
            for task_id in range(first, last + 1):
                tail_lines = request.tail_lines if task_id == first else 0
                follower = TaskLogFollower(
                    self._store, self._backend, tracker, task_id, tail_lines, attempt
                )
                async for chunk in follower.follow():
                    yield _response(job_id, task_id, chunk)
        finally:
            await tracker.close()

    @rpc_errors
    async def FetchTaskLogs(
        self, request: log_service_pb2.FetchTaskLogsRequest, context: Context
    ) -> log_service_pb2.FetchTaskLogsResponse:
        return log_service_pb2.FetchTaskLogsResponse(bytes_stored=await self._fetch(request))

    @rpc_errors
    async def BatchFetchTaskLogs(
        self, request: log_service_pb2.BatchFetchTaskLogsRequest, context: Context
    ) -> log_service_pb2.BatchFetchTaskLogsResponse:
        fetches = request.fetches
        if not 1 <= len(fetches) <= MAX_FETCH_BATCH:
            raise InvalidArgument(
                f"fetches: 1 to {MAX_FETCH_BATCH} fetches, got {len(fetches)}", field="fetches"
            )
        # Who holds the batch's jobs, asked in one call rather than one per fetch.
        await self._holders.prefetch(fetch.job_id for fetch in fetches)
        reply = log_service_pb2.BatchFetchTaskLogsResponse()
        for outcome in await each_alone(self._fetch(fetch) for fetch in fetches):
            result = reply.results.add()
            if isinstance(outcome, ApiError):
                result.code = outcome.code.name
                result.message = bound(outcome.message, MAX_MESSAGE_BYTES)
                result.reason = outcome.reason
            else:
                result.bytes_stored = outcome
        return reply

    async def _fetch(self, request: log_service_pb2.FetchTaskLogsRequest) -> int:
        """Copies one attempt's logs off its cluster into the store; the bytes stored."""
        if request.job_id <= 0:
            raise InvalidArgument("job_id must be positive", field="job_id")
        if request.task_id < 0:
            raise InvalidArgument("task_id must not be negative", field="task_id")
        if request.attempt <= 0:
            raise InvalidArgument(
                "attempt must be positive (1 for the task's first cluster)", field="attempt"
            )
        handle = self._handle(request)
        holding = await self._holders.check(current_principal(), request.job_id, request.epoch)
        if request.task_id >= holding.tasks:
            raise InvalidArgument(
                f"task_id {request.task_id} out of range: job {request.job_id} has "
                f"{holding.tasks} task(s)",
                field="task_id",
            )
        try:
            data = await self._backend.read_logs(handle)
        except BackendUnreachableError as exc:
            raise Unavailable(f"backend unreachable: {exc}") from exc
        except Exception as exc:
            raise FailedPrecondition(
                f"cannot read the logs of cluster {handle.cluster_name}: {exc}",
                cluster_name=handle.cluster_name,
            ) from exc
        try:
            stored = await self._store.save_task_attempt(
                request.job_id, request.task_id, request.attempt, handle.cluster_name, data
            )
        except OSError as exc:
            # The disk, not the request: worth another try later.
            log.error("cannot store task logs", extra={"job_id": request.job_id, "error": str(exc)})
            raise Unavailable(
                f"cannot store the logs of cluster {handle.cluster_name}: {exc.strerror or exc}"
            ) from exc
        log.info(
            "task logs stored",
            extra={
                "job_id": request.job_id,
                "task_id": request.task_id,
                "attempt": request.attempt,
                "cluster": handle.cluster_name,
                "bytes": stored,
            },
        )
        return stored

    def _handle(self, request: log_service_pb2.FetchTaskLogsRequest) -> ClusterHandle:
        """The task's cluster, from handle_json or its name; refuses another task's cluster."""
        expected = cluster_name(request.job_id, request.task_id)
        if request.cluster_name and request.cluster_name != expected:
            raise InvalidArgument(
                f"cluster_name {quote(request.cluster_name)} is not the cluster of task "
                f"{request.task_id} of job {request.job_id} ({expected!r})",
                field="cluster_name",
            )
        if not request.handle_json:
            if not request.cluster_name:
                raise InvalidArgument(
                    "cluster_name or handle_json is required", field="cluster_name"
                )
            return self._backend.handle_for(expected)
        handle = _parse_handle(request.handle_json)
        if handle.backend != self._backend.name:
            raise InvalidArgument(
                f"handle_json is a {quote(handle.backend)} handle; this service runs "
                f"the {self._backend.name!r} backend",
                field="handle_json",
            )
        if handle.cluster_name != expected:
            raise InvalidArgument(
                f"handle_json names cluster {quote(handle.cluster_name)}, not the cluster of "
                f"task {request.task_id} of job {request.job_id} ({expected!r})",
                field="handle_json",
            )
        return handle

    @rpc_errors
    async def AppendControllerLogs(
        self, request: log_service_pb2.AppendControllerLogsRequest, context: Context
    ) -> log_service_pb2.AppendControllerLogsResponse:
        if len(request.lines) > MAX_LOG_BATCH_LINES:
            raise InvalidArgument(
                f"lines: {len(request.lines):,} lines in one call; at most {MAX_LOG_BATCH_LINES:,}",
                field="lines",
            )
        by_claim: dict[tuple[int, int], list[str]] = {}
        for index, line in enumerate(request.lines):
            if line.job_id <= 0:
                raise InvalidArgument(
                    f"lines[{index}].job_id must be positive", field=f"lines[{index}].job_id"
                )
            if len(line.line.encode()) > MAX_LOG_LINE_BYTES:
                raise InvalidArgument(
                    f"lines[{index}].line is {len(line.line.encode()):,} bytes; at most "
                    f"{MAX_LOG_LINE_BYTES:,}",
                    field=f"lines[{index}].line",
                )
            by_claim.setdefault((line.job_id, line.epoch), []).append(line.line)
        refusals = await self._holders.check_many(current_principal(), by_claim)
        held = [claim for claim, refusal in refusals.items() if refusal is None]
        refused = [(claim, refusal) for claim, refusal in refusals.items() if refusal is not None]
        if refused and not held:
            raise refused[0][1]  # nothing of the call can be stored: its first refusal
        stored = 0
        for job_id, epoch in held:
            lines = by_claim[(job_id, epoch)]
            self._store.append_controller_lines(job_id, lines)
            stored += len(lines)
        response = log_service_pb2.AppendControllerLogsResponse(lines_stored=stored)
        for (job_id, _), refusal in refused:
            response.refused.add(job_id=job_id, code=refusal.code.name, reason=refusal.message)
        if refused:
            log.info(
                "controller log lines refused",
                extra={"job_ids": [claim[0] for claim, _ in refused][:20], "jobs": len(refused)},
            )
        return response


def _parse_handle(text: str) -> ClusterHandle:
    """A cluster handle from bounded, shallow JSON."""
    if len(text.encode()) > MAX_HANDLE_BYTES:
        raise InvalidArgument(
            f"handle_json is {len(text.encode()):,} bytes; at most {MAX_HANDLE_BYTES:,}",
            field="handle_json",
        )
    if json_depth(text) > MAX_JSON_DEPTH:
        raise InvalidArgument(
            f"handle_json nests deeper than {MAX_JSON_DEPTH} levels", field="handle_json"
        )
    try:
        return ClusterHandle.from_json(text)
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise InvalidArgument(f"handle_json: {quote(str(exc))}", field="handle_json") from exc


def _task_index(request: log_service_pb2.ReadLogsRequest, job: job_pb2.Job) -> int:
    """The task asked for, or the job's current task."""
    count = len(job.tasks)
    if request.HasField("task_id"):
        if not 0 <= request.task_id < count:
            raise InvalidArgument(
                f"task_id {request.task_id} out of range: job {job.job_id} has {count} task(s)",
                field="task_id",
            )
        return request.task_id
    if count == 0:
        raise FailedPrecondition(f"job {job.job_id} has no tasks", job_id=str(job.job_id))
    return min(max(job.current_task_id, 0), count - 1)


def _attempt(
    request: log_service_pb2.ReadLogsRequest, job: job_pb2.Job, task_id: int
) -> int | None:
    """The attempt asked for (None: all); NOT_FOUND for one the task has not reached."""
    if not request.HasField("attempt"):
        return None
    current = current_attempt(job.tasks[task_id])
    if request.attempt > current:
        raise NotFound(
            f"task {task_id} of job {job.job_id} has no attempt {request.attempt} "
            f"(it is on attempt {current})",
            reason="ATTEMPT_NOT_FOUND",
            job_id=str(job.job_id),
        )
    return request.attempt


def _response(job_id: int, task_id: int, data: bytes) -> log_service_pb2.ReadLogsResponse:
    return log_service_pb2.ReadLogsResponse(job_id=job_id, task_id=task_id, data=data)

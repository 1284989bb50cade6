"""The LogService: validates requests and routes them to the store, the backend and followers.

- ReadLogs serves a task's logs (stored, live, or both) or the job's controller
  log; with `follow` it streams until the job is over. Jobs are looked up in the
  scheduler (the `JobDirectory`): this service owns logs, never job state. Only
  the job's owner and admins may read them (`current_principal()`).
- FetchTaskLogs copies a task's logs off its cluster into the store; replicas call
  it right before a teardown, once per cluster, so a recovered task keeps the
  logs of every cluster it ran on.
- AppendControllerLogs appends replicas' lifecycle lines to each job's log.

Bad input is INVALID_ARGUMENT naming the field; an unknown job is NOT_FOUND.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from managedjobs.v1 import job_pb2, log_service_pb2, log_service_pb2_grpc
from services.backends.base import Backend, BackendUnreachableError, ClusterHandle
from services.common.access import current_principal, require_owner
from services.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
    rpc_errors,
)
from services.logs.controller_logs import follow_controller_log, read_controller_log
from services.logs.directory import JobDirectory
from services.logs.store import LogStore
from services.logs.task_logs import TaskLogFollower, read_task_logs
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
    ) -> None:
        self._store = store
        self._directory = directory
        self._backend = backend
        self._resync_interval = resync_interval
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
        if request.tail_lines < 0:
            raise InvalidArgument("tail_lines must not be negative", field="tail_lines")
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
        async for chunk in read_task_logs(
            self._store, self._backend, job, task_id, request.tail_lines
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
            # Without a task id, follow the chain from the current task to its end.
            last = first if request.HasField("task_id") else len(job.tasks) - 1
            for task_id in range(first, last + 1):
                tail_lines = request.tail_lines if task_id == first else 0
                follower = TaskLogFollower(self._store, self._backend, tracker, task_id, tail_lines)
                async for chunk in follower.follow():
                    yield _response(job_id, task_id, chunk)
        finally:
            await tracker.close()

    @rpc_errors
    async def FetchTaskLogs(
        self, request: log_service_pb2.FetchTaskLogsRequest, context: Context
    ) -> log_service_pb2.FetchTaskLogsResponse:
        if request.job_id <= 0:
            raise InvalidArgument("job_id must be positive", field="job_id")
        if request.task_id < 0:
            raise InvalidArgument("task_id must not be negative", field="task_id")
        handle, key = self._handle(request)
        try:
            data = await self._backend.read_logs(handle)
        except BackendUnreachableError as exc:
            raise Unavailable(f"backend unreachable: {exc}") from exc
        except Exception as exc:
            raise FailedPrecondition(
                f"cannot read the logs of cluster {handle.cluster_name}: {exc}",
                cluster_name=handle.cluster_name,
            ) from exc
        stored = await self._store.save_task_attempt(
            request.job_id, request.task_id, handle.cluster_name, key, data
        )
        log.info(
            "task logs stored",
            extra={
                "job_id": request.job_id,
                "task_id": request.task_id,
                "cluster": handle.cluster_name,
                "bytes": stored,
            },
        )
        return log_service_pb2.FetchTaskLogsResponse(bytes_stored=stored)

    def _handle(self, request: log_service_pb2.FetchTaskLogsRequest) -> tuple[ClusterHandle, str]:
        """The cluster's handle, and the key its stored section is known by."""
        if request.handle_json:
            try:
                handle = ClusterHandle.from_json(request.handle_json)
            except (ValueError, KeyError, TypeError) as exc:
                raise InvalidArgument(f"handle_json: {exc}", field="handle_json") from exc
            if not isinstance(handle.cluster_name, str) or not handle.cluster_name:
                raise InvalidArgument("handle_json has no cluster_name", field="handle_json")
            if handle.backend != self._backend.name:
                raise InvalidArgument(
                    f"handle_json is a {handle.backend!r} handle; this service runs "
                    f"the {self._backend.name!r} backend",
                    field="handle_json",
                )
            if request.cluster_name and request.cluster_name != handle.cluster_name:
                raise InvalidArgument(
                    "cluster_name differs from handle_json's cluster_name", field="cluster_name"
                )
            # Normalized, so a retried fetch of the same cluster replaces its section.
            return handle, handle.to_json()
        if not request.cluster_name:
            raise InvalidArgument("cluster_name or handle_json is required", field="cluster_name")
        handle = self._backend.handle_for(request.cluster_name)
        return handle, json.dumps({"cluster_name": request.cluster_name})

    @rpc_errors
    async def AppendControllerLogs(
        self, request: log_service_pb2.AppendControllerLogsRequest, context: Context
    ) -> log_service_pb2.AppendControllerLogsResponse:
        by_job: dict[int, list[str]] = {}
        for index, line in enumerate(request.lines):
            if line.job_id <= 0:
                raise InvalidArgument("job_id must be positive", field=f"lines[{index}].job_id")
            by_job.setdefault(line.job_id, []).append(line.line)
        for job_id, lines in by_job.items():
            self._store.append_controller_lines(job_id, lines)
        return log_service_pb2.AppendControllerLogsResponse()


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


def _response(job_id: int, task_id: int, data: bytes) -> log_service_pb2.ReadLogsResponse:
    return log_service_pb2.ReadLogsResponse(job_id=job_id, task_id=task_id, data=data)

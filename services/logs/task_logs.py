"""Serving one task's logs: the stored copy, the live cluster, or both in turn.

A task's log is the logs of its attempts (1, then one more per recovery or
restart; `current_attempt`) joined by `attempts.separator`. The stored copy holds
the attempts the controller fetched before tearing their clusters down; the
current attempt lives on its cluster until then. Every attempt of a task runs on
a cluster of the same name, so an attempt is told apart by its number, never by
its cluster's name.

Following a task (`TaskLogFollower`) walks through these phases:
1. Catch up: the stored attempts before the current one.
2. Tail the live cluster (`Backend.tail_logs`) while the task is STARTING,
   RUNNING or CANCELLING, counting the bytes of this attempt already sent
   (`covered`). A tail that ends or breaks (cluster preempted) waits for the next
   job event; a new attempt starts a fresh log behind a separator; the same
   attempt is tailed again, skipping what was sent.
3. Finish: once the task is terminal, wait for the stored copy of the last
   attempt (the controller fetches before teardown) and send it from `covered`
   on; give up waiting when the job is over or has moved to a later task.

Asked for one attempt only, a follower skips phase 1, tails that attempt while it
is the current one, and finishes from its stored copy once the task is past it.

Because the stored copy joins attempts exactly as the follower does, switching
from live bytes to stored bytes never repeats or drops any. This relies on the
backend's `tail_logs` yielding the same byte sequence that `read_logs` returns.

While a task is RECOVERING its cluster's name may already belong to the next
attempt (a relaunch reuses it), so nothing is read live then: only stored copies.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

from managedjobs.v1 import job_pb2
from services.backends.base import Backend
from services.common.errors import NotFound
from services.common.statuses import TERMINAL, JobStatus
from services.logs.attempts import TaskLog, separator
from services.logs.directory import task_status
from services.logs.reading import chunks, read_bytes, read_range, tail_offset, tail_start
from services.logs.store import LogStore
from services.logs.tracker import JobTracker

log = logging.getLogger(__name__)


def current_attempt(task: job_pb2.Task) -> int:
    """The attempt the task is on: 1, then one more per recovery or restart."""
    counted = 1 + task.recovery_count + task.restart_count
    return max([counted, *(a.attempt for a in task.attempts)])


# Statuses in which the task's current cluster is worth tailing. Not RECOVERING: the
# cluster is lost, and a relaunch under the same name must not pass for it.
TAILABLE = frozenset({JobStatus.STARTING, JobStatus.RUNNING, JobStatus.CANCELLING})
# Statuses in which the current attempt may be read live once: a terminal task's
# cluster may still be there before the controller fetched its logs.
READABLE = TAILABLE | TERMINAL


async def read_task_logs(
    store: LogStore,
    backend: Backend,
    job: job_pb2.Job,
    task_id: int,
    tail_lines: int,
    attempt: int | None = None,
) -> AsyncIterator[bytes]:
    """The task's logs as they are now: stored, or stored attempts plus the live cluster.

    With `attempt`, that attempt only (it must not be past the current one).

    Raises:
        NotFound: a past attempt whose logs were never stored (ATTEMPT_LOGS_MISSING).
    """
    if attempt is not None:
        async for chunk in _read_attempt(store, backend, job, task_id, tail_lines, attempt):
            yield chunk
        return
    task = job.tasks[task_id]
    status = task_status(task)
    current = current_attempt(task)
    stored = store.task_log(job.job_id, task_id)
    complete = (
        stored is not None
        and status in TERMINAL
        and (not task.cluster_name or stored.section(current) is not None)
    )
    if not complete and task.cluster_name and status in READABLE:
        # Live, or finished but not fetched yet: the cluster may still be there.
        live = await _read_live(backend, task.cluster_name)
        if live:
            data = _stored_before(stored, current) + live
            for chunk in chunks(data[tail_start(data, tail_lines) :]):
                yield chunk
            return
    if stored is not None:
        start = tail_offset(stored.path, tail_lines)
        for chunk in read_range(stored.path, start, stored.size):
            yield chunk


async def _read_attempt(
    store: LogStore,
    backend: Backend,
    job: job_pb2.Job,
    task_id: int,
    tail_lines: int,
    attempt: int,
) -> AsyncIterator[bytes]:
    """One attempt's log: live while it is the current one and not stored, else stored."""
    task = job.tasks[task_id]
    status = task_status(task)
    stored = store.task_log(job.job_id, task_id)
    section = stored.section(attempt) if stored is not None else None
    live_now = attempt == current_attempt(task) and bool(task.cluster_name)
    if live_now and (status in TAILABLE or (status in TERMINAL and section is None)):
        live = await _read_live(backend, task.cluster_name)
        if live or (live is not None and section is None):
            for chunk in chunks(live[tail_start(live, tail_lines) :]):
                yield chunk
            return
    if stored is not None and section is not None:
        start = tail_offset(stored.path, tail_lines, section.offset, section.end)
        for chunk in read_range(stored.path, start, section.end):
            yield chunk
        return
    if live_now and status not in TERMINAL:
        return  # not started yet, or between clusters: nothing to show so far
    raise NotFound(
        f"no logs were kept of attempt {attempt} of task {task_id} of job {job.job_id} "
        "(its controller log says why)",
        reason="ATTEMPT_LOGS_MISSING",
        job_id=str(job.job_id),
    )


def _stored_before(stored: TaskLog | None, attempt: int) -> bytes:
    """Stored attempts before `attempt`, with the separator its log goes after."""
    if stored is None:
        return b""
    start = stored.start_of(attempt)
    if start is not None:
        return read_bytes(stored.path, 0, start)
    before = read_bytes(stored.path, 0, stored.size)
    return before + separator(before) if stored.sections else before


async def _read_live(backend: Backend, cluster_name: str) -> bytes | None:
    try:
        return await backend.read_logs(backend.handle_for(cluster_name))
    except Exception as exc:
        # A live cluster may vanish at any moment; that is not our error.
        log.info("cannot read live logs", extra={"cluster": cluster_name, "error": repr(exc)})
        return None


@dataclasses.dataclass
class _Attempt:
    """One attempt of the task being followed, and how much of its log was sent."""

    number: int
    cluster_name: str
    covered: int = 0
    # Whether to (re)start tailing; a re-tail skips the `covered` bytes.
    retail: bool = True
    # The backend said the task finished here: its log will not grow any more.
    finished_on_cluster: bool = False

    def same_as(self, task: job_pb2.Task) -> bool:
        return (self.number, self.cluster_name) == (current_attempt(task), task.cluster_name)


_END = object()


class TaskLogFollower:
    """Follows one task's logs (or one attempt's) until it is over and all of it is sent."""

    def __init__(
        self,
        store: LogStore,
        backend: Backend,
        tracker: JobTracker,
        task_id: int,
        tail_lines: int,
        only: int | None = None,
    ) -> None:
        self._store = store
        self._backend = backend
        self._tracker = tracker
        self._job_id = tracker.job_id
        self._task_id = task_id
        # Applies to what is already there when following starts, like `tail -n N -f`.
        self._tail_lines = tail_lines
        # The one attempt to follow; None: all of them.
        self._only = only
        self._attempt: _Attempt | None = None
        self._last = b""

    def _task(self) -> job_pb2.Task:
        return self._tracker.job.tasks[self._task_id]

    async def follow(self) -> AsyncIterator[bytes]:
        while True:
            store_changed = self._store.changed(self._job_id)
            task = self._task()
            status = task_status(task)
            if self._over(task, status):
                if self._final_copy_ready(task, status):
                    for chunk in self._finish():
                        yield chunk
                    return
                # The controller fetches the logs right after an attempt ends.
                await self._tracker.wait(store_changed)
                continue
            wanted = self._only is None or self._only == current_attempt(task)
            if task.cluster_name and status in TAILABLE and wanted:
                if self._attempt is None or not self._attempt.same_as(task):
                    async for chunk in self._begin_attempt(task):
                        yield chunk
                attempt = self._attempt
                assert attempt is not None
                if attempt.retail:
                    attempt.retail = False
                    async for chunk in self._tail(attempt):
                        yield chunk
                    continue
                # The tail ended or broke before the task finished on the cluster (it
                # was still starting, or unreadable): tail again after the next event.
                attempt.retail = not attempt.finished_on_cluster
            await self._tracker.wait()

    def _over(self, task: job_pb2.Task, status: JobStatus | None) -> bool:
        """Whether what is followed will not run any more (its last copy may be on its way)."""
        if self._tracker.over or status in TERMINAL:
            return True
        return self._only is not None and current_attempt(task) > self._only

    def _emit(self, data: bytes) -> bytes:
        if data:
            self._last = data[-1:]
        return data

    def _final_copy_ready(self, task: job_pb2.Task, status: JobStatus | None) -> bool:
        if self._tracker.over or self._tracker.job.current_task_id > self._task_id:
            return True
        if self._only is not None:
            number = self._only
            # A later attempt launched only after this one's teardown, fetch included (a
            # restart counts itself as soon as it is RECOVERING, before the fetch).
            if current_attempt(task) > number and status != JobStatus.RECOVERING:
                return True
        else:
            number = self._attempt.number if self._attempt else current_attempt(task)
        cluster = self._attempt.cluster_name if self._attempt else task.cluster_name
        if not cluster:
            return True
        stored = self._store.task_log(self._job_id, self._task_id)
        return stored is not None and stored.section(number) is not None

    def _finish(self) -> list[bytes]:
        stored = self._store.task_log(self._job_id, self._task_id)
        if stored is None:
            return []
        path = stored.path
        if self._only is not None:
            section = stored.section(self._only)
            if section is None:
                return []
            if self._attempt is not None:
                start = section.offset + min(self._attempt.covered, section.size)
            else:
                start = tail_offset(path, self._tail_lines, section.offset, section.end)
            return [self._emit(b) for b in read_range(path, start, section.end)]
        start = 0
        if self._attempt is not None:
            section = stored.section(self._attempt.number)
            if section is None:
                return []
            start = section.offset + min(self._attempt.covered, section.size)
        elif self._tail_lines:
            start = tail_offset(path, self._tail_lines)
        return [self._emit(b) for b in read_range(path, start, stored.size)]

    async def _begin_attempt(self, task: job_pb2.Task) -> AsyncIterator[bytes]:
        first = self._attempt is None
        number = current_attempt(task)
        self._attempt = _Attempt(number, task.cluster_name)
        if not first:
            yield self._emit(separator(self._last))
            return
        backlog = b""
        if self._only is None:
            stored = self._store.task_log(self._job_id, self._task_id)
            backlog = _stored_before(stored, number)
        if self._tail_lines:
            # Cut the last lines out of everything there now, live part included.
            live = await _read_live(self._backend, task.cluster_name) or b""
            self._attempt.covered = len(live)
            backlog += live
            backlog = backlog[tail_start(backlog, self._tail_lines) :]
        for chunk in chunks(backlog):
            yield self._emit(chunk)

    async def _tail(self, attempt: _Attempt) -> AsyncIterator[bytes]:
        """Streams the attempt's live log until it ends, breaks, or the task moves on."""
        queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=16)
        source = self._backend.tail_logs(self._backend.handle_for(attempt.cluster_name))
        pump = asyncio.create_task(_pump(source, queue))
        getter: asyncio.Task[Any] | None = None
        received = 0
        try:
            while True:
                if getter is None:
                    getter = asyncio.create_task(queue.get())
                await self._tracker.wait(getter)
                if not getter.done():
                    task = self._task()
                    if self._tracker.over or not attempt.same_as(task):
                        return
                    if task_status(task) not in TAILABLE | TERMINAL:
                        # RECOVERING: the cluster is going away, and a relaunch may
                        # reuse its name; the next attempt starts its own log.
                        return
                    continue
                item, getter = getter.result(), None
                if item is _END:
                    attempt.finished_on_cluster = await self._finished_on_cluster(attempt)
                    return
                if isinstance(item, Exception):
                    log.info(
                        "live tail broke",
                        extra={"cluster": attempt.cluster_name, "error": repr(item)},
                    )
                    return
                # A re-tail starts from the beginning: skip what was already sent.
                fresh = item[max(0, attempt.covered - received) :]
                received += len(item)
                attempt.covered = max(attempt.covered, received)
                if fresh:
                    yield self._emit(fresh)
        finally:
            if getter is not None:
                getter.cancel()
            pump.cancel()
            await asyncio.wait([pump])

    async def _finished_on_cluster(self, attempt: _Attempt) -> bool:
        try:
            status = await self._backend.task_status(self._backend.handle_for(attempt.cluster_name))
        except Exception:
            return False
        return status is not None and status.finished


async def _pump(source: AsyncIterator[bytes], queue: asyncio.Queue[Any]) -> None:
    """Moves a backend's tail into a queue, so it can be raced against job events."""
    try:
        async for chunk in source:
            await queue.put(chunk)
        await queue.put(_END)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        await queue.put(exc)
    finally:
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()

"""Log files on disk, per job: where they live, who waits on them, how they are written.

Layout under the store's root (`<data_dir>/logs`):

    <job_id>/task-<task_id>.log            every fetched attempt of the task, in order
    <job_id>/task-<task_id>.sections.json  where each attempt starts and ends (attempts.py)
    <job_id>/controller.log                the job's lifecycle lines, appended

Invariants:
- A task log is only ever replaced whole, durable before in place (durable.py), so a
  reader sees an old or a new copy, never a torn one. Logs saved at once (many jobs
  ending together) are written in a few trips to worker threads; a task's log is
  written under its lock, one writer at a time.
- Controller lines are appended with one small synchronous write each (O_APPEND),
  in arrival order and visible to readers at once; the most recently written
  controller logs are kept open.
- Every write wakes the job's waiters (`changed`), so followers never poll the disk.
- Nothing here checks who may write: the service does, before it calls the store,
  so a refused request never creates a folder.
"""

from __future__ import annotations

import asyncio
import collections
import os
import weakref
from collections.abc import Iterable
from pathlib import Path

from services.backends.base import cluster_name
from services.common.coalesce import Coalescer
from services.logs import attempts, durable
from services.logs.attempts import Section, TaskLog

CONTROLLER_LOG = "controller.log"  # in the job's folder
APPEND_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT  # (not inherited: PEP 446)
# Controller logs kept open for appending, most recently written last: a job's lines
# come in bursts (launch, running, end), and opening a file costs a path lookup.
OPEN_APPENDERS = 256


class LogStore:
    """Task and controller logs of every job, under one folder."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._waiters: weakref.WeakValueDictionary[int, asyncio.Event] = (
            weakref.WeakValueDictionary()
        )
        self._locks: weakref.WeakValueDictionary[tuple[int, int], asyncio.Lock] = (
            weakref.WeakValueDictionary()
        )
        # Open file descriptors of controller logs, by job.
        self._appenders: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._root = str(root)
        # Task logs saved at once are written in trips of up to 64 to worker threads (four
        # at a time): a thread hop per log costs more than the write.
        self._writes: Coalescer[None, _Write, None] = Coalescer(self._write, max_batch=64)

    def task_path(self, job_id: int, task_id: int) -> Path:
        return self.root / str(job_id) / f"task-{task_id}.log"

    def controller_path(self, job_id: int) -> Path:
        return self.root / str(job_id) / CONTROLLER_LOG

    def changed(self, job_id: int) -> asyncio.Event:
        """An event set by the next write of any of the job's logs.

        Take it before reading, then wait on it: a write between the read and the
        wait still wakes the waiter.
        """
        event = self._waiters.get(job_id)
        if event is None:
            event = asyncio.Event()
            self._waiters[job_id] = event
        return event

    def _notify(self, job_id: int) -> None:
        event = self._waiters.pop(job_id, None)
        if event is not None:
            event.set()

    def append_controller_lines(self, job_id: int, lines: Iterable[str]) -> int:
        """Appends lines (each ending in a newline) to the job's controller log."""
        data = "".join(line if line.endswith("\n") else line + "\n" for line in lines).encode()
        if not data:
            return 0
        # One small synchronous write (O_APPEND) keeps concurrent appends in arrival
        # order and visible to readers at once.
        _write_fully(self._appender(job_id), data)
        self._notify(job_id)
        return len(data)

    def _appender(self, job_id: int) -> int:
        """The job's controller log, open for appending (the job's folder made if missing).
        Plain descriptors and string paths: a pathlib path and file object per open cost
        three times the open itself."""
        fd = self._appenders.pop(job_id, None)
        if fd is None:
            folder = f"{self._root}/{job_id}"
            path = f"{folder}/{CONTROLLER_LOG}"
            try:
                fd = os.open(path, APPEND_FLAGS, 0o666)
            except FileNotFoundError:
                os.makedirs(folder, exist_ok=True)
                fd = os.open(path, APPEND_FLAGS, 0o666)
            if len(self._appenders) >= OPEN_APPENDERS:
                _, oldest = self._appenders.popitem(last=False)
                os.close(oldest)
        self._appenders[job_id] = fd
        return fd

    def close(self) -> None:
        """Closes the controller logs kept open."""
        while self._appenders:
            _, fd = self._appenders.popitem()
            os.close(fd)

    def task_log(self, job_id: int, task_id: int) -> TaskLog | None:
        """The stored log of a task, or None when nothing was fetched yet."""
        return attempts.read_task_log(
            self.task_path(job_id, task_id), cluster_name(job_id, task_id)
        )

    async def save_task_attempt(
        self, job_id: int, task_id: int, attempt: int, cluster_name: str, data: bytes
    ) -> int:
        """Stores one attempt's logs of a task, replacing an earlier copy of that attempt."""
        lock = self._locks.get((job_id, task_id))
        if lock is None:
            lock = asyncio.Lock()
            self._locks[(job_id, task_id)] = lock
        async with lock:
            await self._writes.call(
                None, (job_id, task_id, Section(attempt, cluster_name, 0, len(data)), data)
            )
        self._notify(job_id)
        return len(data)

    async def _write(self, _: None, writes: list[_Write]) -> list[BaseException | None]:
        """Writes attempts' logs in one trip to a worker thread; each failure its own."""
        return await asyncio.to_thread(self._write_all, writes)

    def _write_all(self, writes: list[_Write]) -> list[BaseException | None]:
        """Writes each task log whole and durable (log before index); a failure fails
        only its own log."""
        groups: list[list[durable.File] | BaseException] = []
        for job_id, task_id, section, data in writes:
            try:
                current = self.task_log(job_id, task_id)
                path = self.task_path(job_id, task_id)
                groups.append(attempts.with_attempt(current, path, section, data))
            except Exception as error:  # a log or an index that cannot be read
                groups.append(error)
        return durable.put_in_place(self._root, groups)


# A task log to write: job, task, the attempt's section (offset 0), its bytes.
_Write = tuple[int, int, Section, bytes]


def _write_fully(fd: int, data: bytes) -> None:
    """Writes all of `data` (a write may take part of it)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]

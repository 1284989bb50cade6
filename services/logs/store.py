"""Log files on disk: fetched task logs and appended controller logs, per job.

Layout under the store's root (`<data_dir>/logs`):

    <job_id>/task-<task_id>.log            every fetched attempt of the task, in order
    <job_id>/task-<task_id>.sections.json  where each attempt starts and ends (none while
                                           the log holds attempt 1 alone, most tasks' case)
    <job_id>/controller.log                the job's lifecycle lines, appended

A task's attempts are numbered 1, then one more per recovery or restart (contract §18);
the number is what a stored copy is known by, since every attempt of a task runs on
a cluster of the same name.

Invariants:
- A task log is only ever replaced whole (temp file + `os.replace`, the log before
  its index), so a reader sees an old or a new copy, never a torn one, and an index
  never points past the end of the log it describes. Every file is synced to disk
  before it takes its place. Logs saved at once (many jobs ending together) are
  written in a few trips to worker threads: all their files first, then synced,
  then put in place. On Linux a trip of several logs is synced with one `syncfs`
  of the logs' filesystem: a new file's fsync also makes its folder's entry
  durable (a journal commit on ext4, a write of each parent folder without a
  journal), a cost paid once per file that one syncfs pays once per trip. (It
  also writes out whatever else on that filesystem waits to be: give the logs a
  filesystem of their own where that matters.)
- Attempts are kept in the order of their numbers, whatever order they were fetched
  in, and joined with `separator()`, exactly as a live follower joins the clusters
  it tails, so "byte N of this attempt's log" means the same thing live and in the
  stored copy: a follower can switch to the stored copy without repeating or
  skipping bytes.
- A fetch of an attempt already stored replaces that attempt's section (a retried
  fetch is idempotent); a new attempt adds a section (a recovered task keeps the
  logs of its earlier attempts).
- Every write wakes the job's waiters (`changed`), so followers never poll the disk.
- Nothing here checks who may write: the service does, before it calls the store,
  so a refused request never creates a folder.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import dataclasses
import json
import os
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from services.backends.base import cluster_name
from services.common.coalesce import Coalescer

CHUNK_BYTES = 64 * 1024
CONTROLLER_LOG = "controller.log"  # in the job's folder
# Logs in one trip from which the trip syncs the filesystem once instead of each file.
SYNC_AT_ONCE = 4
APPEND_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT  # (not inherited: PEP 446)
# Controller logs kept open for appending, most recently written last: a job's lines
# come in bursts (launch, running, end), and opening a file costs a path lookup.
OPEN_APPENDERS = 256
RECOVERED_MARKER = b"[managed-jobs] task recovered on a new cluster\n"


def separator(previous: bytes) -> bytes:
    """What goes between two attempts' logs; `previous` is what came before (its end suffices)."""
    newline = b"\n" if previous and not previous.endswith(b"\n") else b""
    return newline + RECOVERED_MARKER


def tail_start(data: bytes, lines: int) -> int:
    """Offset in `data` where its last `lines` lines begin (0 for all, or when `lines` <= 0)."""
    if lines <= 0:
        return 0
    end = len(data) - 1 if data.endswith(b"\n") else len(data)
    for _ in range(lines):
        end = data.rfind(b"\n", 0, end)
        if end < 0:
            return 0
    return end + 1


def chunks(data: bytes) -> Iterator[bytes]:
    """`data` in pieces small enough for one message each."""
    for start in range(0, len(data), CHUNK_BYTES):
        yield data[start : start + CHUNK_BYTES]


@dataclasses.dataclass(frozen=True)
class Section:
    """The bytes of one attempt inside a task's stored log."""

    attempt: int
    cluster_name: str
    offset: int
    size: int

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclasses.dataclass(frozen=True)
class TaskLog:
    """A stored task log: its file and the attempts in it."""

    path: Path
    sections: tuple[Section, ...]

    @property
    def size(self) -> int:
        last = self.sections[-1] if self.sections else None
        return last.offset + last.size if last else 0

    def section(self, attempt: int) -> Section | None:
        """The stored copy of attempt `attempt`, if any."""
        for section in self.sections:
            if section.attempt == attempt:
                return section
        return None

    def start_of(self, attempt: int) -> int | None:
        """Where attempt `attempt`'s bytes (stored, or to come) begin; None after the last.

        That is the offset of the first section of this attempt or a later one: what
        comes before it is the earlier attempts, separators included.
        """
        for section in self.sections:
            if section.attempt >= attempt:
                return section.offset
        return None


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
        path = self.task_path(job_id, task_id)
        try:
            raw = json.loads(_index_path(path).read_text())
        except FileNotFoundError:
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                return None
            # A log without an index holds attempt 1 alone (every attempt of a task runs
            # on a cluster of the same name).
            return TaskLog(path, (Section(1, cluster_name(job_id, task_id), 0, size),))
        return TaskLog(path, _sections(raw["sections"]))

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
        """Writes each task log atomically (log before index), every file durable before
        any replaces its old copy; a failure fails only its own log.

        All files are written first and synced after, with one syncfs where it can be.
        Temporary names are fixed (`<name>.tmp`): a task's log is written under its
        lock, one writer at a time.
        """
        filesystem = _filesystem_of(self._root) if len(writes) >= SYNC_AT_ONCE else None
        try:
            return self._write_and_sync(writes, filesystem)
        finally:
            if filesystem is not None:
                os.close(filesystem)

    def _write_and_sync(
        self, writes: list[_Write], filesystem: int | None
    ) -> list[BaseException | None]:
        outcomes: list[BaseException | None] = [None] * len(writes)
        staged: list[tuple[int, list[_File]]] = []
        for number, (job_id, task_id, section, data) in enumerate(writes):
            files: list[_File] = []
            try:
                path = self.task_path(job_id, task_id)
                files = _files(self.task_log(job_id, task_id), path, section, data)
                for file_path, body in files:
                    file_path.parent.mkdir(parents=True, exist_ok=True)
                    _temp(file_path).write_bytes(body)
                staged.append((number, files))
            except Exception as error:  # a file or an index that cannot be read or written
                outcomes[number] = error
                _discard(files)
        synced = filesystem is not None and _syncfs is not None and _syncfs(filesystem) == 0
        for number, files in staged:
            try:
                if not synced:
                    for path, _ in files:
                        _fsync(_temp(path))
                for path, _ in files:
                    os.replace(_temp(path), path)
            except OSError as error:
                outcomes[number] = error
                _discard(files)
        return outcomes

    def read_range(self, path: Path, start: int, end: int | None = None) -> Iterator[bytes]:
        """Bytes [start, end) of a file in chunks; stops early at the end of the file."""
        position = start
        while end is None or position < end:
            want = CHUNK_BYTES if end is None else min(CHUNK_BYTES, end - position)
            try:
                with path.open("rb") as file:
                    file.seek(position)
                    block = file.read(want)
            except FileNotFoundError:
                return
            if not block:
                return
            position += len(block)
            yield block

    def read_bytes(self, path: Path, start: int, end: int) -> bytes:
        return b"".join(self.read_range(path, start, end))

    def tail_offset(self, path: Path, lines: int, start: int = 0, end: int | None = None) -> int:
        """Offset where the last `lines` lines of bytes [start, end) of a file begin.

        `start` when `lines` <= 0, when there are no more lines than that, or when there
        is no file; `end` defaults to the end of the file.
        """
        if lines <= 0:
            return start
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return start
        end = size if end is None else min(end, size)
        if end <= start:
            return start
        with path.open("rb") as file:
            # A final newline ends the last line rather than starting another one.
            file.seek(end - 1)
            position = end - 1 if file.read(1) == b"\n" else end
            remaining = lines
            while position > start:
                block_start = max(start, position - CHUNK_BYTES)
                file.seek(block_start)
                block = file.read(position - block_start)
                found = len(block)
                while (found := block.rfind(b"\n", 0, found)) >= 0:
                    remaining -= 1
                    if remaining == 0:
                        return block_start + found + 1
                position = block_start
        return start


# A task log to write: job, task, the attempt's section (offset 0), its bytes.
_Write = tuple[int, int, "Section", bytes]
# A file to write whole: its path and bytes.
_File = tuple[Path, bytes]


def _index_path(log_path: Path) -> Path:
    return log_path.with_suffix(".sections.json")


def _sections(items: list[dict[str, Any]]) -> tuple[Section, ...]:
    """The sections of an index; an index written before attempts were numbered has them
    in fetch order, which is taken as their numbers."""
    return tuple(
        Section(
            attempt=int(item.get("attempt", number)),
            cluster_name=str(item.get("cluster_name", "")),
            offset=int(item["offset"]),
            size=int(item["size"]),
        )
        for number, item in enumerate(items, start=1)
    )


def _files(current: TaskLog | None, path: Path, new: Section, data: bytes) -> list[_File]:
    """The files of the task log with `new` replacing its attempt's section or added: the
    log, then its index (none for attempt 1 alone)."""
    parts: list[tuple[Section, bytes]] = []
    if current is not None:
        old = path.read_bytes()
        parts = [(s, old[s.offset : s.end]) for s in current.sections if s.attempt != new.attempt]
    parts.append((new, data))
    parts.sort(key=lambda part: part[0].attempt)
    content = bytearray()
    sections = []
    for index, (section, body) in enumerate(parts):
        if index:
            content += separator(bytes(content[-1:]))
        sections.append(dataclasses.replace(section, offset=len(content), size=len(body)))
        content += body
    if current is None and new.attempt == 1:
        return [(path, bytes(content))]
    index_json = json.dumps({"sections": [dataclasses.asdict(s) for s in sections]})
    return [(path, bytes(content)), (_index_path(path), index_json.encode())]


def _write_fully(fd: int, data: bytes) -> None:
    """Writes all of `data` (a write may take part of it)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _temp(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def _load_syncfs() -> Callable[[int], int] | None:
    """Linux's syncfs(2) from the C library, or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        syncfs = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None
    syncfs.argtypes = [ctypes.c_int]
    syncfs.restype = ctypes.c_int
    return syncfs


_syncfs = _load_syncfs()


def _filesystem_of(path: str) -> int | None:
    """A descriptor to syncfs the filesystem holding `path` by, or None where there is no
    syncfs. Open it before writing: syncfs reports the write-back errors since then."""
    if _syncfs is None:
        return None
    try:
        return os.open(path, os.O_RDONLY)
    except OSError:
        return None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _discard(files: list[_File]) -> None:
    for path, _ in files:
        _temp(path).unlink(missing_ok=True)

"""A task's stored log and the attempts in it: the sections index, and how attempts join.

A task's attempts are numbered 1, then one more per recovery or restart (contract
§18); the number is what a stored copy is known by, since every attempt of a task
runs on a cluster of the same name. The log file holds the attempts in the order
of their numbers, whatever order they were fetched in, joined with `separator()`
exactly as a live follower joins the clusters it tails, so "byte N of this
attempt's log" means the same thing live and in the stored copy: a follower can
switch to the stored copy without repeating or skipping bytes.

Next to the log, `task-<task_id>.sections.json` says where each attempt starts and
ends; there is none while the log holds attempt 1 alone (most tasks' case). A fetch
of an attempt already stored replaces that attempt's section (a retried fetch is
idempotent); a new attempt adds a section (a recovered task keeps the logs of its
earlier attempts). The files of a new copy are the log, then its index: put in
place in that order, an index never points past the end of the log it describes.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from services.logs.durable import File

RECOVERED_MARKER = b"[managed-jobs] task recovered on a new cluster\n"


def separator(previous: bytes) -> bytes:
    """What goes between two attempts' logs; `previous` is what came before (its end suffices)."""
    newline = b"\n" if previous and not previous.endswith(b"\n") else b""
    return newline + RECOVERED_MARKER


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


def read_task_log(path: Path, cluster_name: str) -> TaskLog | None:
    """The task log at `path` with its attempts, or None when there is none.

    Args:
        path: The log file.
        cluster_name: The task's cluster, named in attempt 1 of a log without an index.
    """
    try:
        raw = json.loads(_index_path(path).read_text())
    except FileNotFoundError:
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return None
        # A log without an index holds attempt 1 alone (every attempt of a task runs
        # on a cluster of the same name).
        return TaskLog(path, (Section(1, cluster_name, 0, size),))
    return TaskLog(path, _sections(raw["sections"]))


def with_attempt(current: TaskLog | None, path: Path, new: Section, data: bytes) -> list[File]:
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

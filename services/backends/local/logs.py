"""Reading a local cluster's rank logs, whole or as they grow.

A single-node task's log is passed on as written. A multi-node task's lines get
the prefix `(rank=<r>) `, and only whole lines are passed on while following, so
lines of two ranks never run into each other.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable

from services.backends.local.cluster import ClusterLayout, read_json
from services.backends.ranks import MAX_HELD_LINE, RankLogJoiner, prefix_lines

_READ_CHUNK = MAX_HELD_LINE


def num_nodes(layout: ClusterLayout) -> int:
    """The task's node count, from task.json or else from the rank logs present."""
    raw = read_json(layout.task_file)
    if isinstance(raw, dict) and isinstance(raw.get("num_nodes"), int):
        return max(1, raw["num_nodes"])
    ranks = [
        int(m.group(1))
        for p in layout.logs_dir.glob("rank-*.log")
        if (m := re.fullmatch(r"rank-(\d+)\.log", p.name))
    ]
    return max(ranks, default=0) + 1


def read_all(layout: ClusterLayout) -> bytes:
    """Every rank's log in rank order (prefixed when multi-node); b"" if there is none."""
    if not layout.dir.is_dir():
        return b""
    nodes = num_nodes(layout)
    parts = []
    for rank in range(nodes):
        try:
            data = layout.rank_log(rank).read_bytes()
        except OSError:
            continue
        parts.append(data if nodes == 1 else prefix_lines(data, rank))
    return b"".join(parts)


class LogFollower:
    """Reads what the ranks appended since the last call; whole lines when prefixing."""

    def __init__(self, layout: ClusterLayout) -> None:
        self._layout = layout
        self._joiner: RankLogJoiner | None = None
        self._offsets: dict[int, int] = {}

    def read_new(self) -> bytes:
        if self._joiner is None:
            if not self._layout.task_file.exists():
                return b""
            self._joiner = RankLogJoiner(num_nodes(self._layout))
        out = []
        for rank in range(self._joiner.num_nodes):
            offset = self._offsets.get(rank, 0)
            try:
                with open(self._layout.rank_log(rank), "rb") as f:
                    f.seek(offset)
                    data = f.read(_READ_CHUNK)
            except OSError:
                continue
            self._offsets[rank] = offset + len(data)
            out.append(self._joiner.add(rank, data))
        return b"".join(out)

    def flush(self) -> bytes:
        return self._joiner.flush() if self._joiner is not None else b""


async def follow(
    layout: ClusterLayout, finished: Callable[[], bool], poll_interval: float
) -> AsyncIterator[bytes]:
    """Yields log bytes as the ranks write them, until `finished()` and everything written
    has been yielded. `finished` is asked before each read, so whatever was written
    before the end is read after it."""
    follower = LogFollower(layout)
    while True:
        done = finished()
        chunk = await asyncio.to_thread(follower.read_new)
        if chunk:
            yield chunk
        if done:
            while chunk := await asyncio.to_thread(follower.read_new):
                yield chunk
            rest = follower.flush()
            if rest:
                yield rest
            return
        if not chunk:
            await asyncio.sleep(poll_interval)

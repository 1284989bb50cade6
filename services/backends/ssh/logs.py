"""Reading the ranks' logs over SSH: all of them at once, or following them.

Each read is one command per rank's host: a header (does the host still hold the
launch, has the rank ended, is its runner alive) then up to a chunk of the log
from an offset. The header is taken before the bytes, so a rank reported over
has all its output in that reply or, past a full chunk, the next ones.
Multi-node logs are joined as every backend joins them (`ranks`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from services.backends.ranks import RankLogJoiner, prefix_lines
from services.backends.ssh.fleet import Fleet, first
from services.backends.ssh.hosts import Fields, HostUnreachable, parse_reply
from services.backends.ssh.state import Launch

CHUNK = 4 << 20


async def read_rank(fleet: Fleet, launch: Launch, rank: int, offset: int) -> tuple[Fields, bytes]:
    """The header and up to `CHUNK` bytes of the rank's log from `offset`.

    Raises:
        HostUnreachable: the rank's host did not answer.
    """
    host = fleet.hosts.get(launch.hosts[rank])
    if host is None:
        return {"state": "absent"}, b""
    data = await fleet.ask(host, "logs", launch.name, launch.launch, str(offset), str(CHUNK))
    header, _, body = data.partition(b"\n")
    return first(parse_reply(header))[1] or {"state": "absent"}, body


async def read_all(fleet: Fleet, launch: Launch) -> list[bytes] | None:
    """Each rank's whole log; None when no host holds the launch any more.

    Raises:
        BackendUnreachableError: a host of the launch did not answer.
    """

    async def whole(rank: int) -> tuple[bool, bytes]:
        parts: list[bytes] = []
        while True:
            header, data = await read_rank(fleet, launch, rank, sum(map(len, parts)))
            parts.append(data)
            if len(data) < CHUNK:
                return header.get("state") == "ours", b"".join(parts)

    try:
        reads = await asyncio.gather(*(whole(rank) for rank in range(len(launch.hosts))))
    except HostUnreachable as exc:
        raise fleet.unreachable([exc], f"reading the logs of {launch.name}") from None
    if not any(present for present, _ in reads):
        return None
    return [data for _, data in reads]


def join(logs: list[bytes]) -> bytes:
    """The ranks' logs as one: rank order, lines prefixed when multi-node."""
    if len(logs) == 1:
        return logs[0]
    return b"".join(prefix_lines(data, rank) for rank, data in enumerate(logs) if data)


def _over(header: Fields) -> bool:
    """Whether the rank's log will not grow any more: the host let the launch go, the
    rank ended, or its runner died after it started."""
    if header.get("state") != "ours" or header.get("ended") == "1":
        return True
    return header.get("ready") == "1" and header.get("alive") == "0"


async def follow(fleet: Fleet, launch: Launch, poll_interval: float) -> AsyncIterator[bytes]:
    """Yields the ranks' log bytes as they grow, until every rank is over and all it
    wrote was yielded.

    Raises:
        BackendUnreachableError: a host of the launch stopped answering.
    """
    joiner = RankLogJoiner(len(launch.hosts))
    offsets = [0] * len(launch.hosts)
    while True:
        try:
            reads = await asyncio.gather(
                *(read_rank(fleet, launch, rank, offset) for rank, offset in enumerate(offsets))
            )
        except HostUnreachable as exc:
            raise fleet.unreachable([exc], f"tailing {launch.name}") from None
        done = True
        out = []
        for rank, (header, data) in enumerate(reads):
            offsets[rank] += len(data)
            out.append(joiner.add(rank, data))
            done = done and _over(header) and len(data) < CHUNK
        chunk = b"".join(out)
        if chunk:
            yield chunk
        if done:
            rest = joiner.flush()
            if rest:
                yield rest
            return
        if not chunk:
            await asyncio.sleep(poll_interval)

"""Every host of every pool as one: asking a host, asking them all, and turning hosts
that did not answer into the backend's `BackendUnreachableError`.

A host that answers but whose node script failed is a `BackendError`; a host that
does not answer is a `HostUnreachable` here, and becomes a
`BackendUnreachableError` whose `timeout` is the largest `unreachable_timeout` of
the silent hosts' pools.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from services.backends.base import BackendError, BackendUnreachableError
from services.backends.ssh.config import Host, NodePool
from services.backends.ssh.hosts import (
    Fields,
    HostCommandError,
    HostConnections,
    HostUnreachable,
    parse_reply,
)
from services.backends.ssh.state import HostScan

log = logging.getLogger(__name__)

Reply = list[tuple[str, Fields]]


def first(reply: Reply) -> tuple[str, Fields]:
    """The first line of a reply (empty when there is none)."""
    return reply[0] if reply else ("", {})


class Fleet:
    """The pools, their hosts by id, and one connection pool to reach them."""

    def __init__(self, pools: Mapping[str, NodePool], conns: HostConnections) -> None:
        self.pools = dict(pools)
        self.hosts = {host.id: host for pool in self.pools.values() for host in pool.hosts}
        self.conns = conns
        # time.monotonic() of the last answer from any host.
        self.last_answer = -float("inf")

    async def ask(
        self,
        host: Host,
        verb: str,
        *args: str,
        timeout: float | None = None,
        stdin: bytes | None = None,
    ) -> bytes:
        """Runs a node script verb on `host`; its raw output.

        Raises:
            HostUnreachable: the host did not answer.
            BackendError: the node script failed there.
        """
        try:
            data = await self.conns.run(host, verb, *args, timeout=timeout, stdin=stdin)
        except HostCommandError as exc:
            raise BackendError(str(exc)) from None
        self.last_answer = time.monotonic()
        return data

    async def lines(self, host: Host, verb: str, *args: str, **options: Any) -> Reply:
        """`ask`, parsed into reply lines."""
        return parse_reply(await self.ask(host, verb, *args, **options))

    def unreachable(self, errors: Sequence[HostUnreachable], what: str) -> BackendUnreachableError:
        """The backend's error for hosts that did not answer."""
        timeout = max(self.pools[e.host.pool].unreachable_timeout for e in errors)
        more = f" (and {len(errors) - 1} more host(s))" if len(errors) > 1 else ""
        return BackendUnreachableError(f"{what}: {errors[0]}{more}", timeout=timeout)

    @staticmethod
    def silent(
        scans: Mapping[str, HostScan | HostUnreachable], hids: Iterable[str]
    ) -> list[HostUnreachable]:
        """The errors of the hosts among `hids` that did not answer."""
        return [scan for hid in hids if isinstance(scan := scans.get(hid), HostUnreachable)]

    async def scan_all(
        self, *, job: int = 0, names: Sequence[str] = (), processes: bool = False
    ) -> dict[str, HostScan | HostUnreachable]:
        """What every host says (one command each): its reservation and folders, the job's
        highest epoch there, what it recorded of `names` (and, with `processes`, how many
        of their processes run there). Hosts that did not answer map to their error."""

        async def one(host: Host) -> HostScan | HostUnreachable:
            flag = "1" if processes else "0"
            try:
                return HostScan.parse(await self.lines(host, "scan", str(job), flag, *names))
            except HostUnreachable as exc:
                return exc
            except BackendError as exc:
                # A host whose node script fails (a full disk) cannot be asked either.
                log.warning("host scan failed", extra={"host": host.id, "error": str(exc)})
                return HostUnreachable(host, str(exc))

        hosts = list(self.hosts.values())
        results = await asyncio.gather(*(one(host) for host in hosts))
        return {host.id: result for host, result in zip(hosts, results, strict=True)}

    async def release(self, hosts: Sequence[Host], launch: str) -> None:
        """Releases `launch` on each host that it still holds; best effort, since what
        cannot be released now is reaped later."""
        results = await asyncio.gather(
            *(self.lines(host, "release", launch) for host in hosts), return_exceptions=True
        )
        for host, result in zip(hosts, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result
            if isinstance(result, Exception):
                log.warning("release failed", extra={"host": host.id, "error": str(result)})

"""Which reservations no cluster owns any more, decided from what the hosts say.

Every backend instance (each controller replica, the logs service) reaps: it asks
every host for its reservation (one command per host, which also removes cluster
folders no reservation owns), then every host for what it recorded of the
reserved cluster names (one more), and releases a reservation when

- a newer launch of its cluster name was recorded anywhere (it was relaunched
  elsewhere, e.g. after its host stayed unreachable; so its processes die when
  the host comes back), or
- its launch never finished (not ready) and is older than the launch timeout
  (the launcher died half-way), or
- it is ready but a host of its cluster that answered no longer holds the launch
  (the rest of the cluster was terminated or released).

Hosts that do not answer are left out; a release is always of one launch, and
the host does it only if that launch still holds it, so reapers racing each
other or a launch cannot release the wrong cluster.

`Reaper` runs the passes in the background once the backend is first used, every
`interval` seconds on average, jittered so that the replicas' reapers do not all
ask at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections.abc import Iterable, Mapping

from services.backends.base import BackendError
from services.backends.ssh.config import Host
from services.backends.ssh.fleet import Fleet, first
from services.backends.ssh.hosts import HostUnreachable
from services.backends.ssh.state import HostScan, LaunchKey
from services.common.background import Background

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Release:
    """A reservation to release, and why."""

    host: str
    cluster: str
    launch: str
    why: str


def newest_launches(scans: Iterable[HostScan]) -> dict[str, LaunchKey]:
    """Cluster name -> the newest launch key any host holds or recorded."""
    newest: dict[str, LaunchKey] = {}
    for scan in scans:
        found = list(scan.fences.items())
        if scan.reservation is not None:
            found.append((scan.reservation.cluster, scan.reservation.key))
        for name, key in found:
            newest[name] = max(newest.get(name, key), key)
    return newest


def _holds(scan: HostScan | None, launch: str) -> bool:
    return scan is not None and scan.reservation is not None and scan.reservation.launch == launch


def releases(
    scans: Mapping[str, HostScan], newest: Mapping[str, LaunchKey], launch_timeout: float
) -> list[Release]:
    """The reservations of `scans` (host id -> what it said) that no cluster owns.

    Args:
        scans: What every host that answered said.
        newest: `newest_launches` over every host that answered.
        launch_timeout: Seconds a launch may take.
    """
    out = []
    for host, scan in scans.items():
        held = scan.reservation
        if held is None:
            continue
        top = newest.get(held.cluster)
        if top is not None and top > held.key:
            why = "a newer launch of its cluster exists"
        elif not held.ready:
            if held.age <= launch_timeout:
                continue
            why = f"its launch did not finish in {launch_timeout:g}s"
        elif any(
            peer != host and peer in scans and not _holds(scans[peer], held.launch)
            for peer in held.hosts
        ):
            why = "the rest of its cluster is gone"
        else:
            continue
        out.append(Release(host, held.cluster, held.launch, why))
    return out


async def reap(fleet: Fleet, launch_timeout: float) -> list[Release]:
    """One pass over every host (two commands each at most); the releases it made.

    Args:
        fleet: The hosts.
        launch_timeout: Seconds after which an unfinished launch is reaped.
    """

    async def first_round(host: Host) -> HostScan | None:
        try:
            return HostScan.parse(await fleet.lines(host, "reapscan"))
        except (HostUnreachable, BackendError):
            return None

    hosts = list(fleet.hosts.values())
    found = await asyncio.gather(*(first_round(host) for host in hosts))
    scans = {host.id: scan for host, scan in zip(hosts, found, strict=True) if scan is not None}
    names = sorted({s.reservation.cluster for s in scans.values() if s.reservation is not None})
    if not names:
        return []
    fences = await fleet.scan_all(names=names)
    newest = newest_launches(
        [*scans.values(), *(s for s in fences.values() if isinstance(s, HostScan))]
    )
    made = []
    for release in releases(scans, newest, launch_timeout):
        try:
            reply = await fleet.lines(fleet.hosts[release.host], "release", release.launch)
        except (HostUnreachable, BackendError) as exc:
            log.warning("reaper could not release", extra={"host": release.host, "error": str(exc)})
            continue
        if first(reply)[0] == "ok":
            log.info(
                "reaper released a host",
                extra={"host": release.host, "cluster": release.cluster, "why": release.why},
            )
            made.append(release)
    return made


class Reaper:
    """Reaper passes of one backend instance, in the background (none at interval 0)."""

    def __init__(self, fleet: Fleet, interval: float, launch_timeout: float) -> None:
        self._fleet = fleet
        self._interval = interval
        # A launch that is not ready after this long died half-way.
        self._launch_timeout = launch_timeout
        self._passes = Background("ssh-reaper", self._forever)

    async def reap(self) -> list[Release]:
        """One pass now; the reservations it released."""
        return await reap(self._fleet, self._launch_timeout)

    def start(self) -> None:
        """Starts the passes, unless they run already (or the interval is 0)."""
        if self._interval > 0:
            self._passes.start()

    async def _forever(self) -> None:
        jitter = random.Random()
        while True:
            await asyncio.sleep(self._interval * (0.5 + jitter.random()))
            try:
                await self.reap()
            except Exception:
                log.exception("reaper pass failed")

    async def close(self) -> None:
        """Stops the passes."""
        await self._passes.stop()

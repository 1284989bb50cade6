"""Finding and observing the ssh backend's clusters.

`Clusters` keeps the launches this instance made or found, by cluster name, and
finds the others from the hosts: a lazy handle (a name only, from another process)
is resolved by asking every host once which launch of the name it holds, the
newest winning. A reservation whose ranks were never placed is a launch under way
(INIT) until the launch timeout, then a launch that died half-way (DOWN).

One look at many clusters is one command per host, for all of the host's clusters
at once; the ranks' states are judged together by `state.judge`. A host that does
not answer makes the look a `BackendUnreachableError` carrying the pool's
`unreachable_timeout`, unless an answering host already shows the cluster gone.
A launch whose hosts all hold nothing of it any more is forgotten, so a lazy handle
looks for a newer one.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Mapping, Sequence

from services.backends.base import (
    BackendError,
    BackendUnreachableError,
    ClusterHandle,
    ClusterStatus,
    Observation,
)
from services.backends.ssh.fleet import Fleet
from services.backends.ssh.hosts import HostUnreachable
from services.backends.ssh.state import (
    BACKEND_NAME,
    HostScan,
    Launch,
    RankState,
    judge,
    proves_down,
    task_end,
)
from services.common.bounds import CLOUD_NAME_RE

RankLook = RankState | HostUnreachable | BackendError


class Clusters:
    """The launches of cluster names: those this instance knows, and the hosts' word."""

    def __init__(self, fleet: Fleet, launch_timeout: float) -> None:
        self._fleet = fleet
        self._launch_timeout = launch_timeout
        # Launches this instance made or found, by cluster name.
        self.launches: dict[str, Launch] = {}

    def handle_for(self, cluster_name: str) -> ClusterHandle:
        """The handle of a cluster known only by name.

        A cluster this instance launched or found before gets its full handle; any
        other a lazy one (no data), resolved on first use by asking every host
        which launch of the name it holds.
        """
        known = self.launches.get(cluster_name)
        return known.handle() if known else ClusterHandle(cluster_name, BACKEND_NAME)

    def known(self, handle: ClusterHandle) -> Launch | None:
        """The handle's launch, when the handle or this instance knows it."""
        return Launch.from_handle(handle) or self.launches.get(handle.cluster_name)

    async def resolve(
        self, names: Sequence[str]
    ) -> dict[str, Launch | Observation | BackendUnreachableError]:
        """The newest launch of each name, asking every host once; an observation when
        there is none to look at, or an error when hosts that might hold it are silent."""
        scans = await self._fleet.scan_all()
        silent = [s for s in scans.values() if isinstance(s, HostUnreachable)]
        out: dict[str, Launch | Observation | BackendUnreachableError] = {}
        for name in names:
            held = [
                s.reservation
                for s in scans.values()
                if isinstance(s, HostScan)
                and s.reservation is not None
                and s.reservation.cluster == name
            ]
            if not held:
                out[name] = (
                    self._fleet.unreachable(silent, f"cannot find {name}")
                    if silent
                    else Observation(ClusterStatus.DOWN)
                )
                continue
            newest = max(held, key=lambda r: r.key)
            found = newest.launch_of()
            if found is None:
                launching = newest.age <= self._launch_timeout
                out[name] = Observation(ClusterStatus.INIT if launching else ClusterStatus.DOWN)
                continue
            self.launches[name] = found
            out[name] = found
        return out

    async def launch_of(self, handle: ClusterHandle) -> Launch | None:
        """The handle's launch (resolved if lazy); None when there is none to act on.

        Raises:
            BackendUnreachableError: hosts that might hold it did not answer.
        """
        known = self.known(handle)
        if known is not None:
            return known
        if not CLOUD_NAME_RE.fullmatch(handle.cluster_name):
            return None
        found = (await self.resolve([handle.cluster_name]))[handle.cluster_name]
        if isinstance(found, BackendUnreachableError):
            raise found
        return found if isinstance(found, Launch) else None

    def forget(self, launch: Launch) -> None:
        """Drops a launch found gone, so that a lazy handle looks for a newer one."""
        if self.launches.get(launch.name) == launch:
            del self.launches[launch.name]

    async def observe_many(
        self, handles: Sequence[ClusterHandle]
    ) -> dict[str, Observation | BackendError]:
        """What each cluster is now (see `state.judge`): one command per host for all of
        its clusters; an error for a cluster a host of which did not answer."""
        looks: dict[str, Launch | Observation | BackendError] = {}
        lazy = []
        for handle in handles:
            known = self.known(handle)
            if known is not None:
                looks[handle.cluster_name] = known
            elif CLOUD_NAME_RE.fullmatch(handle.cluster_name):
                lazy.append(handle.cluster_name)
            else:
                looks[handle.cluster_name] = Observation(ClusterStatus.DOWN)
        if lazy:
            looks.update(await self.resolve(lazy))
        ranks = await self._rank_states([v for v in looks.values() if isinstance(v, Launch)])
        return {
            name: self._judge(look, ranks) if isinstance(look, Launch) else look
            for name, look in looks.items()
        }

    async def _rank_states(self, launches: Sequence[Launch]) -> dict[tuple[str, str], RankLook]:
        """(host id, launch id) -> that rank's state, asking each host once."""
        asks: dict[str, list[Launch]] = collections.defaultdict(list)
        for launch in launches:
            for hid in launch.hosts:
                asks[hid].append(launch)

        async def one(hid: str, there: list[Launch]) -> dict[str, RankLook]:
            host = self._fleet.hosts.get(hid)
            if host is None:
                # A host taken out of the pools file: its ranks are gone.
                return {launch.launch: RankState(present=False) for launch in there}
            args = [arg for launch in there for arg in (launch.name, launch.launch)]
            try:
                lines = await self._fleet.lines(host, "observe", *args)
            except (HostUnreachable, BackendError) as exc:
                return {launch.launch: exc for launch in there}
            states = {f.get("launch", ""): RankState.parse(f) for w, f in lines if w == "cluster"}
            return {
                launch.launch: states.get(launch.launch, RankState(present=False))
                for launch in there
            }

        results = await asyncio.gather(*(one(hid, there) for hid, there in asks.items()))
        return {
            (hid, launch): look
            for hid, by_launch in zip(asks, results, strict=True)
            for launch, look in by_launch.items()
        }

    def _judge(
        self, launch: Launch, ranks: Mapping[tuple[str, str], RankLook]
    ) -> Observation | BackendError:
        looks = [ranks[(hid, launch.launch)] for hid in launch.hosts]
        known = [look for look in looks if isinstance(look, RankState)]
        if len(known) == len(looks):
            seen = judge(known, self._launch_timeout)
        elif any(proves_down(state, self._launch_timeout) for state in known):
            seen = Observation(ClusterStatus.DOWN, None, task_end(known, complete=False))
        else:
            silent = [look for look in looks if isinstance(look, HostUnreachable)]
            if silent:
                return self._fleet.unreachable(silent, f"cannot observe {launch.name}")
            return next(look for look in looks if isinstance(look, BackendError))
        if known and not any(state.present for state in known):
            self.forget(launch)
        return seen

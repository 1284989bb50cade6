"""`SSHBackend`: clusters made of hosts of the node pools (see the package docstring)."""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import re
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from services.backends.base import (
    Backend,
    BackendError,
    BackendUnreachableError,
    ClusterHandle,
    ClusterStatus,
    Observation,
    PrecheckError,
    ResourcesUnavailableError,
    StaleEpochError,
    TaskRequest,
)
from services.backends.ssh import logs, reaper
from services.backends.ssh.config import NodePool, load_node_pools
from services.backends.ssh.fleet import Fleet, first
from services.backends.ssh.hosts import HostConnections, HostUnreachable
from services.backends.ssh.launch import Launcher, refuse_stale
from services.backends.ssh.placement import parse_need, pools_to_try
from services.backends.ssh.state import (
    BACKEND_NAME,
    HostScan,
    Launch,
    RankState,
    judge,
    proves_down,
    task_end,
)
from services.common.background import Background

log = logging.getLogger(__name__)

_CLUSTER_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# How long `reachable` trusts the last answer from any host.
_REACHABLE_FOR = 30.0
# Extra seconds the reaper gives a launch beyond the launch timeout.
_REAP_MARGIN = 60.0

RankLook = RankState | HostUnreachable | BackendError


def _check_request(request: TaskRequest) -> None:
    if not _CLUSTER_NAME_RE.fullmatch(request.cluster_name):
        raise PrecheckError(f"invalid cluster name {request.cluster_name[:200]!r}")
    bad = [name for name in request.envs if not _ENV_NAME_RE.fullmatch(str(name))]
    if bad:
        raise PrecheckError(f"envs: {str(bad[0])[:200]!r} is not an environment variable name")


def _existing_workdir(workdir: str) -> Path | None:
    if not workdir:
        return None
    path = Path(workdir).expanduser()
    if not path.is_dir():
        raise PrecheckError(f"workdir {workdir[:200]!r} is not an existing directory")
    return path


class SSHBackend(Backend):
    """Clusters on the hosts of SSH node pools; a pool is a region."""

    name = BACKEND_NAME
    # A launch is a few SSH commands, not a process of ours: many run well at once.
    launch_concurrency = 64

    def __init__(
        self,
        pools: Mapping[str, NodePool],
        *,
        connect_timeout: float = 10.0,
        command_timeout: float = 20.0,
        launch_timeout: float = 600.0,
        reap_interval: float = 60.0,
        max_sessions: int = 8,
        poll_interval: float = 1.0,
    ) -> None:
        """Creates the backend; nothing connects until used.

        Args:
            pools: The node pools, by name (`load_node_pools`).
            connect_timeout: Seconds to open an SSH connection.
            command_timeout: Seconds a command on a host may take to answer.
            launch_timeout: Seconds a launch may take (the workdir copy included);
                an unfinished launch older than this is reaped.
            reap_interval: Mean seconds between reaper passes (0: no reaper).
            max_sessions: Commands at once on one host's connection.
            poll_interval: Seconds between log reads while tailing.
        """
        conns = HostConnections(
            connect_timeout=connect_timeout,
            command_timeout=command_timeout,
            max_sessions=max_sessions,
        )
        self._fleet = Fleet(pools, conns)
        self._launch_timeout = launch_timeout
        self._reap_interval = reap_interval
        self._poll_interval = poll_interval
        # Launches this instance made or found, by cluster name.
        self._launches: dict[str, Launch] = {}
        # The highest epoch this instance launched, by job.
        self._epochs: dict[int, int] = {}
        self._reaper = Background("ssh-reaper", self._reap_forever)

    # --- launch -------------------------------------------------------------------------------

    async def launch(
        self,
        request: TaskRequest,
        candidate_regions: Sequence[str] = (),
        blocked_regions: Sequence[str] = (),
    ) -> ClusterHandle:
        """Reserves `num_nodes` free fitting hosts of one pool and starts every rank there
        (see `launch`); returns once every rank's runner runs.

        Raises:
            PrecheckError: the request can never launch (see `placement`).
            ResourcesUnavailableError: no pool has enough free fitting hosts now.
            StaleEpochError: a newer epoch of the job launched already.
            BackendUnreachableError: a host stopped answering during the launch.
        """
        self._start_reaper()
        _check_request(request)
        need = parse_need(request)
        plan = pools_to_try(self._fleet.pools, request, need, candidate_regions, blocked_regions)
        workdir = await asyncio.to_thread(_existing_workdir, request.workdir)
        refuse_stale(request, self._epochs.get(request.job_id, 0), "this replica")
        self._epochs[request.job_id] = request.epoch
        launcher = Launcher(self._fleet, request, plan, need, workdir, self._launch_timeout)
        try:
            async with asyncio.timeout(self._launch_timeout):
                made = await launcher.run()
        except TimeoutError:
            raise ResourcesUnavailableError(
                f"launching {request.cluster_name} took over {self._launch_timeout:g}s",
                regions_tried=[pool.name for pool, _ in plan],
            ) from None
        except HostUnreachable as exc:
            raise self._fleet.unreachable([exc], f"launching {request.cluster_name}") from None
        self._launches[made.name] = made
        return made.handle()

    # --- finding clusters ---------------------------------------------------------------------

    def handle_for(self, cluster_name: str) -> ClusterHandle:
        """The handle of a cluster known only by name.

        A cluster this instance launched or found before gets its full handle; any
        other a lazy one (no data), resolved on first use by asking every host
        which launch of the name it holds.
        """
        known = self._launches.get(cluster_name)
        return known.handle() if known else ClusterHandle(cluster_name, self.name)

    def _known(self, handle: ClusterHandle) -> Launch | None:
        return Launch.from_handle(handle) or self._launches.get(handle.cluster_name)

    async def _resolve(
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
            self._launches[name] = found
            out[name] = found
        return out

    async def _launch_of(self, handle: ClusterHandle) -> Launch | None:
        """The handle's launch (resolved if lazy); None when there is none to act on.

        Raises:
            BackendUnreachableError: hosts that might hold it did not answer.
        """
        known = self._known(handle)
        if known is not None:
            return known
        if not _CLUSTER_NAME_RE.fullmatch(handle.cluster_name):
            return None
        found = (await self._resolve([handle.cluster_name]))[handle.cluster_name]
        if isinstance(found, BackendUnreachableError):
            raise found
        return found if isinstance(found, Launch) else None

    def _forget(self, launch: Launch) -> None:
        """Drops a launch found gone, so that a lazy handle looks for a newer one."""
        if self._launches.get(launch.name) == launch:
            del self._launches[launch.name]

    # --- observing ----------------------------------------------------------------------------

    async def observe(self, handle: ClusterHandle) -> Observation:
        """Every rank's state, one command per host (see `state.judge`).

        Raises:
            BackendUnreachableError: a host of the cluster did not answer (and the
                others do not show it gone); `timeout` is its pool's unreachable_timeout.
        """
        result = (await self.observe_many([handle]))[handle.cluster_name]
        if isinstance(result, BaseException):
            raise result
        return result

    async def observe_many(
        self, handles: Sequence[ClusterHandle]
    ) -> dict[str, Observation | BackendError]:
        """`observe` for many clusters: one command per host for all of its clusters."""
        self._start_reaper()
        looks: dict[str, Launch | Observation | BackendError] = {}
        lazy = []
        for handle in handles:
            known = self._known(handle)
            if known is not None:
                looks[handle.cluster_name] = known
            elif _CLUSTER_NAME_RE.fullmatch(handle.cluster_name):
                lazy.append(handle.cluster_name)
            else:
                looks[handle.cluster_name] = Observation(ClusterStatus.DOWN)
        if lazy:
            looks.update(await self._resolve(lazy))
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
            self._forget(launch)
        return seen

    # --- terminate, notices -------------------------------------------------------------------

    async def terminate(self, handle: ClusterHandle, epoch: int = 0, grace: float = 0.0) -> bool:
        """SIGTERM, then SIGKILL after `grace`, on every host holding any launch of the
        cluster's name; removes its folders and releases its hosts.

        Raises:
            StaleEpochError: a launch of the name with a higher epoch holds a host.
            BackendUnreachableError: a host known to hold the cluster did not answer
                (the others were terminated).
        """
        self._start_reaper()
        name = handle.cluster_name
        if not _CLUSTER_NAME_RE.fullmatch(name):
            return False
        known = self._known(handle)
        scans = await self._fleet.scan_all(names=[name], processes=True)
        answered = {hid: s for hid, s in scans.items() if isinstance(s, HostScan)}
        must = set(known.hosts if known else ())
        for hid, scan in answered.items():
            held = scan.reservation
            if held is None or held.cluster != name:
                continue
            if epoch and held.epoch > epoch:
                raise StaleEpochError(
                    f"stale epoch {epoch}: epoch {held.epoch} holds {name} on {hid}"
                )
            must.update(held.hosts)
        holding = {hid for hid, scan in answered.items() if scan.holds(name)}
        targets = [self._fleet.hosts[hid] for hid in sorted(must | holding) if hid in answered]
        silent = Fleet.silent(scans, must)
        tenths = str(max(0, round(grace * 10)))
        timeout = grace + self._fleet.conns.command_timeout
        results = await asyncio.gather(
            *(
                self._fleet.lines(host, "terminate", name, str(epoch), tenths, timeout=timeout)
                for host in targets
            ),
            return_exceptions=True,
        )
        for host, result in zip(targets, results, strict=True):
            if isinstance(result, HostUnreachable):
                silent.append(result)
            elif isinstance(result, BaseException):
                raise result
            elif first(result)[0] == "stale":
                raise StaleEpochError(
                    f"stale epoch {epoch}: epoch {first(result)[1].get('epoch')} "
                    f"holds {name} on {host.id}"
                )
        if silent:
            raise self._fleet.unreachable(silent, f"terminating {name}")
        self._launches.pop(name, None)
        return False

    async def stop(self, handle: ClusterHandle, epoch: int, grace: float) -> None:
        """SIGTERM, then SIGKILL after `grace`, to every rank; the folders (and their
        logs) and the hosts stay the cluster's until `terminate`.

        Raises:
            StaleEpochError: a newer epoch of the job holds the cluster.
            BackendUnreachableError: a host of the cluster did not answer.
        """
        tenths = str(max(0, round(grace * 10)))
        timeout = grace + self._fleet.conns.command_timeout
        await self._on_each_rank(handle, epoch, "stop", tenths, timeout=timeout)

    async def notify_preemption(self, handle: ClusterHandle, epoch: int, deadline: float) -> None:
        """Writes the notice file (`MJ_PREEMPTION_NOTICE_FILE`, holding `deadline`) on
        every rank and SIGTERMs the ranks; a rank that then exits leaves no end time,
        so the cluster reads as gone (preempted), not as finished.

        Raises:
            StaleEpochError: a newer epoch of the job holds the cluster.
            BackendUnreachableError: a host of the cluster did not answer.
        """
        await self._on_each_rank(handle, epoch, "notify", f"{deadline}")

    async def _on_each_rank(
        self, handle: ClusterHandle, epoch: int, verb: str, arg: str, timeout: float | None = None
    ) -> None:
        """Runs `verb NAME LAUNCH EPOCH ARG` on every host of the cluster's launch.

        Raises:
            StaleEpochError: a newer epoch of the job holds the cluster.
            BackendUnreachableError: a host of the cluster did not answer.
        """
        self._start_reaper()
        launch = await self._launch_of(handle)
        if launch is None:
            return
        hosts = [self._fleet.hosts[hid] for hid in launch.hosts if hid in self._fleet.hosts]
        results = await asyncio.gather(
            *(
                self._fleet.lines(
                    host, verb, launch.name, launch.launch, str(epoch), arg, timeout=timeout
                )
                for host in hosts
            ),
            return_exceptions=True,
        )
        silent = [r for r in results if isinstance(r, HostUnreachable)]
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, HostUnreachable):
                raise result
            if isinstance(result, list) and first(result)[0] == "stale":
                raise StaleEpochError(
                    f"stale epoch {epoch}: epoch {first(result)[1].get('epoch')} "
                    f"holds {launch.name}"
                )
        if silent:
            raise self._fleet.unreachable(silent, f"{verb} {launch.name}")

    async def cluster_exists(self, cluster_name: str) -> bool:
        """True while any host that answers holds a reservation, folder or process of the
        name.

        Raises:
            BackendUnreachableError: nothing was found, but a host known to hold the
                cluster did not answer. (Hosts not known to hold it are not waited for:
                what they hold of it is reaped once they answer again.)
        """
        self._start_reaper()
        if not _CLUSTER_NAME_RE.fullmatch(cluster_name):
            return False
        scans = await self._fleet.scan_all(names=[cluster_name], processes=True)
        if any(isinstance(s, HostScan) and s.holds(cluster_name) for s in scans.values()):
            return True
        known = self._launches.get(cluster_name)
        silent = Fleet.silent(scans, known.hosts if known else ())
        if silent:
            raise self._fleet.unreachable(silent, f"cannot tell whether {cluster_name} exists")
        return False

    # --- logs ---------------------------------------------------------------------------------

    async def read_logs(self, handle: ClusterHandle) -> bytes:
        """Every rank's log in rank order; lines prefixed `(rank=<r>) ` when multi-node.

        Raises:
            BackendUnreachableError: a host of the cluster did not answer.
        """
        self._start_reaper()
        launch = await self._launch_of(handle)
        read = await logs.read_all(self._fleet, launch) if launch else None
        if launch is not None and read is None and Launch.from_handle(handle) is None:
            # A lazy handle's launch is gone: the name may have been launched again.
            self._forget(launch)
            launch = await self._launch_of(handle)
            read = await logs.read_all(self._fleet, launch) if launch else None
        return logs.join(read) if read else b""

    async def tail_logs(self, handle: ClusterHandle) -> AsyncIterator[bytes]:
        """Yields the ranks' log bytes as they grow, until every rank's run ended or
        died (or the cluster was terminated) and everything written was yielded.

        Raises:
            BackendUnreachableError: a host of the cluster stopped answering.
        """
        launch = await self._launch_of(handle)
        if launch is None:
            return
        async for chunk in logs.follow(self._fleet, launch, self._poll_interval):
            yield chunk

    # --- the rest -----------------------------------------------------------------------------

    async def reachable(self) -> bool:
        """Whether any host answers (an answer in the last 30 s counts)."""
        if time.monotonic() - self._fleet.last_answer < _REACHABLE_FOR:
            return True

        async def ping(hid: str) -> bool:
            try:
                await self._fleet.ask(self._fleet.hosts[hid], "ping")
            except (HostUnreachable, BackendError):
                return False
            return True

        return any(await asyncio.gather(*(ping(hid) for hid in self._fleet.hosts)))

    def regions(self) -> Sequence[str]:
        """The pools' names."""
        return list(self._fleet.pools)

    async def reap(self) -> list[reaper.Release]:
        """One reaper pass (see `reaper`); the reservations it released."""
        return await reaper.reap(self._fleet, self._launch_timeout + _REAP_MARGIN)

    def _start_reaper(self) -> None:
        if self._reap_interval > 0:
            self._reaper.start()

    async def _reap_forever(self) -> None:
        jitter = random.Random()
        while True:
            # Jittered, so that the replicas' reapers do not all ask at once.
            await asyncio.sleep(self._reap_interval * (0.5 + jitter.random()))
            try:
                await self.reap()
            except Exception:
                log.exception("reaper pass failed")

    async def close(self) -> None:
        """Stops the reaper and closes every connection."""
        await self._reaper.stop()
        await self._fleet.conns.close()


def from_settings(settings: Mapping[str, Any]) -> SSHBackend:
    """The ssh backend of a service, on the pools of `ssh_node_pools` (a file path).

    Raises:
        ValueError: the setting is missing, or the file is wrong (naming the field).
    """
    path = settings.get("ssh_node_pools")
    if not path:
        raise ValueError(
            "the ssh backend needs ssh_node_pools (--ssh-node-pools or MJ_SSH_NODE_POOLS), "
            "the path of an ssh_node_pools.yaml"
        )
    options: dict[str, Any] = {}
    for setting, option, kind in (
        ("ssh_connect_timeout", "connect_timeout", float),
        ("ssh_command_timeout", "command_timeout", float),
        ("ssh_launch_timeout", "launch_timeout", float),
        ("ssh_reap_interval", "reap_interval", float),
        ("ssh_max_sessions", "max_sessions", int),
        ("tail_poll_interval", "poll_interval", float),
    ):
        if settings.get(setting) is not None:
            options[option] = kind(settings[setting])
    return SSHBackend(load_node_pools(str(path)), **options)

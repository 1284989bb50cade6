"""`SSHBackend`: the ssh backend's calls, on the hosts of the node pools.

How the pieces keep shared truth on the hosts is the package docstring's; a launch's
precheck is `placement`, the launch itself `launch`, finding and observing clusters
`clusters`, logs `logs`, and releasing orphaned hosts `reaper`.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from services.backends.base import (
    Backend,
    BackendError,
    ClusterHandle,
    LaunchPlan,
    Observation,
    PrecheckError,
    ResourcesUnavailableError,
    StaleEpochError,
)
from services.backends.ssh import logs, reaper
from services.backends.ssh.clusters import Clusters
from services.backends.ssh.config import NodePool, load_node_pools
from services.backends.ssh.fleet import Fleet, first
from services.backends.ssh.hosts import HostConnections, HostUnreachable
from services.backends.ssh.launch import Launcher, refuse_stale
from services.backends.ssh.placement import parse_need, pools_to_try
from services.backends.ssh.state import BACKEND_NAME, HostScan, Launch
from services.common.bounds import CLOUD_NAME_RE

log = logging.getLogger(__name__)

_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# How long `reachable` trusts the last answer from any host.
_REACHABLE_FOR = 30.0
# Extra seconds the reaper gives a launch beyond the launch timeout.
_REAP_MARGIN = 60.0


def _check_plan(plan: LaunchPlan) -> None:
    if not CLOUD_NAME_RE.fullmatch(plan.cluster_name):
        raise PrecheckError(f"invalid cluster name {plan.cluster_name[:200]!r}")
    bad = [name for name in plan.envs if not _ENV_NAME_RE.fullmatch(str(name))]
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
        self._poll_interval = poll_interval
        self._clusters = Clusters(self._fleet, launch_timeout)
        # The highest epoch this instance launched, by job.
        self._epochs: dict[int, int] = {}
        self._reaper = reaper.Reaper(self._fleet, reap_interval, launch_timeout + _REAP_MARGIN)

    # --- launch -------------------------------------------------------------------------------

    async def launch(self, plan: LaunchPlan) -> ClusterHandle:
        """Reserves `num_nodes` free fitting hosts of one pool and starts every rank there
        (see `launch`); returns once every rank's runner runs.

        Raises:
            PrecheckError: the plan can never launch (see `placement`).
            ResourcesUnavailableError: no pool has enough free fitting hosts now.
            StaleEpochError: a newer epoch of the job launched already.
            BackendUnreachableError: a host stopped answering during the launch.
        """
        self._reaper.start()
        _check_plan(plan)
        need = parse_need(plan)
        pools = pools_to_try(self._fleet.pools, plan, need)
        workdir = await asyncio.to_thread(_existing_workdir, plan.workdir)
        refuse_stale(plan, self._epochs.get(plan.job_id, 0), "this replica")
        self._epochs[plan.job_id] = plan.epoch
        launcher = Launcher(self._fleet, plan, pools, need, workdir, self._launch_timeout)
        try:
            async with asyncio.timeout(self._launch_timeout):
                made = await launcher.run()
        except TimeoutError:
            raise ResourcesUnavailableError(
                f"launching {plan.cluster_name} took over {self._launch_timeout:g}s",
                regions_tried=[pool.name for pool, _ in pools],
            ) from None
        except HostUnreachable as exc:
            raise self._fleet.unreachable([exc], f"launching {plan.cluster_name}") from None
        self._clusters.launches[made.name] = made
        return made.handle()

    # --- finding clusters ---------------------------------------------------------------------

    def handle_for(self, cluster_name: str) -> ClusterHandle:
        """The handle of a cluster known only by name: its full handle when this instance
        launched or found it before, else a lazy one (no data), resolved on first use."""
        return self._clusters.handle_for(cluster_name)

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
        self._reaper.start()
        return await self._clusters.observe_many(handles)

    # --- terminate, notices -------------------------------------------------------------------

    async def terminate(self, handle: ClusterHandle, epoch: int = 0, grace: float = 0.0) -> bool:
        """SIGTERM, then SIGKILL after `grace`, on every host holding any launch of the
        cluster's name; removes its folders and releases its hosts.

        Raises:
            StaleEpochError: a launch of the name with a higher epoch holds a host.
            BackendUnreachableError: a host known to hold the cluster did not answer
                (the others were terminated).
        """
        self._reaper.start()
        name = handle.cluster_name
        if not CLOUD_NAME_RE.fullmatch(name):
            return False
        known = self._clusters.known(handle)
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
        self._clusters.launches.pop(name, None)
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
        self._reaper.start()
        launch = await self._clusters.launch_of(handle)
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
        self._reaper.start()
        if not CLOUD_NAME_RE.fullmatch(cluster_name):
            return False
        scans = await self._fleet.scan_all(names=[cluster_name], processes=True)
        if any(isinstance(s, HostScan) and s.holds(cluster_name) for s in scans.values()):
            return True
        known = self._clusters.launches.get(cluster_name)
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
        self._reaper.start()
        launch = await self._clusters.launch_of(handle)
        read = await logs.read_all(self._fleet, launch) if launch else None
        if launch is not None and read is None and Launch.from_handle(handle) is None:
            # A lazy handle's launch is gone: the name may have been launched again.
            self._clusters.forget(launch)
            launch = await self._clusters.launch_of(handle)
            read = await logs.read_all(self._fleet, launch) if launch else None
        return logs.join(read) if read else b""

    async def tail_logs(self, handle: ClusterHandle) -> AsyncIterator[bytes]:
        """Yields the ranks' log bytes as they grow, until every rank's run ended or
        died (or the cluster was terminated) and everything written was yielded.

        Raises:
            BackendUnreachableError: a host of the cluster stopped answering.
        """
        launch = await self._clusters.launch_of(handle)
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
        return await self._reaper.reap()

    async def close(self) -> None:
        """Stops the reaper and closes every connection."""
        await self._reaper.close()
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

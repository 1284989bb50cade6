"""Launching a cluster on the hosts of the node pools.

1. Ask every host (one command each) what it holds of the cluster's name and the
   job's highest epoch: a newer epoch anywhere refuses the launch
   (`StaleEpochError`); older launches of the name are released (a relaunch after
   a preemption reuses the name; this one replaces them).
2. Pick a launch id ordered after every launch of the name (epoch, then the
   launcher's clock) and try the pools in order: take `num_nodes` free fitting
   hosts of one pool, each reserved atomically on the host itself (so two
   replicas can never take the same host), in an order of this launch's own so
   concurrent launches rarely collide. A pool that cannot give them all gets back
   the ones taken.
3. On every host, in parallel: copy the workdir (SFTP), then write the rank's
   environment, setup, run and runner and start the runner in a session of its
   own. The reservation is ready once its runner runs.

Anything failing after hosts were taken releases them (also when cancelled);
what cannot be released then (a host that stopped answering) is reaped later.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import random
import shlex
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from services.backends.base import (
    BackendError,
    LaunchPlan,
    ResourcesUnavailableError,
    StaleEpochError,
)
from services.backends.ranks import rank_env
from services.backends.ssh.config import Host, NodePool
from services.backends.ssh.fleet import Fleet, first
from services.backends.ssh.hosts import RUNNER_SCRIPT, HostCommandError, HostUnreachable, host_ids
from services.backends.ssh.placement import Need
from services.backends.ssh.state import HostScan, Launch

log = logging.getLogger(__name__)

# Seconds the node script may wait for a rank's runner to write its pid.
_START_WAIT = 10.0


def refuse_stale(plan: LaunchPlan, seen: int, where: str) -> None:
    """Raises StaleEpochError when `seen`, an epoch launched for the job, is newer."""
    if plan.epoch < seen:
        raise StaleEpochError(
            f"stale epoch {plan.epoch} for job {plan.job_id}: "
            f"epoch {seen} already launched (seen by {where})"
        )


@dataclasses.dataclass
class Launcher:
    """One launch of one plan on the pools to try, in order (see the module docstring)."""

    fleet: Fleet
    plan: LaunchPlan
    pools: list[tuple[NodePool, list[Host]]]
    need: Need
    workdir: Path | None
    launch_timeout: float

    async def run(self) -> Launch:
        """Launches; the launch made.

        Raises:
            ResourcesUnavailableError: no pool has enough free fitting hosts now.
            StaleEpochError: a newer epoch of the job launched already.
            BackendUnreachableError: no host that fits answers.
            HostUnreachable: a host stopped answering while the ranks started.
            BackendError: a host refused the rank's files.
        """
        name = self.plan.cluster_name
        scans = await self.fleet.scan_all(job=self.plan.job_id, names=[name])
        answered = {hid: s for hid, s in scans.items() if isinstance(s, HostScan)}
        newest = (0, 0)
        for hid, scan in answered.items():
            fence = scan.fences.get(name, (0, 0))
            refuse_stale(self.plan, max(scan.job_epoch, fence[0]), hid)
            newest = max(newest, fence)
        freed = await self._release_older(answered)
        # After every launch of the name this epoch, even if our clock stepped back.
        started = time.time_ns()
        if newest[0] == self.plan.epoch:
            started = max(started, newest[1] + 1)
        launch = f"{self.plan.epoch}-{started}-{uuid.uuid4().hex[:8]}"
        for pool, fitting in self.pools:
            free = [
                host
                for host in fitting
                if host.id in freed
                or (host.id in answered and answered[host.id].reservation is None)
            ]
            if len(free) < self.plan.num_nodes:
                continue
            random.Random(launch).shuffle(free)
            hosts = await self._reserve(free, pool, launch, started)
            if hosts is None:
                continue
            made = Launch(
                name,
                pool.name,
                launch,
                self.plan.epoch,
                self.plan.job_id,
                tuple(h.id for h in hosts),
            )
            try:
                await self._start_ranks(made, hosts)
            except BaseException:
                await asyncio.shield(self.fleet.release(hosts, launch))
                raise
            log.info("cluster launched", extra={"cluster": name, "hosts": list(made.hosts)})
            return made
        could = {host.id for _, hosts in self.pools for host in hosts}
        silent = Fleet.silent(scans, could)
        if len(silent) == len(could):
            # Every host that could take it is silent: that says nothing of capacity.
            raise self.fleet.unreachable(silent, f"no host that could take {name} answers")
        tried = [pool.name for pool, _ in self.pools]
        more = f" ({len(silent)} of them not answering)" if silent else ""
        raise ResourcesUnavailableError(
            f"no {self.plan.num_nodes} free host(s) with {self.need} in {', '.join(tried)}{more}",
            regions_tried=tried,
        )

    async def _release_older(self, answered: Mapping[str, HostScan]) -> set[str]:
        """Releases every launch of the name the hosts hold; the hosts freed."""
        name, epoch = self.plan.cluster_name, self.plan.epoch
        old: dict[str, str] = {}
        for hid, scan in answered.items():
            held = scan.reservation
            if held is None or held.cluster != name:
                continue
            if held.epoch > epoch:
                raise StaleEpochError(
                    f"stale epoch {epoch}: epoch {held.epoch} holds {name} on {hid}"
                )
            old[hid] = held.launch
        results = await asyncio.gather(
            *(self.fleet.lines(self.fleet.hosts[hid], "release", old[hid]) for hid in old),
            return_exceptions=True,
        )
        freed = set()
        for hid, result in zip(old, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result
            if isinstance(result, list):
                freed.add(hid)
        return freed

    async def _reserve(
        self, candidates: list[Host], pool: NodePool, launch: str, started: int
    ) -> list[Host] | None:
        """Takes `num_nodes` of the candidates (their order is the ranks'), or none."""
        wanted = self.plan.num_nodes
        taken: list[Host] = []
        attempted: list[Host] = []
        queue = list(candidates)
        try:
            while len(taken) < wanted <= len(taken) + len(queue):
                batch, queue = queue[: wanted - len(taken)], queue[wanted - len(taken) :]
                attempted += batch
                replies = await asyncio.gather(
                    *(self._reserve_one(host, pool, launch, started) for host in batch),
                    return_exceptions=True,
                )
                for reply in replies:
                    if isinstance(reply, StaleEpochError) or (
                        isinstance(reply, BaseException)
                        and not isinstance(reply, HostUnreachable | BackendError)
                    ):
                        raise reply
                taken += [host for host, ok in zip(batch, replies, strict=True) if ok is True]
        except BaseException:
            await asyncio.shield(self.fleet.release(attempted, launch))
            raise
        if len(taken) < wanted:
            await self.fleet.release(attempted, launch)
            return None
        return taken

    async def _reserve_one(self, host: Host, pool: NodePool, launch: str, started: int) -> bool:
        """True: the host is ours now; False: another cluster holds it."""
        plan = self.plan
        word, fields = first(
            await self.fleet.lines(
                host,
                "reserve",
                plan.cluster_name,
                str(plan.job_id),
                str(plan.task_id),
                str(plan.epoch),
                launch,
                str(started),
                pool.name,
            )
        )
        if word == "ok":
            return True
        if word == "busy":
            return False
        if word == "stale":
            refuse_stale(plan, int(fields.get("epoch", plan.epoch + 1)), host.id)
        raise BackendError(f"reserving {host.id}: unexpected reply {word!r} {fields}")

    async def _start_ranks(self, made: Launch, hosts: Sequence[Host]) -> None:
        results = await asyncio.gather(
            *(self._start_rank(made, rank, hosts) for rank in range(len(hosts))),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _start_rank(self, made: Launch, rank: int, hosts: Sequence[Host]) -> None:
        plan, host = self.plan, hosts[rank]
        env = rank_env(
            job_id=plan.job_id,
            task_id=plan.task_id,
            cluster_name=made.name,
            envs=plan.envs,
            rank=rank,
            num_nodes=len(hosts),
            node_ips=[h.ip for h in hosts],
        )
        env_file = "".join(f"export {key}={shlex.quote(value)}\n" for key, value in env.items())
        if self.workdir is not None:
            remote = f".mj/clusters/{made.name}.{made.launch}/workdir"
            try:
                await self.fleet.conns.put_dir(host, self.workdir, remote, self.launch_timeout)
            except HostCommandError as exc:
                raise BackendError(str(exc)) from None
        files = (env_file, plan.setup, plan.run, RUNNER_SCRIPT)
        word, fields = first(
            await self.fleet.lines(
                host,
                "start",
                made.name,
                made.launch,
                str(rank),
                str(len(hosts)),
                host_ids(hosts),
                stdin=b"".join(base64.b64encode(f.encode()) + b"\n" for f in files),
                timeout=self.fleet.conns.command_timeout + _START_WAIT,
            )
        )
        if word != "ok":
            raise BackendError(f"starting rank {rank} on {host.id}: {word} {fields}")

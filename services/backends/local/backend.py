"""The `local` backend: clusters made of real processes on this host (contract §10).

A local cluster is a folder `<root>/<cluster_name>/` plus one supervisor process
(`services.backends.local.supervisor`) that runs the task's setup and run for every node
rank and records what happened. The folder is the cluster's whole state, so any
process on this host (every controller replica, the logs service) can find and
judge a cluster from its name alone (its files: `cluster`). The calls are here;
starting and stopping supervisors is `processes`, who user code runs as `users`.

Invariants:
- The supervisor alive means the cluster is UP; a dead (or zombie) supervisor
  means DOWN, and then the task status is not trusted (None): that is how the
  controller tells preemption (kill the supervisor) from a crash of the user's
  code (a finished status with a non-zero exit code). The task's end recorded in
  status.json stays readable after DOWN, until `terminate` removes the folder.
- One look (`observe`) reads status.json once, then checks that the pid it names
  is still this folder's supervisor: a status is trusted only if its writer
  outlived the read.
- Every process of a cluster dies with its supervisor (PR_SET_PDEATHSIG and a
  guardian, see the supervisor).
- Launches, terminations and preemption notices of one name are serialized across
  processes and fenced by epoch (`fencing`): a stale epoch is refused
  (`StaleEpochError`); epoch 0 (an operator's cleanup) may always terminate. A
  launch by the current or a newer epoch replaces a cluster of the same name; a
  launch that waited while another launch of the very same task attempt finished
  takes that cluster instead of starting a second supervisor.
- `terminate` lets the ranks stop: the supervisor sends them SIGTERM, waits up to
  `grace` seconds, then SIGKILL (a DOWN cluster's ranks died with it: nothing to
  wait for); then `terminate` kills everything of the cluster it can find
  (recorded process groups, the cluster's uid, its environment tag) and removes
  the folder. It is idempotent, and `cluster_exists` is the proof that teardown
  worked. `notify_preemption` writes the notice file and sends SIGTERM to the
  ranks only: the cluster stays up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from services.backends.base import (
    Backend,
    ClusterHandle,
    ClusterStatus,
    LaunchPlan,
    Observation,
    PrecheckError,
    ResourcesUnavailableError,
    TaskStatus,
)
from services.backends.local import logs as local_logs
from services.backends.local.cluster import (
    ClusterLayout,
    cluster_processes,
    read_json,
    read_pid,
    recorded_children,
    signal_groups,
    supervisor_at,
    supervisor_process,
    task_end,
    write_atomic,
)
from services.backends.local.fencing import ClusterLock, EpochFence
from services.backends.local.processes import (
    LOCAL_REGION,
    Supervisors,
    launch_id,
    same_task,
    task_record,
)
from services.backends.local.users import (
    DEFAULT_RUN_AS,
    DEFAULT_RUN_AS_UIDS,
    Confinement,
    parse_uid_range,
    parse_workdir_roots,
)
from services.common.bounds import CLOUD_NAME_RE

log = logging.getLogger(__name__)


class LocalBackend(Backend):
    """Clusters as a folder plus a supervisor process on this host."""

    name = "local"
    # A launch starts a process: 4 per CPU, as SkyPilot sizes its launch parallelism.
    launch_concurrency = 4 * (os.cpu_count() or 1)

    def __init__(
        self,
        root: Path,
        *,
        poll_interval: float = 0.2,
        terminate_timeout: float = 5.0,
        start_timeout: float = 30.0,
        run_as: str = DEFAULT_RUN_AS,
        run_as_uids: range = parse_uid_range(DEFAULT_RUN_AS_UIDS),
        workdir_roots: Sequence[Path] | None = None,
    ) -> None:
        """Creates the backend.

        Args:
            root: Folder holding one subfolder per cluster (created on demand).
            poll_interval: Seconds between polls of the log files in `tail_logs`.
            terminate_timeout: Seconds `terminate` waits, beyond the grace, for the
                supervisor to stop its ranks before it kills everything itself.
            start_timeout: Seconds a launch may take for the supervisor to come up;
                after that a cluster folder without a supervisor counts as DOWN.
            run_as: The user whose group runs user code (created if root and missing).
            run_as_uids: The uids handed out, one per cluster, when root.
            workdir_roots: Folders a task's workdir must be under (default: the
                current folder).
        """
        self._root = Path(root).expanduser().resolve()
        self._poll_interval = poll_interval
        self._start_timeout = start_timeout
        self._fence = EpochFence(self._root)
        self._confinement = Confinement(run_as, run_as_uids, workdir_roots)
        self._supervisors = Supervisors(
            self._root,
            self._fence,
            self._confinement,
            start_timeout=start_timeout,
            terminate_timeout=terminate_timeout,
        )
        # A launch is a process (and a copy of the workdir), not an RPC.
        self.launch_concurrency = 4 * (os.cpu_count() or 1)
        self._prepared = False

    @property
    def root(self) -> Path:
        """The folder holding the clusters."""
        return self._root

    @property
    def confinement(self) -> Confinement:
        """Who user code runs as and where its workdir may come from."""
        return self._confinement

    def regions(self) -> Sequence[str]:
        return [LOCAL_REGION]

    def layout(self, cluster_name: str) -> ClusterLayout:
        """The files of a cluster.

        Raises:
            PrecheckError: the name cannot be a folder name.
        """
        if not CLOUD_NAME_RE.fullmatch(cluster_name):
            raise PrecheckError(f"invalid cluster name {cluster_name[:200]!r}")
        return ClusterLayout(self._root / cluster_name)

    def _layout_or_none(self, cluster_name: str) -> ClusterLayout | None:
        try:
            return self.layout(cluster_name)
        except PrecheckError:
            return None

    def _prepare(self) -> None:
        """Creates the root and its state folder (blocking: from a thread)."""
        if self._prepared and self._fence.state_dir.is_dir():
            return
        self._root.mkdir(parents=True, exist_ok=True)
        if self._confinement.privileged:
            # Ranks must pass through the root to their folder, but not list it.
            self._root.chmod(0o711)
            closed = [p for p in self._root.parents if not p.stat().st_mode & 0o001]
            if closed:
                log.warning(
                    "user code cannot reach its cluster folder by path: %s is not "
                    "searchable by others",
                    closed[-1],
                )
        self._fence.prepare()
        self._prepared = True

    async def launch(self, plan: LaunchPlan) -> ClusterHandle:
        """Creates the cluster folder and starts its supervisor.

        A cluster of the same name that still exists (a relaunch after preemption)
        is terminated first. Returns once the supervisor is up and status.json
        exists, so a fresh handle never looks preempted.

        Raises:
            PrecheckError: a region other than "local", a workdir that is missing
                or outside the workdir roots, a bad cluster name or node count.
            ResourcesUnavailableError: "local" is blocked, no uid is free, or the
                supervisor did not come up (regions_tried is ["local"]).
            StaleEpochError: a newer epoch of the job has been seen.
        """
        if plan.region not in ("", LOCAL_REGION):
            raise PrecheckError(
                f"the local backend has only region {LOCAL_REGION!r}, not {plan.region!r}"
            )
        candidates = {region or LOCAL_REGION for region in plan.candidate_regions}
        if candidates and LOCAL_REGION not in candidates:
            raise PrecheckError(
                f"the local backend has only region {LOCAL_REGION!r}; "
                f"candidates were {sorted(candidates)}"
            )
        if plan.num_nodes < 1:
            raise PrecheckError(f"num_nodes must be >= 1, not {plan.num_nodes}")
        layout = self.layout(plan.cluster_name)
        workdir = await asyncio.to_thread(self._confinement.resolve_workdir, plan.workdir)
        if LOCAL_REGION in plan.blocked_regions:
            raise ResourcesUnavailableError(
                f"region {LOCAL_REGION!r} is blocked", regions_tried=[LOCAL_REGION]
            )
        await asyncio.to_thread(self._prepare)
        task = task_record(plan)
        seen = launch_id(read_json(layout.task_file))

        async with self._fence.cluster_lock(plan.cluster_name):
            await asyncio.to_thread(self._fence.admit, plan.job_id, plan.epoch, action="launch")
            current = read_json(layout.task_file)
            if launch_id(current) not in (None, seen) and same_task(current, task):
                # Another launch of this very attempt finished while we waited.
                joined = self._live_handle(layout)
                if joined is not None:
                    return joined
            await self._supervisors.stop_and_remove(layout, grace=0.0)
            pid = await self._supervisors.start(layout, task, workdir)
        return self._handle(layout, pid)

    def _handle(self, layout: ClusterLayout, pid: int | None) -> ClusterHandle:
        data: dict[str, Any] = {"dir": str(layout.dir)}
        if pid is not None:
            data["pid"] = pid
        return ClusterHandle(layout.dir.name, backend=self.name, region=LOCAL_REGION, data=data)

    def _live_handle(self, layout: ClusterLayout) -> ClusterHandle | None:
        supervisor = supervisor_process(layout)
        return None if supervisor is None else self._handle(layout, supervisor.pid)

    def handle_for(self, cluster_name: str) -> ClusterHandle:
        """The handle of a cluster known only by name.

        Every method finds a local cluster from its name alone; `data` carries the
        folder and, when the supervisor has written it, its pid.
        """
        layout = self._layout_or_none(cluster_name)
        if layout is None:
            return ClusterHandle(cluster_name, backend=self.name, region=LOCAL_REGION)
        return self._handle(layout, read_pid(layout.pid_file))

    async def observe(self, handle: ClusterHandle) -> Observation:
        """UP while the cluster's supervisor lives, INIT while it launches, else DOWN;
        the task's status while UP, and its end whenever status.json records one."""
        layout = self._layout_or_none(handle.cluster_name)
        return Observation(ClusterStatus.DOWN) if layout is None else self._look(layout)

    def _look(self, layout: ClusterLayout) -> Observation:
        status = read_json(layout.status_file)
        if not isinstance(status, dict):
            return Observation(self._without_status(layout))
        end = task_end(status)
        # Checked after the read: the status counts only if its writer still lives.
        if supervisor_at(status.get("pid"), layout.dir) is None:
            return Observation(ClusterStatus.DOWN, None, end)
        try:
            task = TaskStatus(status.get("status"))
        except ValueError:
            task = None
        return Observation(ClusterStatus.UP, task, end)

    def _without_status(self, layout: ClusterLayout) -> ClusterStatus:
        """INIT while a launch may still bring the supervisor up, else DOWN."""
        if self._supervisors.own(layout.dir.name) is not None:
            return ClusterStatus.INIT
        try:
            age = time.time() - layout.dir.stat().st_mtime
        except OSError:
            return ClusterStatus.DOWN
        return ClusterStatus.INIT if age < self._start_timeout else ClusterStatus.DOWN

    @contextlib.asynccontextmanager
    async def _fenced(
        self, handle: ClusterHandle, epoch: int, action: str, existing_only: bool = True
    ) -> AsyncIterator[tuple[ClusterLayout, ClusterLock] | None]:
        """The cluster's layout and lock, held, once `epoch` was admitted for `action`;
        None when there is no such cluster (or, with `existing_only`, no folder).

        Raises:
            StaleEpochError: `epoch` is non-zero and below the job's highest epoch.
        """
        layout = self._layout_or_none(handle.cluster_name)
        if layout is None or (existing_only and not layout.dir.is_dir()):
            yield None
            return
        await asyncio.to_thread(self._prepare)
        async with self._fence.cluster_lock(handle.cluster_name) as lock:
            task = read_json(layout.task_file)
            await asyncio.to_thread(self._fence.admit_on, task, epoch, action)
            yield layout, lock

    async def terminate(self, handle: ClusterHandle, epoch: int = 0, grace: float = 0.0) -> bool:
        """Stops the ranks (SIGTERM, `grace` seconds, SIGKILL), kills every process of
        the cluster and removes its folder.

        Raises:
            StaleEpochError: `epoch` is non-zero and below the job's highest epoch.
        """
        async with self._fenced(handle, epoch, "terminate", existing_only=False) as held:
            if held is not None:
                layout, lock = held
                await self._supervisors.stop_and_remove(layout, max(0.0, grace))
                lock.discard()
        return False

    async def stop(self, handle: ClusterHandle, epoch: int, grace: float) -> None:
        """Stops the ranks (SIGTERM, `grace` seconds, SIGKILL) and waits for the
        supervisor to record their end; the folder, logs and end stay until `terminate`.

        Raises:
            StaleEpochError: `epoch` is non-zero and below the job's highest epoch.
        """
        async with self._fenced(handle, epoch, "stop") as held:
            if held is not None:
                layout, _ = held
                await self._supervisors.stop(layout, max(0.0, grace))
                await self._supervisors.kill_rest(layout)

    async def notify_preemption(self, handle: ClusterHandle, epoch: int, deadline: float) -> None:
        """Writes the deadline to the notice file and sends SIGTERM to every rank; the
        cluster stays up. Nothing happens to a cluster that does not exist.

        Raises:
            StaleEpochError: `epoch` is non-zero and below the job's highest epoch.
        """
        async with self._fenced(handle, epoch, "preemption notice") as held:
            if held is None:
                return
            layout, _ = held
            if supervisor_process(layout) is None:
                return
            write_atomic(layout.notice_file, f"{float(deadline)!r}\n".encode(), mode=0o644)
            pgids, _ = recorded_children(layout)
            signal_groups(pgids, signal.SIGTERM)

    async def cluster_exists(self, cluster_name: str) -> bool:
        """True while the folder or any process of the cluster remains."""
        layout = self._layout_or_none(cluster_name)
        if layout is None:
            return False
        if layout.dir.exists():
            return True
        return bool(await asyncio.to_thread(cluster_processes, layout.dir))

    async def read_logs(self, handle: ClusterHandle) -> bytes:
        """Every rank's log in rank order; lines prefixed `(rank=<r>) ` when multi-node."""
        layout = self._layout_or_none(handle.cluster_name)
        if layout is None:
            return b""
        return await asyncio.to_thread(local_logs.read_all, layout)

    async def tail_logs(self, handle: ClusterHandle) -> AsyncIterator[bytes]:
        """Yields log bytes as the ranks write them, until the task finished or the
        cluster is DOWN and everything written has been yielded."""
        layout = self._layout_or_none(handle.cluster_name)
        if layout is None:
            return

        def finished() -> bool:
            seen = self._look(layout)
            return seen.cluster is ClusterStatus.DOWN or seen.end is not None

        async for chunk in local_logs.follow(layout, finished, self._poll_interval):
            yield chunk

    async def reachable(self) -> bool:
        """True if the root folder exists (it is created if missing) and is writable."""
        try:
            await asyncio.to_thread(self._prepare)
        except OSError:
            return False
        return self._root.is_dir() and os.access(self._root, os.W_OK | os.X_OK)


def from_settings(settings: Mapping[str, Any]) -> LocalBackend:
    """The local backend of a service: clusters under `<data_dir>/clusters`.

    Raises:
        ValueError: a setting is missing or malformed; the message names it.
    """
    data_dir = settings.get("data_dir")
    if not data_dir:
        raise ValueError("the local backend needs data_dir, the folder its clusters live in")
    options: dict[str, Any] = {}
    if settings.get("tail_poll_interval"):
        options["poll_interval"] = float(settings["tail_poll_interval"])
    backend = LocalBackend(
        Path(data_dir) / "clusters",
        run_as=str(settings.get("run_as") or DEFAULT_RUN_AS),
        run_as_uids=parse_uid_range(str(settings.get("run_as_uids") or DEFAULT_RUN_AS_UIDS)),
        workdir_roots=parse_workdir_roots(str(settings.get("workdir_roots") or "")),
        **options,
    )
    if backend.confinement.privileged:
        # The run-as user is made when the service starts; if that fails, every
        # launch says why (PrecheckError) rather than the service not starting.
        try:
            backend.confinement.group()
        except PrecheckError as exc:
            log.error("%s", exc)
    return backend

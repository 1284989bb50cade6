"""The `local` backend: clusters made of real processes on this host (contract §10).

A local cluster is a folder `<root>/<cluster_name>/` plus one supervisor process
(`services.backends.local.supervisor`) that runs the task's setup and run for every node
rank and records what happened. The folder is the cluster's whole state, so any
process on this host (every controller replica, the logs service) can find and
judge a cluster from its name alone:

    <root>/.state/     epochs, locks and the uid hand-out (`local_fencing`), owner only
    <root>/<name>/     the cluster, root's, mode 0711 (`local_users` on who may enter)
      task.json          the TaskRequest, launch_id and run_as, written by `launch`
      status.json        {"status", "exit_codes", "exit_code", "start_time",
                         "end_time", "pid", "stop"}, replaced atomically by the supervisor
      supervisor.pid     the supervisor's pid, written once status.json exists
      children.json      process groups of the rank processes, and the guardian's pid
      stop.json          {"grace"}: how long `terminate` lets the ranks stop
      preemption-notice  the deadline of a preemption notice ($MJ_PREEMPTION_NOTICE_FILE)
      supervisor.log     the supervisor's own stdout and stderr
      logs/rank-<r>.log  stdout and stderr of rank r (setup, then run)
      workdir/           a copy of the task's workdir; every rank's working directory
      home/              every rank's HOME
    (as root, workdir/ and home/ belong to the cluster's own uid, mode 0700; the
    rest is root's and private, but for supervisor.pid and preemption-notice)

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
  processes and fenced by epoch (`local_fencing`): a stale epoch is refused
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
import dataclasses
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from services.backends.base import (
    Backend,
    ClusterHandle,
    ClusterStatus,
    Observation,
    PrecheckError,
    ResourcesUnavailableError,
    TaskRequest,
    TaskStatus,
)
from services.backends.local import logs as local_logs
from services.backends.local.cluster import (
    SUPERVISOR_MODULE,
    ClusterLayout,
    cluster_processes,
    kill_cluster_processes,
    read_json,
    read_pid,
    recorded_children,
    run_uid,
    signal_groups,
    stop_process,
    supervisor_at,
    supervisor_process,
    task_end,
    write_atomic,
    write_json_atomic,
)
from services.backends.local.fencing import ClusterLock, EpochFence
from services.backends.local.users import (
    DEFAULT_RUN_AS,
    DEFAULT_RUN_AS_UIDS,
    Confinement,
    RunAs,
    give_to,
    parse_uid_range,
    parse_workdir_roots,
)

log = logging.getLogger(__name__)

LOCAL_REGION = "local"

_CLUSTER_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# Where `python -m services.backends.local.supervisor` can import this package from.
_IMPORT_ROOT = Path(__file__).resolve().parents[2]
_REQUEST_FIELDS = tuple(f.name for f in dataclasses.fields(TaskRequest))


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
        self._terminate_timeout = terminate_timeout
        self._start_timeout = start_timeout
        self._fence = EpochFence(self._root)
        self._confinement = Confinement(run_as, run_as_uids, workdir_roots)
        # A launch is a process (and a copy of the workdir), not an RPC.
        self.launch_concurrency = 4 * (os.cpu_count() or 1)
        # Supervisors this process started, kept so their exit status is reaped.
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
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
        if not _CLUSTER_NAME_RE.fullmatch(cluster_name):
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

    def _reap(self, cluster_name: str) -> subprocess.Popen[bytes] | None:
        """Our own supervisor for the name if still running; reaps it once it exited."""
        proc = self._procs.get(cluster_name)
        if proc is not None and proc.poll() is not None:
            del self._procs[cluster_name]
            return None
        return proc

    async def launch(
        self,
        request: TaskRequest,
        candidate_regions: Sequence[str] = (),
        blocked_regions: Sequence[str] = (),
    ) -> ClusterHandle:
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
        if request.region not in ("", LOCAL_REGION):
            raise PrecheckError(
                f"the local backend has only region {LOCAL_REGION!r}, not {request.region!r}"
            )
        candidates = {region or LOCAL_REGION for region in candidate_regions}
        if candidates and LOCAL_REGION not in candidates:
            raise PrecheckError(
                f"the local backend has only region {LOCAL_REGION!r}; "
                f"candidates were {sorted(candidates)}"
            )
        if request.num_nodes < 1:
            raise PrecheckError(f"num_nodes must be >= 1, not {request.num_nodes}")
        layout = self.layout(request.cluster_name)
        workdir = await asyncio.to_thread(self._confinement.resolve_workdir, request.workdir)
        if LOCAL_REGION in blocked_regions:
            raise ResourcesUnavailableError(
                f"region {LOCAL_REGION!r} is blocked", regions_tried=[LOCAL_REGION]
            )
        await asyncio.to_thread(self._prepare)
        task = _task_record(request)
        seen = _launch_id(read_json(layout.task_file))

        async with self._fence.cluster_lock(request.cluster_name):
            await asyncio.to_thread(
                self._fence.admit, request.job_id, request.epoch, action="launch"
            )
            current = read_json(layout.task_file)
            if _launch_id(current) not in (None, seen) and _same_task(current, task):
                # Another launch of this very attempt finished while we waited.
                joined = self._live_handle(layout)
                if joined is not None:
                    return joined
            await self._stop_and_remove(layout, grace=0.0)
            starting = asyncio.ensure_future(asyncio.to_thread(self._start, layout, task, workdir))
            try:
                proc = await asyncio.shield(starting)
                self._procs[request.cluster_name] = proc
                await self._await_supervisor(layout, proc)
            except BaseException:
                # Leave nothing half-launched behind, even when cancelled.
                await asyncio.shield(self._abort(layout, starting))
                raise
        return self._handle(layout, proc.pid)

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

    def _start(
        self, layout: ClusterLayout, task: dict[str, Any], workdir: Path | None
    ) -> subprocess.Popen[bytes]:
        with self._fence.locked():
            run_as = self._confinement.allocate(
                self._uids_in_use(), self._fence.state_dir / "next-uid"
            )
            layout.dir.mkdir()
            layout.dir.chmod(0o711)
            task["run_as"] = run_as.to_json() if run_as else None
            write_json_atomic(layout.task_file, task)
        self._make_user_folders(layout, workdir, run_as)
        layout.logs_dir.mkdir(mode=0o700)
        fd = os.open(layout.supervisor_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            # cwd makes `-m services...` importable even without an installed package;
            # the supervisor chdirs into its cluster folder right away.
            return subprocess.Popen(
                [sys.executable, "-m", SUPERVISOR_MODULE, str(layout.dir)],
                cwd=_IMPORT_ROOT,
                stdin=subprocess.DEVNULL,
                stdout=fd,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            os.close(fd)

    def _uids_in_use(self) -> set[int]:
        used = set()
        for entry in self._root.iterdir():
            if not entry.name.startswith(".") and entry.is_dir():
                uid = run_uid(read_json(entry / "task.json"))
                if uid is not None:
                    used.add(uid)
        return used

    @staticmethod
    def _make_user_folders(
        layout: ClusterLayout, workdir: Path | None, run_as: RunAs | None
    ) -> None:
        if workdir is not None:
            shutil.copytree(workdir, layout.workdir, symlinks=True)
        else:
            layout.workdir.mkdir()
        layout.home.mkdir()
        give_to(layout.workdir, run_as)
        give_to(layout.home, run_as)

    async def _await_supervisor(self, layout: ClusterLayout, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self._start_timeout
        while read_pid(layout.pid_file) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                try:
                    out = layout.supervisor_log.read_bytes()[-2000:].decode(errors="replace")
                except OSError:
                    out = ""
                raise ResourcesUnavailableError(
                    f"the supervisor of {layout.dir.name} did not start: {out.strip()}",
                    regions_tried=[LOCAL_REGION],
                )
            await asyncio.sleep(0.02)

    async def _abort(
        self, layout: ClusterLayout, starting: asyncio.Future[subprocess.Popen[bytes]]
    ) -> None:
        # The start may still be running in its thread: let it finish, then undo it.
        with contextlib.suppress(Exception):
            self._procs[layout.dir.name] = await starting
        await self._stop_and_remove(layout, grace=0.0)

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
        if self._reap(layout.dir.name) is not None:
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
            await self._admit(layout, epoch, action)
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
                await self._stop_and_remove(layout, max(0.0, grace))
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
                await self._stop_supervisor(layout, max(0.0, grace))
                await asyncio.to_thread(self._kill_all, layout)

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

    async def _admit(self, layout: ClusterLayout, epoch: int, action: str) -> None:
        """Refuses a stale epoch acting on the cluster; epoch 0 always passes."""
        task = read_json(layout.task_file)
        if not epoch or not isinstance(task, dict):
            return
        job_id, launched_by = task.get("job_id"), task.get("epoch")
        if isinstance(job_id, int) and isinstance(launched_by, int):
            await asyncio.to_thread(
                self._fence.admit, job_id, epoch, floor=launched_by, action=action
            )

    async def _stop_and_remove(self, layout: ClusterLayout, grace: float) -> None:
        await self._stop_supervisor(layout, grace)
        await asyncio.to_thread(self._kill_and_remove, layout)
        child = self._procs.pop(layout.dir.name, None)
        if child is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(child.wait, 5.0)

    async def _stop_supervisor(self, layout: ClusterLayout, grace: float) -> None:
        """Has the supervisor stop the ranks with `grace` and waits for it to exit."""
        name = layout.dir.name
        own = self._reap(name)
        supervisor = supervisor_process(layout)
        pid = supervisor.pid if supervisor else own.pid if own else None
        if pid is not None:
            with contextlib.suppress(OSError):
                write_json_atomic(layout.stop_file, {"grace": grace})

            def ours() -> bool:
                # Our own unreaped child cannot have lent its pid to another process.
                return (own is not None and own.pid == pid) or bool(supervisor_at(pid, layout.dir))

            if await stop_process(pid, grace + self._terminate_timeout, ours):
                self._report_stop(layout, grace)
            else:
                log.warning("cluster %s: its supervisor did not stop; killing everything", name)

    @staticmethod
    def _report_stop(layout: ClusterLayout, grace: float) -> None:
        status = read_json(layout.status_file)
        stop = status.get("stop") if isinstance(status, dict) else None
        if grace > 0 and isinstance(stop, dict) and stop.get("sigkill"):
            log.info(
                "cluster %s: ranks outlived the %.1fs grace; sent SIGKILL", layout.dir.name, grace
            )

    @staticmethod
    def _kill_all(layout: ClusterLayout) -> None:
        """SIGKILLs whatever of the cluster still runs (its folder stays)."""
        pgids, _ = recorded_children(layout)
        kill_cluster_processes(layout.dir, pgids, uid=run_uid(read_json(layout.task_file)))

    @classmethod
    def _kill_and_remove(cls, layout: ClusterLayout) -> None:
        for attempt in range(3):
            cls._kill_all(layout)
            try:
                shutil.rmtree(layout.dir)
                return
            except FileNotFoundError:
                return
            except OSError:
                # Something of the cluster was still writing into it; kill again.
                if attempt == 2:
                    raise
                time.sleep(0.1)

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
        follower = local_logs.LogFollower(layout)
        while True:
            # Decide before reading: whatever was written before the end is read below.
            seen = self._look(layout)
            done = seen.cluster is ClusterStatus.DOWN or seen.end is not None
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
                await asyncio.sleep(self._poll_interval)

    async def reachable(self) -> bool:
        """True if the root folder exists (it is created if missing) and is writable."""
        try:
            await asyncio.to_thread(self._prepare)
        except OSError:
            return False
        return self._root.is_dir() and os.access(self._root, os.W_OK | os.X_OK)


def _task_record(request: TaskRequest) -> dict[str, Any]:
    task = {name: getattr(request, name) for name in _REQUEST_FIELDS}
    task["envs"] = {str(k): str(v) for k, v in request.envs.items()}
    task["sim"] = dict(request.sim)
    task["launch_id"] = uuid.uuid4().hex
    return task


def _launch_id(task: Any) -> str | None:
    launch_id = task.get("launch_id") if isinstance(task, dict) else None
    return launch_id if isinstance(launch_id, str) else None


def _same_task(current: Any, task: Mapping[str, Any]) -> bool:
    """Whether task.json's content `current` is the attempt `task` describes."""
    return isinstance(current, dict) and all(
        current.get(name) == task[name] for name in _REQUEST_FIELDS
    )


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

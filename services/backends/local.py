"""The `local` backend: clusters made of real processes on this host (SPEC §10).

A local cluster is a directory `<root>/<cluster_name>/` plus one supervisor process
(`services.backends.supervisor`) that runs the task's setup and run for every node
rank and records what happened. The directory is the cluster's whole state, so any
process on this host (every controller replica, the logs service) can find and
judge a cluster from its name alone:

    task.json        the TaskRequest, written by `launch` before the supervisor starts
    supervisor.pid   the supervisor's pid, written once status.json exists
    status.json      {"status", "exit_codes", "start_time", "end_time"}, replaced atomically
    children.json    process groups of every rank process, and the guardian's pid
    supervisor.log   the supervisor's own stdout and stderr
    logs/rank-<r>.log  stdout and stderr of rank r (setup, then run)
    workdir/         a copy of the task's workdir; every rank's working directory

Invariants:
- The supervisor alive means the cluster is UP; a dead (or zombie) supervisor
  means DOWN, and then the task status is not trusted (`task_status` is None):
  that is how the controller tells preemption (kill the supervisor) from a crash
  of the user's code (a finished status with a non-zero exit code).
- A pid counts only if /proc shows it is the supervisor *of this directory*, so a
  reused pid never passes for a live cluster.
- Every process of a cluster dies with its supervisor: ranks get PR_SET_PDEATHSIG,
  and a guardian process kills the ranks' process groups (and anything carrying
  the cluster's environment tag) when the supervisor dies by any means.
- `terminate` is idempotent: it kills everything of the cluster it can find (by pid
  file, recorded process groups and a process scan) and removes the directory;
  `cluster_exists` checks both, so it is the proof that teardown worked.
- Relaunching a name whose cluster still exists terminates the stale cluster first
  (a relaunch after preemption reuses the name); the new attempt starts clean.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from services.backends.base import (
    Backend,
    BackendError,
    ClusterHandle,
    ClusterStatus,
    Observation,
    PrecheckError,
    ResourcesUnavailableError,
    TaskEnd,
    TaskRequest,
    TaskStatus,
)
from services.backends.ranks import RankLogJoiner, prefix_lines

LOCAL_REGION = "local"
SUPERVISOR_MODULE = "services.backends.supervisor"
# Every rank process (and what it spawns, unless it clears its environment) carries
# this variable set to the cluster directory, so teardown can find escaped processes.
CLUSTER_DIR_ENV = "MJ_CLUSTER_DIR"

_CLUSTER_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# Where `python -m services.backends.supervisor` can import this package from.
_IMPORT_ROOT = Path(__file__).resolve().parents[2]
_READ_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class ClusterLayout:
    """The files of one local cluster (see the module docstring)."""

    dir: Path

    @property
    def task_file(self) -> Path:
        return self.dir / "task.json"

    @property
    def status_file(self) -> Path:
        return self.dir / "status.json"

    @property
    def pid_file(self) -> Path:
        return self.dir / "supervisor.pid"

    @property
    def children_file(self) -> Path:
        return self.dir / "children.json"

    @property
    def supervisor_log(self) -> Path:
        return self.dir / "supervisor.log"

    @property
    def logs_dir(self) -> Path:
        return self.dir / "logs"

    @property
    def workdir(self) -> Path:
        return self.dir / "workdir"

    def rank_log(self, rank: int) -> Path:
        return self.logs_dir / f"rank-{rank}.log"


def write_json_atomic(path: Path, value: Any) -> None:
    """Writes JSON so that readers see the old or the new content, never a mix."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value, sort_keys=True, default=str))
    os.replace(tmp, path)


def read_json(path: Path) -> Any | None:
    """The parsed content of `path`, or None when it is missing or unreadable."""
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None


def read_pid(path: Path) -> int | None:
    """The pid stored in `path`, or None."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _alive(proc: psutil.Process) -> bool:
    # is_running() also guards against pid reuse since `proc` was created.
    try:
        return proc.is_running() and proc.status() not in (
            psutil.STATUS_ZOMBIE,
            psutil.STATUS_DEAD,
        )
    except psutil.Error:
        return False


def is_supervisor(proc: psutil.Process, cluster_dir: Path) -> bool:
    """Whether `proc` is the supervisor (or its guardian) of `cluster_dir`, alive."""
    try:
        cmdline = proc.cmdline()
    except psutil.Error:
        return False
    return SUPERVISOR_MODULE in cmdline and str(cluster_dir) in cmdline and _alive(proc)


def supervisor_process(layout: ClusterLayout) -> psutil.Process | None:
    """The live supervisor of the cluster per its pid file, or None."""
    pid = read_pid(layout.pid_file)
    if pid is None:
        return None
    try:
        proc = psutil.Process(pid)
    except psutil.Error:
        return None
    return proc if is_supervisor(proc, layout.dir) else None


def cluster_processes(
    cluster_dir: Path, *, include_supervisor: bool = True
) -> list[psutil.Process]:
    """Every live process of the cluster: supervisor, guardian and tagged rank processes.

    Args:
        cluster_dir: The cluster's directory (absolute).
        include_supervisor: Also return the supervisor and guardian processes.

    Returns:
        The processes, never including the caller.
    """
    target = str(cluster_dir)
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            tagged = proc.environ().get(CLUSTER_DIR_ENV) == target
        except psutil.Error:
            tagged = False
        if (tagged and _alive(proc)) or (include_supervisor and is_supervisor(proc, cluster_dir)):
            found.append(proc)
    return found


def signal_groups(pgids: Iterable[int], sig: signal.Signals) -> None:
    """Sends `sig` to each process group, ignoring groups that are gone."""
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)


def kill_cluster_processes(
    cluster_dir: Path, pgids: Iterable[int], *, include_supervisor: bool = True
) -> None:
    """SIGKILLs the given process groups and every process of the cluster, then waits.

    Args:
        cluster_dir: The cluster's directory (absolute).
        pgids: Process groups of the cluster's ranks.
        include_supervisor: Also kill the supervisor and guardian.
    """
    signal_groups(pgids, signal.SIGKILL)
    procs = cluster_processes(cluster_dir, include_supervisor=include_supervisor)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    wait_gone(procs, timeout=2.0)


def wait_gone(procs: Iterable[psutil.Process], timeout: float) -> bool:
    """Waits until no process of `procs` is alive (zombies count as gone).

    Unlike `psutil.wait_procs`, a zombie that its parent has not reaped yet does not
    hold the wait up to the timeout.

    Returns:
        Whether they all went before the timeout.
    """
    pending = list(procs)
    deadline = time.monotonic() + timeout
    while True:
        pending = [p for p in pending if _alive(p)]
        if not pending:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def recorded_children(layout: ClusterLayout) -> tuple[list[int], int | None]:
    """The rank process groups and guardian pid recorded in children.json."""
    raw = read_json(layout.children_file)
    if not isinstance(raw, dict):
        return [], None
    pgids = [int(p) for p in raw.get("pgids", []) if isinstance(p, int) and p > 1]
    guardian = raw.get("guardian_pid")
    return pgids, guardian if isinstance(guardian, int) and guardian > 1 else None


def _num_nodes(layout: ClusterLayout) -> int:
    raw = read_json(layout.task_file)
    if isinstance(raw, dict) and isinstance(raw.get("num_nodes"), int):
        return max(1, raw["num_nodes"])
    ranks = [
        int(m.group(1))
        for p in layout.logs_dir.glob("rank-*.log")
        if (m := re.fullmatch(r"rank-(\d+)\.log", p.name))
    ]
    return max(ranks, default=0) + 1


def _existing_workdir(workdir: str) -> Path | None:
    if not workdir:
        return None
    path = Path(workdir).expanduser()
    if not path.is_dir():
        raise PrecheckError(f"workdir {workdir!r} is not an existing directory")
    return path


class _LogFollower:
    """Reads what the ranks appended since the last call; whole lines when prefixing."""

    def __init__(self, layout: ClusterLayout) -> None:
        self._layout = layout
        self._joiner: RankLogJoiner | None = None
        self._offsets: dict[int, int] = {}

    def read_new(self) -> bytes:
        if self._joiner is None:
            if not self._layout.task_file.exists():
                return b""
            self._joiner = RankLogJoiner(_num_nodes(self._layout))
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


class LocalBackend(Backend):
    """Clusters as a directory plus a supervisor process on this host."""

    name = "local"

    def __init__(
        self,
        root: Path,
        *,
        poll_interval: float = 0.2,
        terminate_timeout: float = 5.0,
        start_timeout: float = 30.0,
    ) -> None:
        """Creates the backend.

        Args:
            root: Directory holding one subdirectory per cluster (created on demand).
            poll_interval: Seconds between polls of the log files in `tail_logs`.
            terminate_timeout: Seconds `terminate` lets the supervisor stop gracefully.
            start_timeout: Seconds a launch may take for the supervisor to come up;
                after that a cluster directory without a supervisor counts as DOWN.
        """
        self._root = Path(root).expanduser().resolve()
        self._poll_interval = poll_interval
        self._terminate_timeout = terminate_timeout
        self._start_timeout = start_timeout
        # Supervisors this process started, kept so their exit status is reaped.
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    @property
    def root(self) -> Path:
        """The directory holding the clusters."""
        return self._root

    def layout(self, cluster_name: str) -> ClusterLayout:
        """The files of a cluster.

        Raises:
            PrecheckError: the name cannot be a directory name.
        """
        if not _CLUSTER_NAME_RE.fullmatch(cluster_name):
            raise PrecheckError(f"invalid cluster name {cluster_name!r}")
        return ClusterLayout(self._root / cluster_name)

    def _layout_or_none(self, cluster_name: str) -> ClusterLayout | None:
        try:
            return self.layout(cluster_name)
        except PrecheckError:
            return None

    def _lock(self, cluster_name: str) -> asyncio.Lock:
        lock = self._locks.get(cluster_name)
        if lock is None:
            lock = asyncio.Lock()
            self._locks[cluster_name] = lock
        return lock

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
        """Creates the cluster directory and starts its supervisor.

        A cluster of the same name that still exists (a relaunch after preemption)
        is terminated first. Returns once the supervisor is up and status.json
        exists, so a fresh handle never looks preempted.

        Raises:
            PrecheckError: a region other than "local", a missing workdir, a bad
                cluster name or node count.
            ResourcesUnavailableError: "local" is blocked, or the supervisor did not
                come up (regions_tried is ["local"]).
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
        workdir = await asyncio.to_thread(_existing_workdir, request.workdir)
        if LOCAL_REGION in blocked_regions:
            raise ResourcesUnavailableError(
                f"region {LOCAL_REGION!r} is blocked", regions_tried=[LOCAL_REGION]
            )

        async with self._lock(request.cluster_name):
            await self._terminate(layout)
            try:
                proc = await asyncio.to_thread(self._start, layout, request, workdir)
                self._procs[request.cluster_name] = proc
                await self._await_supervisor(layout, proc)
            except BaseException:
                # Leave nothing half-launched behind, even when cancelled.
                await asyncio.shield(self._terminate(layout))
                raise
        return ClusterHandle(
            cluster_name=request.cluster_name,
            backend=self.name,
            region=LOCAL_REGION,
            data={"dir": str(layout.dir), "pid": proc.pid},
        )

    def handle_for(self, cluster_name: str) -> ClusterHandle:
        """The handle of a cluster known only by name.

        Every method finds a local cluster from its name alone; `data` carries the
        directory and, when the supervisor has written it, its pid.
        """
        data: dict[str, Any] = {}
        layout = self._layout_or_none(cluster_name)
        if layout is not None:
            data["dir"] = str(layout.dir)
            pid = read_pid(layout.pid_file)
            if pid is not None:
                data["pid"] = pid
        return ClusterHandle(cluster_name, backend=self.name, region=LOCAL_REGION, data=data)

    def _start(
        self, layout: ClusterLayout, request: TaskRequest, workdir: Path | None
    ) -> subprocess.Popen[bytes]:
        layout.dir.mkdir(parents=True)
        task = {f.name: getattr(request, f.name) for f in dataclasses.fields(request)}
        task["envs"] = {str(k): str(v) for k, v in request.envs.items()}
        task["sim"] = dict(request.sim)
        write_json_atomic(layout.task_file, task)
        if workdir is not None:
            shutil.copytree(workdir, layout.workdir, symlinks=True)
        layout.logs_dir.mkdir()
        with open(layout.supervisor_log, "ab") as log:
            # cwd makes `-m services...` importable even without an installed package;
            # the supervisor chdirs into its cluster directory right away.
            return subprocess.Popen(
                [sys.executable, "-m", SUPERVISOR_MODULE, str(layout.dir)],
                cwd=_IMPORT_ROOT,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    async def _await_supervisor(self, layout: ClusterLayout, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self._start_timeout
        while read_pid(layout.pid_file) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                try:
                    log = layout.supervisor_log.read_bytes()[-2000:].decode(errors="replace")
                except OSError:
                    log = ""
                raise ResourcesUnavailableError(
                    f"the supervisor of {layout.dir.name} did not start: {log.strip()}",
                    regions_tried=[LOCAL_REGION],
                )
            await asyncio.sleep(0.02)

    async def cluster_status(self, handle: ClusterHandle) -> ClusterStatus:
        """UP while the cluster's own supervisor lives; INIT during launch; else DOWN."""
        layout = self._layout_or_none(handle.cluster_name)
        if layout is None or not layout.dir.is_dir():
            return ClusterStatus.DOWN
        own = self._reap(handle.cluster_name)
        if read_pid(layout.pid_file) is None:
            if own is not None:
                return ClusterStatus.INIT
            try:
                age = time.time() - layout.dir.stat().st_mtime
            except OSError:
                return ClusterStatus.DOWN
            return ClusterStatus.INIT if age < self._start_timeout else ClusterStatus.DOWN
        return ClusterStatus.UP if supervisor_process(layout) else ClusterStatus.DOWN

    async def task_status(self, handle: ClusterHandle) -> TaskStatus | None:
        """The status in status.json, or None unless the cluster is UP."""
        layout = self._layout_or_none(handle.cluster_name)
        if layout is None:
            return None
        raw = read_json(layout.status_file)
        # Read first, then check: a status is trusted only if the supervisor that
        # wrote it is still alive afterwards.
        if await self.cluster_status(handle) is not ClusterStatus.UP:
            return None
        try:
            return TaskStatus(raw["status"]) if isinstance(raw, dict) else None
        except (KeyError, ValueError):
            return None

    async def observe(self, handle: ClusterHandle) -> Observation:
        cluster = await self.cluster_status(handle)
        task = await self.task_status(handle) if cluster is ClusterStatus.UP else None
        layout = self._layout_or_none(handle.cluster_name)
        raw = read_json(layout.status_file) if layout else None
        end = None
        if isinstance(raw, dict) and isinstance(raw.get("end_time"), (int, float)):
            try:
                status = TaskStatus(raw.get("status"))
            except ValueError:
                status = None
            if status is not None and status.finished:
                end = TaskEnd(status, None, float(raw["end_time"]))
        return Observation(cluster, task, end)

    async def notify_preemption(self, handle: ClusterHandle, epoch: int, deadline: float) -> None:
        raise BackendError("the local backend does not take preemption notices yet")

    async def terminate(self, handle: ClusterHandle, epoch: int = 0, grace: float = 0.0) -> None:
        """Stops the supervisor (gracefully, then SIGKILL), kills leftovers, removes the dir."""
        layout = self._layout_or_none(handle.cluster_name)
        if layout is None:
            return
        async with self._lock(handle.cluster_name):
            await self._terminate(layout)

    async def _terminate(self, layout: ClusterLayout) -> None:
        name = layout.dir.name
        own = self._reap(name)
        supervisor = supervisor_process(layout)
        pid = supervisor.pid if supervisor else own.pid if own else None

        def running() -> bool:
            # poll() reaps our own child so it does not linger as a zombie.
            return (own is not None and own.poll() is None) or (
                supervisor is not None and _alive(supervisor)
            )

        if pid is not None:
            # The supervisor leads its own process group (start_new_session).
            signal_groups([pid], signal.SIGTERM)
            deadline = time.monotonic() + self._terminate_timeout
            while time.monotonic() < deadline:
                if not running():
                    break
                await asyncio.sleep(0.05)
            else:
                signal_groups([pid], signal.SIGKILL)
        await asyncio.to_thread(self._kill_and_remove, layout)
        own = self._procs.pop(name, None)
        if own is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(own.wait, 5.0)

    @staticmethod
    def _kill_and_remove(layout: ClusterLayout) -> None:
        pgids, _ = recorded_children(layout)
        for attempt in range(3):
            kill_cluster_processes(layout.dir, pgids)
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
        """True while the directory or any process of the cluster remains."""
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
        return await asyncio.to_thread(self._read_logs, layout)

    @staticmethod
    def _read_logs(layout: ClusterLayout) -> bytes:
        if not layout.dir.is_dir():
            return b""
        num_nodes = _num_nodes(layout)
        parts = []
        for rank in range(num_nodes):
            try:
                data = layout.rank_log(rank).read_bytes()
            except OSError:
                continue
            parts.append(data if num_nodes == 1 else prefix_lines(data, rank))
        return b"".join(parts)

    async def tail_logs(self, handle: ClusterHandle) -> AsyncIterator[bytes]:
        """Yields log bytes as the ranks write them, until the task finished or the
        cluster is DOWN and everything written has been yielded."""
        layout = self._layout_or_none(handle.cluster_name)
        if layout is None:
            return
        follower = _LogFollower(layout)
        while True:
            # Decide before reading: whatever was written before the end is read below.
            done = await self._tail_done(handle, layout)
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

    async def _tail_done(self, handle: ClusterHandle, layout: ClusterLayout) -> bool:
        if await self.cluster_status(handle) is ClusterStatus.DOWN:
            return True
        raw = read_json(layout.status_file)
        try:
            return isinstance(raw, dict) and TaskStatus(raw.get("status")).finished
        except ValueError:
            return False

    async def reachable(self) -> bool:
        """True if the root directory exists (it is created if missing) and is writable."""
        try:
            await asyncio.to_thread(self._root.mkdir, parents=True, exist_ok=True)
        except OSError:
            return False
        return self._root.is_dir() and os.access(self._root, os.W_OK | os.X_OK)


def from_settings(settings: Mapping[str, Any]) -> LocalBackend:
    """The local backend of a service: clusters under `<data_dir>/clusters`."""
    data_dir = settings.get("data_dir")
    if not data_dir:
        raise ValueError("the local backend needs data_dir, the folder its clusters live in")
    options: dict[str, Any] = {}
    if settings.get("tail_poll_interval"):
        options["poll_interval"] = float(settings["tail_poll_interval"])
    return LocalBackend(Path(data_dir) / "clusters", **options)

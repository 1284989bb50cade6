"""The supervisors of this host's local clusters, as the backend starts and stops them.

`Supervisors` owns the processes of clusters from the outside:
- starting one: the cluster's folder and its task.json (the launch plan's record,
  with the run-as uid handed out under the fence's lock), the workdir copy and
  home given to that uid, then the supervisor process, and waiting until it wrote
  its pid; a start that fails or is cancelled half-way leaves nothing behind;
- stopping one: the supervisor is asked (stop.json) to give the ranks their grace
  between SIGTERM and SIGKILL and is waited for; then whatever of the cluster still
  runs is killed (recorded process groups, the cluster's uid, its environment tag)
  and, for a teardown, the folder is removed.

The supervisors this process started are kept until they exited, so that their exit
status is reaped.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from services.backends.base import LaunchPlan, ResourcesUnavailableError
from services.backends.local.cluster import (
    SUPERVISOR_MODULE,
    ClusterLayout,
    kill_cluster_processes,
    read_json,
    read_pid,
    recorded_children,
    run_uid,
    stop_process,
    supervisor_at,
    supervisor_process,
    write_json_atomic,
)
from services.backends.local.fencing import EpochFence
from services.backends.local.users import Confinement, RunAs, give_to

log = logging.getLogger(__name__)

LOCAL_REGION = "local"

# Where `python -m services.backends.local.supervisor` can import this package from.
_IMPORT_ROOT = Path(__file__).resolve().parents[3]
# What task.json keeps of a launch plan: the attempt and what its supervisor runs (not
# where it may go, nor other backends' options).
_TASK_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(LaunchPlan)
    if f.name not in ("candidate_regions", "blocked_regions", "extensions")
)


def task_record(plan: LaunchPlan) -> dict[str, Any]:
    """task.json's content for a launch of `plan`, under a launch id of its own."""
    task = {name: getattr(plan, name) for name in _TASK_FIELDS}
    task["envs"] = {str(k): str(v) for k, v in plan.envs.items()}
    task["launch_id"] = uuid.uuid4().hex
    return task


def launch_id(task: Any) -> str | None:
    """The launch id of task.json's content `task`, if it has one."""
    found = task.get("launch_id") if isinstance(task, dict) else None
    return found if isinstance(found, str) else None


def same_task(current: Any, task: Mapping[str, Any]) -> bool:
    """Whether task.json's content `current` is the attempt `task` describes."""
    return isinstance(current, dict) and all(
        current.get(name) == task[name] for name in _TASK_FIELDS
    )


class Supervisors:
    """Starts and stops the supervisors of the clusters under `root`."""

    def __init__(
        self,
        root: Path,
        fence: EpochFence,
        confinement: Confinement,
        *,
        start_timeout: float,
        terminate_timeout: float,
    ) -> None:
        self._root = root
        self._fence = fence
        self._confinement = confinement
        self._start_timeout = start_timeout
        self._terminate_timeout = terminate_timeout
        # Supervisors this process started, kept so their exit status is reaped.
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    def own(self, cluster_name: str) -> subprocess.Popen[bytes] | None:
        """Our own supervisor for the name if still running; reaps it once it exited."""
        proc = self._procs.get(cluster_name)
        if proc is not None and proc.poll() is not None:
            del self._procs[cluster_name]
            return None
        return proc

    async def start(self, layout: ClusterLayout, task: dict[str, Any], workdir: Path | None) -> int:
        """Makes the cluster's folder and starts its supervisor; the supervisor's pid, once
        it is up. Nothing of the cluster is left when this fails or is cancelled.

        Raises:
            ResourcesUnavailableError: no uid is free, or the supervisor did not come up.
        """
        starting = asyncio.ensure_future(asyncio.to_thread(self._start, layout, task, workdir))
        try:
            proc = await asyncio.shield(starting)
            self._procs[layout.dir.name] = proc
            await self._await_up(layout, proc)
        except BaseException:
            # Leave nothing half-launched behind, even when cancelled.
            await asyncio.shield(self._abort(layout, starting))
            raise
        return proc.pid

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
        _make_user_folders(layout, workdir, run_as)
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

    async def _await_up(self, layout: ClusterLayout, proc: subprocess.Popen[bytes]) -> None:
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
        await self.stop_and_remove(layout, grace=0.0)

    async def stop_and_remove(self, layout: ClusterLayout, grace: float) -> None:
        """Stops the ranks (SIGTERM, `grace` seconds, SIGKILL), kills every process of the
        cluster and removes its folder."""
        await self.stop(layout, grace)
        await asyncio.to_thread(_kill_and_remove, layout)
        child = self._procs.pop(layout.dir.name, None)
        if child is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(child.wait, 5.0)

    async def stop(self, layout: ClusterLayout, grace: float) -> None:
        """Has the supervisor stop the ranks with `grace` and waits for it to exit."""
        name = layout.dir.name
        own = self.own(name)
        supervisor = supervisor_process(layout)
        pid = supervisor.pid if supervisor else own.pid if own else None
        if pid is not None:
            with contextlib.suppress(OSError):
                write_json_atomic(layout.stop_file, {"grace": grace})

            def ours() -> bool:
                # Our own unreaped child cannot have lent its pid to another process.
                return (own is not None and own.pid == pid) or bool(supervisor_at(pid, layout.dir))

            if await stop_process(pid, grace + self._terminate_timeout, ours):
                _report_stop(layout, grace)
            else:
                log.warning("cluster %s: its supervisor did not stop; killing everything", name)

    @staticmethod
    async def kill_rest(layout: ClusterLayout) -> None:
        """SIGKILLs whatever of the cluster still runs (its folder stays)."""
        await asyncio.to_thread(_kill_all, layout)


def _make_user_folders(layout: ClusterLayout, workdir: Path | None, run_as: RunAs | None) -> None:
    if workdir is not None:
        shutil.copytree(workdir, layout.workdir, symlinks=True)
    else:
        layout.workdir.mkdir()
    layout.home.mkdir()
    give_to(layout.workdir, run_as)
    give_to(layout.home, run_as)


def _report_stop(layout: ClusterLayout, grace: float) -> None:
    status = read_json(layout.status_file)
    stop = status.get("stop") if isinstance(status, dict) else None
    if grace > 0 and isinstance(stop, dict) and stop.get("sigkill"):
        log.info("cluster %s: ranks outlived the %.1fs grace; sent SIGKILL", layout.dir.name, grace)


def _kill_all(layout: ClusterLayout) -> None:
    pgids, _ = recorded_children(layout)
    kill_cluster_processes(layout.dir, pgids, uid=run_uid(read_json(layout.task_file)))


def _kill_and_remove(layout: ClusterLayout) -> None:
    for attempt in range(3):
        _kill_all(layout)
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

"""The files and processes of one local cluster, shared by the backend and the supervisor.

A local cluster is a folder (`ClusterLayout`) plus the processes its supervisor
started:

    <root>/.state/     epochs, locks and the uid hand-out (`fencing`), owner only
    <root>/<name>/     the cluster, root's, mode 0711 (`users` on who may enter)
      task.json          the launch plan, launch_id and run_as, written by `launch`
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

This module holds what the backend and the supervisor need to read that state the
same way: atomic JSON files, the supervisor's identity in /proc, the cluster's
processes (by recorded process group, by the environment tag every rank carries,
and by the cluster's own uid when it has one), stopping a process through a pidfd,
and the task's end as status.json records it.

Invariants:
- A pid counts as the supervisor only if /proc shows it running the supervisor *of
  this folder*, so a reused pid never passes for a live cluster.
- Exit codes in status.json's `exit_codes` are Popen's (negative for a death by
  signal); `exit_code`, the task's one code, follows the shell (128 + signal).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import psutil

from services.backends.base import TaskEnd, TaskStatus

SUPERVISOR_MODULE = "services.backends.local.supervisor"
# Every rank process (and what it spawns, unless it clears its environment) carries
# this variable set to the cluster folder, so teardown can find escaped processes.
CLUSTER_DIR_ENV = "MJ_CLUSTER_DIR"
# Names the file a preemption notice is written to (contract §18).
NOTICE_FILE_ENV = "MJ_PREEMPTION_NOTICE_FILE"


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
    def stop_file(self) -> Path:
        return self.dir / "stop.json"

    @property
    def notice_file(self) -> Path:
        return self.dir / "preemption-notice"

    @property
    def supervisor_log(self) -> Path:
        return self.dir / "supervisor.log"

    @property
    def logs_dir(self) -> Path:
        return self.dir / "logs"

    @property
    def workdir(self) -> Path:
        return self.dir / "workdir"

    @property
    def home(self) -> Path:
        return self.dir / "home"

    def rank_log(self, rank: int) -> Path:
        return self.logs_dir / f"rank-{rank}.log"


def write_json_atomic(path: Path, value: Any, mode: int = 0o600) -> None:
    """Writes JSON so that readers see the old or the new content, never a mix."""
    write_atomic(path, json.dumps(value, sort_keys=True, default=str).encode(), mode)


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Replaces `path` with `data` in one rename; the file gets `mode`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)  # whatever the umask
        os.write(fd, data)
    finally:
        os.close(fd)
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


def alive(proc: psutil.Process) -> bool:
    """Whether `proc` still runs (a zombie does not); guards against pid reuse."""
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
    return SUPERVISOR_MODULE in cmdline and str(cluster_dir) in cmdline and alive(proc)


def supervisor_at(pid: Any, cluster_dir: Path) -> psutil.Process | None:
    """The live supervisor of `cluster_dir` if `pid` is it, else None."""
    if not isinstance(pid, int) or pid <= 1:
        return None
    try:
        proc = psutil.Process(pid)
    except psutil.Error:
        return None
    return proc if is_supervisor(proc, cluster_dir) else None


def supervisor_process(layout: ClusterLayout) -> psutil.Process | None:
    """The live supervisor of the cluster per its pid file, or None."""
    return supervisor_at(read_pid(layout.pid_file), layout.dir)


def cluster_processes(
    cluster_dir: Path, *, uid: int | None = None, include_supervisor: bool = True
) -> list[psutil.Process]:
    """Every live process of the cluster: supervisor, guardian and rank processes.

    Args:
        cluster_dir: The cluster's folder (absolute).
        uid: The cluster's own uid, if it has one: every process running as it counts.
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
            ours = uid is not None and proc.uids().real == uid
            ours = ours or proc.environ().get(CLUSTER_DIR_ENV) == target
        except psutil.Error:
            ours = False
        if (ours and alive(proc)) or (include_supervisor and is_supervisor(proc, cluster_dir)):
            found.append(proc)
    return found


def signal_groups(pgids: Iterable[int], sig: signal.Signals) -> None:
    """Sends `sig` to each process group, ignoring groups that are gone."""
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)


def group_alive(pgid: int) -> bool:
    """Whether any process (a zombie included) is still in the process group."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_cluster_processes(
    cluster_dir: Path,
    pgids: Iterable[int],
    *,
    uid: int | None = None,
    include_supervisor: bool = True,
) -> None:
    """SIGKILLs the given process groups and every process of the cluster, then waits.

    Args:
        cluster_dir: The cluster's folder (absolute).
        pgids: Process groups of the cluster's ranks.
        uid: The cluster's own uid, if it has one.
        include_supervisor: Also kill the supervisor and guardian.
    """
    signal_groups(pgids, signal.SIGKILL)
    procs = cluster_processes(cluster_dir, uid=uid, include_supervisor=include_supervisor)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    wait_gone(procs, timeout=2.0)


def wait_gone(procs: Iterable[psutil.Process], timeout: float) -> bool:
    """Waits until no process of `procs` is alive (zombies count as gone).

    Only for processes that were sent SIGKILL, which go in milliseconds; unlike
    `psutil.wait_procs`, an unreaped zombie does not hold the wait up.

    Returns:
        Whether they all went before the timeout.
    """
    pending = list(procs)
    deadline = time.monotonic() + timeout
    while True:
        pending = [p for p in pending if alive(p)]
        if not pending:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


async def stop_process(pid: int, timeout: float, ours: Callable[[], bool]) -> bool:
    """SIGTERMs `pid` and waits up to `timeout` for it to exit; SIGKILLs it if it did not.

    Waits on a pidfd, so the wait ends the moment the process does; `ours` is asked
    once the pidfd is open, so the signals cannot reach a process that reused the pid.

    Returns:
        Whether it exited by itself.
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        if not ours():
            return True
        signal.pidfd_send_signal(fd, signal.SIGTERM)
        loop = asyncio.get_running_loop()
        exited = loop.create_future()

        def on_exit() -> None:
            if not exited.done():
                exited.set_result(None)

        loop.add_reader(fd, on_exit)
        try:
            await asyncio.wait_for(exited, timeout)
            return True
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            return False
        finally:
            loop.remove_reader(fd)
    except ProcessLookupError:
        return True
    finally:
        os.close(fd)


def recorded_children(layout: ClusterLayout) -> tuple[list[int], int | None]:
    """The rank process groups and guardian pid recorded in children.json."""
    raw = read_json(layout.children_file)
    if not isinstance(raw, dict):
        return [], None
    pgids = [int(p) for p in raw.get("pgids", []) if isinstance(p, int) and p > 1]
    guardian = raw.get("guardian_pid")
    return pgids, guardian if isinstance(guardian, int) and guardian > 1 else None


def run_uid(task: Any) -> int | None:
    """The cluster's own uid as task.json records it, or None (runs as the service)."""
    run_as = task.get("run_as") if isinstance(task, dict) else None
    uid = run_as.get("uid") if isinstance(run_as, dict) else None
    return uid if isinstance(uid, int) and uid > 0 else None


def shell_exit_code(code: int) -> int:
    """A Popen exit code as a shell reports it: 128 + n for a death by signal n."""
    return 128 - code if code < 0 else code


def first_failure(codes: Mapping[str, Any]) -> int:
    """The first non-zero code of `codes` (by rank), in shell terms; 0 if all are 0."""
    ranked = sorted((int(rank), code) for rank, code in codes.items() if isinstance(code, int))
    return next((shell_exit_code(code) for _, code in ranked if code), 0)


def task_end(status: Mapping[str, Any]) -> TaskEnd | None:
    """The task's end as a status.json record says, or None while it has not ended."""
    end_time = status.get("end_time")
    try:
        task = TaskStatus(status.get("status"))
    except ValueError:
        return None
    if not task.finished or not isinstance(end_time, (int, float)):
        return None
    code = status.get("exit_code")
    if not isinstance(code, int):
        codes = status.get("exit_codes")
        code = first_failure(codes) if isinstance(codes, dict) and codes else None
    return TaskEnd(task, code, float(end_time))

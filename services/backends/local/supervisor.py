"""The supervisor of one local cluster: `python -m services.backends.local.supervisor DIR`.

It plays the part of a cluster's head node for the `local` backend (the file
layout is described in `services.backends.local.backend`). It reads DIR/task.json, runs
`setup` on every node rank concurrently, then, only if every rank's setup exited 0,
`run` on every rank, each as `bash -c` in DIR/workdir with its output in
DIR/logs/rank-<r>.log, and records the task status in DIR/status.json:

    PENDING -> [SETTING_UP ->] RUNNING -> SUCCEEDED | FAILED
    PENDING -> SETTING_UP -> FAILED_SETUP          (run never starts)

When one rank of a phase fails, the other ranks of that phase are stopped (as
SkyPilot does for multi-node jobs), since a distributed job usually hangs without
its peers. The task's `exit_code` is that of the first rank to fail (shell style:
128 + n for a death by signal n), or 0.

The ranks run as task.json's `run_as` uid and gid when the supervisor is root
(`services.backends.local.users`), with HOME in DIR/home; the supervisor itself
stays root and keeps the logs, status and records.

After the task finishes the supervisor stays alive, because a cluster stays up
until it is terminated. SIGTERM (or SIGINT) stops it: it sends SIGTERM to every
rank's process group, gives them the grace of DIR/stop.json (written by
`terminate`) to exit, SIGKILLs what is left, records in status.json whether it had
to (`stop`), and ends. Its own death by any other means (SIGKILL = preemption)
must take the user's processes with it:
- each rank is started in its own session and process group, with
  PR_SET_PDEATHSIG=SIGKILL so the rank's `bash` dies with the supervisor;
- a forked *guardian* process, in a session of its own, blocks on a pipe whose
  only writer is the supervisor; when the pipe closes it kills every recorded
  process group (DIR/children.json), every process of the cluster's uid and every
  process tagged with the cluster's `MJ_CLUSTER_DIR`.

The supervisor is a child subreaper: whatever its ranks leave behind is reparented
to it, so it reaps every descendant and a process group is empty once its members
have exited. It is single-threaded on purpose (PR_SET_PDEATHSIG fires when the
*thread* that forked the child exits, and `preexec_fn` is only safe without
threads) and waits on children with SIGCHLD and a wakeup fd rather than polling.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from services.backends.base import TaskStatus
from services.backends.local.cluster import (
    CLUSTER_DIR_ENV,
    NOTICE_FILE_ENV,
    ClusterLayout,
    group_alive,
    kill_cluster_processes,
    read_json,
    recorded_children,
    run_uid,
    shell_exit_code,
    signal_groups,
    write_json_atomic,
)
from services.backends.ranks import rank_env

# How long ranks get between SIGTERM and SIGKILL when nobody said otherwise.
KILL_GRACE_SECONDS = 2.0
# The longest wait between checks while ranks stop (SIGCHLD usually ends it sooner).
_STOP_CHECK_SECONDS = 0.1
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _log(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} supervisor[{os.getpid()}]: {message}", flush=True)


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return prctl


def _die_with_parent(parent_pid: int, prctl: Callable[..., int] | None) -> Callable[[], None]:
    """A `preexec_fn` that makes the child receive SIGKILL when its parent dies.

    It runs after the child changed users, which would clear the setting.
    """

    def preexec() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        # The parent may have died between fork and prctl: then nobody would signal us.
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


def _guard(layout: ClusterLayout, read_fd: int, uid: int | None) -> NoReturn:
    """The guardian's body: wait for the supervisor's end, then kill the cluster's processes."""
    try:
        os.setsid()  # outlives a kill of the supervisor's process group
        while True:
            try:
                if not os.read(read_fd, 1):
                    break
            except InterruptedError:
                continue
        pgids, _ = recorded_children(layout)
        kill_cluster_processes(layout.dir, pgids, uid=uid, include_supervisor=False)
    finally:
        os._exit(0)


def _start_guardian(layout: ClusterLayout, uid: int | None) -> int:
    """Forks the guardian; the supervisor keeps the pipe's write end until it dies."""
    read_fd, write_fd = os.pipe()  # not inheritable: the ranks never hold it
    pid = os.fork()
    if pid == 0:
        os.close(write_fd)
        _guard(layout, read_fd, uid)
    os.close(read_fd)
    # Deliberately leaked: the open write end is the supervisor's heartbeat.
    return pid


class Supervisor:
    """Runs one task on one local cluster and keeps the cluster up until SIGTERM."""

    def __init__(self, layout: ClusterLayout) -> None:
        self._layout = layout
        self._stop = False
        self._pgids: list[int] = []
        self._guardian_pid = 0
        self._wake_fd = -1
        self._prctl = _load_prctl()
        self._status: dict[str, Any] = {}
        # Exit codes of reaped children, by pid, in the order they were reaped.
        self._exited: dict[int, int] = {}
        self._run_as: Mapping[str, Any] = {}

    def serve(self) -> int:
        """Runs the task, then waits for SIGTERM and stops every rank process.

        Returns:
            The process exit code: 0, or 2 when task.json is unusable.
        """
        os.chdir(self._layout.dir)
        os.umask(0o077)  # the logs and records are the supervisor's alone
        task = read_json(self._layout.task_file)
        if not isinstance(task, dict):
            _log(f"cannot read {self._layout.task_file}")
            return 2
        uid = run_uid(task) if os.geteuid() == 0 else None
        if uid is not None:
            self._run_as = task["run_as"]
        if self._prctl is not None:
            self._prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        # Fork before installing handlers: the guardian keeps default dispositions.
        self._guardian_pid = _start_guardian(self._layout, uid)
        self._install_signal_handlers()
        self._status = {
            "status": TaskStatus.PENDING.value,
            "exit_codes": {},
            "exit_code": None,
            "start_time": time.time(),
            "end_time": None,
            "pid": os.getpid(),
        }
        write_json_atomic(self._layout.status_file, self._status)
        self._record_children()
        # The pid file last: whoever sees it can also read status.json.
        write_json_atomic(self._layout.pid_file, os.getpid(), mode=0o644)
        _log(f"up; guardian {self._guardian_pid}; ranks run as uid {uid or os.geteuid()}")
        try:
            try:
                self._run_task(task)
            except Exception as exc:
                # A cluster that cannot run the task must not look preempted
                # (that would relaunch it forever): report a failure instead.
                _log(f"cannot run the task: {exc!r}")
                self._set_status(TaskStatus.FAILED)
            while not self._stop:
                self._wait(None)
        finally:
            self._stop_ranks(self._grace(), uid)
        _log("stopped")
        return 0

    def _install_signal_handlers(self) -> None:
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._wake_fd = read_fd
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        # A Python-level handler makes SIGCHLD write to the wakeup fd.
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        self._stop = True

    def _grace(self) -> float:
        raw = read_json(self._layout.stop_file)
        grace = raw.get("grace") if isinstance(raw, dict) else None
        return max(0.0, float(grace)) if isinstance(grace, (int, float)) else KILL_GRACE_SECONDS

    def _wait(self, timeout: float | None) -> None:
        """Sleeps until a signal arrives (a child exited, SIGTERM) or `timeout` passes,
        then reaps every child that exited."""
        select.select([self._wake_fd], [], [], timeout)
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_fd, 4096):
                pass
        self._reap()

    def _reap(self) -> None:
        """Reaps every exited child: ranks, the guardian and orphans adopted as subreaper."""
        while True:
            try:
                pid, wait_status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self._exited[pid] = os.waitstatus_to_exitcode(wait_status)

    def _set_status(
        self,
        status: TaskStatus,
        exit_codes: Mapping[int, int] | None = None,
        exit_code: int | None = None,
    ) -> None:
        self._status["status"] = status.value
        if exit_codes is not None:
            self._status["exit_codes"] = {str(r): c for r, c in sorted(exit_codes.items())}
        if status.finished:
            self._status["exit_code"] = exit_code
            self._status["end_time"] = time.time()
        write_json_atomic(self._layout.status_file, self._status)
        _log(f"task {status.value} {self._status['exit_codes']}")

    def _record_children(self) -> None:
        write_json_atomic(
            self._layout.children_file,
            {"pgids": self._pgids, "guardian_pid": self._guardian_pid},
        )

    def _run_task(self, task: Mapping[str, Any]) -> None:
        num_nodes = max(1, int(task.get("num_nodes", 1)))
        setup, run = str(task.get("setup") or ""), str(task.get("run") or "")
        envs = [self._rank_env(task, rank, num_nodes) for rank in range(num_nodes)]
        codes: dict[int, int] = {}
        first = 0
        if setup:
            self._set_status(TaskStatus.SETTING_UP)
            phase = self._run_phase("setup", setup, envs)
            if phase is None:
                return
            codes, first = phase
            if first:
                self._set_status(TaskStatus.FAILED_SETUP, codes, first)
                return
        if run:
            self._set_status(TaskStatus.RUNNING)
            phase = self._run_phase("run", run, envs)
            if phase is None:
                return
            codes, first = phase
        self._set_status(TaskStatus.FAILED if first else TaskStatus.SUCCEEDED, codes, first)

    def _rank_env(self, task: Mapping[str, Any], rank: int, num_nodes: int) -> dict[str, str]:
        # The controller's own MJ_* settings (addresses, tokens) stay out of user code.
        env = {k: v for k, v in os.environ.items() if not k.startswith("MJ_")}
        env["PYTHONUNBUFFERED"] = "1"
        env.update(
            rank_env(
                job_id=int(task.get("job_id", 0)),
                task_id=int(task.get("task_id", 0)),
                cluster_name=str(task.get("cluster_name", self._layout.dir.name)),
                envs=task.get("envs") or {},
                rank=rank,
                num_nodes=num_nodes,
                node_ips=["127.0.0.1"] * num_nodes,
            )
        )
        env.update(
            {
                "HOME": str(self._layout.home),
                NOTICE_FILE_ENV: str(self._layout.notice_file),
                CLUSTER_DIR_ENV: str(self._layout.dir),
            }
        )
        if self._run_as:
            env["USER"] = env["LOGNAME"] = str(self._run_as.get("user", ""))
        return env

    def _spawn(self, rank: int, script: str, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
        fd = os.open(self._layout.rank_log(rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        users: dict[str, Any] = {}
        if self._run_as:
            users = {
                "user": int(self._run_as["uid"]),
                "group": int(self._run_as["gid"]),
                "extra_groups": [],
            }
        try:
            proc = subprocess.Popen(
                [shutil.which("bash") or "/bin/bash", "-c", script],
                cwd=self._layout.workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=fd,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                umask=0o022,
                preexec_fn=_die_with_parent(os.getpid(), self._prctl),
                **users,
            )
        finally:
            os.close(fd)
        self._pgids.append(proc.pid)
        return proc

    def _run_phase(
        self, phase: str, script: str, envs: list[dict[str, str]]
    ) -> tuple[dict[int, int], int] | None:
        """Runs `script` on every rank.

        Returns:
            The exit codes by rank and the first failing rank's code in shell terms
            (0 if none failed), or None when told to stop.
        """
        procs = {rank: self._spawn(rank, script, env) for rank, env in enumerate(envs)}
        self._record_children()
        _log(f"{phase} started on {len(procs)} rank(s): pids {[p.pid for p in procs.values()]}")
        codes: dict[int, int] = {}
        first = 0
        kill_at: float | None = None
        while True:
            for rank, proc in procs.items():
                if rank not in codes and proc.pid in self._exited:
                    codes[rank] = proc.returncode = self._exited.pop(proc.pid)
                    first = first or shell_exit_code(codes[rank])
            if len(codes) == len(procs):
                self._forget_empty_groups()
                return codes, first
            if self._stop:
                return None
            if kill_at is None and first:
                _log(f"{phase} failed on a rank {codes}; stopping the other ranks")
                signal_groups([p.pid for r, p in procs.items() if r not in codes], signal.SIGTERM)
                kill_at = time.monotonic() + KILL_GRACE_SECONDS
            if kill_at is not None and time.monotonic() >= kill_at:
                signal_groups([p.pid for r, p in procs.items() if r not in codes], signal.SIGKILL)
            self._wait(1.0 if kill_at is None else max(0.05, kill_at - time.monotonic()))

    def _forget_empty_groups(self) -> None:
        """Drops groups nobody is left in: an empty group's id may be reused by others."""
        self._reap()
        self._pgids = [pgid for pgid in self._pgids if group_alive(pgid)]
        self._record_children()

    def _stop_ranks(self, grace: float, uid: int | None) -> None:
        """SIGTERM every rank process group, wait up to `grace` for them to empty, then
        SIGKILL whatever of the cluster is left; records whether SIGKILL was needed."""
        signal_groups(self._pgids, signal.SIGTERM)
        deadline = time.monotonic() + grace
        self._reap()
        while (live := [g for g in self._pgids if group_alive(g)]) and (
            left := deadline - time.monotonic()
        ) > 0:
            self._wait(min(left, _STOP_CHECK_SECONDS))
        if live:
            _log(f"process groups {live} outlived the {grace:.1f}s grace: SIGKILL")
        kill_cluster_processes(self._layout.dir, self._pgids, uid=uid, include_supervisor=False)
        self._reap()
        self._pgids = []
        self._record_children()
        self._status["stop"] = {"grace": grace, "sigkill": bool(live), "time": time.time()}
        write_json_atomic(self._layout.status_file, self._status)


def main(argv: list[str] | None = None) -> int:
    """Entry point: `python -m services.backends.local.supervisor CLUSTER_DIR`."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m services.backends.local.supervisor CLUSTER_DIR", file=sys.stderr)
        return 2
    return Supervisor(ClusterLayout(Path(args[0]).resolve())).serve()


if __name__ == "__main__":
    sys.exit(main())

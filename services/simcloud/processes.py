"""The task a cluster runs, as a simulated process: setup, run, signals, exit codes.

At UP the task sets up for `setup_seconds` when it has setup (a non-zero setup
exit code ends it FAILED_SETUP, and the run never starts), then runs for
`runtime_seconds` and exits with the plan's exit code (with `exit_code_runs`,
only the first that many runs of the (job, task) do; later ones exit 0). Its log
lines come out over the run (clusters.py computes them).

Signals: the SIGTERM of a stop or of a graceful terminate (a line in the task's
log, `sigterm_time`) ends a live task at once (FAILED, 143) unless its plan traps
it (`sigterm_exit`): then it exits that many seconds later, or never; a second
SIGTERM never makes it exit later. A stop keeps the cluster and kills the task
(SIGKILL, 137) at the end of its grace; a later stop may only shorten the grace.
Every status change of the task is an event.
"""

from __future__ import annotations

from services.simcloud.clock import Clock
from services.simcloud.clusters import CallKind, Cluster, ClusterState, TaskState
from services.simcloud.config import CloudConfig
from services.simcloud.core import CloudCore
from services.simcloud.events import EventKind

# Timer kinds: setup ends, the run ends, a graceful stop's SIGKILL (the task killed,
# the cluster kept), a task that traps SIGTERM exits on it.
SETUP_END, RUN_END, STOP_KILL, SIGTERM_EXIT = "setup_end", "run_end", "stop_kill", "sigterm_exit"
# The exit codes of a task ended by SIGKILL and by SIGTERM, as a shell reports them.
SIGKILL_EXIT_CODE = 137
SIGTERM_EXIT_CODE = 143
# Signal -> (exit code, the note in the task's log).
_ENDED_BY = {
    "SIGKILL": (SIGKILL_EXIT_CODE, "killed (SIGKILL)"),
    "SIGTERM": (SIGTERM_EXIT_CODE, "exited (SIGTERM)"),
}


class Processes(CloudCore):
    """Runs the task of each cluster UP, and signals it."""

    def __init__(self, config: CloudConfig, clock: Clock | None = None) -> None:
        super().__init__(config, clock)
        # Per (job, task) with `exit_code_runs`: how many of its runs exited with exit_code.
        self._failing_runs: dict[tuple[int, int], int] = {}

    def _start_task(self, cluster: Cluster, now: float) -> None:
        """The task of a cluster just UP: its setup when it has one, else its run."""
        plan = cluster.plan
        if plan.has_setup:
            cluster.task_status = TaskState.SETTING_UP
            self._schedule(now + plan.setup_seconds, SETUP_END, cluster)
        else:
            self._start_run(cluster, now)

    def _start_run(self, cluster: Cluster, now: float) -> None:
        cluster.task_status = TaskState.RUNNING
        cluster.run_start = now
        self._schedule(now + cluster.plan.runtime, RUN_END, cluster)

    def _on_setup_end(self, cluster: Cluster, now: float, _: str) -> None:
        if cluster.status != ClusterState.UP or cluster.task_status != TaskState.SETTING_UP:
            return
        code = cluster.plan.setup_exit_code
        if code != 0:
            cluster.task_status = TaskState.FAILED_SETUP
            cluster.exit_code = code
            cluster.task_end_time = now
            message = f"setup exited with {code}"
        else:
            self._start_run(cluster, now)
            message = "setup done"
        self._publish(EventKind.TASK_STATUS_CHANGED, cluster, now, message)
        self._end_if_terminating(cluster, now)

    def _on_run_end(self, cluster: Cluster, now: float, _: str) -> None:
        if cluster.status != ClusterState.UP or cluster.task_status != TaskState.RUNNING:
            return
        code = self._run_exit_code(cluster)
        cluster.task_status = TaskState.SUCCEEDED if code == 0 else TaskState.FAILED
        cluster.exit_code = code
        cluster.task_end_time = now
        self._publish(EventKind.TASK_STATUS_CHANGED, cluster, now, f"run exited with {code}")
        self._end_if_terminating(cluster, now)

    def _run_exit_code(self, cluster: Cluster) -> int:
        """The plan's exit code, or 0 once `exit_code_runs` runs of the task exited with it."""
        plan = cluster.plan
        if plan.exit_code_runs <= 0:
            return plan.exit_code
        key = (cluster.job_id, cluster.task_id)
        runs = self._failing_runs.get(key, 0)
        if runs >= plan.exit_code_runs:
            return 0
        self._failing_runs[key] = runs + 1
        return plan.exit_code

    # --- signals -----------------------------------------------------------------------------

    def begin_stop(self, name: str, epoch: int = 0, grace: float = 0.0) -> Cluster | None:
        """Stops the task of the cluster of this name and keeps the cluster: SIGTERM now
        (recorded, a line in its log), which ends the task at once (FAILED, exit code 143)
        unless its plan traps it, else SIGKILL `grace` simulated seconds later (FAILED,
        exit code 137). None when there is no live task to stop.

        Raises:
            StaleEpoch: `epoch` (when given) is below the highest seen for the job.
        """
        cluster = self._by_name.get(name)
        if cluster is None or not cluster.task_live:
            return None
        now = self.clock.now()
        self.fence.admit(cluster, CallKind.STOP, epoch, now)
        if cluster.stop_at is None:
            self._sigterm(cluster, now, f"received SIGTERM: stopping, SIGKILL in {grace:g}s")
            if not cluster.task_live:
                return cluster
        if cluster.stop_at is None or now + grace < cluster.stop_at:
            if grace <= 0:
                self._end_by_signal(cluster, now, "SIGKILL")
            else:
                cluster.stop_at = now + grace
                self._schedule(cluster.stop_at, STOP_KILL, cluster)
        return cluster

    async def wait_stopped(self, cluster: Cluster) -> None:
        """Returns once the cluster's task is no longer live."""
        while cluster.task_live:
            await self.events.wait(None)

    def _sigterm(self, cluster: Cluster, now: float, note: str) -> None:
        """Sends the live task SIGTERM (a stop's or a terminate's): it exits now, later
        (a plan that traps it) or never; a second SIGTERM never makes it exit later."""
        cluster.sigterm_time = now
        cluster.add_note(now, note)
        self.events.wake()  # log followers read the note now
        after = cluster.plan.sigterm_exit
        if after is None or (cluster.exit_at is not None and cluster.exit_at <= now + after):
            return
        if after <= 0:
            self._end_by_signal(cluster, now, "SIGTERM")
        else:
            cluster.exit_at = now + after
            self._schedule(cluster.exit_at, SIGTERM_EXIT, cluster)

    def _on_stop_kill(self, cluster: Cluster, now: float, _: str) -> None:
        if cluster.stop_at == now and cluster.task_live:
            self._end_by_signal(cluster, now, "SIGKILL")

    def _on_sigterm_exit(self, cluster: Cluster, now: float, _: str) -> None:
        if cluster.exit_at == now and cluster.task_live:
            self._end_by_signal(cluster, now, "SIGTERM")
            self._end_if_terminating(cluster, now)

    def _end_by_signal(self, cluster: Cluster, now: float, signal: str) -> None:
        """The live task ends FAILED, with the signal's exit code (`_ENDED_BY`)."""
        code, note = _ENDED_BY[signal]
        cluster.stop_at = cluster.exit_at = None
        cluster.task_status = TaskState.FAILED
        cluster.exit_code = code
        cluster.task_end_time = now
        cluster.add_note(now, note)
        self._publish(EventKind.TASK_STATUS_CHANGED, cluster, now, f"run ended by {signal}")

"""Clusters of the sim cloud: statuses, the task a cluster runs, and its log.

A `Cluster` is one launch: a small `__slots__` record that is also its own
inventory entry, kept after it ends. Names are reused across a task's attempts;
`cluster_id` never is.

A cluster goes INIT -> UP after the launch latency; its task then goes
SETTING_UP for `setup_seconds` (when it has setup), RUNNING for
`runtime_seconds`, and ends SUCCEEDED (exit code 0), FAILED (non-zero exit code)
or FAILED_SETUP (non-zero setup exit code, and the run never starts). The
SIGTERM of a stop or a graceful terminate ends a live task FAILED with exit code
143 at once, as it ends a process with the default handler; a plan that traps it
(`sigterm_exit`) exits that many seconds later, or never, and SIGKILL at the end
of the grace ends it with 137. A preempted cluster goes DOWN: it frees its
capacity; a task that had finished keeps its final status, exit code and end time
readable, any other task becomes unreadable. A terminated one is TERMINATED: gone,
log included (the record keeps the task's end as history).

The log is computed, never stored: line i of n is emitted at
`run_start + runtime * i / n` on every node (prefixed `(rank=r) ` when there are
several, as the local backend does). The only stored lines are the cloud's notes
of signals delivered to the task (SIGTERM from a preemption notice or a graceful
terminate): each sits after the lines emitted when it was written. So a read at
any instant returns a prefix of every later read, and a follower sees the same
bytes as a reader.
"""

from __future__ import annotations

import asyncio
import bisect
import enum
import math
from collections.abc import Iterator


class ClusterState(enum.IntEnum):
    """Mirrors simcloud.v1.ClusterStatus."""

    INIT = 1
    UP = 2
    DOWN = 3
    TERMINATED = 4


class TaskState(enum.IntEnum):
    """Mirrors simcloud.v1.TaskStatus."""

    PENDING = 1
    SETTING_UP = 2
    RUNNING = 3
    SUCCEEDED = 4
    FAILED = 5
    FAILED_SETUP = 6


class CallKind(enum.IntEnum):
    """Mirrors simcloud.v1.ClusterCallKind."""

    TERMINATE = 1
    STOP = 2
    NOTICE = 3


HOLDS_CAPACITY = frozenset({ClusterState.INIT, ClusterState.UP})
TASK_FINISHED = frozenset({TaskState.SUCCEEDED, TaskState.FAILED, TaskState.FAILED_SETUP})

DEFAULT_RUNTIME_SECONDS = 1.0
# Signal notes kept in one cluster's log; later ones are recorded but not logged.
MAX_NOTES = 16


class TaskPlan:
    """How a cluster's task behaves (the spec's `sim` key); see TaskBehavior in the proto.

    Defaults without a `sim` key: no setup phase unless the task has a `setup`,
    setup 0 s, runtime 1 simulated second, exit code 0, one log line
    "<cluster_name>: running", no scripted preemption, exits at SIGTERM.
    """

    __slots__ = (
        "exit_code",
        "exit_code_runs",
        "has_setup",
        "log_lines",
        "preempt_after",
        "runtime",
        "setup_exit_code",
        "setup_seconds",
        "sigterm_exit",
    )

    def __init__(
        self,
        runtime: float = DEFAULT_RUNTIME_SECONDS,
        setup_seconds: float = 0.0,
        has_setup: bool = False,
        exit_code: int = 0,
        setup_exit_code: int = 0,
        log_lines: tuple[str, ...] | None = None,
        preempt_after: float | None = None,
        exit_code_runs: int = 0,
        sigterm_exit: float | None = 0.0,
    ) -> None:
        self.runtime = runtime
        self.setup_seconds = setup_seconds
        self.has_setup = has_setup or setup_seconds > 0 or setup_exit_code != 0
        self.exit_code = exit_code
        # > 0: only the first this many runs of the (job, task) exit with exit_code.
        self.exit_code_runs = exit_code_runs
        self.setup_exit_code = setup_exit_code
        self.log_lines = log_lines
        self.preempt_after = preempt_after
        # Simulated seconds from SIGTERM to the task's exit; None: it never exits on it.
        self.sigterm_exit = sigterm_exit


class Cluster:
    """One launch, live or ended; also its inventory record."""

    __slots__ = (
        "calls",
        "calls_dropped",
        "cluster_id",
        "epoch",
        "event_seq",
        "exit_at",
        "exit_code",
        "gone",
        "job_id",
        "kill_at",
        "launch_time",
        "name",
        "notes",
        "notice_deadline",
        "notice_delivered_deadline",
        "notice_delivered_time",
        "num_nodes",
        "plan",
        "preempt_time",
        "preempted",
        "region",
        "replaced",
        "run_start",
        "sigterm_time",
        "spot",
        "status",
        "stop_at",
        "task_end_time",
        "task_id",
        "task_status",
        "terminate_time",
        "up_time",
        "waiter",
        "zone",
    )

    def __init__(
        self,
        cluster_id: int,
        name: str,
        job_id: int,
        task_id: int,
        epoch: int,
        region: str,
        zone: str,
        spot: bool,
        num_nodes: int,
        plan: TaskPlan,
        launch_time: float,
    ) -> None:
        self.cluster_id = cluster_id
        self.name = name
        self.job_id = job_id
        self.task_id = task_id
        self.epoch = epoch
        self.region = region
        self.zone = zone
        self.spot = spot
        self.num_nodes = num_nodes
        self.plan = plan
        self.status = ClusterState.INIT
        self.task_status = TaskState.PENDING
        # The seq of the latest event published about this cluster.
        self.event_seq = 0
        self.exit_code = 0
        self.launch_time = launch_time
        self.up_time: float | None = None
        self.run_start: float | None = None
        self.task_end_time: float | None = None
        self.preempt_time: float | None = None
        self.terminate_time: float | None = None
        self.preempted = False
        self.replaced = False
        # Simulated time the pending reclaim is due, once announced.
        self.notice_deadline: float | None = None
        # NotifyPreemption: when it was delivered (simulated) and the deadline told (Unix s).
        self.notice_delivered_time: float | None = None
        self.notice_delivered_deadline: float | None = None
        # Terminate: when the live task got SIGTERM, and when the cluster goes (simulated).
        self.sigterm_time: float | None = None
        # A stop (the cluster kept): when its task is killed (simulated).
        self.stop_at: float | None = None
        self.kill_at: float | None = None
        # When a task that traps SIGTERM exits on it (simulated).
        self.exit_at: float | None = None
        # (plan lines emitted before it, text) for each signal note in the log.
        self.notes: list[tuple[int, str]] | None = None
        # (kind, epoch, simulated time) of each terminate, stop and notice let through
        # (fence.py keeps it).
        self.calls: list[tuple[CallKind, int, float]] | None = None
        self.calls_dropped = 0
        # Resolved when the launch completes or fails; the Launch RPC awaits it.
        self.waiter: asyncio.Future[None] | None = None
        # Resolved when the cluster is terminated; Terminate RPCs await it.
        self.gone: asyncio.Future[None] | None = None

    @property
    def live(self) -> bool:
        """INIT or UP: holding capacity."""
        return self.status in HOLDS_CAPACITY

    @property
    def task_finished(self) -> bool:
        return self.task_status in TASK_FINISHED

    @property
    def task_live(self) -> bool:
        """UP with its task not yet ended: something to signal."""
        return self.status == ClusterState.UP and not self.task_finished

    def readable_task_status(self) -> TaskState | None:
        """The task's status as the API shows it: while UP, and a finished one while DOWN."""
        if self.status == ClusterState.UP:
            return self.task_status
        if self.status == ClusterState.DOWN and self.task_finished:
            return self.task_status
        return None

    @property
    def end_time(self) -> float:
        """When it stopped being live (preempted or terminated); inf while live."""
        ends = [t for t in (self.preempt_time, self.terminate_time) if t is not None]
        return min(ends) if ends else math.inf

    # --- the log -------------------------------------------------------------------------

    def lines(self) -> tuple[str, ...]:
        plan_lines = self.plan.log_lines
        return (f"{self.name}: running",) if plan_lines is None else plan_lines

    def add_note(self, now: float, text: str) -> None:
        """Writes a line of the cloud's into the task's log, after what is out by `now`."""
        notes = self.notes if self.notes is not None else []
        if len(notes) < MAX_NOTES:
            notes.append((self.lines_emitted(now), text))
        self.notes = notes

    def entries_emitted(self, now: float) -> int:
        """How many log entries (plan lines and notes, per node) exist at `now`."""
        if self.status == ClusterState.TERMINATED:
            return 0
        return self.lines_emitted(now) + len(self.notes or ())

    def lines_emitted(self, now: float) -> int:
        """How many of the task's lines (per node) exist at simulated time `now`."""
        if self.run_start is None or self.status == ClusterState.TERMINATED:
            return 0
        total = len(self.lines())
        # A run stops writing when it ends (its exit, or a signal) or its cluster goes down.
        cutoff = min(t for t in (now, self.task_end_time, self.preempt_time) if t is not None)
        if cutoff < self.run_start:
            return 0
        runtime = self.plan.runtime
        if runtime <= 0:
            return total
        # The epsilon keeps a line due exactly now from rounding down to the previous one.
        return min(total, math.floor((cutoff - self.run_start) * total / runtime + 1e-9) + 1)

    def next_line_time(self, emitted: int) -> float | None:
        """Simulated time at which line `emitted` will appear, if it ever will on this run."""
        total = len(self.lines())
        if self.run_start is None or emitted >= total or not self.live:
            return None
        return self.run_start + self.plan.runtime * emitted / total

    def log_final(self) -> bool:
        """Whether the log can no longer grow."""
        return not self.live or self.task_status in TASK_FINISHED

    def entries(self, start: int, stop: int) -> Iterator[str]:
        """The texts of log entries [start, stop): plan lines with the notes among them."""
        lines = self.lines()
        notes = self.notes or []
        # Note j comes after `after_j` plan lines and the j notes before it.
        positions = [after + j for j, (after, _) in enumerate(notes)]
        k = bisect.bisect_left(positions, start)
        plan = start - k
        for index in range(start, stop):
            if k < len(notes) and positions[k] == index:
                yield notes[k][1]
                k += 1
            else:
                yield lines[plan]
                plan += 1

    def render_chunks(self, start: int, stop: int, limit: int) -> Iterator[bytes]:
        """Entries [start, stop) of every node as the log's bytes, in chunks of <= `limit`."""
        out: list[bytes] = []
        size = 0
        for text in self.entries(start, stop):
            for rank in range(self.num_nodes):
                prefix = f"(rank={rank}) " if self.num_nodes > 1 else ""
                piece = f"{prefix}{text}\n".encode()
                if size + len(piece) > limit and out:
                    yield b"".join(out)
                    out, size = [], 0
                while len(piece) > limit:
                    yield piece[:limit]
                    piece = piece[limit:]
                out.append(piece)
                size += len(piece)
        if out:
            yield b"".join(out)

    def render(self, start: int, stop: int) -> bytes:
        """Entries [start, stop) of every node, as the bytes of the log."""
        return b"".join(self.render_chunks(start, stop, 1 << 20))

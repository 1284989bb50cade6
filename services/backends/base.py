"""The backend interface: how the control plane asks for compute and watches it.

A backend launches a *cluster* for one task attempt, reports what it sees of the
cluster and its task (`observe`), serves the task's logs, passes signals on to
the task, and tears the cluster down. The controller and the logs service use
backends only through `Backend`; `local` runs real processes on this host, `sim`
is the client of the simulated cloud, `ssh` runs on pools of machines.

Invariants every backend keeps:
- A cluster's name identifies it across processes: any replica or the logs
  service can find a cluster from its `ClusterHandle` (a small JSON-able record).
  Every backend names a task's cluster `cluster_name(job_id, task_id)`
  (`mj-<job>-<task>`), the same for each of the task's attempts.
- Launches and terminations are fenced by the caller's assignment epoch: a
  backend refuses (`StaleEpochError`) a launch or a terminate whose epoch is
  below the highest it has seen for the job, so a replica that lost a job can
  neither kill nor duplicate the new holder's cluster.
- A task's end (`TaskEnd`: final status, exit code, end time) stays readable
  after its cluster went DOWN, until the cluster is terminated, so a task that
  finished just before its cluster vanished is never run again.
- "Cannot tell now" is `BackendUnreachableError`, never DOWN: a probe that
  times out says nothing about the cluster.
- `terminate` is idempotent and `cluster_exists` is the proof that it worked.
- A launch replaces any older cluster of the same name (a relaunch after a
  preemption reuses the name), even one the backend cannot reach now: it is
  stopped once it can be (the ssh backend's reaper, when its host answers), so
  a controller need not wait for a silent cluster before relaunching.
- Errors the caller must tell apart are the exception classes below; anything
  else is a bug.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import enum
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, ClassVar


def cluster_name(job_id: int, task_id: int) -> str:
    """The name of a task's cluster, the same for each of its attempts."""
    return f"mj-{job_id}-{task_id}"


class ClusterStatus(enum.Enum):
    UP = "UP"
    # Provisioning or stopping: neither up nor gone.
    INIT = "INIT"
    # Gone, or never existed.
    DOWN = "DOWN"


class TaskStatus(enum.Enum):
    """Status of the task's code on a cluster (all ranks together)."""

    PENDING = "PENDING"
    SETTING_UP = "SETTING_UP"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    FAILED_SETUP = "FAILED_SETUP"

    @property
    def finished(self) -> bool:
        return self in (TaskStatus.SUCCEEDED, TaskStatus.FAILED, TaskStatus.FAILED_SETUP)


class BackendError(Exception):
    """Base of the errors a backend raises on purpose."""


class PrecheckError(BackendError):
    """The launch can never succeed (bad name, no access, impossible resources)."""


class ResourcesUnavailableError(BackendError):
    """No capacity now; `regions_tried` is the failover history, in order."""

    def __init__(self, message: str, regions_tried: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.regions_tried = list(regions_tried)


class BackendUnreachableError(BackendError):
    """The backend (or the cluster's host) cannot be asked right now; conclude nothing.

    `timeout`, when the backend knows it (an SSH pool's `unreachable_timeout`),
    is how long the caller should wait before treating the cluster as lost.
    """

    def __init__(self, message: str, timeout: float | None = None) -> None:
        super().__init__(message)
        self.timeout = timeout


class StaleEpochError(BackendError):
    """A launch or terminate fenced off: a newer epoch of the job holds the cluster."""


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """One launch of one task attempt of one job: what to run, on what, and where.

    The controller builds it once per attempt from the task's spec; a recovery
    narrows it (`within`: the regions to try, the regions never to use; on-demand
    instead of spot) and every backend's `launch` takes it whole.
    """

    job_id: int
    task_id: int
    epoch: int
    cluster_name: str
    num_nodes: int = 1
    setup: str = ""
    run: str = ""
    workdir: str = ""
    # The task's envs, its secrets among them.
    envs: Mapping[str, str] = dataclasses.field(default_factory=dict)
    cloud: str = ""
    region: str = ""
    zone: str = ""
    cpus: str = ""
    memory: str = ""
    accelerators: str = ""
    use_spot: bool = False
    # Only these regions, in this order (empty: any the resources allow).
    candidate_regions: tuple[str, ...] = ()
    # Never these regions.
    blocked_regions: tuple[str, ...] = ()
    # Options only one backend reads, by the backend's name, each a JSON object as the
    # task's spec gave it: "sim", the spec's `sim` key (how the simulated task behaves).
    # Every other backend ignores them.
    extensions: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

    def extension(self, backend: str) -> Mapping[str, Any]:
        """The options for `backend` (empty when the spec gave none)."""
        return self.extensions.get(backend, {})

    def within(self, candidates: Sequence[str] = (), blocked: Sequence[str] = ()) -> LaunchPlan:
        """This plan, launched only in `candidates` (in order; empty: anywhere allowed) and
        never in `blocked`."""
        return dataclasses.replace(
            self, candidate_regions=tuple(candidates), blocked_regions=tuple(blocked)
        )


@dataclasses.dataclass(frozen=True)
class ClusterHandle:
    """Enough to find a cluster again from any process."""

    cluster_name: str
    backend: str
    region: str = ""
    zone: str = ""
    data: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # The cluster as the launch that made this handle left it, when the backend's
    # launch answer says: the controller's first look at the new task, without a
    # call. Not part of the handle's identity, nor of its JSON.
    seen: Observation | None = dataclasses.field(default=None, compare=False, repr=False)

    def to_json(self) -> str:
        fields = {
            "cluster_name": self.cluster_name,
            "backend": self.backend,
            "region": self.region,
            "zone": self.zone,
            "data": dict(self.data),
        }
        return json.dumps(fields, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ClusterHandle:
        raw = json.loads(text)
        if not isinstance(raw, dict) or not isinstance(raw.get("cluster_name"), str):
            raise ValueError("a cluster handle is a JSON object with a cluster_name")
        data = raw.get("data", {})
        return cls(
            cluster_name=raw["cluster_name"],
            backend=str(raw.get("backend", "")),
            region=str(raw.get("region", "")),
            zone=str(raw.get("zone", "")),
            data=data if isinstance(data, dict) else {},
        )


@dataclasses.dataclass(frozen=True)
class TaskEnd:
    """How the task ended on its cluster; readable after the cluster went DOWN."""

    # SUCCEEDED, FAILED or FAILED_SETUP.
    status: TaskStatus
    # The exit code of the run (or of the setup, for FAILED_SETUP); None when unknown.
    exit_code: int | None
    # Unix seconds.
    end_time: float


@dataclasses.dataclass(frozen=True)
class Observation:
    """One look at a cluster: everything the controller decides from, read at once."""

    cluster: ClusterStatus
    # The task's status while the cluster is UP; None when it cannot be read.
    task: TaskStatus | None = None
    # Set once the task finished, whatever the cluster's status now.
    end: TaskEnd | None = None
    # A reclaim of the cluster was announced for this time (Unix seconds).
    notice_deadline: float | None = None
    # Where the backend numbers its news (the sim cloud's event sequence): the number
    # of the latest change this look includes; 0 where it does not. Pushed news is a
    # snapshot taken when it happened and may arrive after a newer look: news numbered
    # below the newest already seen is older than what is known, and is ignored. Two
    # looks that say the same are equal, whatever their numbers.
    seq: int = dataclasses.field(default=0, compare=False)


@dataclasses.dataclass(frozen=True)
class ClusterEvent:
    """Pushed by backends that can: something happened to a cluster.

    `observation` is the cluster's state after the change (so the controller need
    not ask again); `notice_deadline` (Unix seconds) announces that the cluster
    will be reclaimed then (a spot preemption notice).
    """

    cluster_name: str
    observation: Observation | None = None
    notice_deadline: float | None = None


class Backend(abc.ABC):
    """One async interface over every kind of compute."""

    name: ClassVar[str]
    # How many launches this backend runs well at once (a launch that is a process
    # costs far more than one that is an RPC). Replicas report it as their launch
    # capacity, under the limits of contract §5.
    launch_concurrency: int = 16
    # Awaited, with what is about to be done, before a call the backend makes of its own
    # accord (the teardown of a launch whose caller gave up); raising forbids the call.
    # A replica's lease guard installs its own check (`fence_own_calls`): such calls are
    # fenced as the replica's others are, not only by the backend's epochs.
    own_call_fence: Callable[[str], Awaitable[None]] | None = None

    def fence_own_calls(self, fence: Callable[[str], Awaitable[None]]) -> None:
        """Has `fence` checked before every call this backend makes of its own accord."""
        self.own_call_fence = fence

    @abc.abstractmethod
    async def launch(self, plan: LaunchPlan) -> ClusterHandle:
        """Provisions a cluster and starts the plan's task on it.

        Raises:
            PrecheckError: the plan can never launch.
            ResourcesUnavailableError: nothing free in any allowed region now.
            StaleEpochError: a newer epoch of the job launched already.
            BackendUnreachableError: the backend cannot be asked now.
        """

    @abc.abstractmethod
    def handle_for(self, cluster_name: str) -> ClusterHandle:
        """The handle of a cluster known only by name (from another process)."""

    @abc.abstractmethod
    async def observe(self, handle: ClusterHandle) -> Observation:
        """The cluster's status, its task's status and the task's end, in one look.

        Raises:
            BackendUnreachableError: the backend, or the cluster's host, cannot tell now.
        """

    async def observe_many(
        self, handles: Sequence[ClusterHandle]
    ) -> dict[str, Observation | BackendError]:
        """`observe` for many clusters; backends that can answer in one call override it."""
        results = await asyncio.gather(
            *(self.observe(handle) for handle in handles), return_exceptions=True
        )
        out: dict[str, Observation | BackendError] = {}
        for handle, result in zip(handles, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, BackendError):
                raise result
            out[handle.cluster_name] = result
        return out

    @abc.abstractmethod
    async def terminate(self, handle: ClusterHandle, epoch: int = 0, grace: float = 0.0) -> bool:
        """Tears the cluster down; idempotent.

        The task's processes get SIGTERM first and SIGKILL after `grace` seconds, so
        code can checkpoint (contract §18). `epoch` is the caller's assignment epoch (0:
        not on behalf of a job, e.g. an operator's cleanup).

        Returns:
            True when the backend itself saw the cluster gone before it returned (the
            sim cloud's Terminate answers only then), so the caller need not check
            with `cluster_exists`; False when it cannot say.

        Raises:
            StaleEpochError: a newer epoch of the job holds the cluster.
            BackendUnreachableError: the backend cannot be asked now.
        """

    async def stop(self, handle: ClusterHandle, epoch: int, grace: float) -> None:
        """Stops the task gracefully and keeps the cluster: SIGTERM now, SIGKILL to what
        is left after `grace` seconds; returns once none of its processes is left.

        What the task wrote while it stopped stays readable (`read_logs`) until the
        `terminate` that follows, so a checkpoint's last words are kept (contract §18).
        This default terminates with the grace, which serves a backend whose logs
        outlive its clusters; backends whose logs go with the cluster override it.

        Raises:
            StaleEpochError: a newer epoch of the job holds the cluster.
            BackendUnreachableError: the backend cannot be asked now.
        """
        await self.terminate(handle, epoch, grace)

    @abc.abstractmethod
    async def notify_preemption(self, handle: ClusterHandle, epoch: int, deadline: float) -> None:
        """Passes a preemption notice on to the task: SIGTERM, and the notice file named by
        `MJ_PREEMPTION_NOTICE_FILE` holding the deadline (Unix seconds)."""

    @abc.abstractmethod
    async def cluster_exists(self, cluster_name: str) -> bool:
        """True while anything of the cluster remains (used to verify teardown)."""

    @abc.abstractmethod
    async def read_logs(self, handle: ClusterHandle) -> bytes:
        """All of the task's logs so far (every rank), as one byte string."""

    @abc.abstractmethod
    def tail_logs(self, handle: ClusterHandle) -> AsyncIterator[bytes]:
        """Streams the task's logs from the start, following until the task finishes."""

    @abc.abstractmethod
    async def reachable(self) -> bool:
        """Whether the backend answers at all."""

    def regions(self) -> Sequence[str] | None:
        """The regions this backend offers, when it knows them (None: it cannot say)."""
        return None

    def events(self) -> AsyncIterator[ClusterEvent] | None:
        """A stream of cluster events, for backends that push; None when they cannot."""
        return None

    async def prepare(self) -> None:  # noqa: B027 - optional hook
        """Learns what the backend offers (e.g. its regions) before work starts; a backend
        that cannot be reached yet is not an error here."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Releases connections."""

    # --- derived reads, for callers that need one part of an observation ------------------

    async def cluster_status(self, handle: ClusterHandle) -> ClusterStatus:
        return (await self.observe(handle)).cluster

    async def task_status(self, handle: ClusterHandle) -> TaskStatus | None:
        """The task's status while the cluster is UP, else None."""
        seen = await self.observe(handle)
        return seen.task if seen.cluster is ClusterStatus.UP else None

    async def task_end(self, handle: ClusterHandle) -> TaskEnd | None:
        return (await self.observe(handle)).end

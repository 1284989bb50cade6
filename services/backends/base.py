"""The backend interface: how the control plane asks for compute and watches it.

A backend launches a *cluster* for one task attempt, reports whether the cluster
is up and how the task on it is doing, serves the task's logs, and tears the
cluster down. The controller and the logs service use backends only through
`Backend`; `local` runs real processes on this host, `sim` is the client of the
simulated cloud.

Invariants every backend keeps:
- A cluster's name identifies it across processes: any replica or the logs
  service can find a cluster from its `ClusterHandle` (a small JSON-able record).
- `terminate` is idempotent and `cluster_exists` is the proof that it worked.
- Errors the caller must tell apart are the exception classes below; anything
  else is a bug or an unreachable backend.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any


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
    """The backend cannot be asked right now; conclude nothing about clusters."""


@dataclasses.dataclass(frozen=True)
class TaskRequest:
    """What to run on a cluster: one task attempt of one job."""

    job_id: int
    task_id: int
    epoch: int
    cluster_name: str
    num_nodes: int = 1
    setup: str = ""
    run: str = ""
    workdir: str = ""
    envs: Mapping[str, str] = dataclasses.field(default_factory=dict)
    cloud: str = ""
    region: str = ""
    zone: str = ""
    cpus: str = ""
    memory: str = ""
    accelerators: str = ""
    use_spot: bool = False
    # Backend-specific knobs (the sim backend reads runtime, exit codes, log lines).
    sim: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ClusterHandle:
    """Enough to find a cluster again from any process."""

    cluster_name: str
    backend: str
    region: str = ""
    zone: str = ""
    data: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ClusterHandle:
        raw = json.loads(text)
        return cls(
            cluster_name=raw["cluster_name"],
            backend=raw["backend"],
            region=raw.get("region", ""),
            zone=raw.get("zone", ""),
            data=raw.get("data", {}),
        )


@dataclasses.dataclass(frozen=True)
class ClusterEvent:
    """Pushed by backends that can: a cluster went down or a task finished."""

    cluster_name: str
    cluster_status: ClusterStatus | None = None
    task_status: TaskStatus | None = None


class Backend(abc.ABC):
    """One async interface over every kind of compute."""

    name: str

    @abc.abstractmethod
    async def launch(
        self,
        request: TaskRequest,
        candidate_regions: Sequence[str] = (),
        blocked_regions: Sequence[str] = (),
    ) -> ClusterHandle:
        """Provisions a cluster and starts the task on it.

        Raises:
            PrecheckError: the request can never launch.
            ResourcesUnavailableError: nothing free in any allowed region now.
        """

    @abc.abstractmethod
    def handle_for(self, cluster_name: str) -> ClusterHandle:
        """The handle of a cluster known only by name (from another process)."""

    @abc.abstractmethod
    async def cluster_status(self, handle: ClusterHandle) -> ClusterStatus:
        """Whether the cluster is up."""

    @abc.abstractmethod
    async def task_status(self, handle: ClusterHandle) -> TaskStatus | None:
        """The task's status, or None when it cannot be read (cluster gone)."""

    @abc.abstractmethod
    async def task_end_time(self, handle: ClusterHandle) -> float | None:
        """When the task finished (Unix seconds), or None if it has not."""

    @abc.abstractmethod
    async def terminate(self, handle: ClusterHandle, epoch: int = 0) -> None:
        """Tears the cluster down; idempotent.

        `epoch` is the caller's assignment epoch for the cluster's job (0: not on
        behalf of a job); backends that can fence refuse a stale one.
        """

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

    def events(self) -> AsyncIterator[ClusterEvent] | None:
        """A stream of cluster events, for backends that push; None when they cannot."""
        return None

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Releases connections."""

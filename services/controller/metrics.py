"""A replica's Prometheus metrics (served on `--metrics-port`).

Every call the replica makes to its backend is counted by method
(`MeteredBackend`), so "a running job on a pushing backend costs nothing until
something happens" can be read off a dashboard (and is tested). Jobs held,
launch slots held, watched clusters and the lease left are read from the
replica when scraped.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from prometheus_client import REGISTRY, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.backends import (
    Backend,
    BackendError,
    ClusterEvent,
    ClusterHandle,
    LaunchPlan,
    Observation,
)
from services.backends.wrapper import BackendWrapper
from services.common.metrics import child

BACKEND_CALLS = Counter("mj_backend_calls_total", "Calls a replica made to its backend", ["call"])
TRANSITIONS = Counter("mj_task_transitions_total", "Task statuses reported, by status", ["status"])
REPLAYED = Counter(
    "mj_replica_replayed_messages_total",
    "Messages from the scheduler received a second time on a stream, and dropped",
)
RESYNCS = Counter(
    "mj_replica_resyncs_total",
    "Streams given up for a fresh one because a message from the scheduler went missing",
)


class MeteredBackend(BackendWrapper):
    """Counts every call to the backend, by method; `calls` keeps this instance's counts."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.calls: dict[str, int] = {}

    def _count(self, call: str, n: int = 1) -> None:
        self.calls[call] = self.calls.get(call, 0) + n
        child(BACKEND_CALLS, call).inc(n)

    async def launch(self, plan: LaunchPlan) -> ClusterHandle:
        self._count("launch")
        return await self.inner.launch(plan)

    async def observe(self, handle: ClusterHandle) -> Observation:
        self._count("observe")
        return await self.inner.observe(handle)

    async def observe_many(
        self, handles: Sequence[ClusterHandle]
    ) -> dict[str, Observation | BackendError]:
        self._count("observe_many")
        return await self.inner.observe_many(handles)

    async def terminate(self, handle: ClusterHandle, epoch: int = 0, grace: float = 0.0) -> bool:
        self._count("terminate")
        return await self.inner.terminate(handle, epoch, grace)

    async def stop(self, handle: ClusterHandle, epoch: int, grace: float) -> None:
        self._count("stop")
        await self.inner.stop(handle, epoch, grace)

    async def notify_preemption(self, handle: ClusterHandle, epoch: int, deadline: float) -> None:
        self._count("notify_preemption")
        await self.inner.notify_preemption(handle, epoch, deadline)

    async def cluster_exists(self, cluster_name: str) -> bool:
        self._count("cluster_exists")
        return await self.inner.cluster_exists(cluster_name)

    async def read_logs(self, handle: ClusterHandle) -> bytes:
        self._count("read_logs")
        return await self.inner.read_logs(handle)

    async def reachable(self) -> bool:
        self._count("reachable")
        return await self.inner.reachable()

    def events(self) -> AsyncIterator[ClusterEvent] | None:
        self._count("events")
        return self.inner.events()


class ReplicaCollector(Collector):
    """Gauges read from the replica when scraped."""

    def __init__(self, read: Callable[[], dict[str, float]]) -> None:
        self._read = read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        helps = {
            "mj_replica_held_jobs": "Jobs this replica runs",
            "mj_replica_held_launch_slots": "Launch slots this replica holds",
            "mj_replica_watched_clusters": "Clusters this replica watches",
            "mj_replica_lease_seconds_left": "Seconds the scheduler surely still counts the lease",
        }
        for name, value in self._read().items():
            yield GaugeMetricFamily(name, helps[name], value=value)


_collector: ReplicaCollector | None = None


def watch_replica(read: Callable[[], dict[str, float]]) -> None:
    """Registers the replica's gauges (the latest replica's, in a process that makes several)."""
    global _collector
    if _collector is not None:
        REGISTRY.unregister(_collector)
    _collector = ReplicaCollector(read)
    REGISTRY.register(_collector)


def transition(status: Any) -> None:
    child(TRANSITIONS, getattr(status, "name", str(status))).inc()


def replayed_message() -> None:
    REPLAYED.inc()


def resync() -> None:
    RESYNCS.inc()

"""What the sim cloud says of its clusters, as observations: one record, one event, and
the WatchEvents stream.

A cluster record (`Cluster`, from GetCluster and GetClusters) and every pushed
event carry a whole `Observation`: a task that finished keeps its status (`task`)
and its `TaskEnd` (exit code, end time) after its cluster was preempted, until the
cluster is terminated; an unfinished task on a DOWN cluster is unreadable
(`task=None`). Observations are numbered by the cloud's event sequence (`seq`).

`EventWatch` is the cloud's WatchEvents stream: every cluster and task status
change, each with its whole observation, and every preemption notice
(`ClusterEvent.notice_deadline`, Unix seconds). It remembers the last sequence
number it saw and resumes after it when the caller (services/controller/watch.py)
reopens the stream; a cloud that restarted (the resume is OUT_OF_RANGE) or dropped
the events (FAILED_PRECONDITION) is watched afresh from its head.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc

from managedjobs.simcloud.v1 import simcloud_service_pb2 as pb
from managedjobs.simcloud.v1 import simcloud_service_pb2_grpc as pb_grpc
from services.backends.base import ClusterEvent, ClusterStatus, Observation, TaskEnd, TaskStatus
from services.backends.sim.errors import backend_error

_CLUSTER_STATUS = {
    pb.CLUSTER_STATUS_INIT: ClusterStatus.INIT,
    pb.CLUSTER_STATUS_UP: ClusterStatus.UP,
    pb.CLUSTER_STATUS_DOWN: ClusterStatus.DOWN,
    pb.CLUSTER_STATUS_TERMINATED: ClusterStatus.DOWN,
}
_TASK_STATUS = {
    pb.TASK_STATUS_PENDING: TaskStatus.PENDING,
    pb.TASK_STATUS_SETTING_UP: TaskStatus.SETTING_UP,
    pb.TASK_STATUS_RUNNING: TaskStatus.RUNNING,
    pb.TASK_STATUS_SUCCEEDED: TaskStatus.SUCCEEDED,
    pb.TASK_STATUS_FAILED: TaskStatus.FAILED,
    pb.TASK_STATUS_FAILED_SETUP: TaskStatus.FAILED_SETUP,
}


def observation(message: pb.Cluster | pb.ClusterEvent) -> Observation:
    """What a cluster record, or an event about one, of the sim cloud says.

    The cloud reports the task's status while the cluster is UP and a finished
    task's while DOWN (UNSPECIFIED otherwise, and always once terminated).
    """
    status_code = message.status if isinstance(message, pb.Cluster) else message.cluster_status
    status = _CLUSTER_STATUS.get(status_code, ClusterStatus.DOWN)
    task = _TASK_STATUS.get(message.task_status)
    if status is ClusterStatus.INIT or (
        status is ClusterStatus.DOWN and not (task and task.finished)
    ):
        task = None
    end = None
    if task is not None and task.finished and message.HasField("task_end_time"):
        end = TaskEnd(task, message.exit_code, message.task_end_time.ToNanoseconds() / 1e9)
    notice = None
    if status is ClusterStatus.UP and message.HasField("notice_deadline"):
        notice = message.notice_deadline.ToNanoseconds() / 1e9
    seq = message.event_seq if isinstance(message, pb.Cluster) else message.seq
    return Observation(status, task, end, notice, seq)


class EventWatch:
    """The cloud's event stream, resumed after the last event seen each time it is opened."""

    def __init__(self, cloud: Callable[[], pb_grpc.SimCloudServiceAsyncStub]) -> None:
        self._cloud = cloud
        self._after_seq = 0

    async def stream(self) -> AsyncIterator[ClusterEvent]:
        """The events after the last one seen, as they happen.

        Raises:
            BackendError: the stream broke (mapped as every call's errors are).
        """
        call = self._cloud().WatchEvents(pb.WatchEventsRequest(after_seq=self._after_seq))
        try:
            async for reply in call:
                if not reply.events:
                    # The hello: resume from here if the stream breaks before any event.
                    self._after_seq = self._after_seq or reply.head_seq
                    continue
                for event in reply.events:
                    self._after_seq = event.seq
                    deadline = None
                    if event.kind == pb.EVENT_KIND_PREEMPTION_NOTICE and event.HasField(
                        "notice_deadline"
                    ):
                        deadline = event.notice_deadline.ToNanoseconds() / 1e9
                    yield ClusterEvent(
                        cluster_name=event.cluster_name,
                        observation=observation(event),
                        notice_deadline=deadline,
                    )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE):
                # The events after our seq are gone, or the cloud restarted: start afresh;
                # the caller wakes every watcher, so nothing missed goes unchecked.
                self._after_seq = 0
            raise backend_error(exc) from exc
        finally:
            call.cancel()

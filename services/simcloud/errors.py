"""The sim cloud's errors: what a real cloud API answers, as `ApiError`s.

The model raises them and `rpc_errors` maps them to gRPC statuses at the edge:

- `PrecheckInvalid` (INVALID_ARGUMENT) and `PrecheckFailed` (FAILED_PRECONDITION):
  the launch can never succeed, whenever it is retried.
- `NoCapacity` (RESOURCE_EXHAUSTED): nothing free now; ErrorInfo metadata
  `regions_tried` is the failover history, comma-separated, in order.
- `StaleEpoch` (FAILED_PRECONDITION, reason STALE_EPOCH): a launch, terminate or
  notice fenced off by a newer epoch of the job.
- `EventsGone` (FAILED_PRECONDITION): a watch resumed after events no longer kept;
  `EventsAhead` (OUT_OF_RANGE): one resumed past the head (the cloud restarted).
- `CloudUnreachable` (UNAVAILABLE): injected outage; conclude nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    Unavailable,
)

REGIONS_TRIED = "regions_tried"


class PrecheckInvalid(InvalidArgument):
    reason = "PRECHECK_INVALID"


class PrecheckFailed(FailedPrecondition):
    reason = "PRECHECK_FAILED"


class StaleEpoch(FailedPrecondition):
    reason = "STALE_EPOCH"


class EventsGone(FailedPrecondition):
    reason = "EVENTS_GONE"


class EventsAhead(OutOfRange):
    reason = "EVENTS_AHEAD"


class NoCapacity(ResourceExhausted):
    reason = "NO_CAPACITY"

    def __init__(self, message: str, regions_tried: Sequence[str]) -> None:
        super().__init__(message, **{REGIONS_TRIED: ",".join(regions_tried)})
        self.regions_tried = list(regions_tried)


class CloudUnreachable(Unavailable):
    reason = "CLOUD_UNREACHABLE"


class ClusterNotFound(NotFound):
    reason = "CLUSTER_NOT_FOUND"

"""The sim cloud's refusals as the backend's errors.

RESOURCE_EXHAUSTED -> `ResourcesUnavailableError` (regions_tried from the ErrorInfo
metadata of a call, or from the item's result in a batch), FAILED_PRECONDITION with
reason STALE_EPOCH -> `StaleEpochError`, other INVALID_ARGUMENT and
FAILED_PRECONDITION -> `PrecheckError`, UNAVAILABLE and DEADLINE_EXCEEDED ->
`BackendUnreachableError`; anything else is a plain `BackendError`. A failed item of
a batched call maps as the same call would have failed alone.
"""

from __future__ import annotations

import grpc

from managedjobs.simcloud.v1 import simcloud_service_pb2 as pb
from services.backends.base import (
    BackendError,
    BackendUnreachableError,
    PrecheckError,
    ResourcesUnavailableError,
    StaleEpochError,
)
from services.common.errors import error_info

_PRECHECK = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


def backend_error(exc: grpc.aio.AioRpcError) -> BackendError:
    """The backend error for a failed call to the sim cloud."""
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        tried = error_info(exc).metadata.get("regions_tried", "")
        return ResourcesUnavailableError(details, [r for r in tried.split(",") if r])
    return _error(code, details, error_info(exc).reason)


def call_error(error: pb.CallError) -> BackendError:
    """The backend error for one failed call of a batch."""
    code = _STATUS_CODES.get(error.code, grpc.StatusCode.UNKNOWN)
    return _error(code, error.message, error.reason)


def launch_outcome(result: pb.LaunchResult) -> pb.LaunchResponse | BaseException:
    """One item of a LaunchClusters answer: the launch's response, or its error."""
    if not result.HasField("error"):
        return result.response
    error = result.error
    if _STATUS_CODES.get(error.code) == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourcesUnavailableError(error.message, list(result.regions_tried))
    return call_error(error)


def _error(code: grpc.StatusCode, details: str, reason: str) -> BackendError:
    if code == grpc.StatusCode.FAILED_PRECONDITION and reason == "STALE_EPOCH":
        return StaleEpochError(details)
    if code in _PRECHECK:
        return PrecheckError(details)
    if code in _UNREACHABLE:
        return BackendUnreachableError(f"sim cloud unreachable: {code.name}: {details}")
    return BackendError(f"sim cloud error: {code.name}: {details}")

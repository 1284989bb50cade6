"""Domain errors and their mapping to gRPC status codes, applied at the edge only.

Handlers raise `ApiError` subclasses; `rpc_errors` turns them into a status with
a clear message and a `google.rpc.ErrorInfo` detail. Anything else escaping a
handler is a bug: it is logged with its traceback and answered INTERNAL.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar, cast

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

log = logging.getLogger(__name__)

DOMAIN = "managedjobs.v1"


class ApiError(Exception):
    """An error meant for the caller."""

    code = grpc.StatusCode.UNKNOWN
    reason = "UNKNOWN"

    def __init__(self, message: str, **metadata: str) -> None:
        super().__init__(message)
        self.message = message
        self.metadata = metadata


class InvalidArgument(ApiError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_ARGUMENT"


class NotFound(ApiError):
    code = grpc.StatusCode.NOT_FOUND
    reason = "NOT_FOUND"


class FailedPrecondition(ApiError):
    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "FAILED_PRECONDITION"


class OutOfRange(ApiError):
    code = grpc.StatusCode.OUT_OF_RANGE
    reason = "OUT_OF_RANGE"


class PermissionDenied(ApiError):
    code = grpc.StatusCode.PERMISSION_DENIED
    reason = "PERMISSION_DENIED"


class Unauthenticated(ApiError):
    code = grpc.StatusCode.UNAUTHENTICATED
    reason = "UNAUTHENTICATED"


class ResourceExhausted(ApiError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "RESOURCE_EXHAUSTED"


class Unavailable(ApiError):
    code = grpc.StatusCode.UNAVAILABLE
    reason = "UNAVAILABLE"


def status_details(error: ApiError) -> bytes:
    """A serialized google.rpc.Status carrying an ErrorInfo."""
    info = error_details_pb2.ErrorInfo(reason=error.reason, domain=DOMAIN, metadata=error.metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=error.code.value[0], message=error.message, details=[detail])
    return status.SerializeToString()


async def abort(context: grpc.aio.ServicerContext[Any, Any], error: ApiError) -> None:
    await context.abort(
        error.code,
        error.message,
        trailing_metadata=(("grpc-status-details-bin", status_details(error)),),
    )


F = TypeVar("F", bound=Callable[..., Any])

# Services register how their infrastructure errors read to callers (e.g. the
# scheduler: "database unreachable" is UNAVAILABLE, for the client to retry).
Translator = Callable[[Exception], ApiError | None]
_translators: list[Translator] = []


def register_translator(translator: Translator) -> None:
    _translators.append(translator)


def translate(exc: Exception) -> ApiError | None:
    for translator in _translators:
        error = translator(exc)
        if error is not None:
            return error
    return None


async def _unexpected(context: Any, handler: Callable[..., Any], exc: Exception) -> None:
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    error = translate(exc)
    if error is not None:
        await abort(context, error)
        return
    log.exception("unhandled error in %s", handler.__qualname__)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {exc}")


def rpc_errors(handler: F) -> F:
    """Maps ApiError (and stray exceptions) raised by a handler to gRPC statuses."""

    if inspect.isasyncgenfunction(handler):

        @functools.wraps(handler)
        async def stream(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:
            try:
                async for item in handler(self, request, context):
                    yield item
            except ApiError as error:
                await abort(context, error)
            except Exception as exc:
                await _unexpected(context, handler, exc)

        return cast(F, stream)

    @functools.wraps(handler)
    async def unary(self: Any, request: Any, context: Any) -> Any:
        try:
            return await handler(self, request, context)
        except ApiError as error:
            await abort(context, error)
        except Exception as exc:
            await _unexpected(context, handler, exc)

    return cast(F, unary)

"""Domain errors and their mapping to gRPC status codes, applied at the edge only.

Handlers raise `ApiError` subclasses; `rpc_errors` turns them into a status with
a clear message and a `google.rpc.ErrorInfo` detail whose `reason` is a domain
reason (`SPEC_INVALID`, `JOB_NOT_FOUND`, `TOKEN_UNKNOWN`...) given by the raiser,
or the class's default. A reason is never a bare status name (`OUT_OF_RANGE`):
the code already says that much, the reason says which rule was broken. Anything
else escaping a handler is a bug: it is logged with its traceback and answered
INTERNAL.

Every message and every ErrorInfo value is bounded (`MAX_MESSAGE_BYTES`,
`MAX_VALUE_BYTES`, `MAX_METADATA_ENTRIES`) so that no error, whatever input it
echoes, outgrows gRPC's 8 KiB metadata limit (which would turn it into
RESOURCE_EXHAUSTED). Raisers quote input with `quote`, at most 200 characters.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar, cast

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

log = logging.getLogger(__name__)

DOMAIN = "managedjobs.v1"
# The status message travels percent-encoded (up to 3 bytes per byte) and again,
# base64-encoded, inside grpc-status-details-bin with the ErrorInfo: these bounds
# keep the worst case near 6 KiB. 1 KiB of message holds a 200-character quote of
# any input (up to 4 bytes a character) and the words around it.
MAX_MESSAGE_BYTES = 1024
MAX_VALUE_BYTES = 256
MAX_KEY_BYTES = 64
MAX_METADATA_ENTRIES = 4
_ELLIPSIS = "…"


def bound(text: str, max_bytes: int) -> str:
    """`text` cut to at most `max_bytes` of UTF-8 at a character boundary, marked when cut."""
    data = text.encode("utf-8", "replace")
    if len(data) <= max_bytes:
        return text
    room = max_bytes - len(_ELLIPSIS.encode())
    return data[:room].decode("utf-8", "ignore") + _ELLIPSIS


def bounded_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    """ErrorInfo metadata within the bounds: the first entries, keys and values cut."""
    out: dict[str, str] = {}
    for key, value in list(metadata.items())[:MAX_METADATA_ENTRIES]:
        out[bound(str(key), MAX_KEY_BYTES)] = bound(str(value), MAX_VALUE_BYTES)
    return out


class ApiError(Exception):
    """An error meant for the caller.

    Args:
        message: What went wrong, for a person; quote input with `quote`.
        reason: The ErrorInfo reason, UPPER_SNAKE (e.g. `JOB_NOT_FOUND`); default: the
            class's `reason`.
        **metadata: ErrorInfo metadata (e.g. `field="resources.cpus"`).
    """

    code = grpc.StatusCode.UNKNOWN
    reason = "ERROR"

    def __init__(self, message: str, *, reason: str | None = None, **metadata: str) -> None:
        super().__init__(message)
        self.message = message
        self.metadata = metadata
        if reason is not None:
            self.reason = reason


class InvalidArgument(ApiError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "ARGUMENT_INVALID"


class NotFound(ApiError):
    code = grpc.StatusCode.NOT_FOUND
    reason = "RESOURCE_NOT_FOUND"


class FailedPrecondition(ApiError):
    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "PRECONDITION_FAILED"


class OutOfRange(ApiError):
    code = grpc.StatusCode.OUT_OF_RANGE
    reason = "VALUE_OUT_OF_RANGE"


class PermissionDenied(ApiError):
    code = grpc.StatusCode.PERMISSION_DENIED
    reason = "ACCESS_DENIED"


class Unauthenticated(ApiError):
    code = grpc.StatusCode.UNAUTHENTICATED
    reason = "AUTHENTICATION_REQUIRED"


class AlreadyExists(ApiError):
    code = grpc.StatusCode.ALREADY_EXISTS
    reason = "RESOURCE_EXISTS"


class ResourceExhausted(ApiError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "LIMIT_EXCEEDED"


class Unavailable(ApiError):
    code = grpc.StatusCode.UNAVAILABLE
    reason = "SERVICE_UNAVAILABLE"


def status_details(error: ApiError) -> bytes:
    """A serialized google.rpc.Status carrying an ErrorInfo, within the bounds."""
    info = error_details_pb2.ErrorInfo(
        reason=bound(error.reason, MAX_KEY_BYTES),
        domain=DOMAIN,
        metadata=bounded_metadata(error.metadata),
    )
    detail = any_pb2.Any()
    detail.Pack(info)
    message = bound(error.message, MAX_MESSAGE_BYTES)
    status = status_pb2.Status(code=error.code.value[0], message=message, details=[detail])
    return status.SerializeToString()


async def abort(context: grpc.aio.ServicerContext[Any, Any], error: ApiError) -> None:
    """Ends the call with the error's status, bounded message and ErrorInfo.

    Raises:
        grpc.aio.AbortError: as `context.abort` does, to end the handler.
        asyncio.CancelledError: the call had already ended (see `_gone`).
    """
    with _gone(context):
        await context.abort(
            error.code,
            bound(error.message, MAX_MESSAGE_BYTES),
            trailing_metadata=(("grpc-status-details-bin", status_details(error)),),
        )


@contextlib.contextmanager
def _gone(context: Any) -> Iterator[None]:
    """A status for a call that already ended (the client cancelled or its deadline
    passed while the handler failed, e.g. a database driver turning the cancellation
    into its own error) cannot be sent, and gRPC says so with an InternalError: there is
    no one to tell, so the handler ends as the cancelled call it is, quietly."""
    try:
        yield
    except grpc.aio.InternalError:
        if context.done() or context.cancelled():
            raise asyncio.CancelledError() from None
        raise


F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

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


async def unexpected(context: Any, where: str, exc: Exception) -> None:
    """Ends the call for an exception that is not an ApiError: a registered translation,
    else INTERNAL (logged with its traceback, as the bug it is). Re-raises AbortError."""
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    error = translate(exc)
    if error is not None:
        await abort(context, error)
        return
    log.exception("unhandled error in %s", where)
    with _gone(context):
        await context.abort(
            grpc.StatusCode.INTERNAL, bound(f"internal error: {exc}", MAX_MESSAGE_BYTES)
        )


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
                await unexpected(context, handler.__qualname__, exc)

        return cast(F, stream)

    @functools.wraps(handler)
    async def unary(self: Any, request: Any, context: Any) -> Any:
        try:
            return await handler(self, request, context)
        except ApiError as error:
            await abort(context, error)
        except Exception as exc:
            await unexpected(context, handler.__qualname__, exc)

    return cast(F, unary)


async def each_alone(calls: Iterable[Awaitable[T]]) -> list[T | ApiError]:
    """Runs a batch's items at once, each answered as if it had come alone: an item's
    ApiError is its answer; any other exception (a bug) fails the whole call."""
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException) and not isinstance(outcome, ApiError):
            raise outcome
    return cast(list[T | ApiError], outcomes)


def error_info(exc: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    """The google.rpc ErrorInfo carried by a failed call (empty if none)."""
    for key, value in exc.trailing_metadata() or ():
        if key != "grpc-status-details-bin" or not isinstance(value, bytes):
            continue
        status = status_pb2.Status.FromString(value)
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info):
                return info
    return error_details_pb2.ErrorInfo()

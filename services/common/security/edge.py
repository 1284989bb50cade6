"""The gRPC edge every server installs: decode, authenticate, authorize, audit.

`Server` puts one `EdgeInterceptor` in front of every service. For each call to a
method outside health and reflection it:

1. decodes the request itself: the method's deserializer is wrapped so bytes that
   do not parse become INVALID_ARGUMENT "request: cannot be decoded" (gRPC alone
   answers UNKNOWN and logs a traceback);
2. authenticates `authorization: Bearer <token>` against the tokens file:
   missing -> UNAUTHENTICATED (TOKEN_MISSING), unknown -> UNAUTHENTICATED
   (TOKEN_UNKNOWN);
3. authorizes the method against the caller's role in `access.POLICY`:
   PERMISSION_DENIED (ROLE_FORBIDDEN, or METHOD_UNLISTED for a method the table
   lacks). With `--auth none` there are no checks: every caller may call every
   method and is an anonymous admin to the handlers;
4. makes the caller, with the names of its client certificate under mTLS, the
   `current_principal()` of the handler and of every task it starts;
5. when the call ends, writes one audit line (JSON log, logger `audit`) for each
   mutating method: user, role, method, job ids from the request and response
   fields job_id / job_ids / cancelled_job_ids (and those of the items a batch
   lists), the status code and duration.

Authentication comes before decoding, so a caller without a token learns nothing
from how its bytes parse. `_finished` sees every call's method, outcome and
duration: per-method latency metrics belong there.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import grpc

from services.common.bounds import quote
from services.common.errors import (
    ApiError,
    InvalidArgument,
    PermissionDenied,
    Unauthenticated,
    abort,
    unexpected,
)
from services.common.metrics import RPC_SECONDS, child
from services.common.security.access import POLICY, Rule, is_open, set_principal
from services.common.security.auth import Principal, Role, TokensFile, TokensFileError
from services.common.security.tls import ServerTls, TlsConfigError, is_loopback, peer_names

log = logging.getLogger(__name__)
audit_log = logging.getLogger("audit")

Context = grpc.aio.ServicerContext[Any, Any]
_JOB_FIELDS = ("job_id", "job_ids", "cancelled_job_ids")
TOKENS_FILE_NAME = "tokens.yaml"


class InsecureListen(Exception):
    """A server was asked to listen beyond loopback in plaintext without `--insecure`."""


@dataclasses.dataclass(frozen=True)
class ServerSecurity:
    """A server's authentication and wire security.

    Attributes:
        tokens: The tokens file; None is `--auth none` (every caller an admin).
        tls: Certificate, key and optional client CA; None serves plaintext.
        insecure: Allows plaintext on a non-loopback address.
    """

    tokens: TokensFile | None
    tls: ServerTls | None = None
    insecure: bool = False

    @classmethod
    def without_auth(cls, tls: ServerTls | None = None) -> ServerSecurity:
        """`--auth none`: for tests that are not about security."""
        return cls(None, tls)

    @classmethod
    def from_settings(cls, values: Mapping[str, Any]) -> ServerSecurity:
        """From a server's settings (`settings.SERVER_SECURITY`, `host`, `data_dir`).

        Raises:
            TokensFileError: the tokens file is missing or malformed.
            TlsConfigError: incomplete TLS settings or an unreadable file.
            InsecureListen: plaintext on a non-loopback address without `insecure`.
        """
        tokens = None
        if values["auth"] == "tokens":
            path = values.get("tokens_file") or ""
            if not path:
                path = str(Path(str(values.get("data_dir") or ".")) / TOKENS_FILE_NAME)
            tokens = TokensFile(Path(path))
        tls = ServerTls.from_files(values["tls_cert"], values["tls_key"], values["tls_client_ca"])
        security = cls(tokens, tls, bool(values.get("insecure")))
        security.check_listen(str(values.get("host", "127.0.0.1")))
        return security

    def check_listen(self, host: str) -> None:
        """Refuses plaintext beyond loopback unless `insecure`.

        Raises:
            InsecureListen: with the one line to show.
        """
        if self.tls is None and not self.insecure and not is_loopback(host):
            raise InsecureListen(
                f"refusing to listen on {host or '*'} without TLS: give --tls-cert and "
                "--tls-key, or --insecure to serve plaintext anyway"
            )


def server_security(prog: str, values: Mapping[str, Any]) -> ServerSecurity:
    """`ServerSecurity.from_settings`, or exit with one line naming the problem."""
    try:
        return ServerSecurity.from_settings(values)
    except (TokensFileError, TlsConfigError, InsecureListen) as exc:
        raise SystemExit(f"{prog}: {exc}") from None


class Undecodable:
    """What the wrapped deserializer returns for bytes that do not parse."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _decoder(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def decode(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # protobuf raises DecodeError, and more on hostile input
            return Undecodable(exc)

    return decode


def _undecodable() -> InvalidArgument:
    return InvalidArgument("request: cannot be decoded", reason="REQUEST_UNDECODABLE")


def job_ids(*messages: Any, items: bool = True) -> list[int]:
    """The job ids named by the messages' job_id / job_ids / cancelled_job_ids fields, and
    by those of the messages they list (a batch's items, e.g. BatchFetchTaskLogs')."""
    found: list[int] = []
    for message in messages:
        descriptor = getattr(message, "DESCRIPTOR", None)
        if descriptor is None:
            continue
        names, lists = _job_fields(descriptor)
        for name in names:
            value = getattr(message, name)
            if isinstance(value, int):
                found.append(value)
            else:
                found.extend(value)
        if not items:
            continue
        for name in lists:
            for item in getattr(message, name):
                found.extend(job_ids(item, items=False))
    return sorted({i for i in found if i})


@functools.cache
def _job_fields(descriptor: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A message type's job-id fields, and its lists of messages (a map is not one: it
    yields its keys), read off its descriptor once."""
    names = tuple(name for name in _JOB_FIELDS if name in descriptor.fields_by_name)
    lists = tuple(
        field.name
        for field in descriptor.fields
        if field.message_type is not None
        and field.is_repeated
        and not field.message_type.GetOptions().map_entry
    )
    return names, lists


@dataclasses.dataclass
class _Call:
    """One call through the edge, as `_finished` sees it."""

    method: str
    rule: Rule | None
    request: Any = None
    response: Any = None
    principal: Principal | None = None
    code: grpc.StatusCode = grpc.StatusCode.OK
    started: float = dataclasses.field(default_factory=time.perf_counter)


class EdgeInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every method handler of a server (see the module docstring)."""

    def __init__(self, tokens: TokensFile | None, policy: Mapping[str, Rule] = POLICY) -> None:
        self._tokens = tokens
        self._policy = policy
        # Per method: the handler gRPC gave and its wrapped form (made once, not per call).
        self._wrapped: dict[str, tuple[Any, Any]] = {}

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or is_open(method):
            return handler
        known = self._wrapped.get(method)
        if known is not None and known[0] is handler:
            return known[1]
        wrapped = self._wrap(handler, method, self._policy.get(method))
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    # --- who and what ----------------------------------------------------------------------

    def _authenticate(self, context: Context) -> Principal:
        names = peer_names(context.auth_context())
        if self._tokens is None:
            return Principal("", Role.ADMIN, cert_names=names)
        values = [v for k, v in context.invocation_metadata() or () if k == "authorization"]
        if not values:
            raise Unauthenticated(
                "authorization: a bearer token is required", reason="TOKEN_MISSING"
            )
        scheme, _, token = str(values[0]).partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated(
                "authorization: expected 'Bearer <token>'", reason="TOKEN_MALFORMED"
            )
        entry = self._tokens.lookup(token.strip())
        if entry is None:
            raise Unauthenticated("authorization: unknown token", reason="TOKEN_UNKNOWN")
        return Principal(entry.user, entry.role, entry.controller_id, names)

    @staticmethod
    def _authorize(call: _Call, principal: Principal) -> None:
        if call.rule is None:
            raise PermissionDenied(
                f"{quote(call.method)} is not in the access policy", reason="METHOD_UNLISTED"
            )
        if principal.role not in call.rule.roles:
            raise PermissionDenied(
                f"{call.method.strip('/')}: not allowed for role {principal.role.value}",
                reason="ROLE_FORBIDDEN",
            )

    @contextlib.asynccontextmanager
    async def _admitted(self, call: _Call, context: Context) -> AsyncIterator[_Call]:
        """Authenticates, authorizes and decodes; the body runs the handler."""
        try:
            try:
                call.principal = self._authenticate(context)
                if self._tokens is not None:
                    self._authorize(call, call.principal)
                if isinstance(call.request, Undecodable):
                    raise _undecodable()
            except ApiError as error:
                call.code = error.code
                await abort(context, error)
            assert call.principal is not None  # abort raised otherwise
            set_principal(call.principal)
            try:
                yield call
            except ApiError as error:  # a handler without rpc_errors: same answer
                call.code = error.code
                await abort(context, error)
            except (grpc.aio.AbortError, asyncio.CancelledError):
                raise
            except Exception as exc:
                await unexpected(context, call.method, exc)
        except BaseException:
            if call.code == grpc.StatusCode.OK:
                code = context.code()
                call.code = code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.CANCELLED
            raise
        finally:
            self._finished(call)

    def _finished(self, call: _Call) -> None:
        """Every call ends here: its latency metric, and the audit line of a mutating one."""
        seconds = time.perf_counter() - call.started
        child(RPC_SECONDS, call.method, call.code.name).observe(seconds)
        if call.rule is None or not call.rule.mutating:
            return
        principal = call.principal
        audit_log.info(
            "audit",
            extra={
                "audit": True,
                "user": principal.user if principal else "",
                "role": principal.role.value if principal else "",
                "controller_id": principal.controller_id if principal else "",
                "method": call.method,
                "job_ids": job_ids(call.request, call.response),
                "code": call.code.name,
                "duration_ms": round(seconds * 1000, 2),
            },
        )

    # --- the four kinds of handler ---------------------------------------------------------

    def _wrap(self, handler: Any, method: str, rule: Rule | None) -> Any:
        decode = _decoder(handler.request_deserializer)
        admitted = self._admitted

        async def checked(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
            async for request in requests:
                if isinstance(request, Undecodable):
                    await abort(context, _undecodable())
                yield request

        if handler.unary_unary is not None:
            unary_unary = handler.unary_unary

            async def unary_unary_edge(request: Any, context: Context) -> Any:
                async with admitted(_Call(method, rule, request), context) as call:
                    call.response = await unary_unary(request, context)
                    return call.response

            return handler._replace(request_deserializer=decode, unary_unary=unary_unary_edge)
        if handler.unary_stream is not None:
            unary_stream = handler.unary_stream

            async def unary_stream_edge(request: Any, context: Context) -> AsyncIterator[Any]:
                async with admitted(_Call(method, rule, request), context):
                    async for response in unary_stream(request, context):
                        yield response

            return handler._replace(request_deserializer=decode, unary_stream=unary_stream_edge)
        if handler.stream_unary is not None:
            stream_unary = handler.stream_unary

            async def stream_unary_edge(requests: AsyncIterator[Any], context: Context) -> Any:
                async with admitted(_Call(method, rule), context) as call:
                    call.response = await stream_unary(checked(requests, context), context)
                    return call.response

            return handler._replace(request_deserializer=decode, stream_unary=stream_unary_edge)
        stream_stream = handler.stream_stream

        async def stream_stream_edge(
            requests: AsyncIterator[Any], context: Context
        ) -> AsyncIterator[Any]:
            async with admitted(_Call(method, rule), context):
                async for response in stream_stream(checked(requests, context), context):
                    yield response

        return handler._replace(request_deserializer=decode, stream_stream=stream_stream_edge)

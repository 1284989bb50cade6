"""Every client channel is opened here: TLS when configured, the bearer token on every call.

`open_channel(address, security)` (grpc.aio, for the services) and
`open_sync_channel` (for `mj` and tests) speak TLS when `security.tls` is set,
presenting the client certificate for mTLS when it has one, and add
`authorization: Bearer <token>` to every call through a client interceptor, so no
call site handles credentials. A `TokenSource` backed by a file (`--token-file`)
re-reads it when it changes, so a rotated token is picked up without a restart.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from services.common.server import CHANNEL_OPTIONS
from services.common.tls import ClientTls

Metadata = tuple[tuple[str, str], ...]


class TokenSource:
    """A bearer token given as text, or kept in a file and re-read when the file changes."""

    def __init__(self, token: str = "", path: Path | None = None) -> None:
        self._token = token.strip()
        self._path = path
        self._stat: tuple[int, int, int] | None = None
        if path is not None:
            self()  # a missing or unreadable file is an error at start

    def __call__(self) -> str:
        """The current token.

        Raises:
            OSError: the token file cannot be read.
        """
        if self._path is None:
            return self._token
        st = os.stat(self._path)
        stat = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stat != self._stat:
            self._token = self._path.read_text(encoding="utf-8").strip()
            self._stat = stat
        return self._token


@dataclasses.dataclass(frozen=True)
class ClientSecurity:
    """How a client proves who it is and protects the wire.

    Attributes:
        token: The bearer token sent with every call; None sends none.
        tls: The CA (and client certificate) for TLS; None speaks plaintext.
    """

    token: TokenSource | None = None
    tls: ClientTls | None = None

    @classmethod
    def of(cls, token: str = "", tls: ClientTls | None = None) -> ClientSecurity:
        return cls(TokenSource(token) if token else None, tls)

    @classmethod
    def from_settings(cls, values: Mapping[str, Any]) -> ClientSecurity:
        """From the client settings (`settings.CLIENT_SECURITY`): token, token file, TLS files.

        Raises:
            TlsConfigError: incomplete TLS settings or an unreadable file.
            OSError: the token file cannot be read.
        """
        token_file = str(values.get("token_file") or "")
        source: TokenSource | None = None
        if token_file:
            source = TokenSource(path=Path(token_file))
        elif values.get("token"):
            source = TokenSource(str(values["token"]))
        tls = ClientTls.from_files(
            str(values.get("tls_ca") or ""),
            str(values.get("tls_client_cert") or ""),
            str(values.get("tls_client_key") or ""),
        )
        return cls(source, tls)

    def metadata(self) -> Metadata:
        if self.token is None:
            return ()
        token = self.token()
        return (("authorization", f"Bearer {token}"),) if token else ()


def _with_token(metadata: Any, extra: Metadata) -> Any:
    if not extra:
        return metadata
    return (*tuple(metadata or ()), *extra)


class _AioBearer:
    """Adds the bearer token to a call's metadata (one subclass per kind of call, as
    grpc.aio files each interceptor under one kind only)."""

    def __init__(self, security: ClientSecurity) -> None:
        self._security = security

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        # A namedtuple at runtime, though the stubs do not say so.
        replace: Callable[..., grpc.aio.ClientCallDetails] = details._replace  # type: ignore[attr-defined]
        return replace(metadata=_with_token(details.metadata, self._security.metadata()))


class _AioBearerUnaryUnary(_AioBearer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(self._details(details), request)


class _AioBearerUnaryStream(_AioBearer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self, continuation: Callable[..., Any], details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(self._details(details), request)


class _AioBearerStreamUnary(_AioBearer, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self, continuation: Callable[..., Any], details: grpc.aio.ClientCallDetails, requests: Any
    ) -> Any:
        return await continuation(self._details(details), requests)


class _AioBearerStreamStream(_AioBearer, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self, continuation: Callable[..., Any], details: grpc.aio.ClientCallDetails, requests: Any
    ) -> Any:
        return await continuation(self._details(details), requests)


class _SyncDetails(
    collections.namedtuple(
        "_SyncDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class _SyncBearer(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, security: ClientSecurity) -> None:
        self._security = security

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _SyncDetails(
            details.method,
            details.timeout,
            _with_token(details.metadata, self._security.metadata()),
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(
        self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, request: Any
    ) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(
        self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, request: Any
    ) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(
        self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, requests: Any
    ) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(
        self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, requests: Any
    ) -> Any:
        return continuation(self._details(details), requests)


def open_channel(
    address: str,
    security: ClientSecurity,
    options: Sequence[tuple[str, Any]] = CHANNEL_OPTIONS,
) -> grpc.aio.Channel:
    """A grpc.aio channel to `address` with the client's TLS and token."""
    interceptors: list[Any] | None = None
    if security.token is not None:
        kinds = (
            _AioBearerUnaryUnary,
            _AioBearerUnaryStream,
            _AioBearerStreamUnary,
            _AioBearerStreamStream,
        )
        interceptors = [kind(security) for kind in kinds]
    if security.tls is not None:
        return grpc.aio.secure_channel(
            address, security.tls.credentials(), options=options, interceptors=interceptors
        )
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


def open_sync_channel(
    address: str,
    security: ClientSecurity,
    options: Sequence[tuple[str, Any]] = CHANNEL_OPTIONS,
) -> grpc.Channel:
    """A blocking channel to `address` with the client's TLS and token (for `mj`, tests)."""
    if security.tls is not None:
        channel = grpc.secure_channel(address, security.tls.credentials(), options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    if security.token is None:
        return channel
    return grpc.intercept_channel(channel, _SyncBearer(security))

"""Every client channel is opened here: TLS when configured, the bearer token on every call.

`open_channel(address, security)` (grpc.aio, for the services) and
`open_sync_channel` (for `mj` and tests) speak TLS when `security.tls` is set,
presenting the client certificate for mTLS when it has one, and add
`authorization: Bearer <token>` to every call (the aio channel wraps each method it
hands a stub; the blocking one uses an interceptor), so no call site handles
credentials. A `TokenSource` backed by a file (`--token-file`)
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

from services.common.security.tls import ClientTls

# A message's bound, both ways, on every server and channel of the system.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
]

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


class _WithToken:
    """A multicallable that adds the bearer token to each call's metadata.

    Cheaper than a grpc.aio client interceptor, which runs every call through an
    extra task: the token goes straight into the call the stub makes.
    """

    __slots__ = ("_multicallable", "_security")

    def __init__(self, multicallable: Any, security: ClientSecurity) -> None:
        self._multicallable = multicallable
        self._security = security

    def __call__(self, request: Any, *, metadata: Any = None, **kwargs: Any) -> Any:
        extra = self._security.metadata()
        return self._multicallable(request, metadata=_with_token(metadata, extra), **kwargs)


class _TokenChannel(grpc.aio.Channel):
    """A grpc.aio channel whose every call carries the bearer token."""

    def __init__(self, channel: grpc.aio.Channel, security: ClientSecurity) -> None:
        self._channel = channel
        self._security = security

    async def __aenter__(self) -> _TokenChannel:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self._channel.__aexit__(*exc_info)

    async def close(self, grace: float | None = None) -> None:
        await self._channel.close(grace)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self._channel.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self._channel.channel_ready()

    def unary_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _WithToken(self._channel.unary_unary(*args, **kwargs), self._security)

    def unary_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _WithToken(self._channel.unary_stream(*args, **kwargs), self._security)

    def stream_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _WithToken(self._channel.stream_unary(*args, **kwargs), self._security)

    def stream_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _WithToken(self._channel.stream_stream(*args, **kwargs), self._security)


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
    if security.tls is not None:
        channel = grpc.aio.secure_channel(address, security.tls.credentials(), options=options)
    else:
        channel = grpc.aio.insecure_channel(address, options=options)
    if security.token is None:
        return channel
    return _TokenChannel(channel, security)


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

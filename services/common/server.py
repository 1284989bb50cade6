"""The gRPC server skeleton every service runs.

grpc.aio, grpc.health.v1 (overall and per service; NOT_SERVING while draining),
reflection so `grpcurl HOST:PORT list` works, bounded message sizes, the security
edge in front of every service (edge.py: tokens, roles, audit, request decoding),
TLS or mTLS when the `ServerSecurity` has certificates, and a SIGTERM/SIGINT
handler that drains in phases: mark NOT_SERVING, let the service hand its work
back, then stop with a grace period. SIGHUP re-reads the tokens files.

A port another process holds is never shared (no SO_REUSEPORT): the service stops at
once with one line naming the address and the reason (`SettingError`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from services.common.channels import MAX_MESSAGE_BYTES
from services.common.security.auth import reload_all
from services.common.security.edge import EdgeInterceptor, ServerSecurity
from services.common.settings import SettingError

log = logging.getLogger(__name__)

SERVER_OPTIONS = [
    # A port another process holds is an error, never shared: with SO_REUSEPORT (gRPC's
    # default) a second scheduler on the same port would silently take half the calls.
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


class Server:
    """A grpc.aio server with health, reflection and the security edge.

    Raises:
        InsecureListen: plaintext on a non-loopback `host` without `security.insecure`.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        security: ServerSecurity,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    ) -> None:
        security.check_listen(host)
        self.security = security
        self._server = grpc.aio.server(
            interceptors=[EdgeInterceptor(security.tokens), *interceptors],
            options=SERVER_OPTIONS,
        )
        self._address = f"{host}:{port}"
        self.health = HealthServicer()
        self._service_names: list[str] = []
        self.port = 0

    def add(
        self, register: Callable[[Any, grpc.aio.Server], None], servicer: Any, name: str
    ) -> None:
        """Registers a servicer; `name` is its full service name for health and reflection."""
        register(servicer, self._server)
        self._service_names.append(name)

    async def start(self) -> int:
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        names = [*self._service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
        reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], self._server)
        # Asked first, so gRPC's own failure (a line of its log, then a bare "Failed to
        # bind") is the rare race where the port was taken in between.
        busy = _bind_error(self._address)
        if busy:
            raise SettingError(f"cannot listen on {self._address} (--host, --port): {busy}")
        try:
            if self.security.tls is not None:
                credentials = self.security.tls.credentials()
                self.port = self._server.add_secure_port(self._address, credentials)
            else:
                self.port = self._server.add_insecure_port(self._address)
        except RuntimeError:  # gRPC's "Failed to bind": say why, in one line
            self.port = 0
        if self.port == 0:
            why = _bind_error(self._address) or "refused by gRPC"
            raise SettingError(f"cannot listen on {self._address} (--host, --port): {why}")
        await self._server.start()
        await self.set_serving(True)
        if self.security.tokens is None:
            log.warning(
                "AUTHENTICATION IS OFF (--auth none): every caller is treated as an admin; "
                "never run this way outside tests",
                extra={"port": self.port},
            )
        _reload_tokens_on_sighup()
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self._service_names]:
            await self.health.set(name, status)

    async def stop(self, grace: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self._server.stop(grace)

    async def wait(self) -> None:
        await self._server.wait_for_termination()


def _bind_error(address: str) -> str:
    """Why `host:port` cannot be listened on, as the operating system says; "" if it can.

    The probe binds as gRPC does (SO_REUSEADDR), so a port whose old connections linger
    in TIME_WAIT after a restart is free, and one another process listens on is not.
    """
    host, _, port = address.rpartition(":")
    try:
        if not int(port):
            return ""
        infos = socket.getaddrinfo(host.strip("[]") or None, int(port), type=socket.SOCK_STREAM)
        family, kind, proto, _, sockaddr = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(sockaddr)
    except (OSError, ValueError) as exc:
        return getattr(exc, "strerror", None) or str(exc)
    return ""


def _reload_tokens_on_sighup() -> None:
    # Outside the main thread signals are not ours to take: whoever owns them decides.
    with contextlib.suppress(RuntimeError, ValueError):
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload_all)


def settle_heap() -> None:
    """Sets what exists now aside from the garbage collector, for good (`gc.freeze`).

    A started service's objects (modules, protobuf descriptors, the ORM's tables) live
    as long as the process; a full collection would scan them all each time, and the
    event loop, with every call in flight, would wait out the scan. Frozen, they are
    never scanned, and a full collection looks only at what the service made since.
    """
    gc.collect()
    gc.freeze()


async def run_until_signal(
    server: Server,
    grace: float,
    drain: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Serves until SIGTERM or SIGINT, then drains and stops. Idempotent on repeated signals."""
    settle_heap()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        log.info("draining", extra={"port": server.port})
        await server.set_serving(False)
        if drain is not None:
            await drain()
    finally:
        await server.stop(grace)
        log.info("stopped", extra={"port": server.port})

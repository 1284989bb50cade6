"""The gRPC server skeleton every service runs.

grpc.aio, grpc.health.v1 (overall and per service; NOT_SERVING while draining),
reflection so `grpcurl -plaintext HOST:PORT list` works, bounded message sizes,
and a SIGTERM/SIGINT handler that drains in phases: mark NOT_SERVING, let the
service hand its work back, then stop with a grace period.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 4 * 1024 * 1024
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
]
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


class Server:
    """A grpc.aio server with health and reflection."""

    def __init__(
        self,
        host: str,
        port: int,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    ) -> None:
        self._server = grpc.aio.server(interceptors=interceptors, options=SERVER_OPTIONS)
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
        self.port = self._server.add_insecure_port(self._address)
        if self.port == 0:
            raise OSError(f"cannot listen on {self._address}")
        await self._server.start()
        await self.set_serving(True)
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


async def run_until_signal(
    server: Server,
    grace: float,
    drain: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Serves until SIGTERM or SIGINT, then drains and stops. Idempotent on repeated signals."""
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

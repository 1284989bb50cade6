"""Serving a `Cloud` over gRPC in this process: both servicers plus the timer task.

`mj-simcloud` (main.py) runs one until SIGTERM; tests start one on port 0.
"""

from __future__ import annotations

import dataclasses

from managedjobs.simcloud.v1 import simcloud_service_pb2_grpc as pb_grpc
from services.common.background import Background
from services.common.security.edge import ServerSecurity
from services.common.server import Server
from services.simcloud.clock import Clock
from services.simcloud.cloud import Cloud
from services.simcloud.cloud_api import CLOUD_SERVICE, SimCloudServicer
from services.simcloud.config import CloudConfig
from services.simcloud.operator_api import OPERATOR_SERVICE, SimOperatorServicer


@dataclasses.dataclass
class RunningCloud:
    """A started sim cloud server and the task driving its timers."""

    cloud: Cloud
    server: Server
    ticker: Background

    @property
    def port(self) -> int:
        return self.server.port

    async def stop(self, grace: float = 0.0) -> None:
        await self.ticker.stop()
        await self.server.stop(grace)


async def start(
    config: CloudConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    clock: Clock | None = None,
    *,
    security: ServerSecurity,
) -> RunningCloud:
    """Starts a cloud and its gRPC server (in this process; tests use port 0)."""
    cloud = Cloud(config, clock)
    server = Server(host, port, security=security)
    server.add(
        pb_grpc.add_SimCloudServiceServicer_to_server, SimCloudServicer(cloud), CLOUD_SERVICE
    )
    server.add(
        pb_grpc.add_SimOperatorServiceServicer_to_server,
        SimOperatorServicer(cloud),
        OPERATOR_SERVICE,
    )
    ticker = Background("simcloud-timers", cloud.run)
    ticker.start()
    try:
        await server.start()
    except BaseException:
        await ticker.stop()
        raise
    return RunningCloud(cloud, server, ticker)

"""Entry point of `mj-logs`: settings, the backend, the store, and the gRPC server.

Every setting is a flag and an environment variable (`SETTINGS`, which a test
checks docker-compose.yml against). Logs go to stderr as JSON lines; stdout stays
empty.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path

from managedjobs.v1 import log_service_pb2_grpc
from services.backends import BACKEND, backend_settings, make_backend
from services.common import logs
from services.common.channels import ClientSecurity
from services.common.metrics import METRICS_PORT, serve_metrics
from services.common.security.edge import ServerSecurity, server_security
from services.common.security.tls import TlsConfigError
from services.common.server import Server, run_until_signal
from services.common.settings import (
    CLIENT_SECURITY,
    DATA_DIR,
    HOST,
    LOG_LEVEL,
    SCHEDULER_ADDRESS,
    SERVER_SECURITY,
    SHUTDOWN_GRACE,
    Setting,
    SettingError,
    parse,
)
from services.logs.directory import JobDirectory
from services.logs.holders import Holders
from services.logs.service import LogServicer
from services.logs.store import LogStore

log = logging.getLogger(__name__)

SERVICE_NAME = "managedjobs.v1.LogService"

PORT = Setting("port", "MJ_LOGS_PORT", 50052, "port to listen on", int)
TAIL_POLL_INTERVAL = Setting(
    "tail_poll_interval",
    "MJ_LOGS_TAIL_POLL_INTERVAL",
    0.2,
    "seconds between reads of a live local cluster's log files while tailing",
    float,
)
HOLDER_CACHE_SECONDS = Setting(
    "holder_cache_seconds",
    "MJ_LOGS_HOLDER_CACHE_SECONDS",
    5.0,
    "seconds the scheduler's word on which replica holds a job is trusted before asking "
    "again (a replica that lost a job may append to its log this long, at most)",
    float,
)
SETTINGS = (
    PORT,
    HOST,
    DATA_DIR,
    SCHEDULER_ADDRESS,
    BACKEND,
    *backend_settings(),
    *SERVER_SECURITY,
    *CLIENT_SECURITY,
    METRICS_PORT,
    LOG_LEVEL,
    SHUTDOWN_GRACE,
    TAIL_POLL_INTERVAL,
    HOLDER_CACHE_SECONDS,
)


def main(argv: Sequence[str] | None = None) -> None:
    """Runs the logs service until SIGTERM or SIGINT."""
    args = parse("mj-logs", "Serves task and controller logs of managed jobs.", SETTINGS, argv)
    logs.setup("logs", args.log_level)
    security = server_security("mj-logs", vars(args))
    try:
        client = ClientSecurity.from_settings(vars(args))
    except (TlsConfigError, OSError) as exc:
        raise SystemExit(f"mj-logs: {exc}") from None
    asyncio.run(serve(args, security, client))


async def serve(args: argparse.Namespace, security: ServerSecurity, client: ClientSecurity) -> None:
    """Serves with the parsed settings; returns after a drained shutdown."""
    data_dir = Path(args.data_dir)
    # First: a taken metrics port or a bad backend setting stops the service, with one
    # line, before it opened anything.
    serve_metrics(args.metrics_port, args.host)
    try:
        backend = make_backend(args.backend, vars(args))
    except ValueError as exc:  # a backend setting it cannot run with, named
        raise SettingError(str(exc)) from None
    directory = JobDirectory(args.scheduler_address, client)
    holders = Holders(directory, ttl=args.holder_cache_seconds)
    store = LogStore(data_dir / "logs")
    servicer = LogServicer(store, directory, backend, holders=holders)
    server = Server(args.host, args.port, security=security)
    server.add(log_service_pb2_grpc.add_LogServiceServicer_to_server, servicer, SERVICE_NAME)
    try:
        port = await server.start()
        log.info("serving", extra={"port": port, "scheduler": args.scheduler_address})
        await run_until_signal(server, args.shutdown_grace, drain=servicer.drain)
    finally:
        await directory.close()
        await backend.close()
        store.close()


if __name__ == "__main__":
    main()

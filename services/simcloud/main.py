"""`mj-simcloud`: the simulated cloud as its own process (contract §2, §10).

Serves SimCloudService (what the `sim` backend calls) and SimOperatorService
(chaos and inventory for tests and demos), with health and reflection, on one
port (default 50071). The cloud is the config at `--config`, or a built-in
three-region cloud; `--seed` and `--time-scale` override the config's.
SIGTERM stops it; the cloud's state lives in memory only, as in a test double
(the data dir only holds the tokens file, as for every service: the cloud API
wants a controller, admin or service token, the operator API an admin's).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Sequence

from services.common import logs, settings
from services.common.metrics import METRICS_PORT, serve_metrics
from services.common.security.edge import ServerSecurity, server_security
from services.common.server import run_until_signal
from services.common.settings import Setting
from services.simcloud.config import CloudConfig, ConfigError, load_config
from services.simcloud.server import start

log = logging.getLogger(__name__)

SETTINGS = (
    settings.HOST,
    Setting("port", "MJ_SIMCLOUD_PORT", 50071, "port to listen on (0 picks a free one)", int),
    Setting(
        "config",
        "MJ_SIMCLOUD_CONFIG",
        "",
        "YAML config of the cloud (default: a built-in three-region cloud)",
    ),
    Setting("seed", "MJ_SIMCLOUD_SEED", None, "random seed (default: the config's)", int),
    Setting(
        "time_scale",
        "MJ_SIMCLOUD_TIME_SCALE",
        None,
        "simulated seconds per real second (default: the config's)",
        float,
    ),
    settings.DATA_DIR,
    *settings.SERVER_SECURITY,
    METRICS_PORT,
    settings.LOG_LEVEL,
    settings.SHUTDOWN_GRACE,
)


async def serve(args: argparse.Namespace, config: CloudConfig, security: ServerSecurity) -> None:
    # First: a taken metrics port stops the service before it opened anything.
    serve_metrics(args.metrics_port, args.host)
    running = await start(config, args.host, args.port, security=security)
    log.info(
        "simcloud serving",
        extra={
            "port": running.port,
            "pid": os.getpid(),
            "regions": [r.name for r in config.regions],
            "seed": config.seed,
            "time_scale": config.time_scale,
        },
    )
    try:
        await run_until_signal(running.server, args.shutdown_grace)
    finally:
        await running.ticker.stop()


def main(argv: Sequence[str] | None = None) -> None:
    args = settings.parse("mj-simcloud", __doc__ or "", SETTINGS, argv)
    logs.setup("simcloud", args.log_level)
    try:
        config = load_config(args.config).with_overrides(args.seed, args.time_scale)
    except ConfigError as exc:
        raise SystemExit(f"mj-simcloud: {exc}") from None
    security = server_security("mj-simcloud", vars(args))
    asyncio.run(serve(args, config, security))


if __name__ == "__main__":
    main()

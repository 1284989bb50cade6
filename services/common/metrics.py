"""Prometheus metrics: one registry per process, served on `--metrics-port` (0: off).

Each service declares its own metrics next to its code (e.g.
`services/scheduler/metrics.py`); what every service shares is here: the
setting, the HTTP endpoint, and the RPC latency histogram the gRPC edge feeds.
Names start with `mj_`; docs/guide.md lists them.
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import Histogram, start_http_server

from services.common.settings import Setting, SettingError

log = logging.getLogger(__name__)

METRICS_PORT = Setting(
    "metrics_port",
    "MJ_METRICS_PORT",
    0,
    "port serving Prometheus metrics at /metrics (0: off)",
    int,
)

# Latency buckets from half a millisecond to a minute: RPCs, grants, launches, cancels.
SECONDS = (
    *(0.0005, 0.001, 0.002, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5),
    *(1, 2.5, 5, 10, 30, 60),
)

RPC_SECONDS = Histogram(
    "mj_rpc_seconds",
    "Server-side duration of each call (a stream's whole life), by method and status code",
    ["method", "code"],
    buckets=SECONDS,
)


_children: dict[tuple[int, tuple[str, ...]], Any] = {}


def child(metric: Any, *values: str) -> Any:
    """`metric.labels(*values)`, looked up once per metric and label values.

    For the labels of hot paths (a method, a status, a kind): a small fixed set, so
    the cache stays small, and the call skips prometheus-client's lock and checks.
    """
    key = (id(metric), values)
    found = _children.get(key)
    if found is None:
        found = _children[key] = metric.labels(*values)
    return found


def serve_metrics(port: int, host: str = "127.0.0.1") -> int:
    """Serves /metrics on `port` (0: not at all); returns the port."""
    if not port:
        return 0
    try:
        start_http_server(port, addr=host)
    except OSError as exc:
        raise SettingError(
            f"cannot serve metrics on {host}:{port} (--metrics-port): {exc.strerror or exc}"
        ) from None
    log.info("metrics serving", extra={"metrics_port": port})
    return port


__all__ = ["METRICS_PORT", "RPC_SECONDS", "SECONDS", "child", "serve_metrics"]

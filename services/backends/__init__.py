"""Backends: where tasks run (contract §10, §17).

`Backend` is the one interface the controller and the logs service use; this
package names it, its value types (`LaunchPlan` among them) and errors, and the
registry: each backend is one package (`local`, `sim`, `ssh`) plus one
`BackendSpec` entry in `BACKENDS` (its name, where its class lives, imported only
when used, and the settings it takes).
`BACKEND` is the setting that picks one (`--backend`, MJ_BACKEND), and
`make_backend(name, settings)` builds it from the services' settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any

from services.backends.base import (
    Backend,
    BackendError,
    BackendUnreachableError,
    ClusterEvent,
    ClusterHandle,
    ClusterStatus,
    LaunchPlan,
    Observation,
    PrecheckError,
    ResourcesUnavailableError,
    StaleEpochError,
    TaskEnd,
    TaskStatus,
    cluster_name,
)
from services.backends.local.users import (
    DEFAULT_RUN_AS,
    DEFAULT_RUN_AS_UIDS,
    run_as_setting,
    uid_range_setting,
)
from services.common.bounds import quote
from services.common.settings import Setting

__all__ = [
    "BACKEND",
    "BACKENDS",
    "Backend",
    "BackendError",
    "BackendSpec",
    "BackendUnreachableError",
    "ClusterEvent",
    "ClusterHandle",
    "ClusterStatus",
    "LaunchPlan",
    "Observation",
    "PrecheckError",
    "ResourcesUnavailableError",
    "StaleEpochError",
    "TaskEnd",
    "TaskStatus",
    "backend_settings",
    "cluster_name",
    "make_backend",
]


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """One registered backend.

    `factory` is "module:callable"; the callable takes the services' settings (a
    mapping of setting name to value: `data_dir`, `simcloud_address`, ...) and
    returns the backend, raising ValueError naming the setting that is wrong.
    """

    name: str
    factory: str
    description: str
    # Settings only this backend reads; every service that may run it accepts them.
    settings: tuple[Setting, ...] = ()

    def load(self) -> Callable[[Mapping[str, Any]], Backend]:
        module, _, attr = self.factory.partition(":")
        loaded: Callable[[Mapping[str, Any]], Backend] = getattr(
            importlib.import_module(module), attr
        )
        return loaded


def node_pools_file(text: str) -> str:
    """Checks the ssh backend's node pools file when the setting is parsed, so a wrong
    file stops a service at once with one line naming the file and the field."""
    if not text:
        return text
    # Only the file's reader: asyncssh is loaded only when the backend is used.
    from services.backends.ssh.config import load_node_pools

    try:
        load_node_pools(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


BACKENDS: dict[str, BackendSpec] = {
    spec.name: spec
    for spec in (
        BackendSpec(
            "local",
            "services.backends.local.backend:from_settings",
            "processes on this host (default)",
            (
                Setting(
                    "run_as",
                    "MJ_RUN_AS",
                    DEFAULT_RUN_AS,
                    "user whose group runs task code, created if missing when the service "
                    "is root (local backend)",
                    run_as_setting,
                ),
                Setting(
                    "run_as_uids",
                    "MJ_RUN_AS_UIDS",
                    DEFAULT_RUN_AS_UIDS,
                    "uids no account uses, one per cluster, when the service is root "
                    "(local backend)",
                    uid_range_setting,
                ),
                Setting(
                    "workdir_roots",
                    "MJ_WORKDIR_ROOTS",
                    "",
                    "colon-separated folders a task's workdir must be under; empty: the "
                    "service's working folder (local backend)",
                ),
            ),
        ),
        BackendSpec(
            "sim",
            "services.backends.sim.backend:from_settings",
            "the simulated cloud (mj-simcloud)",
            (
                Setting(
                    "simcloud_address",
                    "MJ_SIMCLOUD_ADDRESS",
                    "127.0.0.1:50071",
                    "sim cloud host:port (sim backend)",
                ),
            ),
        ),
        BackendSpec(
            "ssh",
            "services.backends.ssh.backend:from_settings",
            "hosts of SSH node pools (an ssh_node_pools.yaml)",
            (
                Setting(
                    "ssh_node_pools",
                    "MJ_SSH_NODE_POOLS",
                    "",
                    "path of the ssh_node_pools.yaml (ssh backend)",
                    node_pools_file,
                ),
                Setting(
                    "ssh_connect_timeout",
                    "MJ_SSH_CONNECT_TIMEOUT",
                    10.0,
                    "seconds to open an SSH connection to a host (ssh backend)",
                    float,
                ),
                Setting(
                    "ssh_command_timeout",
                    "MJ_SSH_COMMAND_TIMEOUT",
                    20.0,
                    "seconds a host may take to answer a command (ssh backend)",
                    float,
                ),
                Setting(
                    "ssh_launch_timeout",
                    "MJ_SSH_LAUNCH_TIMEOUT",
                    600.0,
                    "seconds a launch may take, workdir copy included (ssh backend)",
                    float,
                ),
                Setting(
                    "ssh_reap_interval",
                    "MJ_SSH_REAP_INTERVAL",
                    60.0,
                    "mean seconds between passes releasing orphaned hosts (ssh backend; 0: off)",
                    float,
                ),
                Setting(
                    "ssh_max_sessions",
                    "MJ_SSH_MAX_SESSIONS",
                    8,
                    "commands at once on one host's connection (ssh backend)",
                    int,
                ),
            ),
        ),
    )
}


def backend_name(text: str) -> str:
    """A registered backend's name (`BACKENDS`)."""
    if text not in BACKENDS:
        raise argparse.ArgumentTypeError(
            f"unknown backend {quote(text)}; known backends: {', '.join(BACKENDS)}"
        )
    return text


BACKEND = Setting(
    "backend", "MJ_BACKEND", "local", "compute backend: local, sim or ssh", backend_name
)


def backend_settings() -> tuple[Setting, ...]:
    """The settings of every registered backend (each once), for the services' parsers."""
    seen: dict[str, Setting] = {}
    for spec in BACKENDS.values():
        for setting in spec.settings:
            seen.setdefault(setting.name, setting)
    return tuple(seen.values())


def make_backend(name: str, settings: Mapping[str, Any]) -> Backend:
    """Builds the backend called `name` from the services' settings.

    Raises:
        ValueError: no backend has that name, or a setting it needs is missing or bad;
            the message names it.
    """
    spec = BACKENDS.get(name)
    if spec is None:
        raise ValueError(f"unknown backend {name!r}; known backends: {', '.join(BACKENDS)}")
    return spec.load()(settings)

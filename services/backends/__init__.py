"""Backends: where tasks run (SPEC §10, §17).

`Backend` is the one interface the controller and the logs service use; this
package names it, its value types and errors, and the registry: each backend
is one module plus one `BackendSpec` entry in `BACKENDS` (its name, where its
class lives, imported only when used, and the settings it takes).
`make_backend(name, settings)` builds one from the services' settings.
"""

from __future__ import annotations

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
    Observation,
    PrecheckError,
    ResourcesUnavailableError,
    StaleEpochError,
    TaskEnd,
    TaskRequest,
    TaskStatus,
)
from services.backends.local_users import (
    DEFAULT_RUN_AS,
    DEFAULT_RUN_AS_UIDS,
    run_as_setting,
    uid_range_setting,
)
from services.common.settings import Setting

__all__ = [
    "BACKENDS",
    "Backend",
    "BackendError",
    "BackendSpec",
    "BackendUnreachableError",
    "ClusterEvent",
    "ClusterHandle",
    "ClusterStatus",
    "Observation",
    "PrecheckError",
    "ResourcesUnavailableError",
    "StaleEpochError",
    "TaskEnd",
    "TaskRequest",
    "TaskStatus",
    "backend_settings",
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


BACKENDS: dict[str, BackendSpec] = {
    spec.name: spec
    for spec in (
        BackendSpec(
            "local",
            "services.backends.local:from_settings",
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
            "services.backends.sim:from_settings",
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
    )
}


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

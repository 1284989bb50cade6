"""Backends: where tasks run (SPEC §10).

`Backend` is the one interface the controller and the logs service use; this
package names it, its value types and errors, and `make_backend`, which builds a
backend from its name (the `--backend` setting).
"""

from __future__ import annotations

import inspect
from typing import Any

from services.backends.base import (
    Backend,
    BackendError,
    BackendUnreachableError,
    ClusterEvent,
    ClusterHandle,
    ClusterStatus,
    PrecheckError,
    ResourcesUnavailableError,
    TaskRequest,
    TaskStatus,
)
from services.backends.local import LocalBackend
from services.backends.sim import SimBackend

__all__ = [
    "Backend",
    "BackendError",
    "BackendUnreachableError",
    "ClusterEvent",
    "ClusterHandle",
    "ClusterStatus",
    "LocalBackend",
    "PrecheckError",
    "ResourcesUnavailableError",
    "SimBackend",
    "TaskRequest",
    "TaskStatus",
    "make_backend",
]

BACKEND_NAMES = ("local", "sim")


def _accepted(cls: type[Backend], options: dict[str, Any]) -> dict[str, Any]:
    """The options that `cls`'s constructor takes by name."""
    params = inspect.signature(cls.__init__).parameters
    return {key: value for key, value in options.items() if key in params and key != "self"}


def make_backend(name: str, **options: Any) -> Backend:
    """Builds the backend called `name`.

    Every backend is given the same options and takes the ones it uses, so callers
    pass everything they know: `make_backend(name, root=..., simcloud_address=...)`.

    Args:
        name: A backend name: "local" or "sim".
        **options: `root` (local: the directory holding the clusters, plus its optional
            timings, e.g. `poll_interval`); `simcloud_address` (sim: host:port of
            mj-simcloud). Options a backend does not use are ignored.

    Returns:
        The backend.

    Raises:
        ValueError: no backend has that name, or an option it needs is missing.
    """
    if name == "local":
        if options.get("root") is None:
            raise ValueError("the local backend needs `root`, the clusters directory")
        return LocalBackend(**_accepted(LocalBackend, options))
    if name == "sim":
        address = options.pop("simcloud_address", None)
        if not address:
            raise ValueError("the sim backend needs `simcloud_address` (host:port of mj-simcloud)")
        return SimBackend(address, **options)
    raise ValueError(f"unknown backend {name!r}; known backends: {', '.join(BACKEND_NAMES)}")

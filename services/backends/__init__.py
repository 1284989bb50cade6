"""Backends: where tasks run (SPEC §10).

`Backend` is the one interface the controller and the logs service use; this
package names it, its value types and errors, and `make_backend`, which builds a
backend from its name (the `--backend` setting).
"""

from __future__ import annotations

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
    "TaskRequest",
    "TaskStatus",
    "make_backend",
]

BACKEND_NAMES = ("local",)


def make_backend(name: str, **options: Any) -> Backend:
    """Builds the backend called `name`.

    Args:
        name: A backend name, e.g. "local".
        **options: Keyword arguments of that backend's constructor (for "local":
            `root`, the directory holding the clusters, and optional timings).

    Returns:
        The backend.

    Raises:
        ValueError: no backend has that name.
    """
    if name == "local":
        return LocalBackend(**options)
    raise ValueError(f"unknown backend {name!r}; known backends: {', '.join(BACKEND_NAMES)}")

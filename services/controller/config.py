"""Knobs of a job lifecycle, with the clock and the sleep injected for tests."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable


@dataclasses.dataclass(frozen=True)
class LifecycleConfig:
    # Seconds between checks of a cluster when the backend cannot push events.
    poll_interval: float = 15.0
    # Seconds to wait after user code failed before asking whether the cluster is healthy.
    grace_seconds: float = 5.0
    # Launch retry: exponential backoff from `backoff_initial` up to `backoff_max`, with jitter.
    backoff_initial: float = 60.0
    backoff_max: float = 600.0
    # Launch attempts before FAILED_NO_RESOURCE; 0 retries forever.
    max_launch_retries: int = 0
    # After a launch, checks (one per `start_check_interval`) for the task to start.
    start_checks: int = 60
    start_check_interval: float = 1.0
    # Attempts to terminate a cluster before the cleanup is declared failed.
    terminate_attempts: int = 3
    clock: Callable[[], float] = time.time
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep

"""Knobs of a job lifecycle, with the clock and the sleep injected for tests.

The defaults are SkyPilot's where it has one (15 s between status checks, a 5 s
grace period before telling a crash from a preemption, launch retries from 60 s),
so a replica behaves like the original unless told otherwise. Tests shrink every
duration and pass their own `sleep`, so a whole lifecycle runs in milliseconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable


@dataclasses.dataclass(frozen=True)
class LifecycleConfig:
    # Seconds between checks of a cluster when the backend cannot push events.
    poll_interval: float = 15.0
    # Seconds to wait after user code failed before asking whether the cluster is healthy:
    # a node being preempted can kill the code a moment before the cluster shows it.
    grace_seconds: float = 5.0
    # Launch retry: exponential backoff from `backoff_initial` up to `backoff_max`, with jitter.
    backoff_initial: float = 60.0
    backoff_max: float = 600.0
    # Failed launch attempts before FAILED_NO_RESOURCE; 0 retries forever.
    max_launch_retries: int = 0
    # After a launch, checks (one per `start_check_interval`) for the task to start.
    start_checks: int = 60
    start_check_interval: float = 1.0
    # Attempts to terminate a cluster before the cleanup is declared failed, the n-th retry
    # `terminate_retry_delay * n` seconds after the previous one. Attempts made while the
    # backend is unreachable do not count: nothing can be concluded then.
    terminate_attempts: int = 3
    terminate_retry_delay: float = 1.0
    # Seconds a task's processes get between SIGTERM and SIGKILL when stopped (a cancel, a
    # timeout), so code can checkpoint (contract §18); a task's `grace_period` overrides it.
    grace_period: float = 30.0
    # Seconds a cluster (or the backend) may stay unreachable before it counts as lost,
    # unless the backend says otherwise (an SSH pool's own timeout). contract §17, §18.
    unreachable_timeout: float = 120.0
    # Wall clock (task end times) and monotonic clock (timeouts), injected in tests.
    clock: Callable[[], float] = time.time
    monotonic: Callable[[], float] = time.monotonic
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep

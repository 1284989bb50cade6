"""Tearing down a task's cluster (contract §6 "at the end, always"), for the lifecycle and
the cleanup alike.

`Teardown.remove` copies the attempt's logs off the cluster first, then
terminates it and verifies it is gone, bounded in time and attempts: a
cluster that cannot be removed raises `CleanupFailed` (FAILED_CONTROLLER, its
resources may have leaked). A cluster verified gone is not torn down twice.

With a grace period the task is stopped first (SIGTERM, SIGKILL after the
grace) and its logs copied once it stopped, so what it wrote while stopping is
kept. While the backend cannot be reached nothing is concluded, for at most
`unreachable_timeout`; a cluster that already stayed unreachable past its
timeout (`silent`) is not waited for a second time: every backend's launch of a
cluster name replaces any older cluster of that name, so the backend stops the
old one once it can (the ssh backend's reaper, when the host answers again).
"""

from __future__ import annotations

from services.backends import (
    Backend,
    BackendError,
    BackendUnreachableError,
    ClusterHandle,
    StaleEpochError,
)
from services.controller.config import LifecycleConfig
from services.controller.host import JobHost
from services.controller.messages import MovedAway
from services.controller.tasks import TaskState


class CleanupFailed(Exception):
    """A cluster could not be terminated: resources may have leaked (FAILED_CONTROLLER)."""


class Teardown:
    """Removes the clusters of one job's tasks."""

    def __init__(self, host: JobHost, backend: Backend, config: LifecycleConfig) -> None:
        self.host = host
        self.backend = backend
        self.config = config

    async def remove(
        self,
        state: TaskState,
        handle: ClusterHandle,
        grace: float = 0.0,
        attempt: int | None = None,
        silent: bool = False,
    ) -> None:
        """Copies the attempt's logs off the cluster, then terminates it and verifies it is gone.

        Args:
            state: The task the cluster ran.
            handle: The cluster.
            grace: Stop the task first, with this grace period (seconds).
            attempt: The attempt whose logs these are (default: the task's current one).
            silent: One terminate is tried; a backend that still cannot be reached is
                left to stop the cluster itself.

        Raises:
            CleanupFailed: it could not be terminated (resources may have leaked).
            MovedAway: a newer epoch of the job holds the cluster.
        """
        if state.gone and state.handle is handle:
            return
        if grace > 0 and await self._stop(handle, grace):
            grace = 0.0  # stopped: nothing is left to wait for
        await self.host.fetch_logs(state.task_id, handle, attempt or state.attempt)
        if not await self._terminate(handle, grace, silent=silent):
            return
        if state.handle is handle or state.handle is None:
            state.gone = True

    async def _stop(self, handle: ClusterHandle, grace: float) -> bool:
        """Stops the task gracefully, keeping its cluster; False when the backend could not
        (the terminate that follows then gives the grace).

        Raises:
            MovedAway: a newer epoch of the job holds the cluster.
        """
        try:
            await self.backend.stop(handle, self.host.epoch, grace)
        except StaleEpochError as stale:
            raise MovedAway(f"stop {handle.cluster_name}: {stale}") from stale
        except BackendError as error:
            self.host.note(f"stop {handle.cluster_name}: {error}; terminating with the grace")
            return False
        return True

    async def _terminate(
        self, handle: ClusterHandle, grace: float = 0.0, silent: bool = False
    ) -> bool:
        """Terminates a cluster and verifies it is gone, bounded in time and attempts.

        Gone means the backend's terminate said it saw the cluster gone, or else a
        `cluster_exists` asked afterwards says so.

        While the backend is unreachable nothing is concluded and attempts are not
        counted, but only for `unreachable_timeout`: then the cleanup has failed.
        With `silent` (the cluster already stayed unreachable past its timeout) an
        unreachable backend is not waited for again.

        Returns:
            True once the cluster is verified gone; False when, with `silent`, the
            backend could not be reached.

        Raises:
            CleanupFailed: still there after `terminate_attempts` attempts, or the backend
                stayed unreachable past `unreachable_timeout`.
            MovedAway: a newer epoch of the job holds the cluster.
        """
        name = handle.cluster_name
        attempts = max(1, self.config.terminate_attempts)
        attempt = 0
        unreachable_since: float | None = None
        while True:
            try:
                if await self.backend.terminate(handle, self.host.epoch, grace):
                    return True
                if not await self.backend.cluster_exists(name):
                    return True
                error = "it still exists after terminate"
            except StaleEpochError as stale:
                raise MovedAway(f"terminate {name}: {stale}") from stale
            except BackendUnreachableError as unreachable:
                if silent:
                    self.host.note(
                        f"terminate {name}: {unreachable}; relaunching without waiting again: "
                        "the relaunch replaces it, and the backend stops it once it answers"
                    )
                    return False
                now = self.config.monotonic()
                if unreachable_since is None:
                    unreachable_since = now
                    self.host.note(f"terminate {name}: {unreachable}; retrying until it answers")
                elif now - unreachable_since >= self.config.unreachable_timeout:
                    raise CleanupFailed(
                        f"cluster {name} could not be terminated: the backend stayed unreachable "
                        f"for {self.config.unreachable_timeout:g}s; it may have leaked"
                    ) from unreachable
                await self.config.sleep(self.config.terminate_retry_delay)
                continue
            except BackendError as failed:
                error = str(failed)
            attempt += 1
            self.host.note(f"terminate {name} failed (attempt {attempt} of {attempts}): {error}")
            if attempt >= attempts:
                raise CleanupFailed(
                    f"cluster {name} could not be terminated ({error}); it may have leaked"
                )
            await self.config.sleep(self.config.terminate_retry_delay * attempt)


__all__ = ["CleanupFailed", "Teardown"]

"""How a job ends on a replica (contract §6 "at the end, always", §8): `run_job` and the cleanup.

`run_job` runs the lifecycle's main path as its own task, so that a cancel
interrupts it wherever it waits (for a grant, a launch, a backoff, news of a
cluster) at once, and then runs the cleanup, whatever happened. The cleanup
is never interrupted by a cancel: it is already ending the job. It

- gives back the launch slot;
- after a cancel, moves every task in flight to CANCELLING;
- tears down every cluster of the job that may exist (`Teardown`, teardown.py:
  the attempt's logs are copied off first, with a grace period after a cancel
  so code can checkpoint), skipping clusters already verified gone;
- leaves every task in exactly one terminal status: CANCELLED for a cancel
  and for tasks that never ran, FAILED_CONTROLLER with the reason for a cluster
  that could not be torn down or a main path that failed.

A report refused because the job moved away (`MovedAway`) stops everything at
once: the new holder cleans up. Any other refused report or error is noted and
the cleanup goes on; `run_job` returns the reason, which the replica sends
with `JobFinished` so the scheduler closes whatever is left as
FAILED_CONTROLLER.
"""

from __future__ import annotations

import asyncio
import logging

from services.common.event_messages import CANCEL_REQUESTED, CLEANUP_FAILED
from services.common.statuses import ACTIVE, JobStatus
from services.controller.lifecycle import JobLifecycle
from services.controller.messages import MovedAway, Refused
from services.controller.tasks import TaskState
from services.controller.teardown import CleanupFailed

log = logging.getLogger(__name__)
S = JobStatus


class CancelRequest:
    """A job's cancel request: set once, from any task; interrupts the main path at once.

    Cheaper than an `asyncio.Event` plus a task waiting on it, which matters with
    20,000 jobs on one replica.
    """

    def __init__(self, requested: bool = False) -> None:
        self._requested = requested
        self._main: asyncio.Task[None] | None = None

    def set(self) -> None:
        """Requests the cancel (idempotent)."""
        self._requested = True
        if self._main is not None and not self._main.done():
            self._main.cancel()

    def is_set(self) -> bool:
        return self._requested


async def _report(state: TaskState, status: JobStatus, why: str) -> str:
    """A cleanup transition; a refusal is noted, not fatal (the cleanup goes on)."""
    try:
        await state.transition(
            status, why, failure_reason=why if status == S.FAILED_CONTROLLER else ""
        )
    except Refused as refused:
        state.host.note(f"task {state.task_id}: the scheduler refused {status.name}: {refused}")
        return f"the scheduler refused a report: {refused}"
    return ""


async def cleanup(lifecycle: JobLifecycle, cancelled: bool, error: str = "") -> str:
    """Ends every unfinished task and removes every cluster of the job (see the module doc).

    Returns:
        Why tasks may have been left unfinished ("" when every task ended as it should).

    Raises:
        MovedAway: the job belongs to another replica now.
    """
    host = lifecycle.host
    problems: list[str] = []
    await host.slot.release()
    if cancelled:
        for state in lifecycle.tasks:
            if state.status in ACTIVE - {S.CANCELLING}:
                problems.append(await _report(state, S.CANCELLING, CANCEL_REQUESTED))
    failures: dict[int, str] = {}
    for state in lifecycle.tasks:
        if state.status == S.PENDING or not state.task.spec.run:
            continue  # never launched: no cluster can exist
        if state.gone:
            continue
        handle = state.last_cluster(lifecycle.backend)
        # After a cancel, running code gets SIGTERM and its grace period to checkpoint.
        grace = lifecycle.limits.grace(state) if cancelled else 0.0
        try:
            await lifecycle.teardown.remove(state, handle, grace)
        except CleanupFailed as failed:
            failures[state.task_id] = f"{CLEANUP_FAILED}: {failed}"
            continue
        host.note(f"task {state.task_id}: {handle.cluster_name} is gone")
    for state in lifecycle.tasks:
        failure = failures.get(state.task_id)
        if failure:
            if state.status != S.FAILED_CONTROLLER:
                problems.append(await _report(state, S.FAILED_CONTROLLER, failure))
        elif state.status == S.CANCELLING:
            problems.append(await _report(state, S.CANCELLED, "cancelled; its cluster is gone"))
        elif state.status == S.PENDING:
            why = "cancelled" if cancelled else "not run: an earlier task did not succeed"
            problems.append(await _report(state, S.CANCELLED, why))
        elif state.status in ACTIVE:
            reason = error or "the lifecycle stopped before the task finished"
            problems.append(await _report(state, S.FAILED_CONTROLLER, reason))
    return "; ".join(p for p in [error, *problems] if p)


async def run_job(lifecycle: JobLifecycle, cancel: CancelRequest) -> str:
    """Runs a job's main path, then its cleanup, whatever happened (contract §6, §8).

    Returns:
        Why the job may have tasks left unfinished ("" for a normal end), for the
        scheduler to close them as FAILED_CONTROLLER.

    Raises:
        MovedAway: this replica no longer holds the job: stopped at once, without
            cleanup (the new holder cleans up).

    Cancelling the task that runs `run_job` (a revoke) stops the main path too and
    reports nothing more.
    """
    cancelled = cancel.is_set() or lifecycle.cancelling
    error = ""
    if not cancelled:
        main = asyncio.create_task(lifecycle.run(), name=f"lifecycle-{lifecycle.job.job_id}")
        cancel._main = main
        try:
            await asyncio.wait({main})
        finally:
            cancel._main = None
            if not main.done():
                main.cancel()
                # The main path unwinds (its awaits are cancelled) before anything else.
                await asyncio.wait({main})
        cancelled = main.cancelled() or cancel.is_set()
        failure = None if main.cancelled() else main.exception()
        if isinstance(failure, MovedAway):
            raise failure
        if isinstance(failure, Refused):
            error = f"the scheduler refused a report: {failure}"
            lifecycle.host.note(error)
        elif failure is not None:
            log.error("lifecycle failed", exc_info=failure, extra={"job_id": lifecycle.job.job_id})
            error = f"controller error: {failure!r}"
            lifecycle.host.note(error)
    try:
        return await cleanup(lifecycle, cancelled, error=error)
    except MovedAway:
        raise
    except Exception as failure:
        log.error("cleanup failed", exc_info=failure, extra={"job_id": lifecycle.job.job_id})
        reason = f"{CLEANUP_FAILED}: controller error: {failure!r}"
        lifecycle.host.note(reason)
        return "; ".join(p for p in [error, reason] if p)


__all__ = ["CancelRequest", "cleanup", "run_job"]

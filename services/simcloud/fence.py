"""Fencing by epoch, and the record of the calls each cluster let through.

The cloud knows one thing about who may act for a job: the highest epoch launched
for it. A launch below that epoch is refused (`StaleEpoch`), and so is a
terminate, a stop or a preemption notice below it; epoch 0 on any of the last
three means an operator and is never fenced. Every refusal is counted.

Every terminate, stop and notice let through is kept in its cluster's record
(`Cluster.calls`, at most `MAX_CALLS`, later ones counted) with the epoch it
carried and its simulated time. The fence cannot refuse a call from an epoch the
job no longer holds at a cluster its new holder adopted without launching (the
highest epoch launched did not move), so such a call passes and shows there.
"""

from __future__ import annotations

from services.simcloud.clusters import CallKind, Cluster
from services.simcloud.errors import StaleEpoch

# Calls (terminate, stop, notice) kept in one cluster's record; later ones are counted.
MAX_CALLS = 32
# How a refusal names the call it refused.
_CALL_NAMES = {
    CallKind.TERMINATE: "terminate",
    CallKind.STOP: "stop",
    CallKind.NOTICE: "preemption notice",
}


class Fence:
    """The highest epoch launched per job, and the calls it refused."""

    def __init__(self) -> None:
        self._epochs: dict[int, int] = {}
        self.stale_launches = 0
        # Terminates and stops.
        self.stale_terminates = 0
        self.stale_notices = 0

    def check_launch(self, job_id: int, epoch: int) -> None:
        """Refuses a launch below the highest epoch launched for the job (counted).

        Raises:
            StaleEpoch: a newer epoch of the job launched.
        """
        if epoch < self._epochs.get(job_id, epoch):
            self.stale_launches += 1
            raise StaleEpoch(
                f"stale epoch {epoch} for job {job_id}: "
                f"epoch {self._epochs[job_id]} already launched",
                job_id=str(job_id),
            )

    def launched(self, job_id: int, epoch: int) -> None:
        """The job's highest epoch is now `epoch` (a launch passed its prechecks)."""
        self._epochs[job_id] = epoch

    def admit(self, cluster: Cluster, kind: CallKind, epoch: int, now: float) -> None:
        """Lets a call on the cluster through, into its record, or refuses it (counted).

        Raises:
            StaleEpoch: `epoch` (when not 0) is below the highest launched for the job.
        """
        latest = self._epochs.get(cluster.job_id, 0)
        if epoch and epoch < latest:
            if kind == CallKind.NOTICE:
                self.stale_notices += 1
            else:
                self.stale_terminates += 1
            raise StaleEpoch(
                f"stale epoch {epoch} for job {cluster.job_id}: epoch {latest} holds "
                f"{cluster.name}; {_CALL_NAMES[kind]} refused",
                job_id=str(cluster.job_id),
            )
        calls = cluster.calls if cluster.calls is not None else []
        if len(calls) < MAX_CALLS:
            calls.append((kind, epoch, now))
        else:
            cluster.calls_dropped += 1
        cluster.calls = calls

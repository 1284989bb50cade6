"""Epoch fencing and locks of the local backend, shared by every process on the host.

Every controller replica and the logs service of a host share one clusters root,
so the fence lives there too, in a folder no cluster's code can write:

    <root>/.state/lock                  flock: held briefly to read and raise epochs
                                        and to hand out uids
    <root>/.state/names/<cluster>.lock  flock: held for a whole launch, terminate or
                                        preemption notice of that cluster
    <root>/.state/epochs/<job_id>       the highest epoch seen for the job (decimal)
    <root>/.state/next-uid              where the search for a free uid starts
                                        (`users`)

Invariants:
- A job's recorded epoch only grows, and it is read and raised under the root lock,
  so two processes never both pass a check that only one of them should.
- One cluster name has at most one launch, terminate or notice in flight on the
  host: they hold the name's lock across processes (fcntl.flock), so two launches
  of one name can never both start supervisors.
- A name's lock file may be removed by its holder once the cluster is gone; a
  waiter that then locks the removed file notices (the path names another inode,
  or none) and locks the current file instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from services.backends.base import StaleEpochError
from services.backends.local.cluster import write_atomic

# How long a waiter for a busy cluster lock sleeps between tries, first and at most.
_LOCK_RETRY_FIRST = 0.005
_LOCK_RETRY_MAX = 0.05


class ClusterLock:
    """The lock of one cluster name: `async with`, held across awaits.

    Waiting polls a non-blocking flock with short sleeps, so a waiter can be
    cancelled at any point without leaving a lock (or a thread) behind.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._fd = -1
        self._discard = False

    def discard(self) -> None:
        """Removes the lock file on release: the cluster it guards is gone."""
        self._discard = True

    async def __aenter__(self) -> ClusterLock:
        delay = _LOCK_RETRY_FIRST
        while True:
            fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _LOCK_RETRY_MAX)
                continue
            if _same_file(fd, self._path):
                self._fd = fd
                return self
            os.close(fd)  # the holder before us removed it: lock the current file

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._discard:
            with contextlib.suppress(FileNotFoundError):
                self._path.unlink()
        os.close(self._fd)
        self._fd = -1
        self._discard = False


def _same_file(fd: int, path: Path) -> bool:
    try:
        on_path = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (on_path.st_dev, on_path.st_ino)


class EpochFence:
    """The highest epoch seen per job, and the locks of the clusters root."""

    def __init__(self, root: Path) -> None:
        """Describes the fence of a clusters root; creates nothing yet (see `prepare`).

        Args:
            root: The clusters root; the state lives in `<root>/.state`.
        """
        self.state_dir = root / ".state"
        self._epochs = self.state_dir / "epochs"
        self._names = self.state_dir / "names"
        self._lock_file = self.state_dir / "lock"

    def prepare(self) -> None:
        """Creates the state folders (owner-only: no cluster's code may touch them)."""
        for path in (self.state_dir, self._epochs, self._names):
            path.mkdir(mode=0o700, exist_ok=True)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Holds the root lock (blocking: call from a thread, for short work only)."""
        fd = os.open(self._lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def cluster_lock(self, cluster_name: str) -> ClusterLock:
        """The lock of one cluster name (the name must already be validated)."""
        return ClusterLock(self._names / f"{cluster_name}.lock")

    def epoch(self, job_id: int) -> int:
        """The highest epoch seen for the job (0: none); read without the lock."""
        try:
            return int((self._epochs / str(job_id)).read_text().strip() or 0)
        except (OSError, ValueError):
            return 0

    def admit(self, job_id: int, epoch: int, *, floor: int = 0, action: str) -> None:
        """Lets `epoch` act on the job's cluster, and records it as seen.

        Blocking (takes the root lock): call from a thread.

        Args:
            job_id: The job the cluster belongs to.
            epoch: The caller's assignment epoch.
            floor: An epoch the caller must also reach (the cluster's own).
            action: What the caller wants to do, for the error message.

        Raises:
            StaleEpochError: `epoch` is below the job's highest epoch or `floor`.
        """
        with self.locked():
            seen = self.epoch(job_id)
            if epoch < max(seen, floor):
                raise StaleEpochError(
                    f"{action} of job {job_id} by epoch {epoch} refused: "
                    f"epoch {max(seen, floor)} holds it"
                )
            if epoch > seen:
                write_atomic(self._epochs / str(job_id), f"{epoch}\n".encode())

    def admit_on(self, task: Any, epoch: int, action: str) -> None:
        """Lets `epoch` act on a cluster whose task.json holds `task`: not below the job's
        highest epoch nor below the epoch that launched the cluster. Epoch 0 (an
        operator's cleanup) always passes, as does a cluster without a task record.

        Blocking (takes the root lock): call from a thread.

        Raises:
            StaleEpochError: `epoch` is non-zero and below either.
        """
        if not epoch or not isinstance(task, dict):
            return
        job_id, launched_by = task.get("job_id"), task.get("epoch")
        if isinstance(job_id, int) and isinstance(launched_by, int):
            self.admit(job_id, epoch, floor=launched_by, action=action)

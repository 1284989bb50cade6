"""Serving a job's controller (lifecycle) log, once or following it.

Replicas append lines through AppendControllerLogs; the store wakes followers on
every append, so a follower sleeps until there is something new and never polls
the file. Following ends when the job is DONE rather than when its status turns
terminal: the controller still writes while it cleans up (terminating clusters,
cancelling what never ran), and those lines belong to the log. After DONE the
follower sends whatever was appended up to then and ends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

from services.logs.reading import read_range, tail_offset
from services.logs.store import LogStore
from services.logs.tracker import JobTracker


def read_controller_log(store: LogStore, job_id: int, tail_lines: int) -> Iterator[bytes]:
    """The job's controller log as it is now, in chunks."""
    path = store.controller_path(job_id)
    return read_range(path, tail_offset(path, tail_lines))


async def follow_controller_log(
    store: LogStore, tracker: JobTracker, tail_lines: int
) -> AsyncIterator[bytes]:
    """The job's controller log, then every line appended to it until the job is over."""
    path = store.controller_path(tracker.job_id)
    position = tail_offset(path, tail_lines)
    while True:
        # Taken before reading, so an append right after the read still wakes us.
        appended = store.changed(tracker.job_id)
        over = tracker.over
        for chunk in read_range(path, position):
            position += len(chunk)
            yield chunk
        if over:
            return
        await tracker.wait(appended)

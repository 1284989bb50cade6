"""The logs service (`mj-logs`): every task's logs and every job's controller log.

It copies each task's logs off its cluster before the cluster is torn down
(FetchTaskLogs, called by the controller), tails live clusters for followers,
keeps the controller's lifecycle lines per job, and serves all of them as streams
(ReadLogs). Job state comes from the scheduler; this service only owns log files.

Every attempt of a task (1, then one more per recovery or restart) keeps its own
log, known by its number; only the replica holding a job at its current epoch may
store logs for it.

Public surface: `LogServicer` (the gRPC handlers), `LogStore` (files under
`<data_dir>/logs`), `JobDirectory` (the scheduler client), `Holders` (which
replica holds which job, cached briefly) and `RECOVERED_MARKER` (the line between
the logs of a task's successive attempts). `services.logs.main` holds the entry
point and its `SETTINGS`.
"""

from services.logs.attempts import RECOVERED_MARKER
from services.logs.directory import JobDirectory
from services.logs.holders import Holders
from services.logs.service import LogServicer
from services.logs.store import LogStore

__all__ = ["RECOVERED_MARKER", "Holders", "JobDirectory", "LogServicer", "LogStore"]

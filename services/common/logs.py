"""One-line structured log records (JSON) on stderr.

`log.info("job assigned", extra={"job_id": 7})` prints one line:
`{"time": ..., "level": "INFO", "service": "scheduler", "msg": "job assigned", "job_id": 7}`.
"""

from __future__ import annotations

import json
import logging
import sys
import time

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service
        # The time to the second, formatted once per second: a busy service writes many
        # lines a second (every mutating call leaves an audit line).
        self._second = -1
        self._stamp = ""

    def format(self, record: logging.LogRecord) -> str:
        second = int(record.created)
        if second != self._second:
            self._second = second
            self._stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        out: dict[str, object] = {
            "time": f"{self._stamp}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup(service: str, level: str = "INFO") -> None:
    """Routes every logger to one JSON line per record on stderr."""
    # A line shows neither where it was logged from nor the thread or process: none is
    # collected (logging's documented switches; the caller's frame is walked otherwise).
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Audit lines (services/common/security/edge.py) are written whatever the level.
    logging.getLogger("audit").setLevel(logging.INFO)
    # SQLAlchemy is loud at INFO; asyncssh logs every SSH command the ssh
    # backend runs, with its whole node script.
    for name in ("sqlalchemy", "alembic", "asyncio", "asyncssh"):
        logging.getLogger(name).setLevel(logging.WARNING)

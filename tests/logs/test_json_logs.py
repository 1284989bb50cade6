"""One JSON line per log record (services/common/logs.py)."""

from __future__ import annotations

import json
import logging

from services.common.logs import JsonFormatter


def record(created: float, **extra: object) -> logging.LogRecord:
    made = logging.makeLogRecord({"name": "audit", "levelname": "INFO", "msg": "audit", **extra})
    made.created = created
    made.msecs = (created - int(created)) * 1000
    return made


def test_a_line_has_the_time_to_the_millisecond_and_the_records_fields_in_order() -> None:
    formatter = JsonFormatter("scheduler")
    times = [1_700_000_000.125, 1_700_000_000.875, 1_700_000_001.5, 1_699_999_999.25]
    lines = [json.loads(formatter.format(record(t, user="alice", job_ids=[7]))) for t in times]
    assert [line["time"] for line in lines] == [
        "2023-11-14T22:13:20.125Z",
        "2023-11-14T22:13:20.875Z",
        "2023-11-14T22:13:21.500Z",
        "2023-11-14T22:13:19.250Z",
    ]
    assert list(lines[0]) == ["time", "level", "service", "logger", "msg", "user", "job_ids"]
    assert lines[0]["service"] == "scheduler" and lines[0]["job_ids"] == [7]

"""Bounds on every input of the sim cloud (contract §19).

Both services check each field of each request here before the model sees it, so
no request can overflow a timestamp, wedge the timer heap, or make a later read
fail: a value out of range is `InvalidArgument` (INVALID_ARGUMENT) naming the
field, its message quoting at most `QUOTE_LIMIT` characters of the input, and the
request changes nothing. Launch requests raise `PrecheckInvalid` instead (also
INVALID_ARGUMENT), so they count as rejected prechecks.

The limits are far above anything a job spec produces (specs are at most 1 MiB,
num_nodes at most 1000) and far below what breaks arithmetic on wall-clock times.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from google.protobuf import timestamp_pb2

from services.common.bounds import CLOUD_NAME_RE, CLOUD_NAME_RULE
from services.common.errors import InvalidArgument
from services.simcloud.errors import PrecheckInvalid

QUOTE_LIMIT = 200
# About 317 years: any duration, latency or grace.
MAX_SECONDS = 1e10
# Preemptions per spot-cluster-hour.
MAX_RATE = 1e6
MAX_NODES = 1000
MAX_CAPACITY = 10_000_000
MAX_FAILING_LAUNCHES = 1_000_000
MAX_REGION_LIST = 64
MAX_NAMES_PER_CALL = 1000
MAX_LOG_LINES = 100_000
MAX_LOG_BYTES = 1024 * 1024
MAX_RESOURCE_TEXT = 64
MAX_PAGE = 10_000
# Timestamps taken: 1970-01-01 to 9999-12-31 (the end of google.protobuf.Timestamp's range).
MIN_TIMESTAMP_SECONDS = 0
MAX_TIMESTAMP_SECONDS = 253_402_300_799


def quote(value: object) -> str:
    """`repr(value)`, cut to `QUOTE_LIMIT` characters (with the full length when cut)."""
    text = repr(value)
    if len(text) <= QUOTE_LIMIT:
        return text
    size = f" ({len(value)} characters)" if isinstance(value, str) else ""
    return f"{text[:QUOTE_LIMIT]}...{size}"


def name(
    value: str,
    field: str,
    *,
    optional: bool = False,
    error: type[InvalidArgument] = InvalidArgument,
) -> str:
    """A cluster, region or zone name; "" only when `optional`."""
    if optional and value == "":
        return value
    if not CLOUD_NAME_RE.fullmatch(value):
        raise error(f"{field}: must be {CLOUD_NAME_RULE}, got {quote(value)}", field=field)
    return value


def names(
    values: Sequence[str],
    field: str,
    limit: int,
    *,
    error: type[InvalidArgument] = InvalidArgument,
) -> list[str]:
    if len(values) > limit:
        raise error(f"{field}: at most {limit} names, got {len(values)}", field=field)
    return [name(v, f"{field}[{i}]", error=error) for i, v in enumerate(values)]


def integer(
    value: int,
    field: str,
    low: int = 0,
    high: int | None = None,
    *,
    error: type[InvalidArgument] = InvalidArgument,
) -> int:
    if value < low or (high is not None and value > high):
        upper = "" if high is None else f" and <= {high}"
        raise error(f"{field}: must be >= {low}{upper}, got {value}", field=field)
    return value


def number(
    value: float,
    field: str,
    high: float = MAX_SECONDS,
    *,
    error: type[InvalidArgument] = InvalidArgument,
) -> float:
    """A finite number in [0, high]: a duration in simulated seconds, or a rate."""
    if not (math.isfinite(value) and 0 <= value <= high):
        raise error(
            f"{field}: must be a finite number from 0 to {high:g}, got {value}", field=field
        )
    return value


def text(
    value: str,
    field: str,
    limit: int = MAX_RESOURCE_TEXT,
    *,
    error: type[InvalidArgument] = InvalidArgument,
) -> str:
    if len(value) > limit:
        raise error(
            f"{field}: at most {limit} characters, got {len(value)}: {quote(value)}", field=field
        )
    return value


def log_lines(lines: Sequence[str], field: str) -> None:
    """The `sim.log_lines` of a launch: bounded in count and total size."""
    if len(lines) > MAX_LOG_LINES:
        raise PrecheckInvalid(
            f"{field}: at most {MAX_LOG_LINES} lines, got {len(lines)}", field=field
        )
    size = sum(len(line.encode()) + 1 for line in lines)
    if size > MAX_LOG_BYTES:
        raise PrecheckInvalid(
            f"{field}: at most {MAX_LOG_BYTES} bytes in all, got {size}", field=field
        )


def timestamp(value: timestamp_pb2.Timestamp, field: str) -> float:
    """A Timestamp within the type's range, as Unix seconds."""
    if not (
        MIN_TIMESTAMP_SECONDS <= value.seconds <= MAX_TIMESTAMP_SECONDS
        and 0 <= value.nanos < 1_000_000_000
    ):
        raise InvalidArgument(
            f"{field}: not a valid timestamp (seconds {value.seconds}, nanos {value.nanos})",
            field=field,
        )
    return value.seconds + value.nanos / 1e9

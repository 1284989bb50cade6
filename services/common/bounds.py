"""Bounds on every input (contract §19): the shared limits and the small validators for them.

Every service checks what it receives against these limits before acting on it,
so no request can make a service allocate, store or send more than the limits
allow. Two rules hold for every refusal:

- it names the offending field (:class:`BoundsError.field`), and
- its message quotes at most :data:`QUOTE_LIMIT` characters of the input
  (:func:`quote`), so a 1 MB value is never echoed back or written to a log.

Identifiers that name people and processes (users, pools, controller ids) are at
most 64 characters of ``[a-z0-9._-]``; job and task names follow the stricter
rule in the spec parser (contract §3).
"""

from __future__ import annotations

import re
import reprlib

from google.protobuf.timestamp_pb2 import Timestamp

__all__ = [
    "CLOUD_NAME_RE",
    "CLOUD_NAME_RULE",
    "MAX_ENV_BYTES",
    "MAX_ENV_KEYS",
    "MAX_FETCH_BATCH",
    "MAX_HANDLE_BYTES",
    "MAX_IDENTIFIER_CHARS",
    "MAX_INT32",
    "MAX_INT64",
    "MAX_JOB_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_LOG_BATCH_LINES",
    "MAX_LOG_LINE_BYTES",
    "MAX_SPEC_BYTES",
    "MAX_TAIL_LINES",
    "MAX_TASKS",
    "MAX_TIMESTAMP_SECONDS",
    "MAX_YAML_DEPTH",
    "QUOTE_LIMIT",
    "BoundsError",
    "check_controller_id",
    "check_identifier",
    "check_pool",
    "check_timestamp",
    "check_user",
    "json_depth",
    "quote",
]

# An error message quotes at most this many characters of the input.
QUOTE_LIMIT = 200

MAX_INT32 = 2**31 - 1
MAX_INT64 = 2**63 - 1

# A job spec's YAML text, in UTF-8 bytes, before and after alias expansion.
MAX_SPEC_BYTES = 1024 * 1024
# Nesting of YAML collections in a spec (a task document's mapping is level 1).
MAX_YAML_DEPTH = 32
# Tasks in one chain.
MAX_TASKS = 1000
# Per task: envs and secrets together (request extras included), keys and UTF-8 bytes
# of keys plus values.
MAX_ENV_KEYS = 1000
MAX_ENV_BYTES = 256 * 1024
# A parsed job (every TaskSpec serialized, plus its secrets). Half the 4 MiB gRPC
# message limit, so an assignment carrying the whole job plus its envelope always fits.
MAX_JOB_BYTES = 2 * 1024 * 1024

# Logs RPCs: lines in one AppendControllerLogs call, and UTF-8 bytes in one line; lines
# ReadLogs may be asked to tail; a cluster handle's JSON and how deep it may nest.
MAX_LOG_BATCH_LINES = 1000
MAX_LOG_LINE_BYTES = 16 * 1024
# Fetches in one BatchFetchTaskLogs call (each carries a handle of up to 16 KiB).
MAX_FETCH_BATCH = 500
MAX_TAIL_LINES = 100_000
MAX_HANDLE_BYTES = 16 * 1024
MAX_JSON_DEPTH = 16
# Times a request may carry: 1970-01-01 to 9999-12-31 (the end of google.protobuf.Timestamp).
MAX_TIMESTAMP_SECONDS = 253_402_300_799

# A name on a cloud: a cluster's (every backend's cluster names, `mj-<job>-<task>`
# among them), a region's or a zone's. What the sim cloud accepts, and what the local
# and ssh backends take as a folder name.
CLOUD_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
CLOUD_NAME_RULE = "1-128 characters of [A-Za-z0-9._-], starting with a letter or digit"

MAX_IDENTIFIER_CHARS = 64
_IDENTIFIER_RE = re.compile(r"[a-z0-9._-]+")
_IDENTIFIER_RULE = f"use at most {MAX_IDENTIFIER_CHARS} characters of a-z, 0-9, '.', '_', '-'"

_REPR = reprlib.Repr()
_REPR.maxstring = QUOTE_LIMIT
_REPR.maxother = QUOTE_LIMIT
_REPR.maxlevel = 3


class BoundsError(ValueError):
    """An input outside its bounds; ``field`` is the path of the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def quote(value: object, limit: int = QUOTE_LIMIT) -> str:
    """Renders a piece of input for an error message, at most about ``limit`` characters.

    Strings are shown as Python literals of their first ``limit`` characters; longer
    ones end in ``...`` and their length. Other values are shown by a bounded repr,
    so quoting a huge list costs no more than quoting a short one.

    Args:
        value: The offending input.
        limit: Characters of the input to show.

    Returns:
        The rendering, e.g. ``'Bad_Name'`` or ``'xxxx...' (1,048,576 characters)``.
    """
    if isinstance(value, str):
        text = repr(value[:limit])
        # Escapes (\x00 is four characters) must not lengthen the quote past the limit.
        clipped = len(text) > limit + 2
        if clipped:
            text = text[: limit + 1] + text[0]
        if clipped or len(value) > limit:
            return f"{text[:-1]}...{text[-1]} ({len(value):,} characters)"
        return text
    text = _REPR.repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


_JSON_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)


def json_depth(text: str) -> int:
    """How deeply JSON text nests arrays and objects, counted without parsing it.

    Parsers recurse once per level, so a document nested thousands deep must be
    refused before it is parsed. Brackets inside strings do not count; the text
    need not be valid JSON (the parser says what is wrong with it afterwards).

    Args:
        text: The JSON text.

    Returns:
        The deepest nesting: 0 for a scalar, 1 for ``[]`` or ``{"a": 1}``.
    """
    deepest = depth = 0
    for char in _JSON_STRING_RE.sub("", text):
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth = max(0, depth - 1)
    return deepest


def check_identifier(value: str, field: str, *, allow_empty: bool = False) -> str:
    """Checks a user, pool or controller id: at most 64 characters of ``[a-z0-9._-]``.

    Args:
        value: The identifier.
        field: The field path to name in the error.
        allow_empty: Whether "" (meaning "not given") is accepted.

    Returns:
        The identifier, unchanged.

    Raises:
        BoundsError: The identifier breaks the rule.
    """
    if not value:
        if allow_empty:
            return value
        raise BoundsError(field, "must not be empty")
    if len(value) > MAX_IDENTIFIER_CHARS or not _IDENTIFIER_RE.fullmatch(value):
        raise BoundsError(field, f"invalid {field} {quote(value)}: {_IDENTIFIER_RULE}")
    return value


def check_user(value: str, field: str = "user") -> str:
    """Checks a user name given in a request ("" means the caller; see `check_identifier`)."""
    return check_identifier(value, field, allow_empty=True)


def check_pool(value: str, field: str = "pool") -> str:
    """Checks a pool name ("" means no pool; see `check_identifier`)."""
    return check_identifier(value, field, allow_empty=True)


def check_controller_id(value: str, field: str = "controller_id") -> str:
    """Checks a controller replica's id (required; see `check_identifier`)."""
    return check_identifier(value, field)


def check_timestamp(value: Timestamp, field: str) -> Timestamp:
    """Checks a time given in a request: from 1970 to 9999, nanos within a second.

    Raises:
        BoundsError: seconds or nanos out of range (converting it would fail later).
    """
    if not (0 <= value.seconds <= MAX_TIMESTAMP_SECONDS and 0 <= value.nanos < 1_000_000_000):
        raise BoundsError(
            field, f"not a time from 1970 to 9999 (seconds {value.seconds}, nanos {value.nanos})"
        )
    return value

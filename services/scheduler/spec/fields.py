"""Converters for the fields of a job spec: each checks one YAML value and converts it.

A converter takes the value found at a field path and returns it converted, or
raises :class:`SpecError` naming that path. Every number is range-checked and
every message quotes at most 200 characters of the input (contract §19). The
grammar each converter accepts is documented in ``services.scheduler.spec.parse``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

from managedjobs.v1 import job_pb2
from services.common.bounds import MAX_INT32, BoundsError, quote

NAME_RE = re.compile(r"[a-z][a-z0-9-]{0,62}")
# At most 200 characters, so a name quoted in a field path stays within the quoting bound.
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,199}")
MAX_NUM_NODES = 1000
MAX_ACCELERATOR_COUNT = 1024
# Durations (timeouts, sim times): more than a year is a mistake, not a plan.
MAX_DURATION_SECONDS = 366 * 24 * 3600
# Exit codes: 1..255 from exit(), -N for "killed by signal N".
MIN_EXIT_CODE, MAX_EXIT_CODE = -64, 255
_NAME_RULE = "use lower-case letters, digits and '-', start with a letter, at most 63 characters"

RecoveryStrategy: TypeAlias = job_pb2.RecoveryStrategy.ValueType
STRATEGIES: dict[str, RecoveryStrategy] = {
    "FAILOVER": job_pb2.RECOVERY_STRATEGY_FAILOVER,
    "EAGER_NEXT_REGION": job_pb2.RECOVERY_STRATEGY_EAGER_NEXT_REGION,
    "NONE": job_pb2.RECOVERY_STRATEGY_NONE,
}
DEFAULT_STRATEGY = job_pb2.RECOVERY_STRATEGY_EAGER_NEXT_REGION


class SpecError(BoundsError):
    """A spec that can never run; ``field`` is the path of the offending field."""


# A converter checks one YAML value found at a field path and returns it converted.
Converter = Callable[[object, str], Any]


def join(path: str, key: str) -> str:
    """The path of ``key`` inside the field at ``path`` ("" is the document itself)."""
    key = key or "''"  # an empty YAML key still needs a visible path
    return f"{path}.{key}" if path else key


# Names for YAML values in messages; exact types, so a bool is never an "integer".
_KINDS: dict[type, str] = {
    type(None): "null",
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    list: "list",
    dict: "mapping",
}


def _kind(value: object) -> str:
    return _KINDS.get(type(value), type(value).__name__)  # or date, datetime, bytes, set


def expected(what: str, value: object, path: str) -> SpecError:
    """The error for a value of the wrong type."""
    return SpecError(path, f"expected {what}, got {_kind(value)}")


def fields(value: object, table: Mapping[str, Converter], path: str) -> dict[str, Any]:
    """Converts a mapping field by field; unknown keys are errors, null values are unset."""
    if not isinstance(value, dict):
        raise expected("a mapping", value, path)
    converted: dict[str, Any] = {}
    for key, item in value.items():
        field = join(path, str(key)[:200])
        convert = table.get(key) if isinstance(key, str) else None
        if convert is None:
            raise SpecError(field, f"unknown field (allowed: {', '.join(table)})")
        if item is not None:
            converted[key] = convert(item, field)
    return converted


def string(value: object, path: str) -> str:
    if not isinstance(value, str):
        raise expected("a string", value, path)
    return value


def name(value: object, path: str) -> str:
    text = string(value, path)
    if not NAME_RE.fullmatch(text):
        raise SpecError(path, f"invalid name {quote(text)}: {_NAME_RULE}")
    return text


def boolean(value: object, path: str) -> bool:
    if not isinstance(value, bool):
        raise expected("true or false", value, path)
    return value


def number(value: object, path: str) -> int | float:
    # bool is an int in Python but never a number in a spec.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise expected("a number", value, path)
    if not math.isfinite(value):
        raise SpecError(path, f"expected a finite number, got {value}")
    return value


def seconds(value: object, path: str) -> int | float:
    """A number of seconds, 0 up to a year."""
    amount = number(value, path)
    if not 0 <= amount <= MAX_DURATION_SECONDS:
        raise SpecError(path, f"must be within 0..{MAX_DURATION_SECONDS} seconds, got {amount}")
    return amount


# `sim.sigterm_exit_seconds` of a task that traps SIGTERM and never exits on it.
NEVER = "never"


def sigterm_exit(value: object, path: str) -> int | float | str:
    """``sim.sigterm_exit_seconds``: seconds from SIGTERM to the task's exit, or ``never``."""
    if value == NEVER:
        return NEVER
    if isinstance(value, str):
        raise SpecError(path, f"expected a number of seconds or {NEVER}, got {quote(value)}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise expected(f"a number of seconds or {NEVER}", value, path)
    return seconds(value, path)


def integer(low: int, high: int) -> Converter:
    def convert(value: object, path: str) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise expected("an integer", value, path)
        if value < low:
            raise SpecError(path, f"must be at least {low}, got {quote(value)}")
        if value > high:
            raise SpecError(path, f"must be at most {high}, got {quote(value)}")
        return value

    return convert


def string_list(value: object, path: str) -> list[str]:
    if not isinstance(value, list):
        raise expected("a list of strings", value, path)
    return [string(item, f"{path}[{i}]") for i, item in enumerate(value)]


def _scalar_text(value: object, path: str, what: str) -> str:
    """A string, or a finite YAML number written out as in the spec."""
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(number(value, path))
    raise expected(what, value, path)


# At most nine digits either side of the point: finite, and far beyond any machine.
_AMOUNT = r"(\d{1,9}(?:\.\d{1,9})?)"
_CPUS_RE = re.compile(_AMOUNT + r"\+?")
_MEMORY_RE = re.compile(_AMOUNT + r"(?:[KMGTP]B?)?\+?", re.IGNORECASE)


def cpus(value: object, path: str) -> str:
    """``4``, ``0.5``, ``4+`` (at least 4): a positive number, optionally followed by ``+``."""
    text = _scalar_text(value, path, "a number such as 4 or 4+")
    match = _CPUS_RE.fullmatch(text)
    if not match or float(match.group(1)) <= 0:
        raise SpecError(path, f"expected a positive number such as 4 or 4+, got {quote(text)}")
    return text


def memory(value: object, path: str) -> str:
    """``16`` (GB), ``16+``, ``16GB``, ``512M``, ``1TB+``: a positive size in GB by default."""
    text = _scalar_text(value, path, "a size such as 16, 16+ or 16GB")
    match = _MEMORY_RE.fullmatch(text)
    if not match or float(match.group(1)) <= 0:
        raise SpecError(
            path,
            "expected a positive size such as 16 (GB), 16+ or 512MB "
            f"(units K, M, G, T, P, optionally with B), got {quote(text)}",
        )
    return text


_ACCELERATOR_TYPE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_accelerator_count = integer(1, MAX_ACCELERATOR_COUNT)


def _accelerator_type(value: object, path: str) -> str:
    kind = _scalar_text(value, path, "an accelerator type such as A100")
    if not _ACCELERATOR_TYPE_RE.fullmatch(kind):
        raise SpecError(
            path,
            f"invalid accelerator type {quote(kind)}: use at most 64 letters, digits, "
            "'.', '_' or '-', starting with a letter or digit",
        )
    return kind


def accelerators(value: object, path: str) -> str:
    """``A100``, ``A100:8`` or ``{A100: 8}`` -> ``"A100:8"``; counts are integers >= 1."""
    if isinstance(value, dict):
        if len(value) != 1:
            raise SpecError(path, "give exactly one accelerator type, e.g. {A100: 8}")
        ((raw_kind, raw_count),) = value.items()
        kind = _accelerator_type(raw_kind, path)
        count = _accelerator_count(raw_count, join(path, kind))
        return f"{kind}:{count}"
    text = _scalar_text(value, path, "an accelerator such as A100:8")
    kind, colon, raw_count = text.partition(":")
    kind = _accelerator_type(kind, path)
    if not colon:
        return kind
    if not raw_count.isascii() or not raw_count.isdigit() or len(raw_count) > 9:
        raise SpecError(
            path, f"expected a count of at least 1 after ':', e.g. A100:8, got {quote(text)}"
        )
    return f"{kind}:{_accelerator_count(int(raw_count), path)}"


def strategy(value: object, path: str) -> RecoveryStrategy:
    text = string(value, path)
    found = STRATEGIES.get(text.upper())
    if found is None:
        allowed = ", ".join(STRATEGIES)
        raise SpecError(path, f"unknown recovery strategy {quote(text)} (allowed: {allowed})")
    return found


def exit_codes(value: object, path: str) -> list[int]:
    """A list of exit codes, 1..255 or -1..-64 (killed by signal N); sorted, without repeats."""
    if not isinstance(value, list):
        raise expected("a list of exit codes", value, path)
    codes: set[int] = set()
    for i, item in enumerate(value):
        code = integer(MIN_EXIT_CODE, MAX_EXIT_CODE)(item, f"{path}[{i}]")
        if code == 0:
            raise SpecError(f"{path}[{i}]", "0 is success, never a failure")
        codes.add(code)
    return sorted(codes)


_DURATION_PART_RE = re.compile(_AMOUNT + r"(ms|d|h|m|s)")
_UNIT_SECONDS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
_UNIT_ORDER = list(_UNIT_SECONDS)
_DURATION_RULE = "a duration such as 30s, 5m, 12h, 1h30m, 500ms or a number of seconds"


def _parse_duration(text: str) -> float | None:
    if re.fullmatch(_AMOUNT, text):
        return float(text)
    total, position, last_unit = 0.0, 0, -1
    while position < len(text):
        part = _DURATION_PART_RE.match(text, position)
        if part is None:
            return None
        unit = _UNIT_ORDER.index(part.group(2))
        if unit <= last_unit:  # units largest first, each once: "1h30m", not "30m1h"
            return None
        total += float(part.group(1)) * _UNIT_SECONDS[part.group(2)]
        position, last_unit = part.end(), unit
    return total if text else None


def duration(value: object, path: str) -> float:
    """A positive duration of at most 366 days, in seconds."""
    if isinstance(value, str):
        parsed = _parse_duration(value.strip()) if len(value) <= 64 else None
        if parsed is None:
            raise SpecError(path, f"expected {_DURATION_RULE}, got {quote(value)}")
        total = parsed
    elif isinstance(value, int | float) and not isinstance(value, bool):
        total = float(number(value, path))
    else:
        raise expected(_DURATION_RULE, value, path)
    if total <= 0:
        raise SpecError(path, f"must be longer than 0 seconds, got {quote(value)}")
    if total > MAX_DURATION_SECONDS:
        raise SpecError(path, f"must be at most 366 days, got {quote(value)}")
    return total


def _variable_value(value: object, path: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"  # as written in YAML, not Python's "True"
    if isinstance(value, int | float):
        return str(value)
    raise expected("a string, number or boolean", value, path)


def check_variable_name(key: object, path: str) -> str:
    """An environment variable's name; ``path`` is the map holding it."""
    if not isinstance(key, str) or not ENV_NAME_RE.fullmatch(key):
        raise SpecError(path, f"invalid environment variable name {quote(key)}")
    return key


def variables(value: object, path: str) -> dict[str, str | None]:
    """An ``envs`` or ``secrets`` map: names to strings; null: to be given at submission."""
    if not isinstance(value, dict):
        raise expected("a mapping", value, path)
    return {
        check_variable_name(key, path): _variable_value(item, join(path, key))
        for key, item in value.items()
    }


_RECOVERY_FIELDS: dict[str, Converter] = {
    "strategy": strategy,
    "max_restarts_on_errors": integer(0, MAX_INT32),
    "recover_on_exit_codes": exit_codes,
    "fail_on_exit_codes": exit_codes,
    "max_recoveries": integer(0, MAX_INT32),
    "on_demand_after_preemptions": integer(1, MAX_INT32),
    "unreachable_timeout": duration,
}
# Fields that only make sense when preemptions are recovered.
_RECOVERING_ONLY = ("max_recoveries", "on_demand_after_preemptions")


def job_recovery(value: object, path: str) -> dict[str, Any]:
    """``job_recovery``: a strategy name, or a mapping of the recovery policy (contract §7, §18).

    Returns:
        Keyword arguments for :class:`job_pb2.Resources`.
    """
    if isinstance(value, str):
        return {"recovery_strategy": strategy(value, path)}
    if not isinstance(value, dict):
        raise expected("a strategy name or a mapping", value, path)
    policy = fields(value, _RECOVERY_FIELDS, path)
    recover = policy.get("recover_on_exit_codes", [])
    both = sorted(set(recover) & set(policy.get("fail_on_exit_codes", [])))
    if both:
        raise SpecError(
            join(path, "fail_on_exit_codes"),
            f"exit codes {both[:10]} are also in recover_on_exit_codes; a code either "
            "recovers or fails",
        )
    if policy.get("strategy") == job_pb2.RECOVERY_STRATEGY_NONE:
        for key in _RECOVERING_ONLY:
            if key in policy:
                raise SpecError(join(path, key), "strategy NONE never recovers from a preemption")
    if "strategy" in policy:
        policy["recovery_strategy"] = policy.pop("strategy")
    if "unreachable_timeout" in policy:
        policy["unreachable_timeout_seconds"] = policy.pop("unreachable_timeout")
    return policy


_RESOURCES_FIELDS: dict[str, Converter] = {
    "cloud": string,
    "region": string,
    "zone": string,
    "cpus": cpus,
    "memory": memory,
    "accelerators": accelerators,
    "use_spot": boolean,
    "job_recovery": job_recovery,
}


def resources(value: object, path: str) -> job_pb2.Resources:
    """``resources``: the compute a task asks for, with its recovery policy."""
    converted = fields(value, _RESOURCES_FIELDS, path)
    policy = converted.pop("job_recovery", {})
    policy.setdefault("recovery_strategy", DEFAULT_STRATEGY)
    return job_pb2.Resources(**converted, **policy)

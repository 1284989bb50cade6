"""Parse and validate a job spec: SkyPilot task YAML, the subset of SPEC §3.

A spec is one or more YAML documents. Each document is one task; several form a
chain run in order. A first document that holds only ``name`` names the whole job
and is not a task. Empty documents (a trailing ``---``) are skipped.

Accepted task fields (anything else is an error; a null value means "not set")::

    name: train-gpt              # lower-case letters, digits, '-'; starts with a letter; <= 63
    envs: {EPOCHS: 3}            # scalars, stored as strings; null: must come with submission
    setup: pip install -r req.txt
    run: python train.py         # a task without run succeeds at once (SPEC §6)
    workdir: ~/src
    num_nodes: 1                 # 1..1000
    resources:                   # also: cloud, region, zone (strings)
      cpus: 4+                   # string or number; so is memory
      accelerators: {A100: 8}    # string, number, or a one-entry mapping -> "A100:8"
      use_spot: true
      job_recovery: FAILOVER     # or {strategy: ..., max_restarts_on_errors: 3}
    sim: {runtime_seconds: 30}   # product extension for the sim backend; also setup_seconds,
                                 # exit_code, setup_exit_code, log_lines, preempt_after_seconds

Invariants of the result: every task has ``resources`` set, with a concrete
recovery strategy (EAGER_NEXT_REGION by default, as in SkyPilot) and
``num_nodes >= 1``; ``sim_json`` is compact sorted-key JSON, or "" without sim
settings.

Errors are :class:`SpecError` naming the offending field path. Paths start with
``tasks[i].`` (``i`` counts tasks, not a name-only first document) only when the
chain has more than one task, e.g. ``tasks[1].resources.cpus``; for a single task
they are just ``resources.cpus``. The job name and ``name_override`` are ``name``;
size and YAML syntax errors are ``spec_yaml``; an empty chain is ``tasks``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

import yaml

from managedjobs.v1 import job_pb2

__all__ = [
    "MAX_SPEC_BYTES",
    "NAME_RE",
    "JobSpec",
    "SpecError",
    "parse_job_spec",
    "resources_summary",
]

# libyaml's loader where PyYAML has it: the same safe subset, several times faster.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
MAX_SPEC_BYTES = 1024 * 1024
NAME_RE = re.compile(r"[a-z][a-z0-9-]{0,62}")
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_NUM_NODES = 1000
_INT32_MAX = 2**31 - 1
_NAME_RULE = "use lower-case letters, digits and '-', start with a letter, at most 63 characters"

RecoveryStrategy: TypeAlias = job_pb2.RecoveryStrategy.ValueType
_STRATEGIES: dict[str, RecoveryStrategy] = {
    "FAILOVER": job_pb2.RECOVERY_STRATEGY_FAILOVER,
    "EAGER_NEXT_REGION": job_pb2.RECOVERY_STRATEGY_EAGER_NEXT_REGION,
}
DEFAULT_STRATEGY = job_pb2.RECOVERY_STRATEGY_EAGER_NEXT_REGION


class SpecError(ValueError):
    """A spec that can never run; ``field`` is the path of the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class JobSpec:
    """A validated job: its name and its chain of tasks, in order."""

    name: str
    tasks: list[job_pb2.TaskSpec]


# A converter checks one YAML value found at a field path and returns it converted.
Converter = Callable[[object, str], Any]


def _join(path: str, key: str) -> str:
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


def _expected(what: str, value: object, path: str) -> SpecError:
    return SpecError(path, f"expected {what}, got {_kind(value)}")


def _string(value: object, path: str) -> str:
    if not isinstance(value, str):
        raise _expected("a string", value, path)
    return value


def _name(value: object, path: str) -> str:
    name = _string(value, path)
    if not NAME_RE.fullmatch(name):
        raise SpecError(path, f"invalid name {name!r}: {_NAME_RULE}")
    return name


def _boolean(value: object, path: str) -> bool:
    if not isinstance(value, bool):
        raise _expected("true or false", value, path)
    return value


def _number(value: object, path: str) -> int | float:
    # bool is an int in Python but never a number in a spec.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _expected("a number", value, path)
    if not math.isfinite(value):
        raise SpecError(path, f"expected a finite number, got {value}")
    return value


def _non_negative(value: object, path: str) -> int | float:
    number = _number(value, path)
    if number < 0:
        raise SpecError(path, f"must be at least 0, got {number}")
    return number


def _string_or_number(value: object, path: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(_number(value, path))
    raise _expected("a string or number", value, path)


def _integer(low: int, high: int) -> Converter:
    def convert(value: object, path: str) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _expected("an integer", value, path)
        if value < low:
            raise SpecError(path, f"must be at least {low}, got {value}")
        if value > high:
            raise SpecError(path, f"must be at most {high}, got {value}")
        return value

    return convert


def _string_list(value: object, path: str) -> list[str]:
    if not isinstance(value, list):
        raise _expected("a list of strings", value, path)
    return [_string(item, f"{path}[{i}]") for i, item in enumerate(value)]


def _accelerators(value: object, path: str) -> str:
    if not isinstance(value, dict):
        return _string_or_number(value, path)
    if len(value) != 1:
        raise SpecError(path, "give exactly one accelerator type, e.g. {A100: 8}")
    ((raw_kind, raw_count),) = value.items()
    kind = _string(raw_kind, path)
    if not kind:
        raise SpecError(path, "the accelerator type is empty")
    count = _number(raw_count, _join(path, kind))
    if count <= 0:
        raise SpecError(_join(path, kind), f"must be greater than 0, got {count}")
    return f"{kind}:{count}"


def _strategy(value: object, path: str) -> RecoveryStrategy:
    name = _string(value, path)
    strategy = _STRATEGIES.get(name.upper())
    if strategy is None:
        allowed = ", ".join(_STRATEGIES)
        raise SpecError(path, f"unknown recovery strategy {name!r} (allowed: {allowed})")
    return strategy


_RECOVERY_FIELDS: dict[str, Converter] = {
    "strategy": _strategy,
    "max_restarts_on_errors": _integer(0, _INT32_MAX),
}


def _job_recovery(value: object, path: str) -> tuple[RecoveryStrategy, int]:
    if isinstance(value, str):
        return _strategy(value, path), 0
    if not isinstance(value, dict):
        raise _expected("a strategy name or a mapping", value, path)
    fields = _fields(value, _RECOVERY_FIELDS, path)
    return fields.get("strategy", DEFAULT_STRATEGY), fields.get("max_restarts_on_errors", 0)


_RESOURCES_FIELDS: dict[str, Converter] = {
    "cloud": _string,
    "region": _string,
    "zone": _string,
    "cpus": _string_or_number,
    "memory": _string_or_number,
    "accelerators": _accelerators,
    "use_spot": _boolean,
    "job_recovery": _job_recovery,
}


def _resources(value: object, path: str) -> job_pb2.Resources:
    fields = _fields(value, _RESOURCES_FIELDS, path)
    strategy, max_restarts = fields.pop("job_recovery", (DEFAULT_STRATEGY, 0))
    return job_pb2.Resources(
        **fields, recovery_strategy=strategy, max_restarts_on_errors=max_restarts
    )


def _env_value(value: object, path: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"  # as written in YAML, not Python's "True"
    if isinstance(value, int | float):
        return str(value)
    raise _expected("a string, number or boolean", value, path)


def _envs(value: object, path: str) -> dict[str, str | None]:
    if not isinstance(value, dict):
        raise _expected("a mapping", value, path)
    envs: dict[str, str | None] = {}
    for key, item in value.items():
        if not isinstance(key, str) or not ENV_NAME_RE.fullmatch(key):
            raise SpecError(path, f"invalid environment variable name {key!r}")
        envs[key] = _env_value(item, _join(path, key))
    return envs


_SIM_FIELDS: dict[str, Converter] = {
    "runtime_seconds": _non_negative,
    "setup_seconds": _non_negative,
    "preempt_after_seconds": _non_negative,
    "exit_code": _integer(-_INT32_MAX - 1, _INT32_MAX),
    "setup_exit_code": _integer(-_INT32_MAX - 1, _INT32_MAX),
    "log_lines": _string_list,
}


def _sim(value: object, path: str) -> str:
    fields = _fields(value, _SIM_FIELDS, path)
    return json.dumps(fields, sort_keys=True, separators=(",", ":")) if fields else ""


_TASK_FIELDS: dict[str, Converter] = {
    "name": _name,
    "envs": _envs,
    "setup": _string,
    "run": _string,
    "workdir": _string,
    "num_nodes": _integer(1, MAX_NUM_NODES),
    "resources": _resources,
    "sim": _sim,
}


def _fields(value: object, table: Mapping[str, Converter], path: str) -> dict[str, Any]:
    """Converts a mapping field by field; unknown keys are errors, null values are unset."""
    if not isinstance(value, dict):
        raise _expected("a mapping", value, path)
    fields: dict[str, Any] = {}
    for key, item in value.items():
        field = _join(path, str(key))
        convert = table.get(key) if isinstance(key, str) else None
        if convert is None:
            raise SpecError(field, f"unknown field (allowed: {', '.join(table)})")
        if item is not None:
            fields[key] = convert(item, field)
    return fields


def _task(doc: object, path: str, extra_envs: Mapping[str, str]) -> job_pb2.TaskSpec:
    if not isinstance(doc, dict):
        raise _expected("a mapping of task fields", doc, path or "spec_yaml")
    fields = _fields(doc, _TASK_FIELDS, path)
    envs: dict[str, str] = {}
    for key, env_value in {**fields.pop("envs", {}), **extra_envs}.items():
        if env_value is None:
            raise SpecError(_join(path, f"envs.{key}"), "no value: set it here or at submission")
        envs[key] = env_value
    if "sim" in fields:
        fields["sim_json"] = fields.pop("sim")
    fields.setdefault("num_nodes", 1)
    fields.setdefault("resources", _resources({}, _join(path, "resources")))
    return job_pb2.TaskSpec(envs=envs, **fields)


def _load_documents(spec_yaml: str) -> list[object]:
    if len(spec_yaml.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        raise SpecError("spec_yaml", f"the spec is larger than {MAX_SPEC_BYTES} bytes")
    try:
        docs = list(yaml.load_all(spec_yaml, Loader=_LOADER))
    except yaml.MarkedYAMLError as err:
        where = f" at line {err.problem_mark.line + 1}" if err.problem_mark else ""
        problem = err.problem or err.context or "syntax error"
        raise SpecError("spec_yaml", f"invalid YAML{where}: {problem}") from None
    except RecursionError:
        raise SpecError("spec_yaml", "invalid YAML: nested too deeply") from None
    except (yaml.YAMLError, ValueError, OverflowError) as err:
        # PyYAML raises plain ValueError for impossible dates such as 2024-13-01.
        first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise SpecError("spec_yaml", f"invalid YAML: {first_line}") from None
    return [doc for doc in docs if doc is not None]


def parse_job_spec(
    spec_yaml: str,
    *,
    name_override: str = "",
    extra_envs: Mapping[str, str] | None = None,
) -> JobSpec:
    """Parses and validates a job spec (SPEC §3).

    Args:
        spec_yaml: One or more YAML documents; see the module docstring.
        name_override: When non-empty, the job's name instead of the spec's.
        extra_envs: Merged into every task's envs, overriding the spec's values.

    Returns:
        The job's name (the override, else the name-only first document's, else the
        first task's, else "job") and its tasks. A task without a name takes the
        job's name, or ``task-<i>`` when nothing in the submission has a name.

    Raises:
        SpecError: The spec is invalid; ``field`` names the offending field path.
    """
    if name_override:
        _name(name_override, "name")
    docs = _load_documents(spec_yaml)
    header_name = ""
    first = docs[0] if docs else None
    if isinstance(first, dict) and set(first) == {"name"}:
        docs.pop(0)
        header_name = "" if first["name"] is None else _name(first["name"], "name")
    if not docs:
        raise SpecError("tasks", "a job needs at least one task")
    extra = dict(extra_envs or {})
    for key in extra:
        if not ENV_NAME_RE.fullmatch(key):
            raise SpecError("envs", f"invalid environment variable name {key!r}")
    chained = len(docs) > 1
    tasks = [_task(doc, f"tasks[{i}]" if chained else "", extra) for i, doc in enumerate(docs)]
    job_name = name_override or header_name or tasks[0].name
    for i, task in enumerate(tasks):
        task.name = task.name or job_name or f"task-{i}"
    return JobSpec(name=job_name or "job", tasks=tasks)


def resources_summary(spec: job_pb2.TaskSpec) -> str:
    """A SkyPilot-like one-line summary of a task's resources.

    Format: ``<num_nodes>x[spot](<cloud>, <region>, <zone>, cpus=<c>, memory=<m>,
    <accelerators>)``; unset parts are left out and ``[spot]`` appears only for spot.
    Examples: ``1x[spot](gcp, us-east1, cpus=2, A100:8)``, ``2x(cpus=4)``, ``1x()``.
    """
    res = spec.resources
    parts = [part for part in (res.cloud, res.region, res.zone) if part]
    parts += [f"{key}={val}" for key, val in (("cpus", res.cpus), ("memory", res.memory)) if val]
    if res.accelerators:
        parts.append(res.accelerators)
    spot = "[spot]" if res.use_spot else ""
    return f"{max(spec.num_nodes, 1)}x{spot}({', '.join(parts)})"

"""Parse and validate a job spec: SkyPilot task YAML, the subset of contract §3.

A spec is one or more YAML documents. Each document is one task; several form a
chain run in order. Empty documents (a trailing ``---``) are skipped. A first
document that holds ``name`` and nothing but job-level keys (``max_pending``,
``max_duration``, ``launch_timeout``, ``grace_period``) is the *header*: it names
the whole job, sets its timeouts and is not a task.

Accepted task fields (anything else is an error; a null value means "not set")::

    name: train-gpt              # lower-case letters, digits, '-'; starts with a letter; <= 63
    envs: {EPOCHS: 3}            # names [A-Za-z_][A-Za-z0-9_]*, <= 200; values scalars, stored
                                 # as strings; null: must come with the submission
    secrets: {HF_TOKEN: null}    # like envs, but kept apart from the task (see below)
    setup: pip install -r req.txt
    run: python train.py         # a task without run succeeds at once (contract §6)
    workdir: ~/src
    num_nodes: 1                 # 1..1000
    max_duration: 12h            # timeouts, contract §18 (durations below)
    launch_timeout: 30m
    grace_period: 30s
    max_pending: 2h              # first document of the spec only (see "Job-level keys")
    resources:                   # also: cloud, zone (strings)
      region: us-east1           # one the backend offers, when the caller says which
      cpus: 4+                   # a positive number, optionally followed by '+'
      memory: 16GB+              # the same, in GB, or with a unit: K, M, G, T, P (+ 'B')
      accelerators: {A100: 8}    # or A100:8, or A100 (count 1); counts are integers 1..1024
      use_spot: true
      job_recovery: FAILOVER     # FAILOVER, EAGER_NEXT_REGION or NONE, or a mapping:
        # strategy: FAILOVER
        # max_restarts_on_errors: 3          # restarts after user code failed, >= 0
        # recover_on_exit_codes: [137]       # treated like a preemption
        # fail_on_exit_codes: [2, -9]        # fail at once, no restart
        # max_recoveries: 10                 # >= 0; unset: unlimited
        # on_demand_after_preemptions: 3     # >= 1; then relaunch on on-demand capacity
        # unreachable_timeout: 10m           # unset: the backend's default
    sim: {runtime_seconds: 30}   # product extension for the sim backend; also setup_seconds,
                                 # exit_code, exit_code_runs, setup_exit_code, log_lines,
                                 # preempt_after_seconds, sigterm_exit_seconds (seconds
                                 # from SIGTERM to exit, or never; unset: exits at once)

Values:
- ``cpus``, ``memory`` and durations have at most nine digits either side of the
  point; a bare ``memory`` number is in GB, as in SkyPilot.
- A *duration* is a number of seconds, or parts from largest to smallest unit,
  each at most once: ``d``, ``h``, ``m``, ``s``, ``ms`` (``12h``, ``1h30m``, ``500ms``);
  it is > 0 and at most 366 days, and is stored in seconds.
- An *exit code* is 1..255 (``exit(n)``) or -1..-64 (killed by signal N); 0 is
  success and never listed. A code is in at most one of the two lists; each list
  is stored sorted, without repeats. With ``strategy: NONE``, ``max_recoveries``
  and ``on_demand_after_preemptions`` are errors: nothing is recovered.

Job-level keys: ``max_pending`` (a job whose first task has not started by then
fails) belongs to the whole job, so it is accepted only in the spec's first
document: the header, or the first task when there is no header. The header's
``max_duration`` bounds the whole job; its ``launch_timeout`` and
``grace_period`` are the default of every task that sets none, and are copied
onto those tasks. All four land in :attr:`JobSpec.timeouts`.

Secrets (contract §14): a task's ``secrets`` plus the submission's extra secrets are
in :attr:`JobSpec.secrets` (one map per task), never in the ``TaskSpec``, since
everything that serializes a TaskSpec (GetJob, logs, the database) could leak
them. A name is either an env or a secret, never both.

Bounds (contract §19, limits in ``services.common.bounds``): the text is at most 1 MiB
before and after alias expansion and nests at most 32 levels (``spec_yaml``); at
most 1,000 tasks (``tasks``); per task, envs and secrets together (submission
extras merged in) at most 1,000 names and 256 KiB of names plus values; the
parsed job (every TaskSpec serialized, plus the secrets) at most 2 MiB
(``tasks``), so that a job's assignment always fits a gRPC message. Messages
quote at most 200 characters of the input.

Invariants of the result: every task has ``resources`` set, with a concrete
recovery strategy (EAGER_NEXT_REGION by default, as in SkyPilot) and
``num_nodes >= 1``; ``sim_json`` is compact sorted-key JSON, or "" without sim
settings; ``len(secrets) == len(tasks)``.

Errors are :class:`SpecError` naming the offending field path. Paths start with
``tasks[i].`` (``i`` counts tasks, not the header) only when the chain has more
than one task, e.g. ``tasks[1].resources.cpus``; for a single task they are just
``resources.cpus``. The header's fields, the job name and ``name_override`` are
bare (``name``, ``max_pending``); size and YAML syntax errors are ``spec_yaml``;
an empty or oversized chain is ``tasks``.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from managedjobs.v1 import job_pb2
from services.common.bounds import (
    MAX_ENV_BYTES,
    MAX_ENV_KEYS,
    MAX_INT32,
    MAX_JOB_BYTES,
    MAX_SPEC_BYTES,
    MAX_TASKS,
    quote,
)
from services.scheduler.spec import fields as f
from services.scheduler.spec.fields import NAME_RE, SpecError
from services.scheduler.spec.loader import load_documents

__all__ = [
    "MAX_SPEC_BYTES",
    "NAME_RE",
    "JobSpec",
    "SpecError",
    "parse_job_spec",
    "resources_summary",
]


@dataclass(frozen=True)
class JobSpec:
    """A validated job: its name, its chain of tasks in order, and what is kept apart.

    Attributes:
        name: The job's name.
        tasks: The chain, in order.
        secrets: One map per task (same order; empty when the task has none): the
            task's secrets. Never part of a TaskSpec.
        timeouts: Job-level timeouts (header document, or ``max_pending``).
    """

    name: str
    tasks: list[job_pb2.TaskSpec]
    secrets: list[dict[str, str]] = field(default_factory=list)
    timeouts: job_pb2.JobTimeouts = field(default_factory=job_pb2.JobTimeouts)


# Spec key -> field of TaskSpec / JobTimeouts, in seconds.
_TIMEOUT_FIELDS = {
    "max_pending": "max_pending_seconds",
    "max_duration": "max_duration_seconds",
    "launch_timeout": "launch_timeout_seconds",
    "grace_period": "grace_period_seconds",
}
# Job-level values a task inherits when it sets none.
_INHERITED = ("launch_timeout_seconds", "grace_period_seconds")

_HEADER_FIELDS: dict[str, f.Converter] = {
    "name": f.name,
    **{key: f.duration for key in _TIMEOUT_FIELDS},
}


def _sim(value: object, path: str) -> str:
    converted = f.fields(value, _SIM_FIELDS, path)
    return json.dumps(converted, sort_keys=True, separators=(",", ":")) if converted else ""


_SIM_FIELDS: dict[str, f.Converter] = {
    "runtime_seconds": f.seconds,
    "setup_seconds": f.seconds,
    "preempt_after_seconds": f.seconds,
    "exit_code": f.integer(-MAX_INT32 - 1, MAX_INT32),
    "setup_exit_code": f.integer(-MAX_INT32 - 1, MAX_INT32),
    "exit_code_runs": f.integer(0, MAX_INT32),
    "log_lines": f.string_list,
    "sigterm_exit_seconds": f.sigterm_exit,
}

_TASK_FIELDS: dict[str, f.Converter] = {
    "name": f.name,
    "envs": f.variables,
    "secrets": f.variables,
    "setup": f.string,
    "run": f.string,
    "workdir": f.string,
    "num_nodes": f.integer(1, f.MAX_NUM_NODES),
    "resources": f.resources,
    "sim": _sim,
    **{key: f.duration for key in _TIMEOUT_FIELDS},
}


def _is_header(doc: object) -> bool:
    return isinstance(doc, dict) and "name" in doc and all(key in _HEADER_FIELDS for key in doc)


def _map_bytes(variables: Mapping[str, str]) -> int:
    """Serialized size of a string map, as it travels in a message."""
    return job_pb2.TaskSpec(envs=variables).ByteSize() if variables else 0


@dataclass
class _Chain:
    """What every task of one submission shares while the chain is built."""

    extra_envs: dict[str, str]
    extra_secrets: dict[str, str]
    known_regions: Collection[str] | None
    timeouts: job_pb2.JobTimeouts
    chained: bool
    # Whether the first task is the spec's first document (no header): it may set max_pending.
    headerless: bool
    job_bytes: int = 0
    # The header's timeouts that tasks setting none take over (TaskSpec field -> seconds).
    inherited: dict[str, float] = field(init=False)

    def __post_init__(self) -> None:
        self.inherited = {
            name: getattr(self.timeouts, name)
            for name in _INHERITED
            if self.timeouts.HasField(name)  # type: ignore[arg-type]
        }

    def path(self, i: int) -> str:
        return f"tasks[{i}]" if self.chained else ""

    def task(self, doc: object, i: int) -> tuple[job_pb2.TaskSpec, dict[str, str]]:
        path = self.path(i)
        if not isinstance(doc, dict):
            raise f.expected("a mapping of task fields", doc, path or "spec_yaml")
        converted = f.fields(doc, _TASK_FIELDS, path)
        envs = _merged(converted.pop("envs", {}), self.extra_envs, f.join(path, "envs"))
        secrets = _merged(converted.pop("secrets", {}), self.extra_secrets, f.join(path, "secrets"))
        _check_variables(envs, secrets, path)
        if "max_pending" in converted:
            if i > 0 or not self.headerless:
                raise SpecError(
                    f.join(path, "max_pending"),
                    "max_pending applies to the whole job: set it in the spec's first document"
                    + ("" if self.headerless else ", the one that names the job"),
                )
            self.timeouts.max_pending_seconds = converted.pop("max_pending")
        for key in _TIMEOUT_FIELDS.keys() & converted.keys():
            converted[_TIMEOUT_FIELDS[key]] = converted.pop(key)
        for proto_field, value in self.inherited.items():
            converted.setdefault(proto_field, value)
        if "sim" in converted:
            converted["sim_json"] = converted.pop("sim")
        converted.setdefault("num_nodes", 1)
        if "resources" not in converted:
            converted["resources"] = job_pb2.Resources(recovery_strategy=f.DEFAULT_STRATEGY)
        self._check_region(converted["resources"].region, f.join(path, "resources.region"))
        task = job_pb2.TaskSpec(envs=envs, **converted)
        self.job_bytes += task.ByteSize() + _map_bytes(secrets)
        if self.job_bytes > MAX_JOB_BYTES:
            raise SpecError(
                "tasks",
                f"the job is larger than {MAX_JOB_BYTES} bytes once parsed (reached at task {i}, "
                "counting envs and secrets merged into every task)",
            )
        return task, secrets

    def _check_region(self, region: str, path: str) -> None:
        if not region or self.known_regions is None or region in self.known_regions:
            return
        known = sorted(self.known_regions)
        shown = ", ".join(known[:5]) + (f" and {len(known) - 5} more" if len(known) > 5 else "")
        raise SpecError(path, f"unknown region {quote(region)} (known: {shown or 'none'})")


def _merged(
    spec_values: Mapping[str, str | None], extra: Mapping[str, str], path: str
) -> dict[str, str]:
    merged: dict[str, str] = {}
    for key, value in {**spec_values, **extra}.items():
        if value is None:
            raise SpecError(f.join(path, key), "no value: set it here or at submission")
        merged[key] = value
    return merged


def _check_variables(envs: Mapping[str, str], secrets: Mapping[str, str], path: str) -> None:
    if not secrets and not envs:
        return
    clash = envs.keys() & secrets.keys()
    if clash:
        key = min(clash)
        raise SpecError(
            f.join(path, f"secrets.{key}"), "also in envs: a name is either an env or a secret"
        )
    size = 0
    for name, variables in (("envs", envs), ("secrets", secrets)):
        where = f.join(path, name)
        if len(envs) + (len(secrets) if name == "secrets" else 0) > MAX_ENV_KEYS:
            raise SpecError(
                where,
                f"{len(envs) + len(secrets)} names in envs and secrets (submission's included); "
                f"at most {MAX_ENV_KEYS} per task",
            )
        for key, value in variables.items():
            size += len(key.encode("utf-8", "surrogatepass"))
            size += len(value.encode("utf-8", "surrogatepass"))
        if size > MAX_ENV_BYTES:
            raise SpecError(
                where,
                f"envs and secrets (submission's included) hold more than {MAX_ENV_BYTES} bytes "
                "of names and values; at most that per task",
            )


def _extras(values: Mapping[str, str] | None, path: str) -> dict[str, str]:
    if not values:
        return {}
    extra = dict(values or {})
    for key in extra:
        f.check_variable_name(key, path)
    return extra


def parse_job_spec(
    spec_yaml: str,
    *,
    name_override: str = "",
    extra_envs: Mapping[str, str] | None = None,
    extra_secrets: Mapping[str, str] | None = None,
    known_regions: Collection[str] | None = None,
) -> JobSpec:
    """Parses and validates a job spec (contract §3, §14, §18, §19).

    Args:
        spec_yaml: One or more YAML documents; see the module docstring.
        name_override: When non-empty, the job's name instead of the spec's.
        extra_envs: Merged into every task's envs, overriding the spec's values.
        extra_secrets: Merged into every task's secrets, overriding the spec's values.
        known_regions: When given, the regions a task may name in ``resources.region``
            (the regions the backend offers); any other is an error.

    Returns:
        The job's name (the override, else the header's, else the first task's, else
        "job"), its tasks, their secrets and the job's timeouts. A task without a name
        takes the job's name, or ``task-<i>`` when nothing in the submission has a name.

    Raises:
        SpecError: The spec is invalid; ``field`` names the offending field path.
    """
    if name_override:
        f.name(name_override, "name")
    extra_envs = _extras(extra_envs, "envs")
    extra_secrets = _extras(extra_secrets, "secrets")
    docs = load_documents(spec_yaml)
    has_header = bool(docs) and _is_header(docs[0])
    header = f.fields(docs.pop(0), _HEADER_FIELDS, "") if has_header else {}
    if not docs:
        hint = " (the only document names the job; add `run` to make it a task)"
        raise SpecError("tasks", "a job needs at least one task" + (hint if has_header else ""))
    if len(docs) > MAX_TASKS:
        raise SpecError("tasks", f"{len(docs)} tasks; a chain has at most {MAX_TASKS}")
    # Every task carries the extras: refuse before building a chain that cannot fit.
    extras_bytes = _map_bytes(extra_envs) + _map_bytes(extra_secrets)
    if extras_bytes * len(docs) > MAX_JOB_BYTES:
        raise SpecError(
            "tasks",
            f"the submission's envs and secrets ({extras_bytes} bytes) merged into each of "
            f"{len(docs)} tasks exceed the job's {MAX_JOB_BYTES} bytes",
        )
    job_name = str(header.pop("name", ""))
    timeouts = job_pb2.JobTimeouts(**{_TIMEOUT_FIELDS[key]: value for key, value in header.items()})
    chain = _Chain(
        extra_envs=extra_envs,
        extra_secrets=extra_secrets,
        known_regions=known_regions,
        timeouts=timeouts,
        chained=len(docs) > 1,
        headerless=not has_header,
    )
    built = [chain.task(doc, i) for i, doc in enumerate(docs)]
    tasks = [task for task, _ in built]
    job_name = name_override or job_name or tasks[0].name
    for i, task in enumerate(tasks):
        task.name = task.name or job_name or f"task-{i}"
    return JobSpec(
        name=job_name or "job",
        tasks=tasks,
        secrets=[secrets for _, secrets in built],
        timeouts=timeouts,
    )


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

"""Parsed job specs, remembered: a sweep submits the same YAML many times.

Parsing and validating a spec (`spec.parse_job_spec`: YAML, every field's
checks, the task protos) is a noticeable share of the scheduler's CPU per job
under a stream of submissions (`bench/spec.py` measures it). The answer is a
pure function of the text, the submission's name and envs, and the regions the
replicas offer, so it is kept by those, least recently used first out.

Bounded twice: at most `MAX_ENTRIES` answers, and only for submissions whose
text and envs take at most `MAX_KEY_BYTES` together. A spec that carries secrets
(in the YAML or with the submission) is never kept: this cache holds nothing a
heap dump should not show. A spec that fails is not kept either; it fails again
on its own. Every answer is a copy, so no caller can change another's.
"""

from __future__ import annotations

import collections
from collections.abc import Collection, Mapping

from managedjobs.v1 import job_pb2
from services.scheduler.spec.parse import JobSpec, parse_job_spec

MAX_ENTRIES = 256
MAX_KEY_BYTES = 16 * 1024

Key = tuple[str, str, tuple[tuple[str, str], ...], frozenset[str] | None]


class SpecCache:
    def __init__(self, entries: int = MAX_ENTRIES, key_bytes: int = MAX_KEY_BYTES) -> None:
        self.entries = entries
        self.key_bytes = key_bytes
        self._kept: collections.OrderedDict[Key, JobSpec] = collections.OrderedDict()
        self.hits = 0

    def __len__(self) -> int:
        return len(self._kept)

    def parse(
        self,
        spec_yaml: str,
        *,
        name_override: str = "",
        extra_envs: Mapping[str, str] | None = None,
        extra_secrets: Mapping[str, str] | None = None,
        known_regions: Collection[str] | None = None,
    ) -> JobSpec:
        """`parse_job_spec` with the same arguments, answered from the cache when it can be.

        Raises:
            SpecError, BoundsError: as `parse_job_spec`.
        """
        envs = tuple(sorted((extra_envs or {}).items()))
        size = len(spec_yaml) + len(name_override) + sum(len(k) + len(v) for k, v in envs)
        keep = not extra_secrets and size <= self.key_bytes
        regions = frozenset(known_regions) if known_regions is not None else None
        key: Key = (spec_yaml, name_override, envs, regions)
        if keep:
            found = self._kept.get(key)
            if found is not None:
                self._kept.move_to_end(key)
                self.hits += 1
                return _copy(found)
        spec = parse_job_spec(
            spec_yaml,
            name_override=name_override,
            extra_envs=extra_envs,
            extra_secrets=extra_secrets,
            known_regions=known_regions,
        )
        if keep and not any(spec.secrets):
            self._kept[key] = _copy(spec)
            while len(self._kept) > self.entries:
                self._kept.popitem(last=False)
        return spec


def _copy(spec: JobSpec) -> JobSpec:
    tasks = []
    for task in spec.tasks:
        copied = job_pb2.TaskSpec()
        copied.CopyFrom(task)
        tasks.append(copied)
    timeouts = job_pb2.JobTimeouts()
    timeouts.CopyFrom(spec.timeouts)
    return JobSpec(spec.name, tasks, [dict(s) for s in spec.secrets], timeouts)

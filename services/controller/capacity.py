"""What a replica can hold: launches = 4 x CPUs, jobs = memory / memory per job (contract §5)."""

from __future__ import annotations

import os

import psutil

from managedjobs.v1 import scheduler_service_pb2 as pb

# The memory a replica counts per live job in its capacity: more than a job takes
# (`replica_kb_per_job` in bench/scale.py's results), so a replica is never offered
# more jobs than its memory holds.
DEFAULT_MEMORY_PER_JOB_KB = 64


def replica_capacity(
    max_launches: int = 0, max_jobs: int = 0, memory_per_job_kb: int = DEFAULT_MEMORY_PER_JOB_KB
) -> pb.Capacity:
    """The replica's capacity from this machine, each figure overridable (0 = derive it)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    launches = max_launches or 4 * (cpus or 1)
    jobs = max_jobs or max(1, psutil.virtual_memory().available // (memory_per_job_kb * 1024))
    return pb.Capacity(max_launches=launches, max_jobs=int(min(jobs, 2**31 - 1)))

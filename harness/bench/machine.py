"""The machine a benchmark ran on, for its JSON line (`results.py`).

Besides what the machine is, two readings of how it behaved that day:

- `python_loop_s`: a bare Python loop of 3M iterations, taken as the line is
  recorded. The same code's figures differ widely between machines of the same
  kind, and drift within a day; compare runs through this, and compare revisions
  only in paired runs (bench/README.md).
- `filesystem`: creating empty files in the benchmark's data folder, timed
  before the system starts (`probe_filesystem`). On an ext4 without a journal,
  creating a file passes over every inode of its group deleted in the last few
  minutes (the kernel will not reuse them yet), so a run soon after another
  (each deletes its data folder, thousands of files) pays that scan for every
  log file it creates, and the logs service's CPU per job with it
  (docs/performance.md, "Files cost").
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import psutil

PROBE_FILES = 500
_filesystem: dict[str, object] = {}


def machine() -> dict[str, object]:
    return {
        "cpus": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "processor": platform.processor() or platform.machine(),
        "python_loop_s": round(python_loop_seconds(), 3),
        **({"filesystem": dict(_filesystem)} if _filesystem else {}),
    }


def python_loop_seconds(iterations: int = 3_000_000) -> float:
    start = time.perf_counter()
    for _ in range(iterations):
        pass
    return time.perf_counter() - start


def probe_filesystem(data_dir: Path) -> None:
    """Times creating empty files in a new folder of `data_dir` (left there: they go
    with it) and notes the filesystem's type and journal; `machine()` reports it."""
    folder = Path(data_dir) / ".probe"
    folder.mkdir(parents=True)
    start = time.perf_counter()
    for number in range(PROBE_FILES):
        os.close(os.open(folder / str(number), os.O_CREAT | os.O_WRONLY, 0o600))
    create_us = (time.perf_counter() - start) / PROBE_FILES * 1e6
    _filesystem.clear()
    _filesystem.update({**_kind(folder), "create_us": round(create_us, 1)})


def _kind(path: Path) -> dict[str, object]:
    """The type of the filesystem holding `path`, and for ext4 whether it has a journal."""
    resolved = str(path.resolve())
    partitions = psutil.disk_partitions(all=True)
    mounts = [p for p in partitions if resolved.startswith(p.mountpoint.rstrip("/") + "/")]
    if not mounts:
        return {}
    mount = max(mounts, key=lambda p: len(p.mountpoint))
    kind: dict[str, object] = {"type": mount.fstype}
    if mount.fstype == "ext4":
        device = os.path.basename(mount.device)
        try:
            journals = os.listdir("/proc/fs/jbd2")
        except OSError:
            return kind
        kind["journal"] = any(name.rsplit("-", 1)[0] == device for name in journals)
    return kind

"""The machine a benchmark ran on, for its JSON line."""

from __future__ import annotations

import os
import platform

import psutil


def machine() -> dict[str, object]:
    return {
        "cpus": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "processor": platform.processor() or platform.machine(),
    }

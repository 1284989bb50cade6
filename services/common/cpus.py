"""Which CPUs a service runs on (`--cpus`, `MJ_CPUS`): by default any the OS gives it.

A service given CPUs pins every thread it has when it starts, before it serves: its
event loop, the database's threads and gRPC's. Threads started later inherit the
pinning of the thread that starts them, so the whole process stays on those CPUs,
but for a thread whose work must overlap the event loop's (the scheduler's SQLite
writes, `unpin_thread`).

What it is for: the scheduler answers clients on one event loop, and every message
it handles passes between its threads (contract §15 sets its answer times). When
the replicas, the logs service or the sim cloud share its cores, each of those
hand-offs may wait for a core another process holds. Sharing a core with no other
service shortens its slowest answers most (docs/performance.md, "Cores"): on one
host, `services.stack --cpu-layout apart` gives it the first CPU and the other
services the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterable

from services.common.settings import Setting, SettingError

# Most CPUs a list may name: a bound on what a typo (`0-99999999`) costs.
MAX_CPU = 4095
# The CPUs this process had before `pin` kept it to some (None: never pinned).
_before_pin: frozenset[int] | None = None


def cpu_list(text: str) -> frozenset[int]:
    """Parses a CPU list as Linux writes them ("0", "1-3", "0,2,4-7"); "" is none
    (no pinning)."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise argparse.ArgumentTypeError(f"not a CPU list (like 0, 1-3 or 0,2): {text!r}")
        low, high = int(first), int(last or first)
        if low > high or high > MAX_CPU:
            raise argparse.ArgumentTypeError(
                f"not a CPU range (low-high, at most {MAX_CPU}): {part!r}"
            )
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def format_cpus(cpus: Iterable[int]) -> str:
    """A CPU list `cpu_list` reads back: ranges of consecutive CPUs ("0,2-3")."""
    parts: list[str] = []
    for cpu in sorted(cpus):
        if parts and cpu == int(parts[-1].rpartition("-")[2]) + 1:
            parts[-1] = f"{parts[-1].partition('-')[0]}-{cpu}"
        else:
            parts.append(str(cpu))
    return ",".join(parts)


def unpinned() -> frozenset[int]:
    """The CPUs this process was given before `pin`: what the user code a local
    backend starts runs on, so that a replica set apart from the scheduler does not
    keep its users' tasks off the scheduler's CPU."""
    return available() if _before_pin is None else _before_pin


def unpin_thread(thread_id: int) -> None:
    """Lets one thread (its native id) run on every CPU this process had before `pin`
    again: a thread whose work must overlap the event loop's rather than wait for the
    loop's CPU (`sqlite_thread`). Does nothing in a process never pinned."""
    if _before_pin is not None:
        os.sched_setaffinity(thread_id, _before_pin)


def available() -> frozenset[int]:
    """The CPUs this process may run on (a container's or taskset's share)."""
    if not hasattr(os, "sched_getaffinity"):
        return frozenset(range(os.cpu_count() or 1))
    return frozenset(os.sched_getaffinity(0))


def pin(cpus: frozenset[int]) -> None:
    """Moves every thread of this process onto `cpus` (none: leaves them where they
    are). Stops the service (`SettingError`) on CPUs it may not use: ones this host
    does not have, or that its cgroup's cpuset leaves out."""
    if not cpus:
        return
    if not hasattr(os, "sched_setaffinity"):
        raise SettingError(f"{CPUS.flag}: this platform cannot pin threads to CPUs")
    global _before_pin
    before = available()
    # None of them usable: the kernel refuses the whole list (EINVAL).
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, cpus)
    # The kernel keeps only the CPUs the process may use.
    if (kept := available()) != cpus:
        os.sched_setaffinity(0, before)
        raise SettingError(
            f"{CPUS.flag} names CPUs this process may not use: {format_cpus(cpus - kept)} "
            f"(this host has {format_cpus(range(os.cpu_count() or 1))})"
        )
    _before_pin = before if _before_pin is None else _before_pin
    for task in os.listdir("/proc/self/task"):
        # A thread may end between the listing and its turn.
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:
            continue


CPUS = Setting(
    "cpus",
    "MJ_CPUS",
    "",
    "CPUs every thread of this service runs on, e.g. 0 or 1-3 (default: any)",
    cpu_list,
)


def scheduler_apart(cpus: frozenset[int]) -> tuple[frozenset[int], frozenset[int]]:
    """One host's layout for contract §13's services: the scheduler's CPUs and every
    other service's. The scheduler gets the first of `cpus` to itself and the others
    share the rest; with fewer than two CPUs there is nothing to set apart (none,
    none: no pinning)."""
    if len(cpus) < 2:
        return frozenset(), frozenset()
    first = min(cpus)
    return frozenset({first}), cpus - {first}

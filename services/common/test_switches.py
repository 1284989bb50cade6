"""Test-only switches that turn one protection off. Never set them outside a test.

The history checker (`harness/history.py`) is shown to catch a broken system by
running the real one with one protection turned off (`tests/system/test_history_mutations.py`):
each switch below removes exactly one protection, at one place in the code, and
the checker must then report the violation that protection prevents.

`MJ_TEST_DISABLE` names the switches a process turns on, comma-separated. A
service reads it once, at start (`load`, from its `main`); until then, and when
the variable is unset or empty, every protection is on. A name that is not a
switch stops the service at start, so a misspelt switch cannot pass for a
protected run, and a service with any switch on logs a warning naming them.
There is deliberately no command-line flag: these are not settings an operator
chooses, and `--help` does not offer them.

- `epoch-check-at-report` (scheduler, `batch_rows.py`): a task report or a finished
  lifecycle is applied whatever its epoch and controller.
- `lease-guard` (controller, `fencing.py`): backend calls that change anything
  are made without a valid lease; the epoch each one carries still goes.
- `cancel-on-assignment` (controller, `replica.py`): the cancel flag an
  assignment carries, and a cancel that arrived before its assignment, are ignored.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

log = logging.getLogger(__name__)

ENV = "MJ_TEST_DISABLE"
EPOCH_CHECK_AT_REPORT = "epoch-check-at-report"
LEASE_GUARD = "lease-guard"
CANCEL_ON_ASSIGNMENT = "cancel-on-assignment"
SWITCHES = frozenset({EPOCH_CHECK_AT_REPORT, LEASE_GUARD, CANCEL_ON_ASSIGNMENT})

_disabled: frozenset[str] = frozenset()


def parse(value: str) -> frozenset[str]:
    """The switches a value of `MJ_TEST_DISABLE` names.

    Raises:
        ValueError: a name that is not a switch, named.
    """
    names = frozenset(name.strip() for name in value.split(",") if name.strip())
    unknown = names - SWITCHES
    if unknown:
        raise ValueError(
            f"{ENV}: {', '.join(sorted(unknown))} is not a test switch "
            f"(the switches: {', '.join(sorted(SWITCHES))})"
        )
    return names


def load(service: str, environ: Mapping[str, str] = os.environ) -> frozenset[str]:
    """Reads `MJ_TEST_DISABLE` for this process, once, at its start; returns the switches on.

    Raises:
        SystemExit: a name that is not a switch.
    """
    global _disabled
    try:
        _disabled = parse(environ.get(ENV, ""))
    except ValueError as error:
        raise SystemExit(f"{service}: {error}") from None
    if _disabled:
        log.warning(
            "TEST ONLY: protections are turned off", extra={"test_switches": sorted(_disabled)}
        )
    return _disabled


def disabled(name: str) -> bool:
    """Whether this process runs with the protection `name` turned off (a test's switch)."""
    if name not in SWITCHES:
        raise ValueError(f"{name!r} is not a test switch")
    return name in _disabled

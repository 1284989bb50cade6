"""Tests that need what a machine may lack: root, a tool, a server to stop.

Under CI=true every test runs: a missing prerequisite fails the test, naming
what is missing. Elsewhere the test skips with that reason, so a developer
without root or openssh-server still runs the rest.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def missing(reason: str) -> NoReturn:
    """Fails the calling test under CI, skips it elsewhere, with `reason`."""
    if IN_CI:
        pytest.fail(f"{reason}; under CI=true no test skips")
    pytest.skip(reason)


def require_root(why: str) -> None:
    """`missing` unless this process runs as root; `why` says what root is needed for."""
    if os.geteuid() != 0:
        missing(f"{why} needs root")

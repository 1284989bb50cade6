"""Helpers the end-to-end tests share: running `mj` against a stack, checking service logs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from services.launcher.stack import Stack

ROOT = Path(__file__).resolve().parent.parent


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the services' variables (a developer's shell may set
    them), plus `extra`."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("MJ_")}, **extra}


def python(
    *args: str, env: dict[str, str] | None = None, timeout: float = 100
) -> subprocess.CompletedProcess[str]:
    """`python ARGS` from the repository's root (`-m services...` as `make up` runs
    them), with `env` or `clean_env()`; its output captured as text."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=clean_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def mj(stack: Stack, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Runs the real `mj` client against the stack, as user e2e.

    `mj` finds the stack's admin token in its data dir by itself (and the CA and
    client certificate come from `client_env` when the stack runs TLS).
    """
    env = {**os.environ, **stack.client_env(), "MJ_USER": "e2e"}
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def assert_no_tracebacks(data_dir: Path) -> None:
    """No service logged an unexpected exception while the test ran."""
    for path in sorted((data_dir / "service-logs").glob("*.log")):
        text = path.read_text(errors="replace")
        assert "Traceback" not in text, f"{path.name}:\n{text[-3000:]}"

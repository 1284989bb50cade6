"""Settings: every knob of a service is a flag and an environment variable.

A service declares its settings as a tuple of `Setting`; `parse` builds the
argparse parser from it, with each environment variable supplying the default
that a flag overrides. The same declarations let tests check that
docker-compose.yml only uses variables a service accepts.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Setting:
    """One knob: `--flag-name` on the command line, `env` in the environment."""

    name: str
    env: str
    default: Any
    help: str
    type: Callable[[str], Any] = str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def boolean(text: str) -> bool:
    """Parses the usual spellings of a boolean."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def parse(
    prog: str,
    description: str,
    settings: Sequence[Setting],
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> argparse.Namespace:
    """Parses flags over environment variables over defaults."""
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(prog=prog, description=description)
    for setting in settings:
        default = setting.default
        if setting.env in environ:
            try:
                default = setting.type(environ[setting.env])
            except (ValueError, argparse.ArgumentTypeError) as exc:
                parser.error(f"{setting.env}={environ[setting.env]!r}: {exc}")
        parser.add_argument(
            setting.flag,
            dest=setting.name,
            type=setting.type,
            default=default,
            help=f"{setting.help} (env {setting.env}; default {setting.default!r})",
        )
    return parser.parse_args(argv)


# Settings shared by more than one service.
DATA_DIR = Setting("data_dir", "MJ_DATA_DIR", ".mj", "folder for databases, logs and clusters")
LOG_LEVEL = Setting("log_level", "MJ_LOG_LEVEL", "INFO", "log level")
HOST = Setting("host", "MJ_HOST", "127.0.0.1", "address to listen on")
SCHEDULER_ADDRESS = Setting(
    "scheduler_address", "MJ_SCHEDULER_ADDRESS", "127.0.0.1:50051", "scheduler host:port"
)
LOGS_ADDRESS = Setting("logs_address", "MJ_LOGS_ADDRESS", "127.0.0.1:50052", "logs host:port")
BACKEND = Setting("backend", "MJ_BACKEND", "local", "compute backend: local, sim or ssh")
SHUTDOWN_GRACE = Setting(
    "shutdown_grace",
    "MJ_SHUTDOWN_GRACE",
    5.0,
    "seconds in-flight RPCs get to finish on SIGTERM",
    float,
)

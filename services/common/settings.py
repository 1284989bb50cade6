"""Settings: every knob of a service is a flag and an environment variable.

A service declares its settings as a tuple of `Setting`; `parse` builds the
argparse parser from it, with each environment variable supplying the default
that a flag overrides. The same declarations let tests check that
docker-compose.yml only uses variables a service accepts.

Bad settings fail fast (contract §19): a value its type refuses (an unknown backend, an
unreadable node pools file, a number that is not one), from a flag or from its
variable, stops the service before it does anything, with one line naming the
setting and the problem (`prog: error: argument --flag: ...`), exit code 2, no usage text and no
traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from services.common.bounds import quote


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


def count(text: str) -> int:
    """Parses a whole number (0 or more)."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}")
    return int(text)


def one_of(*values: str) -> Callable[[str], str]:
    """A parser of one of `values` (any case), lower-cased."""

    def parse(text: str) -> str:
        lowered = text.strip().lower()
        if lowered not in values:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(values)}, got {text!r}")
        return lowered

    parse.__name__ = "one_of"
    return parse


# The service whose settings were parsed last (`parse`): its error lines name it.
_program = ""


class SettingError(SystemExit):
    """A setting the service cannot run with, found once running (a port another process
    holds): raised anywhere, it ends the process with one line, `prog: error: message`,
    and exit code 1, without a traceback."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{_program or 'error'}: error: {message}")
        self.message = message


class OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line, `prog: error: message`, without the
    usage text (`--help` shows it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(
    prog: str,
    description: str,
    settings: Sequence[Setting],
    environ: Mapping[str, str] | None = None,
) -> argparse.ArgumentParser:
    """The argparse parser of `settings`: each environment variable supplies the default."""
    environ = os.environ if environ is None else environ
    parser = OneLineParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for setting in settings:
        default = setting.default
        if setting.env in environ:
            try:
                default = setting.type(environ[setting.env])
            except (ValueError, argparse.ArgumentTypeError) as exc:
                parser.error(f"{setting.env}={quote(environ[setting.env])}: {exc}")
        # A boolean flag alone means true: `--insecure` as well as `--insecure false`.
        flag_only: dict[str, Any] = {"nargs": "?", "const": True} if setting.type is boolean else {}
        parser.add_argument(
            setting.flag,
            dest=setting.name,
            type=setting.type,
            default=default,
            help=f"{setting.help} (env {setting.env}; default {setting.default!r})",
            **flag_only,
        )
    return parser


def parse(
    prog: str,
    description: str,
    settings: Sequence[Setting],
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> argparse.Namespace:
    """Parses flags over environment variables over defaults."""
    global _program
    _program = prog
    return build_parser(prog, description, settings, environ).parse_args(argv)


# Settings shared by more than one service.
DATA_DIR = Setting("data_dir", "MJ_DATA_DIR", ".mj", "folder for databases, logs and clusters")
LOG_LEVEL = Setting("log_level", "MJ_LOG_LEVEL", "INFO", "log level")
HOST = Setting("host", "MJ_HOST", "127.0.0.1", "address to listen on")
SCHEDULER_ADDRESS = Setting(
    "scheduler_address", "MJ_SCHEDULER_ADDRESS", "127.0.0.1:50051", "scheduler host:port"
)
LOGS_ADDRESS = Setting("logs_address", "MJ_LOGS_ADDRESS", "127.0.0.1:50052", "logs host:port")


SHUTDOWN_GRACE = Setting(
    "shutdown_grace",
    "MJ_SHUTDOWN_GRACE",
    5.0,
    "seconds in-flight RPCs get to finish on SIGTERM",
    float,
)


def _auth_mode(text: str) -> str:
    mode = text.strip().lower()
    if mode not in ("tokens", "none"):
        raise argparse.ArgumentTypeError(f"not an auth mode (tokens or none): {text!r}")
    return mode


# Security of a server (contract §14): see services/common/security/edge.py and tls.py.
AUTH = Setting(
    "auth",
    "MJ_AUTH",
    "tokens",
    "tokens: every RPC but health and reflection needs a bearer token listed in the tokens "
    "file; none: no checks, every caller is an admin (for tests only)",
    _auth_mode,
)
TOKENS_FILE = Setting(
    "tokens_file",
    "MJ_TOKENS_FILE",
    "",
    "the tokens file: SHA-256, user, role per token (default: tokens.yaml in the data dir)",
)
TLS_CERT = Setting("tls_cert", "MJ_TLS_CERT", "", "PEM certificate chain to serve TLS with")
TLS_KEY = Setting("tls_key", "MJ_TLS_KEY", "", "PEM private key of --tls-cert")
TLS_CLIENT_CA = Setting(
    "tls_client_ca",
    "MJ_TLS_CLIENT_CA",
    "",
    "PEM CA that client certificates must be signed by: mTLS, a certificate required",
)
INSECURE = Setting(
    "insecure",
    "MJ_INSECURE",
    False,
    "allow serving plaintext on a non-loopback address",
    boolean,
)
SERVER_SECURITY = (AUTH, TOKENS_FILE, TLS_CERT, TLS_KEY, TLS_CLIENT_CA, INSECURE)

# Security of a client: the token it sends and how it checks the server.
TOKEN = Setting(
    "token", "MJ_TOKEN", "", "bearer token sent to other services (prefer --token-file)"
)
TOKEN_FILE = Setting(
    "token_file",
    "MJ_TOKEN_FILE",
    "",
    "file holding the bearer token sent to other services (re-read when it changes)",
)
TLS_CA = Setting("tls_ca", "MJ_TLS_CA", "", "PEM CA to verify servers with; set, clients speak TLS")
TLS_CLIENT_CERT = Setting(
    "tls_client_cert", "MJ_TLS_CLIENT_CERT", "", "PEM client certificate presented for mTLS"
)
TLS_CLIENT_KEY = Setting(
    "tls_client_key", "MJ_TLS_CLIENT_KEY", "", "PEM private key of --tls-client-cert"
)
CLIENT_SECURITY = (TOKEN, TOKEN_FILE, TLS_CA, TLS_CLIENT_CERT, TLS_CLIENT_KEY)

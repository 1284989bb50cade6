"""`mj`: submit, list, inspect, cancel and follow managed jobs (contract §12).

Connection flags (`--scheduler`, `--logs`, `--user`, `--token`, `--timeout`,
`--tls-ca`...) each have an environment variable (`MJ_SCHEDULER_ADDRESS`,
`MJ_LOGS_ADDRESS`, `MJ_USER`, `MJ_TOKEN`, `MJ_TIMEOUT`, `MJ_TLS_CA`...) and go
before or after the subcommand.

The bearer token is `--token` (`MJ_TOKEN`), else the file `--token-file`
(`MJ_TOKEN_FILE`), else the admin token `make up` keeps in the data dir
(`MJ_DATA_DIR/secrets/admin.token`), so on the machine that runs the stack `mj`
needs no setup. With `--tls-ca` it speaks TLS, presenting `--tls-client-cert` and
`--tls-client-key` when the services require client certificates.

Exit codes, which scripts can trust:

    0    success; for `mj launch`, the job SUCCEEDED
    1    the job did not succeed, or a service answered with an error
    N    `mj launch`: the job FAILED and its failing task's last attempt exited
         with N (a death by signal S gives 128+S; clamped to 1..255); with
         several files, the first job in file order that did not succeed decides
    2    usage: a bad command line, or a job file that cannot be read
    3    a service could not be reached (the message names its address)
    130  interrupted by Ctrl-C (`mj launch` leaves the job running)
    141  the reader of the output went away (`mj logs 3 | head`)

Every failure is one line on stderr, `mj: <command>: <reason>`, e.g.
`mj: launch: INVALID_ARGUMENT: resources.gpus: unknown field`; a user error
never shows a Python traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import getpass
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NoReturn

import grpc

from managedjobs.v1 import job_pb2
from services.cli import commands
from services.cli.client import Client, ServiceError
from services.cli.exit_codes import ExitCode, UsageError
from services.common.channels import ClientSecurity, TokenSource
from services.common.security.auth import Secrets
from services.common.security.tls import ClientTls, TlsConfigError
from services.common.settings import (
    DATA_DIR,
    LOGS_ADDRESS,
    SCHEDULER_ADDRESS,
    TLS_CA,
    TLS_CLIENT_CERT,
    TLS_CLIENT_KEY,
    TOKEN_FILE,
    Setting,
    count,
)

Command = Callable[[Client, argparse.Namespace], int]


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"not a positive number of seconds: {text!r}")
    return value


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) == 0:
        raise argparse.ArgumentTypeError(f"not a positive whole number: {text!r}")
    return int(text)


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _secret_pair(text: str) -> tuple[str, str]:
    """KEY=VALUE, or KEY alone: the value of KEY in mj's own environment (so it never
    shows in a shell's history or the process list)."""
    key, sep, value = text.partition("=")
    if not key:
        raise argparse.ArgumentTypeError(f"expected KEY or KEY=VALUE, got {text!r}")
    if not sep:
        if key not in os.environ:
            raise argparse.ArgumentTypeError(f"{key} is not set in the environment")
        value = os.environ[key]
    return key, value


def _status(text: str) -> job_pb2.JobStatus.ValueType:
    names = [name.removeprefix("JOB_STATUS_") for name in job_pb2.JobStatus.keys()[1:]]
    name = text.strip().upper().removeprefix("JOB_STATUS_")
    if name not in names:
        raise argparse.ArgumentTypeError(f"unknown status {text!r} (one of {', '.join(names)})")
    return job_pb2.JobStatus.Value("JOB_STATUS_" + name)


def _os_user() -> str:
    try:
        return getpass.getuser()
    except (OSError, KeyError):
        return f"uid-{os.getuid()}"


SCHEDULER = dataclasses.replace(SCHEDULER_ADDRESS, name="scheduler")
LOGS = dataclasses.replace(LOGS_ADDRESS, name="logs")
USER = Setting("user", "MJ_USER", _os_user(), "who submits; whose jobs are shown and cancelled")
TOKEN = Setting("token", "MJ_TOKEN", "", "bearer token (else --token-file, else the data dir's)")
TIMEOUT = Setting("timeout", "MJ_TIMEOUT", 10.0, "seconds to wait for a unary call", _seconds)
TOKEN_FILE_ = dataclasses.replace(TOKEN_FILE, help="file holding the bearer token")
DATA_DIR_ = dataclasses.replace(
    DATA_DIR, help="where `make up` keeps the admin token used when no token is given"
)
SETTINGS = (
    SCHEDULER,
    LOGS,
    USER,
    TOKEN,
    TOKEN_FILE_,
    DATA_DIR_,
    TLS_CA,
    TLS_CLIENT_CERT,
    TLS_CLIENT_KEY,
    TIMEOUT,
)


def _add_settings(
    parser: argparse.ArgumentParser,
    settings: Sequence[Setting],
    environ: Mapping[str, str] | None,
) -> None:
    """Adds the connection flags.

    On the top-level parser (`environ` given) they carry the environment-over-default
    values. On a subcommand they have no default and no help, so that a flag given
    after the subcommand overrides the top-level value and its absence keeps it.
    """
    for setting in settings:
        default = argparse.SUPPRESS
        if environ is not None:
            default = setting.default
            if setting.env in environ:
                try:
                    default = setting.type(environ[setting.env])
                except (ValueError, argparse.ArgumentTypeError) as error:
                    raise UsageError(f"{setting.env}={environ[setting.env]!r}: {error}") from None
        shown = "" if setting is TOKEN else f"; default {setting.default!r}"
        parser.add_argument(
            setting.flag,
            dest=setting.name,
            type=setting.type,
            default=default,
            metavar=setting.name.upper(),
            help=argparse.SUPPRESS
            if environ is None
            else f"{setting.help} (env {setting.env}{shown})",
        )


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    """The `mj` command line; `environ` supplies the connection defaults."""
    parser = argparse.ArgumentParser(
        prog="mj",
        description="Run batch jobs on compute that can vanish.",
        epilog="Exit codes: 0 ok, 1 job failed or RPC error, 2 usage, 3 service unreachable, "
        "130 interrupted; `mj launch` of a job that FAILED with an exit code exits with that "
        "code (1..255).",
    )
    _add_settings(parser, SETTINGS, environ)
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(
        name: str, run: Command, summary: str, group: argparse._SubParsersAction | None = None
    ) -> argparse.ArgumentParser:
        sub = (group or subcommands).add_parser(
            name, help=summary, description=summary, epilog="Connection flags: see `mj --help`."
        )
        label = name if group is None else f"ops {name}"
        sub.set_defaults(run=run, label=label, parser=sub)
        # `mj queue --user U` filters by owner; the caller stays MJ_USER / the top-level flag.
        _add_settings(sub, [s for s in SETTINGS if not (name == "queue" and s is USER)], None)
        return sub

    launch = command("launch", commands.launch, "submit jobs and follow their logs")
    launch.epilog = (
        "Several files are submitted together (all or none), one job each, and followed in "
        "turn. A relative workdir is taken relative to its file's folder. Exit code: 0 when "
        "every job SUCCEEDED; else the first unsuccessful job's: its exit code when it FAILED "
        "with one (its failing task's last attempt; a death by signal S gives 128+S; clamped "
        "to 1..255), else 1. Connection flags: see `mj --help`."
    )
    launch.add_argument(
        "files", nargs="+", metavar="FILE.yaml", help="SkyPilot task YAML; documents chain"
    )
    launch.add_argument("--name", help="job name, overriding the spec's (every job's)")
    launch.add_argument("--priority", type=int, default=0, help="higher runs first")
    launch.add_argument(
        "--env",
        type=_env_pair,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment variable for every task (repeatable)",
    )
    launch.add_argument(
        "--secret",
        type=_secret_pair,
        action="append",
        default=[],
        metavar="KEY[=VALUE]",
        help="secret for every task, never shown or logged; KEY alone takes the value of "
        "KEY in this environment (repeatable)",
    )
    launch.add_argument("--detach", action="store_true", help="print the job id and return")
    launch.add_argument(
        "--idempotency-key",
        help="a repeat with this key returns the first job (with several files: KEY-0, KEY-1...)",
    )

    queue = command("queue", commands.queue, "list jobs")
    owners = queue.add_mutually_exclusive_group()
    owners.add_argument("--all", action="store_true", help="every user's jobs")
    owners.add_argument("--user", dest="filter_user", metavar="USER", help="this user's jobs")
    queue.add_argument(
        "--status",
        type=_status,
        nargs="+",
        action="extend",
        default=[],
        metavar="STATUS",
        help="only jobs in these statuses",
    )
    queue.add_argument("--limit", type=_positive_int, help="at most this many jobs")

    status = command("status", commands.status, "show a job and its tasks")
    status.add_argument("job_id", type=_positive_int, metavar="ID")

    cancel = command("cancel", commands.cancel, "cancel jobs by id, by name, or all of yours")
    cancel.add_argument("job_ids", type=_positive_int, nargs="*", metavar="ID")
    cancel.add_argument("--name", help="every job of yours with this name")
    cancel.add_argument("--all", action="store_true", help="every job of yours")
    cancel.add_argument("--yes", "-y", action="store_true", help="do not ask before --all")

    logs = command("logs", commands.logs, "stream a task's logs")
    logs.add_argument("job_id", type=_positive_int, metavar="ID")
    logs.add_argument("--task", type=count, metavar="N", help="task index (default: current)")
    logs.add_argument(
        "--attempt",
        type=_positive_int,
        metavar="N",
        help="only this attempt of the task (1, then one more per recovery or restart)",
    )
    logs.add_argument(
        "--follow",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep streaming until the job ends (default)",
    )
    logs.add_argument("--controller", action="store_true", help="the controller's lifecycle log")
    logs.add_argument("--tail", type=count, default=0, metavar="N", help="only the last N lines")

    watch = command("watch", commands.watch, "print job events as they happen")
    watch.add_argument("job_ids", type=_positive_int, nargs="*", metavar="ID", help="default: all")
    watch.add_argument("--after", type=count, default=0, metavar="EVENT_ID")

    ops = subcommands.add_parser("ops", help="operator views", description="operator views")
    command(
        "state",
        commands.ops_state,
        "the scheduler's limits, counters and replicas",
        ops.add_subparsers(dest="ops_command", metavar="COMMAND", required=True),
    )
    return parser


def client_security(args: argparse.Namespace) -> ClientSecurity:
    """The token (flag, file, or the data dir's admin token) and TLS `mj` calls with.

    Raises:
        UsageError: a token or TLS file that cannot be read, or incomplete TLS flags.
    """
    try:
        tls = ClientTls.from_files(args.tls_ca, args.tls_client_cert, args.tls_client_key)
        if args.token:
            return ClientSecurity(TokenSource(args.token), tls)
        if args.token_file:
            return ClientSecurity(TokenSource(path=Path(args.token_file)), tls)
        local = Secrets.in_data_dir(Path(args.data_dir)).admin()
        return ClientSecurity(TokenSource(path=local) if local.exists() else None, tls)
    except TlsConfigError as error:
        raise UsageError(str(error)) from None
    except OSError as error:
        raise UsageError(f"cannot read the token: {error.strerror or error}") from None


def _check(args: argparse.Namespace) -> None:
    if args.command == "cancel":
        given = bool(args.job_ids) + bool(args.name) + bool(args.all)
        if given != 1:
            args.parser.error("give exactly one of: job ids, --name N, --all")


NO_TOKEN_HINT = (
    "no token given: use --token or MJ_TOKEN, --token-file, or MJ_DATA_DIR set to the data dir "
    "of `make up`"
)
# How gRPC words a transport failure; the words after its last colon say why.
_CONNECT_FAILED = "failed to connect to all addresses"


def _describe(error: ServiceError) -> str:
    details = " ".join(error.details.split())
    if error.code == grpc.StatusCode.UNAVAILABLE:
        where = f"cannot reach the {error.service} at {error.address}"
        if details.startswith(_CONNECT_FAILED):
            details = details.rsplit(": ", 1)[-1]  # e.g. "Connection refused"
        return f"UNAVAILABLE: {where} ({details})" if details else f"UNAVAILABLE: {where}"
    if error.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"DEADLINE_EXCEEDED: no answer from the {error.service} at {error.address}"
    return f"{error.code.name}: {details}" if details else error.code.name


def run(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Runs `mj` and returns its exit code instead of exiting."""
    label = "error"
    security = ClientSecurity()
    try:
        try:
            args = build_parser(os.environ if environ is None else environ).parse_args(argv)
            _check(args)
        except SystemExit as exit_:
            return exit_.code if isinstance(exit_.code, int) else ExitCode.USAGE
        label = args.label
        security = client_security(args)
        with Client(args.scheduler, args.logs, security, args.timeout) as client:
            return int(args.run(client, args))
    except UsageError as error:
        print(f"mj: {label}: {error}", file=sys.stderr)
        return ExitCode.USAGE
    except ServiceError as error:
        hint = ""
        if error.code == grpc.StatusCode.UNAUTHENTICATED and security.token is None:
            hint = f" ({NO_TOKEN_HINT})"
        print(f"mj: {label}: {_describe(error)}{hint}", file=sys.stderr)
        unreachable = error.code == grpc.StatusCode.UNAVAILABLE
        return ExitCode.UNREACHABLE if unreachable else ExitCode.FAILED
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return ExitCode.INTERRUPTED
    except BrokenPipeError:
        # Point stdout at /dev/null so the interpreter's final flush does not complain.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitCode.BROKEN_PIPE


def main(argv: list[str] | None = None) -> NoReturn:
    """The `mj` console script: runs the command line and exits with its code."""
    sys.exit(run(argv))


if __name__ == "__main__":
    main()

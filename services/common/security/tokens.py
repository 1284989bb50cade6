"""`mj-tokens`: manage the tokens file that every service authenticates callers with.

    mj-tokens add --user alice --role user          # prints the new token, once
    mj-tokens add --user ci --role admin
    mj-tokens add --user controller-4 --role controller --controller-id controller-4
    mj-tokens list                                  # user, role, controller id, hash prefix
    mj-tokens remove --user alice                   # every token of alice (or --role too)
    mj-tokens bootstrap --controllers controller-1,controller-2 --services logs

`bootstrap` makes sure the tokens the services use among themselves exist: an
admin token for `--admin` (default: the local user), one controller token per
controller id (bound to it) and one service token per service name, each kept in
plain text, mode 0600, under `--secrets-dir` (admin.token, controllers/ID.token,
services/NAME.token) for the services to read with `--token-file`. It keeps what
is already there, so it can run on every start (`make up` and docker-compose do).

The tokens file is `--tokens-file`, by default tokens.yaml in the data dir; it is
replaced atomically, and running services pick the change up at once.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from services.common import settings
from services.common.security.auth import (
    Role,
    Secrets,
    TokensFileError,
    add_token,
    ensure_token,
    local_user,
    read_tokens,
    write_tokens,
)
from services.common.security.edge import TOKENS_FILE_NAME
from services.common.settings import Setting

SETTINGS = (
    settings.DATA_DIR,
    settings.TOKENS_FILE,
    Setting("user", "MJ_TOKENS_USER", "", "add, remove: the token's user"),
    Setting(
        "role",
        "MJ_TOKENS_ROLE",
        "",
        "add: user (the default), admin, controller or service; remove: only this role's",
    ),
    Setting(
        "controller_id", "MJ_TOKENS_CONTROLLER_ID", "", "add: the controller a token is bound to"
    ),
    Setting(
        "secrets_dir",
        "MJ_SECRETS_DIR",
        "",
        "bootstrap: folder for the services' plaintext tokens (default: secrets/ in the data dir)",
    ),
    Setting("admin", "MJ_TOKENS_ADMIN", "", "bootstrap: the admin's user (default: local user)"),
    Setting(
        "controllers", "MJ_TOKENS_CONTROLLERS", "", "bootstrap: comma-separated controller ids"
    ),
    Setting("services", "MJ_TOKENS_SERVICES", "logs", "bootstrap: comma-separated service names"),
)
ACTIONS = ("add", "list", "remove", "bootstrap")


def tokens_path(data_dir: Path, tokens_file: str = "") -> Path:
    """The tokens file: `tokens_file`, else tokens.yaml in the data dir."""
    return Path(tokens_file) if tokens_file else data_dir / TOKENS_FILE_NAME


def bootstrap(
    tokens_file: Path,
    secrets: Secrets,
    *,
    admin: str,
    controllers: Sequence[str] = (),
    services: Sequence[str] = (),
) -> None:
    """Ensures the admin, controller and service tokens exist, kept under `secrets`."""
    secrets.root.mkdir(mode=0o700, parents=True, exist_ok=True)
    ensure_token(tokens_file, secrets.admin(), admin, Role.ADMIN)
    for controller_id in controllers:
        ensure_token(
            tokens_file, secrets.controller(controller_id), controller_id, Role.CONTROLLER,
            controller_id,
        )  # fmt: skip
    for name in services:
        ensure_token(tokens_file, secrets.service(name), name, Role.SERVICE)


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def run(argv: Sequence[str] | None = None) -> int:
    """Runs `mj-tokens`; returns its exit code."""
    parser = settings.build_parser("mj-tokens", __doc__ or "", SETTINGS)
    parser.add_argument("action", choices=ACTIONS)
    args = parser.parse_args(argv)
    path = tokens_path(Path(args.data_dir), args.tokens_file)
    try:
        if args.action == "add":
            if not args.user:
                parser.error("add needs --user")
            try:
                role = Role(args.role or Role.USER.value)
            except ValueError:
                parser.error(f"--role: one of {', '.join(r.value for r in Role)}")
            token = add_token(path, args.user, role, args.controller_id)
            print(token)
            print(f"added a {role.value} token for {args.user} to {path}", file=sys.stderr)
        elif args.action == "list":
            for entry in read_tokens(path):
                bound = f" controller_id={entry.controller_id}" if entry.controller_id else ""
                print(f"{entry.user}\t{entry.role.value}\tsha256:{entry.sha256[:12]}{bound}")
        elif args.action == "remove":
            if not args.user:
                parser.error("remove needs --user")
            entries = read_tokens(path)
            kept = [
                e
                for e in entries
                if not (e.user == args.user and (not args.role or e.role == args.role))
            ]
            write_tokens(path, kept)
            print(f"removed {len(entries) - len(kept)} token(s) of {args.user}", file=sys.stderr)
        else:
            secrets = (
                Secrets(Path(args.secrets_dir))
                if args.secrets_dir
                else Secrets.in_data_dir(Path(args.data_dir))
            )
            bootstrap(
                path,
                secrets,
                admin=args.admin or local_user(),
                controllers=_names(args.controllers),
                services=_names(args.services),
            )
            print(f"tokens in {path}; the services' tokens in {secrets.root}", file=sys.stderr)
    except (TokensFileError, ValueError) as exc:
        print(f"mj-tokens: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    """The `mj-tokens` console script."""
    sys.exit(run(argv))


if __name__ == "__main__":
    main()

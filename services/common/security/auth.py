"""Who a caller is: bearer tokens, the tokens file, roles and the `Principal`.

The tokens file (YAML) lists, for each token, its SHA-256 (never the token), its
user, its role and, for a controller token, the controller id it is bound to:

    tokens:
      - sha256: 5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8
        user: alice
        role: user
      - sha256: ...
        user: controller-1
        role: controller
        controller_id: controller-1

A `TokensFile` answers `lookup(token)` from memory and re-reads the file when its
stat changes (mtime, size or inode, checked on every lookup: one stat call) and on
SIGHUP (`reload_all`, for an edit that kept the stat), so tokens rotate without a
restart. A file that cannot be read or parsed at start is an error; later, the last
good entries stay in force and the error is logged. Writers (`add_token`,
`ensure_token`) replace the file atomically, mode 0600.
"""

from __future__ import annotations

import dataclasses
import enum
import getpass
import hashlib
import logging
import os
import re
import secrets
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger(__name__)

TOKEN_PREFIX = "mj_"
_HEX64 = re.compile(r"[0-9a-f]{64}")
# contract §19: users and controller ids are at most 64 characters of [a-z0-9._-].
_NAME = re.compile(r"[a-z0-9._-]{1,64}")


class Role(enum.StrEnum):
    """What a caller may do; the policy table (access.py) maps methods to roles."""

    USER = "user"
    ADMIN = "admin"
    CONTROLLER = "controller"
    SERVICE = "service"


@dataclasses.dataclass(frozen=True)
class Principal:
    """The authenticated caller of one RPC.

    Attributes:
        user: The token's user (empty with `--auth none`).
        role: The token's role.
        controller_id: For a controller token, the replica it is bound to.
        cert_names: Names in the peer's verified client certificate (common name and
            subject alternative names); empty without mTLS.
    """

    user: str
    role: Role
    controller_id: str = ""
    cert_names: frozenset[str] = frozenset()

    @property
    def sees_every_job(self) -> bool:
        """Admins and services act on every user's jobs; users only on their own."""
        return self.role in (Role.ADMIN, Role.SERVICE)


class TokensFileError(Exception):
    """The tokens file cannot be read or is malformed (the message names the entry)."""


@dataclasses.dataclass(frozen=True)
class TokenEntry:
    """One line of the tokens file."""

    sha256: str
    user: str
    role: Role
    controller_id: str = ""

    def to_yaml(self) -> dict[str, str]:
        out = {"sha256": self.sha256, "user": self.user, "role": self.role.value}
        if self.controller_id:
            out["controller_id"] = self.controller_id
        return out


def hash_token(token: str) -> str:
    """The hex SHA-256 of a token, as the tokens file keeps it."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def new_token() -> str:
    """A fresh random token (256 bits)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def local_user() -> str:
    """This OS user's name as a token user ([a-z0-9._-], at most 64 characters)."""
    try:
        name = getpass.getuser()
    except (OSError, KeyError):
        name = f"uid-{os.getuid()}"
    cleaned = re.sub(r"[^a-z0-9._-]", "-", name.lower())[:64]
    return cleaned or "admin"


@dataclasses.dataclass(frozen=True)
class Secrets:
    """Where the plaintext tokens the services use among themselves are kept (mode 0600).

    `make up` keeps them under the data dir (`DATA_DIR/secrets`); `mj` reads
    `admin.token` from there when it is given no token.
    """

    root: Path

    @classmethod
    def in_data_dir(cls, data_dir: Path) -> Secrets:
        return cls(data_dir / "secrets")

    def admin(self) -> Path:
        return self.root / "admin.token"

    def controller(self, controller_id: str) -> Path:
        return self.root / "controllers" / f"{controller_id}.token"

    def service(self, name: str) -> Path:
        return self.root / "services" / f"{name}.token"


def _entry(index: int, raw: Any) -> TokenEntry:
    where = f"tokens[{index}]"
    if not isinstance(raw, Mapping):
        raise TokensFileError(f"{where}: expected a mapping")
    unknown = set(raw) - {"sha256", "user", "role", "controller_id"}
    if unknown:
        raise TokensFileError(f"{where}: unknown field {sorted(unknown)[0]!r}")
    digest, user = raw.get("sha256"), raw.get("user")
    role, controller_id = raw.get("role"), raw.get("controller_id", "")
    if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
        raise TokensFileError(f"{where}.sha256: 64 lower-case hex digits expected")
    if not isinstance(user, str) or not _NAME.fullmatch(user):
        raise TokensFileError(f"{where}.user: 1-64 characters of [a-z0-9._-] expected")
    try:
        parsed_role = Role(role if isinstance(role, str) else "")
    except ValueError:
        roles = ", ".join(r.value for r in Role)
        raise TokensFileError(f"{where}.role: one of {roles} expected") from None
    if not isinstance(controller_id, str):
        raise TokensFileError(f"{where}.controller_id: a string expected")
    if parsed_role is Role.CONTROLLER and not _NAME.fullmatch(controller_id):
        raise TokensFileError(f"{where}.controller_id: required for a controller token")
    if parsed_role is not Role.CONTROLLER and controller_id:
        raise TokensFileError(f"{where}.controller_id: only controller tokens are bound")
    return TokenEntry(digest, user, parsed_role, controller_id)


def parse_tokens(text: str) -> list[TokenEntry]:
    """The entries of a tokens file's text.

    Raises:
        TokensFileError: malformed YAML, an unknown field, a bad value, a repeated hash.
    """
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise TokensFileError(f"not YAML: {exc}") from None
    if document is None:
        return []
    if not isinstance(document, Mapping) or set(document) - {"tokens"}:
        raise TokensFileError("expected a mapping with one key, tokens")
    raw = document.get("tokens") or []
    if not isinstance(raw, list):
        raise TokensFileError("tokens: expected a list")
    entries = [_entry(i, item) for i, item in enumerate(raw)]
    seen: set[str] = set()
    for index, entry in enumerate(entries):
        if entry.sha256 in seen:
            raise TokensFileError(f"tokens[{index}].sha256: repeated")
        seen.add(entry.sha256)
    return entries


def read_tokens(path: Path) -> list[TokenEntry]:
    """The entries of the tokens file at `path` (none if it does not exist)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as exc:
        raise TokensFileError(f"{path}: {exc}") from None
    try:
        return parse_tokens(text)
    except TokensFileError as exc:
        raise TokensFileError(f"{path}: {exc}") from None


_HEADER = (
    "# managed-jobs tokens: the SHA-256 of each bearer token (never the token itself),\n"
    "# its user, role (user, admin, controller, service) and, for a controller, its id.\n"
    "# Services re-read this file when it changes and on SIGHUP. Manage it with mj-tokens.\n"
)


def write_private(path: Path, text: str) -> None:
    """Writes `text` atomically into a file created with mode 0600 (its folder: 0700 if new)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)
    os.replace(tmp, path)


def write_tokens(path: Path, entries: Iterable[TokenEntry]) -> None:
    """Replaces the tokens file with `entries`."""
    body = yaml.safe_dump({"tokens": [e.to_yaml() for e in entries]}, sort_keys=False)
    write_private(path, _HEADER + body)


def add_token(path: Path, user: str, role: Role, controller_id: str = "") -> str:
    """Adds a new token to the file; returns the token, which is stored nowhere else.

    Raises:
        TokensFileError: the file is malformed or the new entry would be.
    """
    token = new_token()
    entries = read_tokens(path)
    entry = _entry(len(entries), TokenEntry(hash_token(token), user, role, controller_id).to_yaml())
    write_tokens(path, [*entries, entry])
    return token


def ensure_token(path: Path, secret: Path, user: str, role: Role, controller_id: str = "") -> str:
    """The token kept in `secret` for this identity, made and registered if need be.

    `make up` calls this for every identity the services use among themselves, so a
    second start reuses the tokens of the first; a token whose entry is gone from
    the tokens file (or whose secret file is gone) is replaced, and the entries of
    the replaced token are dropped.
    """
    entries = read_tokens(path)
    wanted = TokenEntry("", user, role, controller_id)
    try:
        token = secret.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        token = ""
    if token and any(e == dataclasses.replace(wanted, sha256=hash_token(token)) for e in entries):
        return token
    token = new_token()
    kept = [e for e in entries if (e.user, e.role, e.controller_id) != (user, role, controller_id)]
    write_tokens(path, [*kept, dataclasses.replace(wanted, sha256=hash_token(token))])
    write_private(secret, token + "\n")
    return token


_live: weakref.WeakSet[TokensFile] = weakref.WeakSet()


def reload_all() -> None:
    """Re-reads every tokens file in this process (the SIGHUP handler)."""
    for tokens in list(_live):
        tokens.reload()


class TokensFile:
    """The tokens of one file, re-read when it changes.

    Attributes:
        on_reload: Called after each reload that took effect (e.g. to count or await them).

    Raises:
        TokensFileError: at construction, when the file is missing or malformed.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.on_reload: Callable[[], None] | None = None
        if not path.exists():
            raise TokensFileError(
                f"{path} does not exist: create it with `mj-tokens add`, or run with --auth none"
            )
        self._by_hash: dict[str, TokenEntry] = {}
        self._stat: tuple[int, int, int] | None = None
        self._load(strict=True)
        _live.add(self)

    def __len__(self) -> int:
        return len(self._by_hash)

    def _current_stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _load(self, strict: bool) -> None:
        stat = self._current_stat()
        try:
            entries = read_tokens(self.path)
            if stat is None:
                raise TokensFileError(f"{self.path}: no such file")
        except TokensFileError as exc:
            if strict:
                raise
            # Keep the last good tokens: a typo must not lock every caller out.
            log.error("tokens file not reloaded; keeping the previous tokens: %s", exc)
            self._stat = stat
            return
        self._by_hash = {e.sha256: e for e in entries}
        changed = self._stat is not None
        self._stat = stat
        if changed:
            log.info("tokens file reloaded", extra={"path": str(self.path), "tokens": len(entries)})
            if self.on_reload is not None:
                self.on_reload()

    def reload(self) -> None:
        """Re-reads the file now, whatever its stat says."""
        self._load(strict=False)

    def lookup(self, token: str) -> TokenEntry | None:
        """The entry of `token`, or None when it is unknown."""
        stat = self._current_stat()
        if stat != self._stat:
            self._load(strict=False)
        return self._by_hash.get(hash_token(token))

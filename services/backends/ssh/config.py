"""The node pools file: SkyPilot's `ssh_node_pools.yaml` form (contract §17).

    gpu-box:                         # a pool; its name is a region
      user: alice                    # pool defaults for every host
      identity_file: ~/.ssh/id_ed25519
      known_hosts: ~/.ssh/known_hosts   # host keys are checked against it (the default)
      unreachable_timeout: 120       # seconds a silent host is waited for (the default)
      hosts:
        - 10.0.0.5                   # just an address
        - ip: 10.0.0.6               # or a mapping
          port: 2222
          user: bob
          identity_file: ~/.ssh/bob
          accelerators: A100:8       # or {A100: 8}
          cpus: 64
          memory: 512                # GB

A host's `cpus`, `memory` and `accelerators` are what launches are matched
against; a host that leaves one out is taken to fit any request for it (except
that a host without `accelerators` has none). Unknown fields are errors, so a
typo never silently changes placement. `load_node_pools` raises ValueError naming
the file and the field.
"""

from __future__ import annotations

import dataclasses
import getpass
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

DEFAULT_UNREACHABLE_TIMEOUT = 120.0
DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"
POOL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_POOL_FIELDS = frozenset({"hosts", "user", "identity_file", "known_hosts", "unreachable_timeout"})
_HOST_FIELDS = frozenset({"ip", "port", "user", "identity_file", "accelerators", "cpus", "memory"})
_USER_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
_ADDRESS_RE = re.compile(r"^[A-Za-z0-9:._%-]{1,253}$")
_GB_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:gb?|gib?)?\s*$", re.IGNORECASE)
_QUOTE_LIMIT = 200


@dataclasses.dataclass(frozen=True)
class Accelerators:
    """`A100:8`: a kind and how many."""

    kind: str
    count: float

    def __str__(self) -> str:
        return f"{self.kind}:{self.count:g}"


@dataclasses.dataclass(frozen=True)
class Host:
    """One machine of a pool."""

    pool: str
    ip: str
    port: int
    user: str
    identity_file: str | None
    known_hosts: str
    accelerators: Accelerators | None = None
    cpus: float | None = None
    # GB.
    memory: float | None = None

    @property
    def id(self) -> str:
        """`user@ip:port`, the host's name in reservations and handles."""
        address = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"{self.user}@{address}:{self.port}"


@dataclasses.dataclass(frozen=True)
class NodePool:
    """A pool of hosts; a region of the ssh backend."""

    name: str
    hosts: tuple[Host, ...]
    unreachable_timeout: float = DEFAULT_UNREACHABLE_TIMEOUT


class _Problem(Exception):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")


def _quote(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _QUOTE_LIMIT else text[:_QUOTE_LIMIT] + "..."


def _text(value: object, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _Problem(field, f"must be a non-empty string, not {_quote(value)}")
    return value.strip()


def _positive(value: object, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise _Problem(field, f"must be a positive number, not {_quote(value)}")
    match = _GB_RE.match(str(value))
    number = float(match.group(1)) if match else math.nan
    if not number > 0 or math.isinf(number):
        raise _Problem(field, f"must be a positive number, not {_quote(value)}")
    return number


def _file(value: object, field: str) -> str:
    path = Path(_text(value, field)).expanduser()
    if not path.is_file():
        raise _Problem(field, f"{str(path)[:_QUOTE_LIMIT]} is not a readable file")
    return str(path)


def parse_accelerators(value: object, field: str = "accelerators") -> Accelerators:
    """`"A100:8"`, `"A100"` (one) or `{A100: 8}`.

    Raises:
        ValueError: anything else; the message names `field`.
    """
    try:
        return _accelerators(value, field)
    except _Problem as problem:
        raise ValueError(str(problem)) from None


def _accelerators(value: object, field: str) -> Accelerators:
    if isinstance(value, dict):
        if len(value) != 1:
            raise _Problem(field, "give one accelerator kind, e.g. {A100: 8}")
        ((kind, count),) = value.items()
        return Accelerators(_text(kind, field), _positive(count, f"{field}.{kind}"))
    text = _text(value, field)
    kind, colon, count = text.partition(":")
    if not kind.strip():
        raise _Problem(field, f"no accelerator kind in {_quote(text)}")
    return Accelerators(kind.strip(), _positive(count, field) if colon else 1.0)


def _port(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise _Problem(field, f"must be a port number (1-65535), not {_quote(value)}")
    return value


def _user(value: object, field: str) -> str:
    user = _text(value, field)
    if not _USER_RE.fullmatch(user):
        raise _Problem(field, f"is not a user name: {_quote(user)}")
    return user


def _unknown(raw: Mapping[Any, Any], allowed: frozenset[str], field: str) -> None:
    for key in raw:
        if key not in allowed:
            raise _Problem(f"{field}.{key}", f"unknown field (known: {', '.join(sorted(allowed))})")


def _host(raw: object, pool: str, defaults: Mapping[str, Any], field: str) -> Host:
    entry: dict[str, Any] = {"ip": raw} if isinstance(raw, str) else raw  # type: ignore[assignment]
    if not isinstance(entry, dict):
        raise _Problem(field, f"must be an address or a mapping with an ip, not {_quote(raw)}")
    _unknown(entry, _HOST_FIELDS, field)
    if "ip" not in entry:
        raise _Problem(f"{field}.ip", "is required")
    ip = _text(entry["ip"], f"{field}.ip")
    if not _ADDRESS_RE.fullmatch(ip):
        raise _Problem(f"{field}.ip", f"is not a host address: {_quote(ip)}")
    identity = defaults["identity_file"]
    if entry.get("identity_file") is not None:
        identity = _file(entry["identity_file"], f"{field}.identity_file")
    return Host(
        pool=pool,
        ip=ip,
        port=_port(entry.get("port", 22), f"{field}.port"),
        user=_user(entry["user"], f"{field}.user") if "user" in entry else defaults["user"],
        identity_file=identity,
        known_hosts=defaults["known_hosts"],
        accelerators=(
            _accelerators(entry["accelerators"], f"{field}.accelerators")
            if entry.get("accelerators") is not None
            else None
        ),
        cpus=_positive(entry["cpus"], f"{field}.cpus") if "cpus" in entry else None,
        memory=_positive(entry["memory"], f"{field}.memory") if "memory" in entry else None,
    )


def _pool(name: object, raw: object) -> NodePool:
    if not isinstance(name, str) or not POOL_NAME_RE.fullmatch(name):
        raise _Problem(_quote(name), "a pool name is letters, digits, '.', '_' or '-' (at most 63)")
    if not isinstance(raw, dict):
        raise _Problem(name, f"must be a mapping with hosts, not {_quote(raw)}")
    _unknown(raw, _POOL_FIELDS, name)
    defaults = {
        "user": _user(raw["user"], f"{name}.user") if "user" in raw else getpass.getuser(),
        "identity_file": (
            _file(raw["identity_file"], f"{name}.identity_file")
            if raw.get("identity_file") is not None
            else None
        ),
        "known_hosts": _file(raw.get("known_hosts", DEFAULT_KNOWN_HOSTS), f"{name}.known_hosts"),
    }
    timeout = raw.get("unreachable_timeout", DEFAULT_UNREACHABLE_TIMEOUT)
    hosts = raw.get("hosts")
    if not isinstance(hosts, list) or not hosts:
        raise _Problem(f"{name}.hosts", "must be a non-empty list of hosts")
    return NodePool(
        name=name,
        hosts=tuple(_host(h, name, defaults, f"{name}.hosts[{i}]") for i, h in enumerate(hosts)),
        unreachable_timeout=_positive(timeout, f"{name}.unreachable_timeout"),
    )


def parse_node_pools(text: str) -> dict[str, NodePool]:
    """The pools of a node pools document, in file order.

    Raises:
        ValueError: the message names the field that is wrong.
    """
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        # One line: services print this as their only line before exiting.
        raise ValueError(f"not valid YAML: {' '.join(str(exc).split())[:_QUOTE_LIMIT]}") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError("must map pool names to pools, each with a list of hosts")
    try:
        pools = {str(name): _pool(name, spec) for name, spec in raw.items()}
    except _Problem as problem:
        raise ValueError(str(problem)) from None
    seen: dict[str, str] = {}
    for pool in pools.values():
        for host in pool.hosts:
            if host.id in seen:
                where = "twice in it" if seen[host.id] == pool.name else f"in {seen[host.id]} too"
                raise ValueError(f"{pool.name}.hosts: {host.id} is {where}")
            seen[host.id] = pool.name
    return pools


def load_node_pools(path: str | Path) -> dict[str, NodePool]:
    """The pools of the node pools file at `path`.

    Raises:
        ValueError: the file cannot be read or is wrong; the message names the file
            and the field.
    """
    where = Path(path).expanduser()
    try:
        text = where.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"ssh node pools file {where}: cannot read it: {exc}") from None
    try:
        return parse_node_pools(text)
    except ValueError as exc:
        raise ValueError(f"ssh node pools file {where}: {exc}") from None

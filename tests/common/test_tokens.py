"""The tokens file: parsing, lookups, reloading on change and on SIGHUP, and `mj-tokens`."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
from pathlib import Path

import pytest

from services.common.security.auth import (
    Role,
    Secrets,
    TokenEntry,
    TokensFile,
    TokensFileError,
    add_token,
    ensure_token,
    hash_token,
    parse_tokens,
    reload_all,
    write_tokens,
)
from services.common.security.tokens import bootstrap, run, tokens_path

HASH = "a" * 64


def entry_yaml(**fields: str) -> str:
    lines = "\n".join(f"    {key}: {value}" for key, value in fields.items())
    return "tokens:\n  -\n" + lines + "\n"


def test_parses_every_role_and_binds_controllers() -> None:
    text = (
        "tokens:\n"
        f"  - {{sha256: {HASH}, user: alice, role: user}}\n"
        f"  - {{sha256: {'b' * 64}, user: ops, role: admin}}\n"
        f"  - {{sha256: {'c' * 64}, user: controller-1, role: controller,"
        " controller_id: controller-1}\n"
        f"  - {{sha256: {'d' * 64}, user: logs, role: service}}\n"
    )
    entries = parse_tokens(text)
    assert [e.role for e in entries] == [Role.USER, Role.ADMIN, Role.CONTROLLER, Role.SERVICE]
    assert entries[2].controller_id == "controller-1"
    assert parse_tokens("") == []


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"sha256": "xyz", "user": "alice", "role": "user"}, "tokens[0].sha256"),
        ({"sha256": HASH, "user": "Alice!", "role": "user"}, "tokens[0].user"),
        ({"sha256": HASH, "user": "alice", "role": "root"}, "tokens[0].role"),
        ({"sha256": HASH, "user": "c1", "role": "controller"}, "tokens[0].controller_id"),
        (
            {"sha256": HASH, "user": "alice", "role": "user", "controller_id": "c1"},
            "tokens[0].controller_id",
        ),
        ({"sha256": HASH, "user": "alice", "role": "user", "token": "x"}, "unknown field"),
    ],
)
def test_a_bad_entry_is_refused_naming_it(fields: dict[str, str], named: str) -> None:
    with pytest.raises(TokensFileError, match=named.replace("[", r"\[").replace("]", r"\]")):
        parse_tokens(entry_yaml(**fields))


def test_a_repeated_hash_and_malformed_yaml_are_refused() -> None:
    twice = (
        f"tokens:\n  - {{sha256: {HASH}, user: a, role: user}}\n"
        f"  - {{sha256: {HASH}, user: b, role: user}}\n"
    )
    with pytest.raises(TokensFileError, match="repeated"):
        parse_tokens(twice)
    with pytest.raises(TokensFileError, match="not YAML"):
        parse_tokens("tokens: [unclosed")


def test_the_file_keeps_hashes_only_with_mode_0600(tmp_path: Path) -> None:
    path = tmp_path / "tokens.yaml"
    token = add_token(path, "alice", Role.USER)
    text = path.read_text()
    assert token not in text and hash_token(token) in text
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    entry = TokensFile(path).lookup(token)
    assert entry == TokenEntry(hash_token(token), "alice", Role.USER)


def test_a_missing_file_is_an_error_at_start(tmp_path: Path) -> None:
    with pytest.raises(TokensFileError, match="does not exist"):
        TokensFile(tmp_path / "nothing.yaml")


def test_an_added_token_works_without_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "tokens.yaml"
    first = add_token(path, "alice", Role.USER)
    tokens = TokensFile(path)
    second = add_token(path, "bob", Role.ADMIN)
    entry = tokens.lookup(second)
    assert entry is not None and entry.user == "bob"
    assert tokens.lookup(first) is not None


def test_a_removed_token_stops_working_without_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "tokens.yaml"
    token = add_token(path, "alice", Role.USER)
    tokens = TokensFile(path)
    assert tokens.lookup(token) is not None
    write_tokens(path, [])
    assert tokens.lookup(token) is None


def test_a_broken_edit_keeps_the_previous_tokens(tmp_path: Path) -> None:
    path = tmp_path / "tokens.yaml"
    token = add_token(path, "alice", Role.USER)
    tokens = TokensFile(path)
    path.write_text("tokens: [unclosed")
    assert tokens.lookup(token) is not None


def _same_stat_rewrite(path: Path, old: str, new: str) -> None:
    """Replaces one hash with another in place, keeping size, inode and mtime."""
    before = path.stat()
    with path.open("r+") as out:
        text = out.read()
        out.seek(0)
        out.write(text.replace(old, new))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_mtime_ns, after.st_size, after.st_ino) == (
        before.st_mtime_ns,
        before.st_size,
        before.st_ino,
    )


def test_reload_all_rereads_a_file_whose_stat_did_not_change(tmp_path: Path) -> None:
    path = tmp_path / "tokens.yaml"
    old = add_token(path, "alice", Role.USER)
    tokens = TokensFile(path)
    new = "mj_" + "n" * 43
    _same_stat_rewrite(path, hash_token(old), hash_token(new))
    assert tokens.lookup(new) is None  # the stat says nothing changed
    reload_all()
    assert tokens.lookup(new) is not None and tokens.lookup(old) is None


async def test_sighup_reloads_the_tokens_of_a_running_server(tmp_path: Path) -> None:
    from services.common.security.edge import ServerSecurity
    from services.common.server import Server

    path = tmp_path / "tokens.yaml"
    old = add_token(path, "alice", Role.USER)
    tokens = TokensFile(path)
    server = Server("127.0.0.1", 0, security=ServerSecurity(tokens))
    await server.start()  # installs the SIGHUP handler on this loop
    try:
        new = "mj_" + "s" * 43
        _same_stat_rewrite(path, hash_token(old), hash_token(new))
        assert tokens.lookup(new) is None
        reloaded = asyncio.Event()
        tokens.on_reload = reloaded.set
        os.kill(os.getpid(), signal.SIGHUP)
        await asyncio.wait_for(reloaded.wait(), 5)
        assert tokens.lookup(new) is not None and tokens.lookup(old) is None
    finally:
        await server.stop(0)


def test_ensure_token_reuses_and_replaces(tmp_path: Path) -> None:
    path, secret = tmp_path / "tokens.yaml", tmp_path / "secrets" / "c1.token"
    first = ensure_token(path, secret, "controller-1", Role.CONTROLLER, "controller-1")
    assert ensure_token(path, secret, "controller-1", Role.CONTROLLER, "controller-1") == first
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    secret.unlink()
    second = ensure_token(path, secret, "controller-1", Role.CONTROLLER, "controller-1")
    assert second != first
    tokens = TokensFile(path)
    assert tokens.lookup(first) is None  # the replaced token's entry is gone
    entry = tokens.lookup(second)
    assert entry is not None and entry.controller_id == "controller-1"


def test_bootstrap_makes_the_stack_tokens_once(tmp_path: Path) -> None:
    path = tokens_path(tmp_path)
    secrets = Secrets.in_data_dir(tmp_path)
    bootstrap(path, secrets, admin="root", controllers=["controller-1"], services=["logs"])
    before = path.read_text()
    bootstrap(path, secrets, admin="root", controllers=["controller-1"], services=["logs"])
    assert path.read_text() == before
    tokens = TokensFile(path)
    roles = {
        (e.user, e.role, e.controller_id)
        for e in [
            tokens.lookup(secrets.admin().read_text().strip()),
            tokens.lookup(secrets.controller("controller-1").read_text().strip()),
            tokens.lookup(secrets.service("logs").read_text().strip()),
        ]
        if e is not None
    }
    assert roles == {
        ("root", Role.ADMIN, ""),
        ("controller-1", Role.CONTROLLER, "controller-1"),
        ("logs", Role.SERVICE, ""),
    }
    assert stat.S_IMODE(secrets.root.stat().st_mode) == 0o700


def test_mj_tokens_add_prints_the_token_once_and_list_shows_no_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = ["--data-dir", str(tmp_path)]
    assert run([*data, "add", "--user", "alice"]) == 0
    token = capsys.readouterr().out.strip()
    entry = TokensFile(tmp_path / "tokens.yaml").lookup(token)
    assert entry is not None and (entry.user, entry.role) == ("alice", Role.USER)
    assert run([*data, "add", "--user", "c9", "--role", "controller", "--controller-id", "c9"]) == 0
    capsys.readouterr()
    assert run([*data, "list"]) == 0
    listed = capsys.readouterr().out
    assert "alice\tuser" in listed and "controller_id=c9" in listed and token not in listed
    assert run([*data, "remove", "--user", "alice"]) == 0
    assert TokensFile(tmp_path / "tokens.yaml").lookup(token) is None


def test_mj_tokens_refuses_a_bad_entry_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(["--data-dir", str(tmp_path), "add", "--user", "Not Valid"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mj-tokens: ") and err.count("\n") == 1
    assert not (tmp_path / "tokens.yaml").exists()

"""Talking to the hosts of the node pools: one pooled SSH connection per host.

Every command is the node script (`node.sh`, shipped in this package) run as
`bash -c <script> node.sh VERB ARGS...`, so a host needs no install and every
replica speaks the protocol it ships. Replies follow a marker line (so output of
the user's shell startup files is ignored) and are lines of a word and key=value
fields (`parse_reply`).

Rules:
- Host keys are checked against the pool's known_hosts file; an unknown or
  changed key fails the connection (never auto-accepted).
- One connection per host, shared by every caller; concurrent first uses share
  one connection attempt. At most `max_sessions` commands run on it at once,
  below sshd's default MaxSessions of 10.
- A command that gets no answer within its timeout, a connection that cannot
  be made, and one that dies under a command (its channel closes without an
  exit status, as when sshd is killed) are `HostUnreachable`: nothing can be
  concluded about the host. A timed-out connection is closed (it may be stuck)
  so the next command reconnects; a command on a reused connection that turns
  out to be broken is retried once on a fresh one.
- A host that answers but whose node script fails is `HostCommandError`.
"""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import asyncssh

from services.backends.ssh.config import Host

NODE_SCRIPT = Path(__file__).with_name("node.sh").read_text()
RUNNER_SCRIPT = Path(__file__).with_name("runner.sh").read_text()
_ERROR_TAIL = 300
REPLY_MARKER = b"@mj-reply\n"

Fields = dict[str, str]


class HostUnreachable(Exception):
    """The host did not answer (connect failure or timeout): conclude nothing."""

    def __init__(self, host: Host, reason: str) -> None:
        super().__init__(f"host {host.id} of pool {host.pool} is unreachable: {reason}")
        self.host = host


class HostCommandError(Exception):
    """The host answered, but the node script failed there."""


def reply_of(stdout: bytes) -> bytes:
    """The node script's reply: what follows its marker line, so that anything the
    user's shell startup files print comes before it and is dropped."""
    _, marker, reply = stdout.partition(REPLY_MARKER)
    return reply if marker else stdout


def parse_reply(data: bytes) -> list[tuple[str, Fields]]:
    """The lines of a node script reply: (first word, its key=value fields)."""
    out = []
    for line in data.decode(errors="replace").splitlines():
        words = line.split()
        if words:
            fields = dict(w.split("=", 1) for w in words[1:] if "=" in w)
            out.append((words[0], fields))
    return out


def _as_bytes(output: bytes | str | None) -> bytes:
    # Commands run with encoding=None, so output is bytes (None when there was none).
    return output.encode() if isinstance(output, str) else output or b""


def _describe(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text[:_ERROR_TAIL]


class HostConnections:
    """The pool of SSH connections, one per host, and the commands run on them."""

    def __init__(
        self,
        *,
        connect_timeout: float = 10.0,
        command_timeout: float = 20.0,
        max_sessions: int = 8,
        keepalive_interval: float = 15.0,
    ) -> None:
        """Creates the pool; connections open on first use.

        Args:
            connect_timeout: Seconds to set up a connection (TCP, SSH handshake, login).
            command_timeout: Default seconds a command may take to answer.
            max_sessions: Commands running at once on one host's connection.
            keepalive_interval: Seconds between keepalives on idle connections, so a
                dead peer is noticed.
        """
        self.connect_timeout = connect_timeout
        self.command_timeout = command_timeout
        self._max_sessions = max(1, max_sessions)
        self._keepalive_interval = keepalive_interval
        self._conns: dict[str, asyncssh.SSHClientConnection] = {}
        self._connecting: dict[str, asyncio.Task[asyncssh.SSHClientConnection]] = {}
        self._sessions: dict[str, asyncio.Semaphore] = {}

    async def run(
        self,
        host: Host,
        verb: str,
        *args: str,
        timeout: float | None = None,
        stdin: bytes | None = None,
    ) -> bytes:
        """Runs node script `verb` on `host` (with `stdin` as its input); its stdout.

        Raises:
            HostUnreachable: no connection, or no answer within `timeout` (default
                `command_timeout`) seconds.
            HostCommandError: the script exited non-zero.
        """
        command = shlex.join(["bash", "-c", NODE_SCRIPT, "node.sh", verb, *args])
        limit = timeout or self.command_timeout
        for retry in (False, True):
            conn, reused = await self._connection(host)
            try:
                async with self._session(host), asyncio.timeout(limit):
                    result = await conn.run(command, input=stdin, check=False, encoding=None)
            except TimeoutError:
                self._drop(host, conn)
                raise HostUnreachable(host, f"no answer to {verb} in {limit:g}s") from None
            except (asyncssh.Error, ConnectionError) as exc:
                self._drop(host, conn)
                if reused and not retry:
                    continue
                raise HostUnreachable(host, f"{verb}: {_describe(exc)}") from None
            if result.exit_status is None:
                # The channel closed without an exit status: the connection died under the
                # command (sshd killed, host gone), which says nothing about the host.
                self._drop(host, conn)
                if reused and not retry:
                    continue
                raise HostUnreachable(host, f"{verb}: the connection closed without an answer")
            if result.exit_status != 0:
                stderr = _as_bytes(result.stderr).decode(errors="replace")[-_ERROR_TAIL:]
                raise HostCommandError(
                    f"{verb} failed on {host.id} (exit {result.exit_status}): {stderr.strip()}"
                )
            return reply_of(_as_bytes(result.stdout))
        raise AssertionError("unreachable: the loop returns or raises")

    async def put_dir(self, host: Host, local: Path, remote: str, timeout: float) -> None:
        """Copies the folder `local` to `remote` (relative to the user's home) over SFTP,
        keeping modes and symbolic links.

        Raises:
            HostUnreachable: no connection, or not done within `timeout` seconds.
            HostCommandError: the host refused a file (permissions, disk full).
        """
        conn, _ = await self._connection(host)
        try:
            async with (
                self._session(host),
                asyncio.timeout(timeout),
                conn.start_sftp_client() as sftp,
            ):
                await sftp.put(str(local), remote, recurse=True, preserve=True)
        except TimeoutError:
            self._drop(host, conn)
            raise HostUnreachable(host, f"workdir copy not done in {timeout:g}s") from None
        except asyncssh.SFTPError as exc:
            raise HostCommandError(f"copying {local} to {host.id}: {_describe(exc)}") from None
        except (asyncssh.Error, ConnectionError) as exc:
            self._drop(host, conn)
            raise HostUnreachable(host, f"workdir copy: {_describe(exc)}") from None
        except OSError as exc:
            raise HostCommandError(f"copying {local} to {host.id}: {_describe(exc)}") from None

    def _session(self, host: Host) -> asyncio.Semaphore:
        semaphore = self._sessions.get(host.id)
        if semaphore is None:
            semaphore = self._sessions[host.id] = asyncio.Semaphore(self._max_sessions)
        return semaphore

    async def _connection(self, host: Host) -> tuple[asyncssh.SSHClientConnection, bool]:
        """The host's connection and whether it was already open."""
        conn = self._conns.get(host.id)
        if conn is not None and not conn.is_closed():
            return conn, True
        task = self._connecting.get(host.id)
        if task is None:
            task = asyncio.create_task(self._connect(host))
            self._connecting[host.id] = task
            task.add_done_callback(lambda done: self._connected(host, done))
        # Shielded: one caller giving up must not cancel the attempt the others wait on.
        return await asyncio.shield(task), False

    def _connected(self, host: Host, task: asyncio.Task[asyncssh.SSHClientConnection]) -> None:
        if self._connecting.get(host.id) is task:
            del self._connecting[host.id]
        if not task.cancelled() and task.exception() is None:
            self._conns[host.id] = task.result()

    async def _connect(self, host: Host) -> asyncssh.SSHClientConnection:
        options: dict[str, Any] = {}
        if host.identity_file:
            options["client_keys"] = [host.identity_file]
        try:
            return await asyncssh.connect(
                host.ip,
                host.port,
                username=host.user,
                known_hosts=host.known_hosts,
                connect_timeout=self.connect_timeout,
                keepalive_interval=self._keepalive_interval,
                keepalive_count_max=3,
                **options,
            )
        except TimeoutError:
            raise HostUnreachable(host, f"no connection in {self.connect_timeout:g}s") from None
        except (OSError, asyncssh.Error) as exc:
            raise HostUnreachable(host, f"cannot connect: {_describe(exc)}") from None

    def _drop(self, host: Host, conn: asyncssh.SSHClientConnection) -> None:
        if self._conns.get(host.id) is conn:
            del self._conns[host.id]
        conn.abort()

    async def close(self) -> None:
        """Closes every connection."""
        for task in list(self._connecting.values()):
            task.cancel()
        conns = list(self._conns.values())
        self._conns.clear()
        for conn in conns:
            conn.close()
        for conn in conns:
            try:
                async with asyncio.timeout(2):
                    await conn.wait_closed()
            except (TimeoutError, asyncssh.Error, OSError):
                conn.abort()


def host_ids(hosts: Sequence[Host]) -> str:
    """Host ids joined as the node script stores them."""
    return ",".join(host.id for host in hosts)

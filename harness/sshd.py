"""Real SSH hosts for tests: one Debian `sshd` per simulated host on a loopback address.

`SshHosts.create(n, folder)` makes, for host N (1-based):
- an OS user `mjhostN-<token>` with its own home (a host's files are its user's);
- a host key, a client key for the user, an authorized_keys file and one known_hosts
  file listing every host's key;
- a non-daemon `/usr/sbin/sshd -D` listening only on 127.0.1.N, on a free port, with
  PAM off and its pid file, keys and config in the test's folder.

A host can then be preempted (`kill`: SIGKILL its sshd and every process of its
user), partitioned (`pause`: SIGSTOP its sshd and every connection's sshd, so
nothing answers but nothing dies; `resume` undoes it) and started again. `close`
stops every sshd, kills every process of the users and removes the users.

It needs root (to add users and run sshd) and openssh-server: `require_sshd`
skips a test with the reason when either is missing, except under CI=true,
where it fails instead. Users left behind by a harness whose process died are
removed by the next one (their comment field names the harness's pid).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import asyncssh
import psutil
import yaml

from harness.prerequisites import missing
from services.launcher.ports import free_port

SSHD = Path("/usr/sbin/sshd")
_COMMENT = "managed-jobs test host, harness pid "
_COMMENT_RE = re.compile(re.escape(_COMMENT) + r"(\d+)$")


def require_sshd() -> None:
    """Skips the calling test (fails it under CI) unless root and sshd are available."""
    needed = []
    if os.geteuid() != 0:
        needed.append("root (to add the hosts' users and run sshd)")
    if not SSHD.exists():
        needed.append(f"{SSHD} (apt-get install -y openssh-server)")
    if shutil.which("useradd") is None:
        needed.append("useradd")
    if needed:
        missing("real sshd tests need " + " and ".join(needed))


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=60)


def _processes_of(uid: int) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.uids().real == uid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def clusters_running(hosts: Sequence[SshHost]) -> dict[str, set[str]]:
    """User -> the MJ_CLUSTER_NAME of every live process of each host's user, in one pass
    over the process table."""
    users = {host.uid: host.user for host in hosts}
    found: dict[str, set[str]] = {user: set() for user in users.values()}
    for proc in psutil.process_iter():
        try:
            user = users.get(proc.uids().real)
            if user is None or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            name = proc.environ().get("MJ_CLUSTER_NAME")
        except psutil.Error:
            continue
        if name:
            found[user].add(name)
    return found


def _dead(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _kill_all(procs: Sequence[psutil.Process], timeout: float = 5.0) -> None:
    """SIGKILLs the processes and waits until each is gone or a zombie (a zombie is
    dead, though whoever adopted it may reap it late)."""
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    deadline = time.monotonic() + timeout
    while not all(_dead(proc) for proc in procs) and time.monotonic() < deadline:
        time.sleep(0.02)


def _remove_user(name: str) -> None:
    """Kills every process of the user, then removes it and its home."""
    try:
        uid = pwd.getpwnam(name).pw_uid
    except KeyError:
        return
    for _ in range(5):
        _kill_all(_processes_of(uid))
        result = subprocess.run(
            ["userdel", "-r", "-f", name], capture_output=True, timeout=60, check=False
        )
        if result.returncode in (0, 6):  # 6: no such user
            return
        time.sleep(0.2)


def remove_orphaned_users() -> None:
    """Removes test users whose harness process is gone (a test run that was killed)."""
    for entry in pwd.getpwall():
        match = _COMMENT_RE.match(entry.pw_gecos)
        if match and not psutil.pid_exists(int(match.group(1))):
            _remove_user(entry.pw_name)


@dataclasses.dataclass
class SshHost:
    """One simulated machine: an OS user and an sshd on its own loopback address."""

    index: int
    user: str
    address: str
    port: int
    home: Path
    folder: Path
    process: subprocess.Popen[bytes] | None = None
    _paused: list[psutil.Process] = dataclasses.field(default_factory=list)

    @property
    def config(self) -> Path:
        return self.folder / "sshd_config"

    @property
    def client_key(self) -> Path:
        return self.folder / "id_ed25519"

    @property
    def uid(self) -> int:
        return pwd.getpwnam(self.user).pw_uid

    def start(self, timeout: float = 10.0) -> None:
        """Starts sshd and returns once it sends its banner."""
        log = (self.folder / "sshd.log").open("ab")
        self.process = subprocess.Popen(
            [str(SSHD), "-D", "-e", "-f", str(self.config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                text = (self.folder / "sshd.log").read_text(errors="replace")
                raise RuntimeError(f"sshd of {self.user} exited: {text[-2000:]}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection((self.address, self.port), timeout=1) as sock,
            ):
                if sock.recv(64).startswith(b"SSH-"):
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"sshd of {self.user} did not answer in {timeout}s")
            time.sleep(0.05)

    def _sshd_processes(self) -> list[psutil.Process]:
        """The listening sshd and every sshd (and session) serving a connection."""
        if self.process is None or self.process.poll() is not None:
            return []
        try:
            parent = psutil.Process(self.process.pid)
            return [parent, *parent.children(recursive=True)]
        except psutil.Error:
            return []

    def kill(self) -> None:
        """A preemption: SIGKILL sshd (with its connections) and every process of the user."""
        self.resume()
        _kill_all(self._sshd_processes())
        if self.process is not None:
            self.process.wait(10)
            self.process = None
        _kill_all(_processes_of(self.uid))

    def pause(self) -> None:
        """A partition: every sshd process of the host stops (SIGSTOP); nothing answers."""
        self._paused = self._sshd_processes()
        for proc in self._paused:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Ends a partition (SIGCONT to what `pause` stopped)."""
        for proc in self._paused:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGCONT)
        self._paused = []

    def stop(self) -> None:
        self.resume()
        _kill_all(self._sshd_processes())
        if self.process is not None:
            self.process.wait(10)
            self.process = None

    def ps(self) -> list[str]:
        """`ps -u USER`: the command line of every live process of the host's user
        (zombies are dead, whether or not anyone reaped them yet)."""
        result = subprocess.run(
            ["ps", "-u", self.user, "-o", "stat=,args="],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        rows = [line.strip().split(None, 1) for line in result.stdout.splitlines()]
        return [row[1] for row in rows if len(row) == 2 and not row[0].startswith("Z")]

    def task_processes(self) -> list[str]:
        """The user's processes other than sshd's own ones for open connections."""
        return [args for args in self.ps() if not args.startswith("sshd:")]

    def reservation(self) -> dict[str, str] | None:
        """The host's own reservation (its owner file's fields), or None when it is free."""
        owner = self.home / ".mj" / "reservation" / "owner"
        try:
            text = owner.read_text()
        except FileNotFoundError:
            return None
        return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)

    def cluster_folders(self) -> list[str]:
        """The cluster folders (NAME.LAUNCH) in the host's ~/.mj/clusters."""
        clusters = self.home / ".mj" / "clusters"
        return sorted(p.name for p in clusters.iterdir()) if clusters.is_dir() else []

    def clusters_running(self) -> set[str]:
        """The MJ_CLUSTER_NAME of every live process of the host's user, read from the
        processes themselves."""
        return clusters_running([self])[self.user]

    def wipe(self) -> None:
        """Kills every process of the user (its connections too) and empties ~/.mj."""
        _kill_all(_processes_of(self.uid))
        shutil.rmtree(self.home / ".mj", ignore_errors=True)


class SshHosts:
    """N simulated hosts and the files a node pool needs to reach them."""

    def __init__(self, folder: Path, hosts: list[SshHost]) -> None:
        self.folder = folder
        self.hosts = hosts

    @property
    def known_hosts(self) -> Path:
        return self.folder / "known_hosts"

    @classmethod
    def create(cls, count: int, folder: Path) -> SshHosts:
        """Creates and starts `count` hosts (see the module docstring)."""
        require_sshd()
        remove_orphaned_users()
        # The privilege-separation directory sshd insists on.
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        token = uuid.uuid4().hex[:4]
        made = cls(folder, [])
        try:
            known = []
            for index in range(1, count + 1):
                host = made._make_host(index, token)
                made.hosts.append(host)
                key = asyncssh.read_public_key(host.folder / "host_key.pub")
                known.append(
                    f"[{host.address}]:{host.port} {key.export_public_key().decode().strip()}"
                )
            made.known_hosts.write_text("\n".join(known) + "\n")
            for host in made.hosts:
                host.start()
        except BaseException:
            made.close()
            raise
        return made

    def _make_host(self, index: int, token: str) -> SshHost:
        user = f"mjhost{index}-{token}"
        address = f"127.0.1.{index}"
        host_dir = self.folder / f"host{index}"
        host_dir.mkdir(parents=True)
        # "*" rather than useradd's locked "!": sshd without PAM refuses locked accounts.
        _run(
            "useradd",
            "--create-home",
            "--shell",
            "/bin/bash",
            "--password",
            "*",
            "--comment",
            f"{_COMMENT}{os.getpid()}",
            user,
        )
        home = Path(pwd.getpwnam(user).pw_dir)
        host = SshHost(index, user, address, free_port(address), home, host_dir)
        host_key = asyncssh.generate_private_key("ssh-ed25519")
        host_key.write_private_key(host_dir / "host_key")
        host_key.write_public_key(host_dir / "host_key.pub")
        (host_dir / "host_key").chmod(0o600)
        client_key = asyncssh.generate_private_key("ssh-ed25519")
        client_key.write_private_key(host.client_key)
        host.client_key.chmod(0o600)
        # sshd reads authorized_keys as the user, so it lives in the user's home.
        ssh_dir = home / ".ssh"
        ssh_dir.mkdir(mode=0o700, exist_ok=True)
        (ssh_dir / "authorized_keys").write_bytes(client_key.export_public_key())
        for path in (ssh_dir, ssh_dir / "authorized_keys"):
            os.chown(path, host.uid, pwd.getpwnam(user).pw_gid)
        host.config.write_text(
            "\n".join(
                [
                    f"ListenAddress {address}",
                    f"Port {host.port}",
                    f"HostKey {host_dir / 'host_key'}",
                    f"PidFile {host_dir / 'sshd.pid'}",
                    f"AllowUsers {user}",
                    "UsePAM no",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "PubkeyAuthentication yes",
                    # The host key and config live in the test's folder, owned by root.
                    "StrictModes no",
                    "PrintMotd no",
                    "MaxStartups 100",
                    "Subsystem sftp internal-sftp",
                    "LogLevel ERROR",
                    "",
                ]
            )
        )
        return host

    def pool_file(self, path: Path, pools: dict[str, dict[str, object]]) -> Path:
        """Writes an ssh_node_pools.yaml; host entries are indexes into `hosts` (1-based)
        or dicts with an `index` plus extra fields (accelerators, cpus, memory)."""
        document: dict[str, object] = {}
        for name, spec in pools.items():
            entries = []
            for item in spec.get("hosts", []):  # type: ignore[attr-defined]
                extra = dict(item) if isinstance(item, dict) else {"index": item}
                host = self.hosts[int(extra.pop("index")) - 1]
                entries.append(
                    {
                        "ip": host.address,
                        "port": host.port,
                        "user": host.user,
                        "identity_file": str(host.client_key),
                        **extra,
                    }
                )
            pool = {k: v for k, v in spec.items() if k != "hosts"}
            document[name] = {"known_hosts": str(self.known_hosts), **pool, "hosts": entries}
        path.write_text(yaml.safe_dump(document, sort_keys=False))
        return path

    def close(self) -> None:
        """Stops every sshd, kills every process of the users and removes the users."""
        for host in self.hosts:
            host.stop()
        for host in self.hosts:
            _remove_user(host.user)

"""Starts the whole system on this host: scheduler, controller replicas and logs.

`python -m services.launcher.stack` (what `make up` runs) starts a scheduler, two
controller replicas and the logs service as separate processes, with SQLite
under the data dir and the local backend, and stops them all on Ctrl-C. With
`--backend sim` it first starts `mj-simcloud` (on port 50071, with
`--simcloud-config` if given) and runs the controllers and logs on the sim
backend; with `--backend ssh --ssh-node-pools FILE` they run on the hosts of
that node pools file. The end-to-end tests start the same topology through `Stack`
(`simcloud_args` not None: with a sim cloud; `database_url`: on PostgreSQL), and
the reliability tests break it one process at a time through `Service`: kill
(SIGKILL), pause and resume (SIGSTOP, SIGCONT), restart with the same arguments.

Security is on as in production (contract §14). On first start the stack writes the
tokens file (`DATA_DIR/tokens.yaml`) with an admin token for the local user, one
token per controller replica bound to its id and a service token for the logs
service, keeping the plain tokens in `DATA_DIR/secrets/` (mode 0600): each
service reads its own through `MJ_TOKEN_FILE`, and `mj` finds the admin token
there by itself. Later starts reuse them. With `tls=True` (`--tls`) it also makes
a CA and certificates under `DATA_DIR/tls/` (`mj-certs`) and runs every server
with TLS and mTLS: each replica's certificate names its controller id, and
clients present `admin.pem`. Tests talk to a stack through `client_security`,
`channel()` and `client_env()`.

Starting fails fast (contract §19): a service that exits while the stack starts (a bad
setting: an unknown backend, an unreadable config, a port another process holds)
is reported at once with its own error line, and every service already started is
stopped, so nothing is left running for the next `make up` to trip over.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.backends import BACKENDS
from services.backends.ssh.config import NodePool, load_node_pools
from services.common.channels import ClientSecurity, TokenSource, open_sync_channel
from services.common.security.auth import Secrets, local_user
from services.common.security.certs import make_certificates
from services.common.security.tls import ClientTls
from services.common.security.tokens import bootstrap, tokens_path
from services.common.settings import OneLineParser

# Names on the stack's certificates: every process listens on 127.0.0.1.
TLS_HOSTS = ("scheduler", "logs", "simcloud")
LOOPBACK_NAMES = ("localhost", "127.0.0.1")
LOGS_SERVICE = "logs"
# The lowest port `free_port` picks (below the kernel's ephemeral range).
PORTS_FROM = 20000


class StackError(RuntimeError):
    """A service of the stack exited while the stack was starting; the message ends with
    the service's own last line (its error)."""


def last_line(path: Path, limit: int = 8192) -> str:
    """The last non-empty line of a log file (its tail only is read)."""
    try:
        with path.open("rb") as file:
            file.seek(max(0, path.stat().st_size - limit))
            lines = file.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    return next((line.strip() for line in reversed(lines) if line.strip()), "")


# Ports handed out by `free_port` in this process, never handed out twice.
_handed_out: set[int] = set()
_random = random.SystemRandom()


def _ephemeral_floor() -> int:
    """The lowest port the kernel gives outgoing connections (0 when unknown)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_port(address: str = "127.0.0.1") -> int:
    """A port free on `address` for a service to listen on, below the kernel's ephemeral
    range where there is room: a port the kernel could also give an outgoing connection
    may be taken between this check and the service's bind, or before a restarted
    service binds it again."""
    floor = _ephemeral_floor()
    if floor > PORTS_FROM + 1000:
        for _ in range(100):
            port = _random.randrange(PORTS_FROM, floor)
            if port in _handed_out:
                continue
            with socket.socket() as sock:
                try:
                    sock.bind((address, port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket() as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


def wait_serving(
    address: str, timeout: float = 30.0, security: ClientSecurity | None = None
) -> None:
    """Blocks until the server at `address` reports SERVING on grpc.health.v1."""
    deadline = time.monotonic() + timeout
    with open_sync_channel(address, security or ClientSecurity()) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} did not become healthy in {timeout:.0f}s")
            time.sleep(0.1)


@dataclasses.dataclass
class Service:
    """One service process: started, signalled, stopped and restarted with the same argv."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    address: str = ""
    process: subprocess.Popen[bytes] | None = None
    security: ClientSecurity = dataclasses.field(default_factory=ClientSecurity)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()

    @property
    def running(self) -> bool:
        """Whether the process was started and has not exited (a paused one is running)."""
        return self.process is not None and self.process.poll() is None

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, sig)

    def failure(self) -> str:
        """Why the process is gone: its exit code and its last line ("" while it runs)."""
        if self.process is None or self.running:
            return ""
        return f"{self.name} exited with {self.process.returncode}: {last_line(self.log_path)}"

    def serving(self) -> bool:
        """Whether the service answers SERVING now (one short health check)."""
        try:
            wait_serving(self.address, 0.2, self.security)
        except TimeoutError:
            return False
        return True

    def wait_serving(self, timeout: float = 30.0) -> None:
        """Blocks until the service reports SERVING.

        Raises:
            StackError: its process exited first (with its last line).
            TimeoutError: it did not become healthy in `timeout` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            if not self.running:
                raise StackError(f"{self.failure()} (log: {self.log_path})")
            try:
                wait_serving(
                    self.address,
                    min(1.0, max(0.1, deadline - time.monotonic())),
                    self.security,
                )
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{self.name} at {self.address} did not become healthy in {timeout:.0f}s"
                    ) from None

    def kill(self) -> None:
        """SIGKILL: the process dies at once, with no chance to hand anything back."""
        if self.process is None:
            return
        self.signal(signal.SIGKILL)
        self.process.wait()

    def pause(self) -> None:
        """SIGSTOP: the process stays alive but does nothing (as a long GC pause or a VM stall)."""
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after `pause`."""
        self.signal(signal.SIGCONT)

    def restart(self, timeout: float = 30.0, kill: bool = False) -> None:
        """Stops the process (SIGTERM, or SIGKILL with `kill`) and starts it again, serving."""
        if kill:
            self.kill()
        else:
            self.stop()
        self.start()
        if self.address:
            self.wait_serving(timeout)

    def stop(self, timeout: float = 15.0) -> None:
        if self.process is None:
            return
        self.signal(signal.SIGTERM)
        # A paused process handles SIGTERM only once it runs again.
        self.signal(signal.SIGCONT)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.process.wait()


class Stack:
    """The topology of contract §13 as local processes, on the ports given or free ones."""

    def __init__(
        self,
        data_dir: Path,
        replicas: int = 2,
        scheduler_port: int = 0,
        logs_port: int = 0,
        controller_ports: Sequence[int] = (),
        env: Mapping[str, str] | None = None,
        controller_args: Sequence[str] = (),
        scheduler_args: Sequence[str] = (),
        simcloud_args: Sequence[str] | None = None,
        simcloud_port: int = 0,
        database_url: str = "",
        ssh_node_pools: str = "",
        auth: bool = True,
        tls: bool = False,
    ) -> None:
        self.data_dir = data_dir.resolve()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        base = dict(os.environ if env is None else env)
        base.setdefault("MJ_DATA_DIR", str(self.data_dir))
        base.setdefault("PYTHONUNBUFFERED", "1")
        controller_ids = [f"controller-{index + 1}" for index in range(replicas)]
        # Each service's own token and certificate, by service name.
        own = self._secure(base, controller_ids, auth, tls)
        self.env = base
        self.scheduler_address = f"127.0.0.1:{scheduler_port or free_port()}"
        self.logs_address = f"127.0.0.1:{logs_port or free_port()}"
        py = [sys.executable, "-m"]
        logs_dir = self.data_dir / "service-logs"
        # With a sim cloud, controllers and logs use the sim backend pointed at it.
        self.simcloud: Service | None = None
        self.simcloud_address = ""
        backend_env: dict[str, str] = {}
        if simcloud_args is not None:
            self.simcloud_address = f"127.0.0.1:{simcloud_port or free_port()}"
            cloud_port = self.simcloud_address.split(":")[1]
            self.simcloud = Service(
                "simcloud",
                [*py, "services.simcloud.main", "--port", cloud_port, *simcloud_args],
                {**base, **own["simcloud"]},
                logs_dir / "simcloud.log",
                self.simcloud_address,
                security=self.probe_security,
            )
            backend_env = {"MJ_BACKEND": "sim", "MJ_SIMCLOUD_ADDRESS": self.simcloud_address}
        elif ssh_node_pools:
            # Controllers and logs on the hosts of a node pools file (the ssh backend).
            pools = str(Path(ssh_node_pools).expanduser().resolve())
            backend_env = {"MJ_BACKEND": "ssh", "MJ_SSH_NODE_POOLS": pools}
        # A database URL (PostgreSQL for several replicas); empty: SQLite in the data dir.
        self.database_url = database_url
        database = ["--database-url", database_url] if database_url else []
        self.scheduler = Service(
            "scheduler",
            [*py, "services.scheduler.main", "--port", self.scheduler_address.split(":")[1]]
            + database
            + list(scheduler_args),
            {**base, **own["scheduler"]},
            logs_dir / "scheduler.log",
            self.scheduler_address,
            security=self.probe_security,
        )
        self.logs = Service(
            "logs",
            [*py, "services.logs.main", "--port", self.logs_address.split(":")[1]],
            {
                **base,
                **backend_env,
                **own[LOGS_SERVICE],
                "MJ_SCHEDULER_ADDRESS": self.scheduler_address,
            },
            logs_dir / "logs.log",
            self.logs_address,
            security=self.probe_security,
        )
        self.controllers: list[Service] = []
        for index, controller_id in enumerate(controller_ids):
            port = controller_ports[index] if index < len(controller_ports) else free_port()
            self.controllers.append(
                Service(
                    controller_id,
                    [*py, "services.controller.main", "--port", str(port)]
                    + ["--controller-id", controller_id, *controller_args],
                    {
                        **base,
                        **backend_env,
                        **own[controller_id],
                        "MJ_SCHEDULER_ADDRESS": self.scheduler_address,
                        "MJ_LOGS_ADDRESS": self.logs_address,
                    },
                    logs_dir / f"{controller_id}.log",
                    f"127.0.0.1:{port}",
                    security=self.probe_security,
                )
            )

    def _secure(
        self, base: dict[str, str], controller_ids: list[str], auth: bool, tls: bool
    ) -> dict[str, dict[str, str]]:
        """Makes the tokens (and with `tls` the certificates); returns each service's env.

        Sets `client_security` (the admin's token and TLS, for tests and `mj`),
        `probe_security` (TLS only, for health checks) and `tls_dir`.
        """
        names = ["scheduler", LOGS_SERVICE, "simcloud", *controller_ids]
        own: dict[str, dict[str, str]] = {name: {} for name in names}
        for name in names:
            # Every setting is explicit: a variable from the caller's shell must not leak in.
            own[name].update(
                {
                    "MJ_AUTH": "tokens" if auth else "none",
                    "MJ_TOKENS_FILE": "",
                    "MJ_TOKEN": "",
                    "MJ_TOKEN_FILE": "",
                    "MJ_TLS_CERT": "",
                    "MJ_TLS_KEY": "",
                    "MJ_TLS_CLIENT_CA": "",
                    "MJ_TLS_CA": "",
                    "MJ_TLS_CLIENT_CERT": "",
                    "MJ_TLS_CLIENT_KEY": "",
                }
            )
        secrets = Secrets.in_data_dir(self.data_dir)
        self.tokens_file = tokens_path(self.data_dir)
        bootstrap(
            self.tokens_file,
            secrets,
            admin=local_user(),
            controllers=controller_ids,
            services=[LOGS_SERVICE],
        )
        self.admin_token_file = secrets.admin()
        for name in names:
            own[name]["MJ_TOKENS_FILE"] = str(self.tokens_file)
        own[LOGS_SERVICE]["MJ_TOKEN_FILE"] = str(secrets.service(LOGS_SERVICE))
        for controller_id in controller_ids:
            own[controller_id]["MJ_TOKEN_FILE"] = str(secrets.controller(controller_id))
        self.tls_dir: Path | None = None
        client_tls: ClientTls | None = None
        if tls:
            self.tls_dir = self.data_dir / "tls"
            ca = make_certificates(
                self.tls_dir,
                hosts=TLS_HOSTS,
                controllers=controller_ids,
                clients=["admin"],
                extra_names=LOOPBACK_NAMES,
            )
            for name in names:
                own[name].update(
                    {
                        "MJ_TLS_CERT": str(self.tls_dir / f"{name}.pem"),
                        "MJ_TLS_KEY": str(self.tls_dir / f"{name}.key"),
                        "MJ_TLS_CLIENT_CA": str(ca),
                        "MJ_TLS_CA": str(ca),
                        "MJ_TLS_CLIENT_CERT": str(self.tls_dir / f"{name}.pem"),
                        "MJ_TLS_CLIENT_KEY": str(self.tls_dir / f"{name}.key"),
                    }
                )
            client_tls = ClientTls.from_files(
                str(ca), str(self.tls_dir / "admin.pem"), str(self.tls_dir / "admin.key")
            )
        self.client_security = ClientSecurity(TokenSource(path=self.admin_token_file), client_tls)
        self.probe_security = ClientSecurity(None, client_tls)
        return own

    @property
    def admin_token(self) -> str:
        """The admin token the stack made for the local user."""
        return self.admin_token_file.read_text().strip()

    def client_env(self) -> dict[str, str]:
        """Variables that point `mj` at this stack; it finds the admin token in the data dir."""
        env = {
            "MJ_SCHEDULER_ADDRESS": self.scheduler_address,
            "MJ_LOGS_ADDRESS": self.logs_address,
            "MJ_DATA_DIR": str(self.data_dir),
            "MJ_TOKEN": "",
            "MJ_TOKEN_FILE": "",
            "MJ_TLS_CA": "",
            "MJ_TLS_CLIENT_CERT": "",
            "MJ_TLS_CLIENT_KEY": "",
        }
        if self.tls_dir is not None:
            env["MJ_TLS_CA"] = str(self.tls_dir / "ca.pem")
            env["MJ_TLS_CLIENT_CERT"] = str(self.tls_dir / "admin.pem")
            env["MJ_TLS_CLIENT_KEY"] = str(self.tls_dir / "admin.key")
        return env

    def channel(self, address: str) -> grpc.Channel:
        """A blocking channel to one of the stack's servers, as the admin."""
        return open_sync_channel(address, self.client_security)

    @property
    def services(self) -> list[Service]:
        cloud = [self.simcloud] if self.simcloud is not None else []
        return [*cloud, self.scheduler, self.logs, *self.controllers]

    def service(self, name: str) -> Service:
        """The service of this name: "scheduler", "logs", "simcloud" or "controller-N"."""
        for service in self.services:
            if service.name == name:
                return service
        raise KeyError(f"no service named {name!r}")

    def exited(self) -> list[Service]:
        """Services whose process was started and has exited."""
        return [s for s in self.services if s.process is not None and not s.running]

    def start(self, timeout: float = 30.0) -> None:
        """Starts the services in order (the cloud, the scheduler, then the rest together),
        each group serving before the next starts.

        Fails fast: as soon as any started process exits, every service started so far
        is stopped and `StackError` names the one that exited with its own last line
        (e.g. `controller-1 exited with 2: mj-controller: error: argument --backend:
        ...`). Nothing of the stack is left running when this raises.

        Raises:
            StackError: a service exited while starting.
            TimeoutError: a service did not become healthy in `timeout` seconds.
        """
        cloud = [self.simcloud] if self.simcloud is not None else []
        try:
            for group in ([*cloud], [self.scheduler], [self.logs, *self.controllers]):
                for service in group:
                    service.start()
                self._wait_serving(group, timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_serving(self, group: Sequence[Service], timeout: float) -> None:
        """Waits until every service of `group` serves, checking every started process."""
        deadline = time.monotonic() + timeout
        waiting = list(group)
        while waiting:
            for service in self.services:
                failure = service.failure()
                if failure:
                    raise StackError(f"{failure} (log: {service.log_path})")
            waiting = [service for service in waiting if not service.serving()]
            if waiting and time.monotonic() > deadline:
                names = ", ".join(service.name for service in waiting)
                raise TimeoutError(f"{names} did not become healthy in {timeout:.0f}s")

    def stop(self) -> None:
        """Stops every service started (each at most once; one never started is skipped)."""
        # Replicas first, so that they hand their jobs back to a live scheduler.
        for service in [*self.controllers, self.logs, self.scheduler]:
            service.stop()
        # The cloud last: replicas tear clusters down through it until they stop.
        if self.simcloud is not None:
            self.simcloud.stop()

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> None:
    parser = OneLineParser(prog="stack", description=__doc__)
    parser.add_argument("--data-dir", default=os.environ.get("MJ_DATA_DIR", ".mj"))
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--poll-interval", default=os.environ.get("MJ_POLL_INTERVAL", "1"))
    parser.add_argument(
        "--backend",
        choices=list(BACKENDS),
        default=os.environ.get("MJ_BACKEND", "local"),
        help="local: processes on this host; sim: start mj-simcloud and use it; "
        "ssh: the hosts of --ssh-node-pools",
    )
    parser.add_argument(
        "--ssh-node-pools",
        default=os.environ.get("MJ_SSH_NODE_POOLS", ""),
        help="ssh_node_pools.yaml of the ssh backend (env MJ_SSH_NODE_POOLS)",
    )
    parser.add_argument(
        "--simcloud-config",
        default=os.environ.get("MJ_SIMCLOUD_CONFIG", ""),
        help="YAML config of the sim cloud (default: its built-in three regions)",
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        help="TLS and mTLS between every process, with certificates made under DATA_DIR/tls",
    )
    args = parser.parse_args(argv)
    if args.backend not in BACKENDS:  # from MJ_BACKEND: argparse checks only flags
        parser.error(f"MJ_BACKEND={args.backend!r}: choose one of {', '.join(BACKENDS)}")
    simcloud_args: list[str] | None = None
    pools: dict[str, NodePool] = {}
    if args.backend == "sim":
        simcloud_args = ["--config", args.simcloud_config] if args.simcloud_config else []
    if args.backend == "ssh":
        if not args.ssh_node_pools:
            parser.error("--backend ssh needs --ssh-node-pools FILE (or MJ_SSH_NODE_POOLS)")
        try:
            pools = load_node_pools(args.ssh_node_pools)
        except ValueError as exc:
            parser.error(str(exc))
    stack = Stack(
        Path(args.data_dir),
        replicas=args.replicas,
        scheduler_port=50051,
        logs_port=50052,
        controller_ports=[50061 + i for i in range(args.replicas)],
        controller_args=["--poll-interval", str(args.poll_interval)],
        simcloud_args=simcloud_args,
        simcloud_port=50071,
        ssh_node_pools=args.ssh_node_pools if args.backend == "ssh" else "",
        tls=args.tls,
    )
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        stack.start()
    except (StackError, TimeoutError) as exc:
        # Every service it started is stopped already: the next `make up` starts clean.
        raise SystemExit(f"stack: {exc}") from None
    if stack.simcloud is not None:
        print(f"simcloud   {stack.simcloud_address}")
    if args.backend == "ssh":
        print(f"ssh pools  {', '.join(f'{p.name} ({len(p.hosts)} hosts)' for p in pools.values())}")
    print(f"scheduler  {stack.scheduler_address}")
    print(f"logs       {stack.logs_address}")
    for service in stack.controllers:
        print(f"{service.name:<10} {service.address}")
    print(f"data dir   {stack.data_dir}  (service logs in {stack.data_dir / 'service-logs'})")
    print(f"tokens     {stack.tokens_file}  (mj uses {stack.admin_token_file} by itself)")
    if stack.tls_dir is not None:
        tls = stack.tls_dir
        print(
            f"tls        export MJ_TLS_CA={tls / 'ca.pem'} MJ_TLS_CLIENT_CERT={tls / 'admin.pem'} "
            f"MJ_TLS_CLIENT_KEY={tls / 'admin.key'}"
        )
    print("try: mj launch examples/hello.yaml   (Ctrl-C stops everything)")
    try:
        while not stopping:
            for service in stack.services:
                if service.failure():
                    print(f"{service.failure()}; stopping", file=sys.stderr)
                    stopping = True
            time.sleep(0.5)
    finally:
        stack.stop()


if __name__ == "__main__":
    main()

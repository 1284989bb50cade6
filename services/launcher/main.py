"""Starts the whole system on this host: scheduler, controller replicas and logs.

`python -m services.launcher` (what `make up` runs) starts a scheduler, two
controller replicas and the logs service as separate processes, with SQLite
under the data dir and the local backend, and stops them all on Ctrl-C. With
`--backend sim` it first starts `mj-simcloud` (on port 50071, with
`--simcloud-config` if given) and runs the controllers and logs on the sim
backend; with `--backend ssh --ssh-node-pools FILE` they run on the hosts of
that node pools file. With `--tls` every process talks TLS and mTLS, with
certificates made under DATA_DIR/tls. A service that exits while the stack starts
is reported with its own error line, and nothing is left running.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from services.backends import BACKENDS
from services.backends.ssh.config import NodePool, load_node_pools
from services.common.settings import OneLineParser
from services.launcher.service import StackError
from services.launcher.stack import Stack


def build_parser() -> argparse.ArgumentParser:
    """The launcher's flags, each defaulting to its environment variable where it has one."""
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
    return parser


def print_addresses(stack: Stack, pools: dict[str, NodePool]) -> None:
    """Where each service listens, and where its data, logs and credentials are."""
    if stack.simcloud is not None:
        print(f"simcloud   {stack.simcloud_address}")
    if pools:
        print(f"ssh pools  {', '.join(f'{p.name} ({len(p.hosts)} hosts)' for p in pools.values())}")
    print(f"scheduler  {stack.scheduler_address}")
    print(f"logs       {stack.logs_address}")
    for service in stack.controllers:
        print(f"{service.name:<10} {service.address}")
    credentials = stack.credentials
    print(f"data dir   {stack.data_dir}  (service logs in {stack.data_dir / 'service-logs'})")
    print(
        f"tokens     {credentials.tokens_file}  (mj uses {credentials.admin_token_file} by itself)"
    )
    if credentials.tls_dir is not None:
        tls = credentials.tls_dir
        print(
            f"tls        export MJ_TLS_CA={tls / 'ca.pem'} MJ_TLS_CLIENT_CERT={tls / 'admin.pem'} "
            f"MJ_TLS_CLIENT_KEY={tls / 'admin.key'}"
        )
    print("try: mj launch examples/hello.yaml   (Ctrl-C stops everything)")


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
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
    print_addresses(stack, pools)
    try:
        while not stopping:
            for service in stack.services:
                if service.failure():
                    print(f"{service.failure()}; stopping", file=sys.stderr)
                    stopping = True
            time.sleep(0.5)
    finally:
        stack.stop()

"""Bad settings fail fast (contract §19): one line naming the setting, and nothing left running.

Real processes. A service given a setting it cannot run with (an unknown backend,
an unreadable config or tokens file, a port another process holds) exits at once
with one line (`prog: error: ...`), no traceback. The stack (`Stack.start`, and
`python -m services.launcher`, what `make up` runs) reports the first service that
exited, with that line, as soon as it exits, and stops every service it had
started: psutil finds no process of the stack afterwards.

The stacks here get a health timeout of 10 minutes: a stack that waited for health
instead of failing fast would outlive the tests' own timeout and fail them.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from harness.e2e import clean_env, python
from services.launcher.ports import PORTS_FROM, free_port
from services.launcher.service import StackError
from services.launcher.stack import Stack

PATIENT = 600.0
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def processes_of(data_dir: Path) -> list[psutil.Process]:
    """Live processes started for the stack in `data_dir` (by their MJ_DATA_DIR)."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("MJ_DATA_DIR") == str(data_dir.resolve()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return [p for p in found if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port another process (here: this one) listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def failed_start(stack: Stack) -> str:
    with pytest.raises(StackError) as caught:
        stack.start(timeout=PATIENT)
    assert all(not service.running for service in stack.services)
    assert processes_of(stack.data_dir) == []
    return str(caught.value)


def test_an_unknown_backend_stops_the_stack_with_the_services_own_line(tmp_path: Path) -> None:
    env = {**clean_env(), "MJ_BACKEND": "bogus"}
    stack = Stack(tmp_path / "data", replicas=1, env=env)
    message = failed_start(stack)
    # The scheduler had started and served: it was stopped too.
    assert stack.scheduler.process is not None and stack.scheduler.process.returncode == 0
    assert "exited with 2" in message
    assert "error: MJ_BACKEND='bogus': unknown backend 'bogus'; known backends:" in message
    assert message.split(": ", 1)[1].startswith(("mj-controller", "mj-logs"))


def test_a_port_already_taken_stops_the_stack_naming_the_address(
    tmp_path: Path, held_port: int
) -> None:
    stack = Stack(tmp_path / "data", replicas=1, logs_port=held_port, env=clean_env())
    message = failed_start(stack)
    assert message.startswith("logs exited with 1: mj-logs: error: cannot listen on ")
    assert f"127.0.0.1:{held_port} (--host, --port): Address already in use" in message
    assert stack.scheduler.process is not None and stack.scheduler.process.returncode == 0


def test_a_scheduler_port_already_taken_is_its_one_line(tmp_path: Path, held_port: int) -> None:
    stack = Stack(tmp_path / "data", replicas=1, scheduler_port=held_port, env=clean_env())
    message = failed_start(stack)
    assert message.startswith("scheduler exited with 1: mj-scheduler: error: cannot listen")
    # Nothing after the scheduler was started.
    assert stack.logs.process is None and all(c.process is None for c in stack.controllers)


def test_make_up_with_an_unreadable_cloud_config_reports_it_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "data"
    config = tmp_path / "a-folder"
    config.mkdir()
    run = python(
        "-m", "services.launcher", "--backend", "sim",
        "--simcloud-config", str(config), "--data-dir", str(data_dir),
    )  # fmt: skip
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert lines == [
        f"stack: simcloud exited with 1: mj-simcloud: cannot read {config}: "
        f"[Errno 21] Is a directory: '{config}' (log: {data_dir.resolve()}/service-logs/"
        "simcloud.log)"
    ]
    assert processes_of(data_dir) == []


def test_make_up_with_an_unknown_backend_is_one_line(tmp_path: Path) -> None:
    run = python(
        "-m",
        "services.launcher",
        "--data-dir",
        str(tmp_path),
        env=clean_env(MJ_BACKEND="bogus"),
    )
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "stack: error: MJ_BACKEND='bogus': choose one of local, sim, ssh"
    ]


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--metrics-port", "HELD"], "cannot serve metrics on 127.0.0.1:HELD (--metrics-port)"),
        (["--backend", "ssh", "--ssh-node-pools", "/nonexistent/pools.yaml"], "pools.yaml"),
    ],
    ids=["metrics-port-taken", "bad-backend-setting"],
)
def test_the_logs_service_refuses_a_setting_it_cannot_use_in_one_line(
    tmp_path: Path, held_port: int, flags: list[str], said: str
) -> None:
    flags = [f.replace("HELD", str(held_port)) for f in flags]
    run = python(
        "-m", "services.logs.main", "--port", "0", "--auth", "none",
        "--data-dir", str(tmp_path), *flags,
    )  # fmt: skip
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if not line.startswith("{")]
    assert len(errors) == 1 and errors[0].startswith("mj-logs"), run.stderr
    assert said.replace("HELD", str(held_port)) in errors[0]
    assert "Traceback" not in run.stderr and "Exception ignored" not in run.stderr


def test_free_ports_lie_below_the_ephemeral_range_and_are_never_handed_out_twice() -> None:
    """An outgoing connection can take no such port between the check and the bind."""
    floor = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert floor > PORTS_FROM + 1000  # as on every machine these tests run on
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(PORTS_FROM <= port < floor for port in ports)
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))

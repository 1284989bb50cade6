"""The history checker catches the real system with one protection turned off.

Each test below starts the whole system with one test-only switch on
(`MJ_TEST_DISABLE`, `services/common/test_switches.py`), arranges the situation
that switch's protection exists for (`harness/history_mutations.py`: a TCP proxy cutting
a replica off, a late report played by the test), and asserts that the checker
reports the violation the protection prevents, with its evidence. The same
scenarios with every protection on leave a clean history, so what is reported is
the switch's doing. `bench/history.py --mutations` runs them and records which
were caught.

The switches themselves (read once at start, unknown names refused) and the proxy
are tested first, without the system.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.history import Kind
from harness.history_mutations import MUTATIONS, MutationReport, mutation, run_mutation
from harness.reliability import ADMIN_URL
from harness.tcp_proxy import TcpProxy
from harness.waiting import wait_until
from services.common import test_switches
from services.common.test_switches import (
    CANCEL_ON_ASSIGNMENT,
    ENV,
    EPOCH_CHECK_AT_REPORT,
    LEASE_GUARD,
    SWITCHES,
)

# --- the switches ---------------------------------------------------------------------------


def test_switches_are_off_unless_named() -> None:
    assert test_switches.parse("") == frozenset()
    assert test_switches.parse(f" {LEASE_GUARD} ,{CANCEL_ON_ASSIGNMENT},") == {
        LEASE_GUARD,
        CANCEL_ON_ASSIGNMENT,
    }
    try:
        assert test_switches.load("mj-test", {}) == frozenset()
        assert not any(test_switches.disabled(name) for name in SWITCHES)
        assert test_switches.load("mj-test", {ENV: LEASE_GUARD}) == {LEASE_GUARD}
        assert test_switches.disabled(LEASE_GUARD)
        assert not test_switches.disabled(EPOCH_CHECK_AT_REPORT)
    finally:
        test_switches.load("mj-test", {})
    with pytest.raises(ValueError, match="'no-such-check' is not a test switch"):
        test_switches.disabled("no-such-check")


def test_a_name_that_is_not_a_switch_is_refused() -> None:
    with pytest.raises(ValueError, match="lease-gaurd is not a test switch"):
        test_switches.parse("lease-gaurd")
    with pytest.raises(SystemExit, match="mj-test: MJ_TEST_DISABLE: lease-gaurd"):
        test_switches.load("mj-test", {ENV: f"{EPOCH_CHECK_AT_REPORT},lease-gaurd"})
    assert not test_switches.disabled(EPOCH_CHECK_AT_REPORT)


@pytest.mark.parametrize("service", ["scheduler", "controller"])
def test_a_service_with_a_misspelt_switch_does_not_start(service: str, tmp_path: Path) -> None:
    env = {**os.environ, ENV: "epoch-check", "MJ_DATA_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", f"services.{service}.main", "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert f"mj-{service}: {ENV}: epoch-check is not a test switch" in done.stderr


# --- the proxy ------------------------------------------------------------------------------


@pytest.fixture
def echo_pair() -> Iterator[tuple[TcpProxy, socket.socket, socket.socket]]:
    """A proxy to a listening socket: (proxy, the client's end, the server's end)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    with TcpProxy(f"127.0.0.1:{port}") as proxy:
        host, proxy_port = proxy.address.rsplit(":", 1)
        client = socket.create_connection((host, int(proxy_port)), timeout=10)
        server, _ = listener.accept()
        server.settimeout(10)
        try:
            yield proxy, client, server
        finally:
            client.close()
            server.close()
            listener.close()


def nothing_to_read(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        sock.recv(1)
    except BlockingIOError:
        return True
    finally:
        sock.settimeout(10)
    return False


def test_the_proxy_forwards_and_holds_each_direction(
    echo_pair: tuple[TcpProxy, socket.socket, socket.socket],
) -> None:
    proxy, client, server = echo_pair
    client.sendall(b"up")
    assert server.recv(2) == b"up"
    proxy.hold()
    client.sendall(b"held up")
    server.sendall(b"held down")
    # Both chunks are read by the proxy and kept at its gate: neither end can have them.
    wait_until(lambda: proxy.waiting == 2, what="both chunks held")
    assert nothing_to_read(server) and nothing_to_read(client)
    proxy.release()
    assert server.recv(7) == b"held up"
    assert client.recv(9) == b"held down"
    proxy.hold(upstream=False)
    server.sendall(b"down")
    client.sendall(b"still up")
    assert server.recv(8) == b"still up"
    wait_until(lambda: proxy.waiting == 1, what="the downstream chunk held")
    assert nothing_to_read(client)
    proxy.release()
    assert client.recv(4) == b"down"


# --- the mutation runs ----------------------------------------------------------------------


@pytest.fixture
def admin_url(postgres_base: str) -> str:
    """The PostgreSQL server's admin URL (skipped when unreachable, failed under CI)."""
    return ADMIN_URL


def mutated(switch: str, tmp_path: Path, admin_url: str) -> MutationReport:
    report = run_mutation(mutation(switch), tmp_path / switch, admin_url, log=print)
    print(report.details)
    assert report.caught, report.details
    return report


def only_of(report: MutationReport, kind: Kind) -> list[str]:
    return [v.evidence for v in report.violations if v.kind == kind]


@pytest.mark.e2e
@pytest.mark.postgres
@pytest.mark.timeout(240)
def test_without_the_epoch_check_a_late_report_is_a_stale_report(
    tmp_path: Path, admin_url: str
) -> None:
    report = mutated(EPOCH_CHECK_AT_REPORT, tmp_path, admin_url)
    (evidence,) = only_of(report, Kind.STALE_REPORT)
    assert "epoch 1" in evidence and "the current assignment epoch was 2" in evidence


@pytest.mark.e2e
@pytest.mark.postgres
@pytest.mark.timeout(240)
def test_without_the_lease_guard_a_cut_off_replica_makes_a_stale_call(
    tmp_path: Path, admin_url: str
) -> None:
    report = mutated(LEASE_GUARD, tmp_path, admin_url)
    (evidence,) = only_of(report, Kind.STALE_CALL)
    # The cloud could not refuse it: the notice went to a cluster the new holder adopted.
    assert "a notice of cluster" in evidence and "with epoch 1" in evidence
    assert "the assignment was epoch 2" in evidence


@pytest.mark.e2e
@pytest.mark.postgres
@pytest.mark.timeout(240)
def test_without_cancel_on_assignment_a_cancel_in_flight_is_not_honoured(
    tmp_path: Path, admin_url: str
) -> None:
    report = mutated(CANCEL_ON_ASSIGNMENT, tmp_path, admin_url)
    (evidence,) = only_of(report, Kind.CANCEL_NOT_HONOURED)
    assert "ended SUCCEEDED" in evidence


@pytest.mark.e2e
@pytest.mark.postgres
@pytest.mark.timeout(240)
@pytest.mark.parametrize("switch", [m.switch for m in MUTATIONS])
def test_with_every_protection_on_the_same_scenario_leaves_a_clean_history(
    switch: str, tmp_path: Path, admin_url: str
) -> None:
    report = run_mutation(mutation(switch), tmp_path / switch, admin_url, True, log=print)
    assert report.violations == [], report.details

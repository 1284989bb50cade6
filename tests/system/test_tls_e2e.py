"""The whole system as processes with TLS and mTLS between all of them (`Stack(tls=True)`),
driven through `mj` and the real `grpcurl` with the CA, a client certificate and a token.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness.e2e import ROOT, assert_no_tracebacks, mj
from services.common.channels import ClientSecurity, open_sync_channel
from services.launcher.stack import Stack

pytestmark = pytest.mark.e2e
GRPCURL = str(Path(sys.executable).parent / "grpcurl")
FAST = ["--poll-interval", "0.2", "--grace-seconds", "0.2", "--start-check-interval", "0.1"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    data = tmp_path_factory.mktemp("tls-stack")
    with Stack(data, replicas=1, controller_args=FAST, tls=True) as running:
        yield running
    assert_no_tracebacks(data)


def grpcurl(stack: Stack, *args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    assert stack.credentials.tls_dir is not None
    tls = stack.credentials.tls_dir
    flags = ["-cacert", str(tls / "ca.pem"), "-cert", str(tls / "admin.pem")]
    flags += ["-key", str(tls / "admin.key")]
    if token is not None:
        flags += ["-H", f"authorization: Bearer {token}"]
    return subprocess.run(
        [GRPCURL, *flags, *args], capture_output=True, text=True, timeout=30, check=False
    )


def test_mj_runs_a_job_over_mtls(stack: Stack) -> None:
    result = mj(stack, "launch", "examples/hello.yaml")
    assert result.returncode == 0, result.stderr
    assert "hello from rank 0 of 1" in result.stdout
    assert result.stdout.rstrip().endswith("SUCCEEDED")


def test_grpcurl_with_the_ca_a_certificate_and_a_token(stack: Stack) -> None:
    method = "managedjobs.v1.SchedulerService/GetSchedulerState"
    answered = grpcurl(stack, stack.scheduler_address, method, token=stack.credentials.admin_token)
    assert answered.returncode == 0, answered.stderr
    replicas = json.loads(answered.stdout)["replicas"]
    assert [(r["controller_id"], r["connected"]) for r in replicas] == [("controller-1", True)]
    refused = grpcurl(stack, stack.scheduler_address, method)
    assert refused.returncode != 0 and "Unauthenticated" in refused.stderr
    listed = grpcurl(stack, stack.scheduler_address, "list")  # reflection needs no token
    assert "managedjobs.v1.JobService" in listed.stdout.split()


def test_a_client_without_tls_or_without_a_certificate_is_refused(stack: Stack) -> None:
    assert stack.credentials.client_security.tls is not None
    no_cert = ClientSecurity(
        None, type(stack.credentials.client_security.tls)(stack.credentials.client_security.tls.ca)
    )
    for security in (ClientSecurity(), no_cert):
        with open_sync_channel(stack.scheduler_address, security) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]


def test_mj_without_a_token_is_unauthenticated(stack: Stack, tmp_path: Path) -> None:
    env = {**os.environ, **stack.client_env(), "MJ_DATA_DIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "queue"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "mj: queue: UNAUTHENTICATED: authorization: a bearer token is required (no token "
        "given: use --token or MJ_TOKEN, --token-file, or MJ_DATA_DIR set to the data dir "
        "of `make up`)"
    )

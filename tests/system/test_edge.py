"""The security edge on a real grpc.aio server: tokens, roles, the principal, decoding,
bounded errors, audit lines, and health and reflection left open.

The servicers here are small stand-ins registered under the real service names,
so the real policy table applies; each reports the principal it was handed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from harness.identities import Identities, make_identities
from managedjobs.v1 import (
    controller_service_pb2,
    controller_service_pb2_grpc,
    job_service_pb2,
    log_service_pb2,
    log_service_pb2_grpc,
    scheduler_service_pb2,
    scheduler_service_pb2_grpc,
)
from services.common.bounds import quote
from services.common.channels import ClientSecurity, open_channel
from services.common.errors import InvalidArgument, Unavailable, rpc_errors
from services.common.security.access import current_principal
from services.common.security.edge import ServerSecurity, job_ids
from services.common.security.tls import ClientTls
from services.common.server import Server

Context = grpc.aio.ServicerContext[Any, Any]
HUGE = "é" * 1_000_000


def describe() -> str:
    p = current_principal()
    return f"{p.user}|{p.role.value}|{p.controller_id}|{','.join(sorted(p.cert_names))}"


class StateStandIn(controller_service_pb2_grpc.ControllerServiceServicer):
    """GetControllerState (admin) answering with the principal it sees."""

    @rpc_errors
    async def GetControllerState(
        self, request: controller_service_pb2.GetControllerStateRequest, context: Context
    ) -> controller_service_pb2.GetControllerStateResponse:
        seen = describe()

        async def in_a_task() -> str:
            return describe()

        # A task started by the handler inherits the caller.
        inherited = await asyncio.create_task(in_a_task())
        await asyncio.sleep(0.05)  # concurrent calls overlap here
        assert describe() == seen == inherited
        return controller_service_pb2.GetControllerStateResponse(controller_id=seen)


class LogsStandIn(log_service_pb2_grpc.LogServiceServicer):
    """ReadLogs (user, admin) streams the principal, or for job 99 fails once the caller
    has gone (as a database driver does that turns the cancellation into its own error);
    FetchTaskLogs (controller) fails big."""

    late_failures: asyncio.Queue[str] = asyncio.Queue()

    @rpc_errors
    async def ReadLogs(
        self, request: log_service_pb2.ReadLogsRequest, context: Context
    ) -> AsyncIterator[log_service_pb2.ReadLogsResponse]:
        if request.job_id == 99:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.late_failures.put_nowait("failed after the caller left")
                raise Unavailable("the database went away") from None
        for _ in range(2):
            yield log_service_pb2.ReadLogsResponse(job_id=request.job_id, data=describe().encode())

    @rpc_errors
    async def FetchTaskLogs(
        self, request: log_service_pb2.FetchTaskLogsRequest, context: Context
    ) -> log_service_pb2.FetchTaskLogsResponse:
        if request.cluster_name == "huge":
            raise InvalidArgument(
                f"cluster_name: {request.handle_json} is not known", reason="CLUSTER_UNKNOWN",
                **{f"key{i}": request.handle_json for i in range(20)},
            )  # fmt: skip
        return log_service_pb2.FetchTaskLogsResponse(bytes_stored=request.job_id)


class SchedulerStandIn(scheduler_service_pb2_grpc.SchedulerServiceServicer):
    """ConnectController (controller) answers each message with the principal;
    GetSchedulerState (admin), written without `rpc_errors`, raises `failure`."""

    failure: Exception = RuntimeError("unset")

    async def GetSchedulerState(
        self, request: scheduler_service_pb2.GetSchedulerStateRequest, context: Context
    ) -> scheduler_service_pb2.GetSchedulerStateResponse:
        raise self.failure

    @rpc_errors
    async def ConnectController(
        self,
        request_iterator: AsyncIterator[scheduler_service_pb2.ConnectControllerRequest],
        context: Context,
    ) -> AsyncIterator[scheduler_service_pb2.ConnectControllerResponse]:
        async for request in request_iterator:
            ack = scheduler_service_pb2.ReportAck(ack_seq=request.seq, reason=describe())
            yield scheduler_service_pb2.ConnectControllerResponse(ack=ack)


@contextlib.asynccontextmanager
async def serving(security: ServerSecurity) -> AsyncIterator[str]:
    server = Server("127.0.0.1", 0, security=security)
    server.add(
        controller_service_pb2_grpc.add_ControllerServiceServicer_to_server,
        StateStandIn(),
        "managedjobs.v1.ControllerService",
    )
    server.add(
        log_service_pb2_grpc.add_LogServiceServicer_to_server,
        LogsStandIn(),
        "managedjobs.v1.LogService",
    )
    server.add(
        scheduler_service_pb2_grpc.add_SchedulerServiceServicer_to_server,
        SchedulerStandIn(),
        "managedjobs.v1.SchedulerService",
    )
    port = await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


@pytest.fixture
def ids(tmp_path: Path) -> Identities:
    return make_identities(tmp_path)


@pytest.fixture
async def address(ids: Identities) -> AsyncIterator[str]:
    async with serving(ids.server("scheduler", tls=False)) as running:
        yield running


def error_info(error: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    for key, value in error.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            info = error_details_pb2.ErrorInfo()
            status_pb2.Status.FromString(value).details[0].Unpack(info)
            return info
    raise AssertionError("no ErrorInfo")


async def state(address: str, security: ClientSecurity) -> str:
    async with open_channel(address, security) as channel:
        stub = controller_service_pb2_grpc.ControllerServiceStub(channel)
        reply = await stub.GetControllerState(
            controller_service_pb2.GetControllerStateRequest(), timeout=10
        )
        return reply.controller_id


async def refused(address: str, security: ClientSecurity) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await state(address, security)
    return caught.value


@pytest.mark.parametrize(
    ("metadata", "reason"),
    [
        ((), "TOKEN_MISSING"),
        ((("authorization", "Basic abc"),), "TOKEN_MALFORMED"),
        ((("authorization", "Bearer mj_not-a-token-anyone-has"),), "TOKEN_UNKNOWN"),
    ],
)
async def test_a_call_without_a_known_token_is_unauthenticated(
    address: str, metadata: tuple[tuple[str, str], ...], reason: str
) -> None:
    async with open_channel(address, ClientSecurity()) as channel:
        stub = controller_service_pb2_grpc.ControllerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.GetControllerState(
                controller_service_pb2.GetControllerStateRequest(), metadata=metadata, timeout=10
            )
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error_info(caught.value).reason == reason


async def test_a_role_outside_the_policy_is_permission_denied(
    address: str, ids: Identities
) -> None:
    error = await refused(address, ids.client("user", tls=False))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error_info(error).reason == "ROLE_FORBIDDEN"
    assert "not allowed for role user" in (error.details() or "")


async def test_the_handler_sees_the_caller_and_concurrent_calls_do_not_mix(
    address: str, ids: Identities, tmp_path: Path
) -> None:
    from services.common.security.auth import Role, add_token

    other_admin = add_token(ids.tokens_file, "ops", Role.ADMIN)
    seen = await asyncio.gather(
        state(address, ids.client("admin", tls=False)),
        state(address, ClientSecurity.of(other_admin)),
        state(address, ids.client("admin", tls=False)),
    )
    assert seen == ["root|admin||", "ops|admin||", "root|admin||"]


async def test_streams_see_the_caller(address: str, ids: Identities) -> None:
    async with open_channel(address, ids.client("user", tls=False)) as channel:
        stub = log_service_pb2_grpc.LogServiceStub(channel)
        chunks = [r.data async for r in stub.ReadLogs(log_service_pb2.ReadLogsRequest(job_id=1))]
    assert chunks == [b"alice|user||"] * 2
    async with open_channel(address, ids.client("controller", tls=False)) as channel:
        stub2 = scheduler_service_pb2_grpc.SchedulerServiceStub(channel)

        async def two() -> AsyncIterator[scheduler_service_pb2.ConnectControllerRequest]:
            for seq in (1, 2):
                yield scheduler_service_pb2.ConnectControllerRequest(seq=seq)

        acks = [r.ack async for r in stub2.ConnectController(two())]
    assert [(a.ack_seq, a.reason) for a in acks] == [
        (1, "controller-1|controller|controller-1|"),
        (2, "controller-1|controller|controller-1|"),
    ]


async def test_health_and_reflection_need_no_token(address: str) -> None:
    async with open_channel(address, ClientSecurity()) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)

        async def ask() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        names = {
            s.name
            async for r in stub.ServerReflectionInfo(ask())
            for s in r.list_services_response.service
        }
    assert "managedjobs.v1.ControllerService" in names


async def test_undecodable_bytes_are_invalid_argument_after_authentication(
    address: str, ids: Identities
) -> None:
    garbage = b"\xff\xff\xff\xff"
    method = "/managedjobs.v1.ControllerService/GetControllerState"
    errors = {}
    for caller in ("admin", "none"):
        async with open_channel(address, ids.client(caller, tls=False)) as channel:
            call = channel.unary_unary(method)  # no serializers: bytes in, bytes out
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call(garbage, timeout=10)
        errors[caller] = caught.value
    assert errors["admin"].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert errors["admin"].details() == "request: cannot be decoded"
    assert error_info(errors["admin"]).reason == "REQUEST_UNDECODABLE"
    # Who may not call learns nothing about how the bytes parse.
    assert errors["none"].code() == grpc.StatusCode.UNAUTHENTICATED


async def test_an_undecodable_message_on_a_client_stream_is_invalid_argument(
    address: str, ids: Identities
) -> None:
    ok = scheduler_service_pb2.ConnectControllerRequest(seq=1).SerializeToString()
    async with open_channel(address, ids.client("controller", tls=False)) as channel:
        call = channel.stream_stream("/managedjobs.v1.SchedulerService/ConnectController")

        async def messages() -> AsyncIterator[bytes]:
            yield ok
            yield b"\xff\xff\xff\xff"

        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in call(messages(), timeout=10):
                pass
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "request: cannot be decoded"


async def test_an_error_echoing_a_huge_input_stays_within_metadata_limits(
    address: str, ids: Identities
) -> None:
    async with open_channel(address, ids.client("controller", tls=False)) as channel:
        stub = log_service_pb2_grpc.LogServiceStub(channel)
        request = log_service_pb2.FetchTaskLogsRequest(cluster_name="huge", handle_json=HUGE)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.FetchTaskLogs(request, timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = caught.value.details() or ""
    assert details.startswith("cluster_name: éé") and len(details.encode()) <= 1024
    info = error_info(caught.value)
    assert info.reason == "CLUSTER_UNKNOWN"
    assert 0 < len(info.metadata) <= 4
    assert all(len(v.encode()) <= 256 for v in info.metadata.values())


@pytest.mark.parametrize(
    ("failure", "code"),
    [
        (InvalidArgument(f"name: {HUGE}", reason="NAME_INVALID"), grpc.StatusCode.INVALID_ARGUMENT),
        (RuntimeError(HUGE), grpc.StatusCode.INTERNAL),
    ],
)
async def test_the_edge_answers_for_a_handler_without_rpc_errors(
    address: str, ids: Identities, failure: Exception, code: grpc.StatusCode
) -> None:
    SchedulerStandIn.failure = failure
    async with open_channel(address, ids.client("admin", tls=False)) as channel:
        stub = scheduler_service_pb2_grpc.SchedulerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.GetSchedulerState(scheduler_service_pb2.GetSchedulerStateRequest())
    assert caught.value.code() == code
    assert 100 < len((caught.value.details() or "").encode()) <= 1024


async def test_a_handler_failing_after_its_caller_left_ends_quietly(
    address: str, ids: Identities, caplog: pytest.LogCaptureFixture
) -> None:
    """The status of a call already over cannot be sent; that is no bug to log."""
    caplog.set_level(logging.WARNING)
    async with open_channel(address, ids.client("admin", tls=False)) as channel:
        stub = log_service_pb2_grpc.LogServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.ReadLogs(log_service_pb2.ReadLogsRequest(job_id=99), timeout=0.2):
                pass
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await asyncio.wait_for(LogsStandIn.late_failures.get(), 5)
        # The server still answers (a round trip: the failed handler's end ran meanwhile),
        # and logged nothing about the late failure.
        assert await state(address, ids.client("admin", tls=False))
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_quote_shows_at_most_200_characters() -> None:
    assert quote("abc") == "'abc'"
    quoted = quote("x" * 1_000_000)
    assert quoted.startswith("'" + "x" * 200) and "(1,000,000 characters)" in quoted
    assert len(quoted) < 240


async def test_mutating_calls_leave_an_audit_line(
    address: str, ids: Identities, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="audit")
    async with open_channel(address, ids.client("controller", tls=False)) as channel:
        stub = log_service_pb2_grpc.LogServiceStub(channel)
        await stub.FetchTaskLogs(log_service_pb2.FetchTaskLogsRequest(job_id=7), timeout=10)
    async with open_channel(address, ids.client("user", tls=False)) as channel:
        stub = log_service_pb2_grpc.LogServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.FetchTaskLogs(log_service_pb2.FetchTaskLogsRequest(job_id=8), timeout=10)
        # Reads are not audited.
        _ = [r async for r in stub.ReadLogs(log_service_pb2.ReadLogsRequest(job_id=1))]
    lines = [vars(r) for r in caplog.records if r.name == "audit"]
    assert [(r["user"], r["role"], r["method"], r["job_ids"], r["code"]) for r in lines] == [
        ("controller-1", "controller", "/managedjobs.v1.LogService/FetchTaskLogs", [7], "OK"),
        ("alice", "user", "/managedjobs.v1.LogService/FetchTaskLogs", [8], "PERMISSION_DENIED"),
    ]


def test_the_audit_names_the_jobs_of_a_batchs_items() -> None:
    fetches = [log_service_pb2.FetchTaskLogsRequest(job_id=n) for n in (5, 3, 5)]
    batch = log_service_pb2.BatchFetchTaskLogsRequest(fetches=fetches)
    assert job_ids(batch, log_service_pb2.BatchFetchTaskLogsResponse()) == [3, 5]
    lines = [log_service_pb2.ControllerLogLine(job_id=9, line="x")]
    assert job_ids(log_service_pb2.AppendControllerLogsRequest(lines=lines)) == [9]
    # A map is no list of items; a message that names no job adds none.
    submit = job_service_pb2.SubmitJobRequest(envs={"job_id": "4"}, secrets={"K": "V"})
    assert job_ids(submit, job_service_pb2.SubmitJobResponse(job_id=7)) == [7]
    many = job_service_pb2.SubmitJobsRequest(jobs=[submit, submit])
    assert job_ids(many, job_service_pb2.SubmitJobsResponse(job_ids=[8, 6])) == [6, 8]


async def test_without_auth_every_caller_is_an_anonymous_admin(ids: Identities) -> None:
    async with serving(ServerSecurity.without_auth()) as address:
        assert await state(address, ClientSecurity()) == "|admin||"
        async with open_channel(address, ClientSecurity()) as channel:
            stub = log_service_pb2_grpc.LogServiceStub(channel)
            reply = await stub.FetchTaskLogs(
                log_service_pb2.FetchTaskLogsRequest(job_id=3), timeout=10
            )
    assert reply.bytes_stored == 3


# --- TLS and mTLS -------------------------------------------------------------------------


async def test_tls_serves_a_client_that_trusts_the_ca_and_refuses_plaintext(
    ids: Identities,
) -> None:
    async with serving(ids.server("scheduler", tls=True, mtls=False)) as address:
        trusting = ids.client("admin", tls=True)
        without_cert = ClientSecurity(trusting.token, ClientTls(trusting.tls.ca))  # type: ignore[union-attr]
        assert await state(address, without_cert) == "root|admin||"
        error = await refused(address, ids.client("admin", tls=False))
        assert error.code() == grpc.StatusCode.UNAVAILABLE


async def test_mtls_refuses_a_client_without_a_certificate(ids: Identities) -> None:
    async with serving(ids.server("scheduler", tls=True)) as address:
        trusting = ids.client("admin", tls=True)
        without_cert = ClientSecurity(trusting.token, ClientTls(trusting.tls.ca))  # type: ignore[union-attr]
        error = await refused(address, without_cert)
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        # With its certificate the caller gets through, its names visible to the handler.
        seen = await state(address, trusting)
    assert seen == "root|admin||admin"


async def test_mtls_shows_the_replica_certificate_to_the_handler(ids: Identities) -> None:
    async def one() -> AsyncIterator[scheduler_service_pb2.ConnectControllerRequest]:
        yield scheduler_service_pb2.ConnectControllerRequest(seq=1)

    async with (
        serving(ids.server("scheduler", tls=True)) as address,
        open_channel(address, ids.client("controller", tls=True)) as channel,
    ):
        stub = scheduler_service_pb2_grpc.SchedulerServiceStub(channel)
        acks = [r.ack.reason async for r in stub.ConnectController(one())]
    user, role, bound, names = acks[0].split("|")
    assert (user, role, bound) == ("controller-1", "controller", "controller-1")
    assert {"controller-1", "localhost", "127.0.0.1"} <= set(names.split(","))


def test_certificates_name_their_host_or_controller(ids: Identities) -> None:
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def load(name: str) -> x509.Certificate:
        return x509.load_pem_x509_certificate((ids.tls_dir / f"{name}.pem").read_bytes())

    replica = load("controller-1")
    assert replica.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "controller-1"
    sans = replica.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "controller-1" in sans.get_values_for_type(x509.DNSName)
    usages = replica.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.CLIENT_AUTH in usages and ExtendedKeyUsageOID.SERVER_AUTH in usages
    client = load("admin").extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(client) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    for key in ids.tls_dir.glob("*.key"):
        assert key.stat().st_mode & 0o777 == 0o600, key


def test_making_certificates_again_keeps_what_exists(ids: Identities) -> None:
    from services.common.security.certs import make_certificates

    before = {p.name: p.read_bytes() for p in ids.tls_dir.iterdir()}
    make_certificates(ids.tls_dir, hosts=["scheduler", "extra"], controllers=["controller-1"])
    after = {p.name: p.read_bytes() for p in ids.tls_dir.iterdir()}
    assert {k: after[k] for k in before} == before
    assert set(after) - set(before) == {"extra.pem", "extra.key"}


def test_require_controller_wants_the_bound_id_and_the_certificate_name() -> None:
    from services.common.errors import PermissionDenied
    from services.common.security.access import require_controller
    from services.common.security.auth import Principal, Role

    bound = Principal("controller-1", Role.CONTROLLER, "controller-1")
    require_controller(bound, "controller-1")
    with pytest.raises(PermissionDenied) as wrong_id:
        require_controller(bound, "controller-2")
    assert wrong_id.value.reason == "CONTROLLER_MISMATCH"
    certified = Principal("controller-1", Role.CONTROLLER, "controller-1", frozenset({"c-9"}))
    with pytest.raises(PermissionDenied):
        require_controller(certified, "controller-1")
    with pytest.raises(PermissionDenied):
        require_controller(Principal("ops", Role.ADMIN), "controller-1")


# --- plaintext stays on loopback ------------------------------------------------------------


async def test_a_server_refuses_plaintext_beyond_loopback(ids: Identities) -> None:
    from services.common.security.edge import InsecureListen

    with pytest.raises(InsecureListen, match="without TLS"):
        Server("0.0.0.0", 0, security=ids.server("scheduler", tls=False))
    Server("127.0.0.1", 0, security=ids.server("scheduler", tls=False))
    Server("0.0.0.0", 0, security=ids.server("scheduler", tls=True))
    insecure = ServerSecurity(None, None, insecure=True)
    Server("0.0.0.0", 0, security=insecure)


def test_mj_scheduler_exits_with_one_line_beyond_loopback_without_tls(
    ids: Identities, tmp_path: Path
) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "services.scheduler.main", "--host", "0.0.0.0", "--port", "0",
         "--tokens-file", str(ids.tokens_file), "--data-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "mj-scheduler: refusing to listen on 0.0.0.0 without TLS: give --tls-cert and "
        "--tls-key, or --insecure to serve plaintext anyway"
    ]

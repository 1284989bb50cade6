"""Hostile input, proven (contract §19): every RPC of every service, fuzzed against real servers.

For each RPC of `access.POLICY`, hypothesis generates requests from the proto
descriptors (`fuzzing.attempts`: extreme and random values in every field, valid
requests with fields replaced, random and truncated bytes) and sends them to the
four servers of `inprocess` (scheduler on SQLite and on PostgreSQL, controller
replica, logs, sim cloud), mostly as an admin and for a sample as a user or a
controller. Every answer must be a clear error or a success: never INTERNAL or
UNKNOWN, UNAVAILABLE only from the sim cloud (an outage an operator call injected),
DEADLINE_EXCEEDED only for a stream the test cut (or a Terminate that grants a
grace), an ErrorInfo with a domain reason on every error, short messages that
quote at most 200 characters of the input (`fuzzing.problems`).

A refused request stores nothing: around each call of a method that writes, the
state it would write (the jobs and their cancel flags, the cloud's inventory and
regions, the logs service's files) is read before and after, and must not change
when the call failed. At the end every server is SERVING and no service logged an
error or a traceback.

Bounded: `EXAMPLES` examples per RPC and `BUDGET` seconds for each, so the file
takes well under a minute; the `ci` profile (tests/conftest.py) derandomizes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path

import pytest
from fuzz_system import fuzzing_system, health
from fuzzing import attempts, explore
from grpc_health.v1 import health_pb2
from identities import Identities, make_identities

from services.common.access import POLICY

EXAMPLES = 25
# Seconds of generated calls per RPC; the examples left when it runs out are skipped.
BUDGET = 2.0
# Answers of the edge, before any handler ran.
EDGE_REASONS = {"REQUEST_UNDECODABLE", "ROLE_FORBIDDEN", "TOKEN_UNKNOWN", "TOKEN_MISSING"}


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> Identities:
    return make_identities(tmp_path_factory.mktemp("identities"))


def logged_errors(records: list[logging.LogRecord]) -> list[str]:
    """Records that are errors or carry a traceback."""
    found = []
    for record in records:
        if record.levelno < logging.ERROR and not record.exc_info:
            continue
        error = record.exc_info[1] if record.exc_info else None
        found.append(f"{record.name}: {record.getMessage()[:200]} {error!r:.300}")
    return found


async def test_every_rpc_answers_hostile_requests_with_clear_errors(
    ids: Identities, tmp_path: Path, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    loop = asyncio.get_running_loop()
    ran: dict[str, int] = {}
    async with fuzzing_system(ids, tmp_path, database_url) as fuzzer:
        for method in POLICY:
            ran[method] = await asyncio.to_thread(
                explore, attempts(method), fuzzer.check, loop, examples=EXAMPLES, budget=BUDGET
            )
        # Checked before the servers stop: what they log then is not about the requests.
        for address in dataclasses.astuple(fuzzer.system):
            assert await health(address) == health_pb2.HealthCheckResponse.SERVING, address
        errors = logged_errors(caplog.records)
    assert errors == []
    assert all(count >= 1 for count in ran.values()), ran
    # The requests reached the handlers: every RPC answered something past the edge.
    past_the_edge = {
        method
        for method, outcomes in fuzzer.outcomes.items()
        if any(o.reason not in EDGE_REASONS for o in outcomes)
    }
    assert past_the_edge == set(POLICY)

"""Hostile input, proven (contract §19): every RPC of every service, fuzzed against real servers.

For each RPC of `access.POLICY`, hypothesis generates requests from the proto
descriptors (`fuzzing.attempts`: extreme and random values in every field, valid
requests with fields replaced, random and truncated bytes) and sends them to the
four servers of `inprocess` (controller replica, logs, sim cloud, and the scheduler
on SQLite; on PostgreSQL again for the scheduler's own RPCs, the only ones its
database answers), mostly as an admin and for a sample as a user or a controller.
Every answer must be a clear error or a success: never INTERNAL or UNKNOWN,
UNAVAILABLE only from the sim cloud (an outage an operator call injected),
DEADLINE_EXCEEDED only for a stream the test cut (or a Terminate that grants a
grace), an ErrorInfo with a domain reason on every error, short messages that
quote at most 200 characters of the input (`fuzzing.problems`).

A refused request stores nothing: around each call of a method that writes, the
state it would write (the jobs and their cancel flags, the cloud's inventory and
regions, the logs service's files) is read before and after, and must not change
when the call failed. At the end every server is SERVING and no service logged an
error or a traceback.

`EXAMPLES` examples per RPC, all of them run (no time budget), drawn from a fresh
seed each run: the seed is printed, a failure names it, and `MJ_FUZZ_SEED=N`
draws the same examples again (`fuzzing.explore`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2
from hypothesis import strategies as st

from harness.fuzz_system import fuzzing_system, health
from harness.fuzzing import SEED_VARIABLE, attempts, explore, fuzz_seed
from harness.identities import Identities, make_identities
from services.common.security.access import POLICY, service_of

EXAMPLES = 200
# The services whose answers come from the scheduler's database.
SCHEDULER = {"managedjobs.v1.JobService", "managedjobs.v1.SchedulerService"}
# Answers of the edge, before any handler ran.
EDGE_REASONS = {"REQUEST_UNDECODABLE", "ROLE_FORBIDDEN", "TOKEN_UNKNOWN", "TOKEN_MISSING"}


@pytest.fixture(scope="module")
def ids(tmp_path_factory: pytest.TempPathFactory) -> Identities:
    return make_identities(tmp_path_factory.mktemp("identities"))


@pytest.fixture(scope="module")
def seed() -> int:
    """One seed for the module's runs, so `MJ_FUZZ_SEED` repeats all of them."""
    return fuzz_seed()


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
    ids: Identities,
    tmp_path: Path,
    database_url: str,
    seed: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    print(f"{SEED_VARIABLE}={seed}")  # shown with any failure
    caplog.set_level(logging.WARNING)
    loop = asyncio.get_running_loop()
    on_sqlite = database_url.startswith("sqlite")
    methods = [m for m in POLICY if on_sqlite or service_of(m) in SCHEDULER]
    ran: dict[str, int] = {}
    async with fuzzing_system(ids, tmp_path, database_url) as fuzzer:
        for method in methods:
            ran[method] = await asyncio.to_thread(
                explore, attempts(method), fuzzer.check, loop, examples=EXAMPLES, seed=seed
            )
        # Checked before the servers stop: what they log then is not about the requests.
        for address in dataclasses.astuple(fuzzer.system):
            assert await health(address) == health_pb2.HealthCheckResponse.SERVING, address
        errors = logged_errors(caplog.records)
    assert errors == []
    assert ran == dict.fromkeys(methods, EXAMPLES)
    # The requests reached the handlers: every RPC answered something past the edge.
    past_the_edge = {
        method
        for method, outcomes in fuzzer.outcomes.items()
        if any(o.reason not in EDGE_REASONS for o in outcomes)
    }
    assert past_the_edge == set(methods)


async def test_a_seed_draws_the_same_examples_again_and_a_failure_names_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop = asyncio.get_running_loop()

    def drawn(seed: int) -> Awaitable[list[int]]:
        seen: list[int] = []

        async def check(example: int) -> list[str]:
            seen.append(example)
            return []

        async def run() -> list[int]:
            ran = await asyncio.to_thread(
                explore, st.integers(), check, loop, examples=30, seed=seed
            )
            assert ran == 30
            return seen

        return run()

    assert await drawn(7) == await drawn(7)
    assert await drawn(7) != await drawn(8)
    monkeypatch.setenv(SEED_VARIABLE, "7")
    assert fuzz_seed() == 7

    async def refuse_big(example: int) -> list[str]:
        return ["too big"] if example > 1000 else []

    with pytest.raises(AssertionError, match="too big") as caught:
        await asyncio.to_thread(explore, st.integers(), refuse_big, loop, examples=100, seed=7)
    assert f"{SEED_VARIABLE}=7 draws these examples again" in caught.value.__notes__

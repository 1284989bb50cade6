"""Benchmark: the fuzz test's generator, run longer, counting every answer.

Starts the four servers in this process as the fuzz test does (tests/system/test_fuzz.py:
scheduler, a controller replica, logs, sim cloud; tokens and roles on), and for
each RPC of the access policy sends `--examples` hypothesis-generated requests
(or as many as fit in `--seconds` per RPC), without shrinking. Prints one JSON
line: per RPC the examples run, the count of each status code and of each error
reason, and the problems found (INTERNAL or UNKNOWN, an error without a domain
reason, a message too long, a refused request that changed state), with the first
few described; what the servers logged as errors or with a traceback, by logger
and message; plus the machine.

    python bench/fuzz.py [--examples 500] [--seconds 30] [--database-url URL]
                         [--methods SUBSTRING] [--seed N]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from harness.bench.machine import machine
from harness.bench.results import record
from harness.fuzz_system import Fuzzer, fuzzing_system
from harness.fuzzing import Attempt, attempts, explore, fuzz_seed
from harness.identities import make_identities
from services.common.security.access import POLICY

SHOWN_PROBLEMS = 20


@dataclasses.dataclass
class Tally:
    """The answers to one RPC's examples."""

    fuzzer: Fuzzer
    problems: list[str]
    codes: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    reasons: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    found: int = 0

    async def check(self, attempt: Attempt) -> list[str]:
        try:
            listed = await self.fuzzer.check(attempt)
        except grpc.aio.AioRpcError as error:
            # The state read around the call failed: the server is in trouble.
            self.codes["CHECK_FAILED"] += 1
            self.problems.append(f"{attempt!r:.400}: reading state failed: {error.details()}")
            self.found += 1
            return []
        outcome = self.fuzzer.outcomes[attempt.method][-1]
        self.codes[outcome.code.name] += 1
        if outcome.reason:
            self.reasons[outcome.reason] += 1
        self.found += bool(listed)
        self.problems.extend(f"{attempt!r:.400}: {p}" for p in listed)
        return []  # count, never stop


class LoggedErrors(logging.Handler):
    """Counts what the servers log as errors or with a traceback, by logger."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR or record.exc_info:
            self.counts[f"{record.name}: {record.getMessage()[:120]}"] += 1


async def run(args: argparse.Namespace) -> dict[str, Any]:
    methods = [m for m in POLICY if args.methods in m]
    seed = fuzz_seed() if args.seed is None else args.seed
    logged = LoggedErrors()
    logging.getLogger().addHandler(logged)
    report: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mj-fuzz-") as folder:
        ids = make_identities(Path(folder) / "ids")
        data = Path(folder) / "system"
        data.mkdir()
        loop = asyncio.get_running_loop()
        async with fuzzing_system(ids, data, args.database_url) as fuzzer:
            for method in methods:
                tally = Tally(fuzzer, problems)
                ran = await asyncio.to_thread(
                    explore,
                    attempts(method),
                    tally.check,
                    loop,
                    examples=args.examples,
                    budget=args.seconds,
                    shrink=False,
                    seed=seed,
                )
                report[method.strip("/")] = {
                    "examples": ran,
                    "codes": dict(tally.codes.most_common()),
                    "reasons": dict(tally.reasons.most_common()),
                    "problems": tally.found,
                }
    return {
        "bench": "fuzz",
        "examples_per_rpc": args.examples,
        "seconds_per_rpc": args.seconds,
        "seed": seed,
        "database": "postgresql" if args.database_url.startswith("postgres") else "sqlite",
        "rpcs": report,
        "problems_total": len(problems),
        "problems_shown": problems[:SHOWN_PROBLEMS],
        "logged_errors": dict(logged.counts.most_common()),
        "elapsed_seconds": round(time.monotonic() - started, 1),
        "machine": machine(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=500, help="examples per RPC")
    parser.add_argument("--seconds", type=float, default=30.0, help="time budget per RPC")
    parser.add_argument(
        "--database-url", default="", help="the scheduler's database (default: SQLite)"
    )
    parser.add_argument("--methods", default="", help="only RPCs whose name contains this")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="hypothesis seed (default: MJ_FUZZ_SEED, else a fresh one)",
    )
    args = parser.parse_args()
    record("fuzz", asyncio.run(run(args)))


if __name__ == "__main__":
    main()

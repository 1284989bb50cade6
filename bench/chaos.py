"""Benchmark: 1,000 sim jobs while controller replicas are SIGKILLed, three times a minute.

The chaos soak of `tests/test_reliability.py` at bench scale, through the same
harness (`tests/reliability.py`, `tests/soak.py`): the whole system as processes (scheduler on a
fresh PostgreSQL database, three controller replicas, logs, a seeded
three-region sim cloud with random spot preemptions), jobs submitted at a
steady rate with idempotency keys, a random replica SIGKILLed at seeded random
intervals and restarted with the same id after a seeded random delay. Once every
job is DONE it judges the run's durable record with the history checker
(`tests/history.py`: one terminal status per job, no finished task redone, no
duplicate launch, no cluster left, counters equal to a recount and never corrected
by the scheduler's reconcile; the other kinds counted) and records one JSON
line (`results.py`): the figures (resume latency after a kill, p50 and p99, against
the "replica killed -> its jobs resumed" row of contract §15; kills, preemptions,
recoveries), the problems found, and the machine. Exits 1 when it found a problem.

    python bench/chaos.py [--jobs 1000] [--kills-per-minute 3] [--seconds 300]

Needs the PostgreSQL server (MJ_TEST_POSTGRES_URL, default the local one).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from reliability import ADMIN_URL  # noqa: E402
from results import record  # noqa: E402
from soak import SoakConfig, run_soak  # noqa: E402


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--kills-per-minute", type=float, default=3.0)
    parser.add_argument("--seconds", type=float, default=300.0, help="how long the kills go on")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--lease-ttl", type=float, default=10.0, help="seconds (the scheduler's default is 10)"
    )
    parser.add_argument("--preemptions-per-hour", type=float, default=20.0)
    parser.add_argument("--database-url", default=ADMIN_URL, help="PostgreSQL admin URL")
    parser.add_argument("--data-dir", default="", help="keep the services' data and logs here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    mean_gap = 60.0 / args.kills_per_minute
    config = SoakConfig(
        jobs=args.jobs,
        replicas=args.replicas,
        seed=args.seed,
        chaos_seconds=args.seconds,
        kill_interval=(mean_gap * 0.75, mean_gap * 1.25),
        # Some replicas come back before their lease runs out, some after.
        restart_delay=(1.0, min(mean_gap * 0.7, args.lease_ttl * 1.5)),
        submit_seconds=max(10.0, args.seconds - 30.0),
        lease_ttl=args.lease_ttl,
        heartbeat_interval=min(2.0, args.lease_ttl / 5),
        preemptions_per_hour=args.preemptions_per_hour,
        drain_timeout=600.0,
    )

    def progress(message: str) -> None:
        print(f"{time.strftime('%X')} {message}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="mj-chaos-") as scratch:
        data_dir = Path(args.data_dir or scratch).resolve()
        report = run_soak(config, data_dir, args.database_url, progress)
    record(
        "chaos",
        {
            **report.figures,
            "kill_interval_seconds": list(config.kill_interval),
            "first_problems": report.problems[:20],
            "first_violations": [str(v) for v in report.violations[:20]],
        },
    )
    return 1 if report.problems or report.violations else 0


if __name__ == "__main__":
    sys.exit(main())

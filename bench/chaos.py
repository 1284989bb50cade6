"""Benchmark: 1,000 sim jobs while controller replicas are SIGKILLed or SIGSTOPped.

The chaos soak of `tests/system/test_reliability.py` at bench scale, through the same
harness (`harness/reliability.py`, `harness/soak.py`): the whole system as processes
(scheduler on a fresh PostgreSQL database, three controller replicas, logs, a
seeded three-region sim cloud with random spot preemptions; tokens, TLS and mTLS),
jobs submitted at a steady rate with idempotency keys, and every few seconds (seeded)
a random replica hit one of two ways:
- SIGKILL: its stream closes at once ("stream closed");
- SIGSTOP: its stream stays open but carries no heartbeats ("silent"), so only
  the lease's TTL tells the scheduler it is gone.
The replica stays down (or stopped) until every job it held was handed to another
replica, then for a seeded delay, and is started again with the same id (or
SIGCONTed, its stale epochs then refused): its own return never cuts its jobs'
move short. Once every job is DONE it judges the run's durable record with the
history checker (`harness/history.py`: one terminal status per job, no finished task
redone, no duplicate launch, no cluster left, counters equal to a recount) and
records one JSON line (`results.py`) with, for each kind of fault, the jobs it
caught, p50/p99/max seconds from the signal until each was RUNNING again elsewhere,
and the jobs left never resumed; the duplicate launches, counter corrections, kills,
pauses, preemptions, recoveries and the problems found; each target with whether
it was met; and the machine. Exits 1 on any violation (a problem of the run, a
history violation, a duplicate launch, a job left, a counter correction); a target
missed is a figure, not a failure.

    python bench/chaos.py [--jobs 1000] [--faults-per-minute 3] [--seconds 150]

Needs the PostgreSQL server (MJ_TEST_POSTGRES_URL, default the local one).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from harness.bench.results import record
from harness.reliability import ADMIN_URL
from harness.soak import SoakConfig, run_soak

# Seconds from the fault until a job of the replica runs elsewhere: at once after
# its stream closes; the TTL plus a margin after it goes silent.
STREAM_CLOSED_TARGET = 1.5
SILENT_MARGIN = 2.0


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--faults-per-minute", type=float, default=3.0)
    parser.add_argument("--seconds", type=float, default=150.0, help="how long the faults go on")
    parser.add_argument(
        "--pause-share", type=float, default=0.5, help="share of faults that SIGSTOP, not SIGKILL"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--lease-ttl", type=float, default=10.0, help="seconds (the scheduler's default is 10)"
    )
    parser.add_argument(
        "--runtime",
        type=float,
        nargs=2,
        default=(20.0, 60.0),
        metavar=("MIN", "MAX"),
        help="real seconds a task runs, drawn uniformly (long enough for many to be "
        "running when a replica is hit)",
    )
    parser.add_argument(
        "--preemptions-per-hour",
        type=float,
        default=1.0,
        help="per spot cluster and simulated hour (the sim cloud runs 10 times real time)",
    )
    parser.add_argument("--database-url", default=ADMIN_URL, help="PostgreSQL admin URL")
    parser.add_argument("--data-dir", default="", help="keep the services' data and logs here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    mean_gap = 60.0 / args.faults_per_minute
    time_scale = 10.0
    config = SoakConfig(
        jobs=args.jobs,
        replicas=args.replicas,
        seed=args.seed,
        chaos_seconds=args.seconds,
        fault_interval=(mean_gap * 0.75, mean_gap * 1.25),
        restart_delay=(0.5, 3.0),
        pause_share=args.pause_share,
        hold_until_moved=3 * args.lease_ttl + 30,
        submit_seconds=max(10.0, args.seconds - 30.0),
        lease_ttl=args.lease_ttl,
        heartbeat_interval=min(2.0, args.lease_ttl / 5),
        time_scale=time_scale,
        runtime_seconds=(args.runtime[0] * time_scale, args.runtime[1] * time_scale),
        preemptions_per_hour=args.preemptions_per_hour,
        drain_timeout=600.0,
    )

    def progress(message: str) -> None:
        print(f"{time.strftime('%X')} {message}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="mj-chaos-") as scratch:
        data_dir = Path(args.data_dir or scratch).resolve()
        report = run_soak(config, data_dir, args.database_url, progress)
    figures = report.figures
    resume = figures["resume"]
    targets = {
        "stream_closed_p99_s": (resume["stream_closed"]["p99_s"], STREAM_CLOSED_TARGET),
        "silent_p99_s": (resume["silent"]["p99_s"], args.lease_ttl + SILENT_MARGIN),
    }
    left = sum(kind["left"] for kind in resume.values())
    violations = {
        "problems": len(report.problems),
        "history_violations": len(report.violations),
        "duplicate_launches": figures["duplicate_launches"],
        "jobs_left": left,
        "counter_corrections": figures["counter_corrections"],
    }
    record(
        "chaos",
        {
            **figures,
            "targets": {
                name: {"value": got, "target": target, "met": got is not None and got <= target}
                for name, (got, target) in targets.items()
            },
            "verdict": violations,
            "fault_interval_seconds": list(config.fault_interval),
            "first_problems": report.problems[:20],
            "first_violations": [str(v) for v in report.violations[:20]],
        },
    )
    return 1 if any(violations.values()) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: the randomized fault run at length, over many seeds, and what its history shows.

The run of `tests/system/test_history.py` (`harness/history_run.py`), longer and more often:
the whole system as processes (scheduler on a fresh PostgreSQL database, three
controller replicas, logs, a seeded sim cloud), a seeded workload of jobs and
chains with cancels right after submit, while launching and later, and a seeded
fault schedule of replica SIGKILLs, replicas paused past their lease, scheduler
restarts, PostgreSQL outages and spot preemptions. Each seed's durable record is
judged by the history checker (`harness/history.py`). With `--mutations`, also the
mutation runs (`harness/history_mutations.py`): the system with one protection turned
off by a test-only switch, in the situation that protection exists for, which the
checker must catch, and the same with every protection on, which it must pass.
Records one JSON line (`results.py`): the violations per kind and the faults
carried out per kind, summed over the seeds and per seed; per mutation, the
violation expected, those reported, whether it was caught and whether the
protected run was clean; and the machine. The violations themselves go to stderr
with `--details`. Exits 1 when a seed shows a violation or a problem, or a
mutation run was not caught (or its protected run was not clean).

    python bench/history.py [--seeds 1 2 3 4 5] [--jobs 60] [--fault-seconds 90]
    python bench/history.py --ci --seeds 2 --details --data-dir /tmp/h   # one CI seed
    python bench/history.py --seeds --mutations                          # mutations only

Needs the PostgreSQL server (MJ_TEST_POSTGRES_URL, default the local one) and,
for database outages, root to stop and start it (`--database-outages 0` without).
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from harness.bench.results import record
from harness.faults import FaultKind
from harness.history_mutations import MUTATIONS, run_mutation
from harness.history_run import RunConfig, run_history
from harness.reliability import ADMIN_URL


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="*", default=[1, 2, 3, 4, 5])
    parser.add_argument(
        "--mutations",
        action="store_true",
        help="also the mutation runs: one protection off each, which the checker must catch",
    )
    parser.add_argument("--jobs", type=int, default=60, help="ordinary jobs per seed")
    parser.add_argument("--long-jobs", type=int, default=4)
    parser.add_argument("--submit-seconds", type=float, default=40.0)
    parser.add_argument("--fault-seconds", type=float, default=90.0)
    parser.add_argument("--kills", type=int, default=4)
    parser.add_argument("--pauses", type=int, default=3)
    parser.add_argument("--scheduler-restarts", type=int, default=2)
    parser.add_argument("--database-outages", type=int, default=2)
    parser.add_argument("--preemptions", type=int, default=12, help="single clusters")
    parser.add_argument(
        "--finished-preemptions",
        type=int,
        default=6,
        help="clusters whose task finished, preempted while a replica is down or paused",
    )
    parser.add_argument("--region-preemptions", type=int, default=3)
    parser.add_argument("--cancel-fraction", type=float, default=0.35)
    parser.add_argument("--lease-ttl", type=float, default=3.0)
    parser.add_argument("--database-url", default=ADMIN_URL, help="PostgreSQL admin URL")
    parser.add_argument("--data-dir", default="", help="keep each seed's data and logs here")
    parser.add_argument("--details", action="store_true", help="violations to stderr")
    parser.add_argument(
        "--ci",
        action="store_true",
        help="the CI test's run (tests/system/test_history.py) for each seed; other sizes ignored",
    )
    return parser.parse_args(argv)


def config_for(args: argparse.Namespace, seed: int) -> RunConfig:
    if args.ci:
        return RunConfig(seed=seed)
    return RunConfig(
        seed=seed,
        jobs=args.jobs,
        long_jobs=args.long_jobs,
        submit_seconds=args.submit_seconds,
        fault_seconds=args.fault_seconds,
        faults={
            FaultKind.KILL_REPLICA: args.kills,
            FaultKind.PAUSE_REPLICA: args.pauses,
            FaultKind.RESTART_SCHEDULER: args.scheduler_restarts,
            FaultKind.DATABASE_OUTAGE: args.database_outages,
            FaultKind.PREEMPT_CLUSTER: args.preemptions,
            FaultKind.PREEMPT_FINISHED: args.finished_preemptions,
            FaultKind.PREEMPT_REGION: args.region_preemptions,
        },
        cancel_fraction=args.cancel_fraction,
        lease_ttl=args.lease_ttl,
        drain_timeout=180.0,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)

    def progress(message: str) -> None:
        print(f"{time.strftime('%X')} {message}", file=sys.stderr, flush=True)

    violations: collections.Counter[str] = collections.Counter()
    faults: collections.Counter[str] = collections.Counter()
    per_seed: list[dict[str, object]] = []
    failed = False
    with tempfile.TemporaryDirectory(prefix="mj-history-") as scratch:
        for seed in args.seeds:
            data_dir = Path(args.data_dir or scratch).resolve() / f"seed-{seed}"
            progress(f"seed {seed}: data in {data_dir}")
            report = run_history(config_for(args, seed), data_dir, args.database_url, progress)
            violations.update(report.figures["violations"])
            faults.update(report.figures["faults"])
            per_seed.append({**report.figures, "first_problems": report.problems[:10]})
            failed = failed or bool(report.violations or report.problems)
            if args.details and (report.violations or report.problems):
                print(f"seed {seed}:", *report.problems, file=sys.stderr, sep="\n")
                print(report.details, *report.internal, file=sys.stderr, sep="\n", flush=True)
        mutations: dict[str, dict[str, object]] = {}
        for mutation in MUTATIONS if args.mutations else ():
            outcome: dict[str, object] = {"expected": mutation.kind.value}
            for protected in (False, True):
                run = "protected" if protected else "mutated"
                data_dir = Path(args.data_dir or scratch).resolve() / f"{mutation.switch}-{run}"
                progress(f"{mutation.switch} ({run}): data in {data_dir}")
                report = run_mutation(mutation, data_dir, args.database_url, protected, progress)
                found = collections.Counter(v.kind.value for v in report.violations)
                if protected:
                    outcome["clean_when_protected"] = not report.violations
                    outcome["reported_when_protected"] = dict(found)
                else:
                    outcome["caught"] = report.caught
                    outcome["reported"] = dict(found)
                ok = not report.violations if protected else report.caught
                failed = failed or not ok
                if args.details and not ok:
                    print(f"{mutation.switch} ({run}):", report.details, file=sys.stderr)
            mutations[mutation.switch] = outcome
    figures: dict[str, object] = {
        "seeds": args.seeds,
        "violations": dict(violations),
        "faults": dict(sorted(faults.items())),
        "per_seed": per_seed,
    }
    if args.mutations:
        figures["mutations"] = mutations
        figures["mutations_caught"] = sum(bool(m["caught"]) for m in mutations.values())
    record("history", figures)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

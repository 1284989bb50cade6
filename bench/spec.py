"""Job spec parsing speed: what SubmitJob pays per submission before touching the database.

Measures, in one process, the best of several rounds:
- a minimal spec (the admission benchmark's) and a typical single-task spec;
- a ten-task chain;
- a 1,000-task chain (the longest allowed) and an alias bomb refused without
  being expanded, the two worst cases an attacker can send.
Records one JSON line (`results.py`).

    .venv/bin/python bench/spec.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from harness.bench.results import record
from services.scheduler.spec.parse import SpecError, parse_job_spec

MINIMAL = "name: bench\nrun: echo hi\n"
TYPICAL = """\
name: train
envs: {EPOCHS: 3, LR: 0.5, MODEL: gpt}
secrets: {HF_TOKEN: null}
setup: pip install -r requirements.txt
run: python train.py --epochs $EPOCHS
workdir: ~/src
num_nodes: 2
max_duration: 12h
resources:
  cloud: gcp
  region: us-east1
  cpus: 4+
  memory: 32GB+
  accelerators: {A100: 8}
  use_spot: true
  job_recovery: {strategy: FAILOVER, max_restarts_on_errors: 3, recover_on_exit_codes: [137]}
"""
CHAIN_10 = "name: pipe\n---\n" + "---\n".join(TYPICAL.replace("train", f"t{i}") for i in range(10))
CHAIN_1000 = "---\n".join("run: x\n" for _ in range(1000))


def alias_bomb(levels: int = 30, width: int = 10) -> str:
    lines = ["run: x", "x-laughs:", '  l0: &l0 "hahahahahahahahahaha"']
    for level in range(1, levels + 1):
        lines.append(f"  l{level}: &l{level} [{', '.join([f'*l{level - 1}'] * width)}]")
    return "\n".join(lines) + "\n"


def best_seconds(call: Callable[[], object], number: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(number):
            call()
        best = min(best, (time.perf_counter() - start) / number)
    return best


def refused(text: str) -> None:
    try:
        parse_job_spec(text)
    except SpecError:
        return
    raise AssertionError("the alias bomb was accepted")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    secrets = {"HF_TOKEN": "hf-secret"}
    cases: dict[str, tuple[Callable[[], object], int]] = {
        "minimal": (lambda: parse_job_spec(MINIMAL), 2000),
        "typical": (lambda: parse_job_spec(TYPICAL, extra_secrets=secrets), 1000),
        "chain_10": (lambda: parse_job_spec(CHAIN_10, extra_secrets=secrets), 100),
        "chain_1000": (lambda: parse_job_spec(CHAIN_1000), 5),
        "alias_bomb_refused": (lambda: refused(alias_bomb()), 200),
    }
    figures: dict[str, object] = {}
    for label, (call, number) in cases.items():
        seconds = best_seconds(call, number, args.rounds)
        figures[f"{label}_us"] = round(seconds * 1e6, 1)
        figures[f"{label}_per_s"] = round(1 / seconds)
    record("spec", figures)


if __name__ == "__main__":
    main()

"""A benchmark's result: one JSON line, printed and kept under `bench/results/`.

Every benchmark hands its figures to `record`, which prints them as one JSON line
and appends the same line to `bench/results/<bench>.jsonl`. A figure is then read
from the line of the run that gave it, never copied into code or prose. Besides
the figures a line says what makes it comparable with another:

- `time`: when the line was recorded, in UTC;
- `revision`: the tree that ran (`git rev-parse --short HEAD`), with `-dirty`
  when tracked files differ from it; the results themselves do not count, or
  every run after the first would look dirty;
- `command`: the command line, so the run can be repeated;
- `machine`: what the machine is and how fast it was that day (`machine.py`).

A line is printed before it is appended: a results folder that cannot be written
costs the copy, never the figures of a long run.
"""

from __future__ import annotations

import datetime as dt
import json
import shlex
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from harness.bench.machine import machine

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
ROOT = RESULTS.parent.parent


def record(bench: str, figures: Mapping[str, object]) -> None:
    """Prints `figures` of benchmark `bench` as one JSON line, with the machine
    measured now, and appends the line to `bench/results/<bench>.jsonl`."""
    line = {
        "bench": bench,
        "time": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "revision": revision(),
        "command": command(),
        **figures,
        "machine": machine(),
    }
    text = json.dumps(line)
    print(text, flush=True)
    try:
        RESULTS.mkdir(exist_ok=True)
        with (RESULTS / f"{bench}.jsonl").open("a") as results:
            results.write(text + "\n")
    except OSError as error:
        print(f"not kept in {RESULTS}: {error}", file=sys.stderr, flush=True)


def revision() -> str:
    """The short hash of HEAD, `-dirty` when tracked files outside `bench/results/`
    have changes; "unknown" outside a git checkout."""
    try:
        head = git("rev-parse", "--short", "HEAD")
        changes = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                      f":(exclude){RESULTS.relative_to(ROOT)}")  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if changes else "")


def git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def command() -> str:
    """The command line that ran the benchmark, its script relative to the repository."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return shlex.join(["python", str(shown), *sys.argv[1:]])

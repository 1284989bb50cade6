"""Which CPUs a service runs on: `--cpus` / `MJ_CPUS` on every service, and the stack's
`--cpu-layout apart` (the scheduler on a CPU of its own).

The lists are checked as values; pinning is checked in real processes (never this
one: pytest keeps every CPU), by reading each thread's affinity from the kernel.
"""

from __future__ import annotations

import argparse
import os
import textwrap
from pathlib import Path

import pytest
from e2e import clean_env, mj, python
from hypothesis import given
from hypothesis import strategies as st

from services.common.cpus import MAX_CPU, available, cpu_list, format_cpus, scheduler_apart
from services.stack import Stack

SERVICES = {
    "mj-scheduler": "services.scheduler.main",
    "mj-controller": "services.controller.main",
    "mj-logs": "services.logs.main",
    "mj-simcloud": "services.simcloud.main",
}
TWO_CPUS = pytest.mark.skipif(
    len(available()) < 2, reason="needs two CPUs to set one apart (every CI machine has two)"
)


def thread_cpus(pid: int) -> dict[int, frozenset[int]]:
    """Each live thread of process `pid`: the CPUs it may run on."""
    cpus = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            cpus[int(task)] = frozenset(os.sched_getaffinity(int(task)))
        except ProcessLookupError:
            continue
    return cpus


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("", set()),
        ("0", {0}),
        ("1-3", {1, 2, 3}),
        ("0,2,4-5", {0, 2, 4, 5}),
        (" 1 , 3 ,", {1, 3}),
        ("2-2", {2}),
    ],
)
def test_a_cpu_list_reads_as_linux_writes_it(text: str, cpus: set[int]) -> None:
    assert cpu_list(text) == cpus


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("a", "not a CPU list (like 0, 1-3 or 0,2): 'a'"),
        ("-1", "not a CPU list"),
        ("1-", "not a CPU list"),
        ("0-x", "not a CPU list"),
        ("3-1", "not a CPU range (low-high, at most 4095): '3-1'"),
        ("0-99999999", "not a CPU range"),
    ],
)
def test_a_bad_cpu_list_is_refused_naming_it(text: str, said: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        cpu_list(text)
    assert str(refused.value).startswith(said)


@given(st.frozensets(st.integers(0, MAX_CPU), max_size=40))
def test_a_formatted_cpu_list_reads_back_as_the_same_cpus(cpus: frozenset[int]) -> None:
    text = format_cpus(cpus)
    assert cpu_list(text) == cpus
    # Each run of consecutive CPUs is written as one item.
    runs = sum(cpu - 1 not in cpus for cpu in cpus)
    assert (len(text.split(",")) if text else 0) == runs


@pytest.mark.parametrize(
    ("cpus", "scheduler", "others"),
    [
        ({0, 1}, {0}, {1}),
        ({2, 5, 7}, {2}, {5, 7}),
        ({3}, set(), set()),
        (set(), set(), set()),
    ],
)
def test_apart_gives_the_scheduler_the_first_cpu_and_the_others_the_rest(
    cpus: set[int], scheduler: set[int], others: set[int]
) -> None:
    assert scheduler_apart(frozenset(cpus)) == (scheduler, others)


def test_pinning_moves_every_thread_and_threads_started_later_follow(tmp_path: Path) -> None:
    cpu = min(available())
    script = textwrap.dedent(
        f"""
        import os, threading
        from services.common.cpus import pin
        stop = threading.Event()
        before = threading.Thread(target=stop.wait)
        before.start()
        from services.common.cpus import unpin_thread, unpinned
        before = unpinned()
        pin(frozenset({{{cpu}}}))
        pin(frozenset({{{cpu}}}))
        after = threading.Thread(target=stop.wait)
        after.start()
        print(sorted(sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")))
        # One thread may be let back onto every CPU the process had.
        unpin_thread(after.native_id)
        print(os.sched_getaffinity(after.native_id) == before)
        # What the process had before, however often it was pinned since.
        print(unpinned() == before == frozenset(os.sched_getaffinity(os.getppid())))
        stop.set()
        """
    )
    run = python("-c", script)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines() == [str([[cpu]] * 3), "True", "True"]


@TWO_CPUS
def test_a_process_started_on_some_cpus_may_be_pinned_to_others_of_the_host() -> None:
    """`taskset` or a parent's own pinning is no bound: a replica started by a pinned
    parent still takes the CPUs it is told to."""
    first, last = min(available()), max(available())
    script = textwrap.dedent(
        f"""
        import os
        from services.common.cpus import pin, unpinned
        os.sched_setaffinity(0, {{{first}}})  # as a parent's pinning leaves a child
        pin(frozenset({{{last}}}))
        print(sorted(os.sched_getaffinity(0)), sorted(unpinned()))
        """
    )
    run = python("-c", script)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"[{last}] [{first}]"


@pytest.mark.parametrize("command", sorted(SERVICES))
def test_a_service_given_cpus_it_may_not_use_stops_in_one_line(
    command: str, tmp_path: Path
) -> None:
    outside = os.cpu_count() or 1  # one past this host's last CPU
    run = python(
        "-m", SERVICES[command], "--port", "0", "--auth", "none",
        "--data-dir", str(tmp_path), "--cpus", f"0,{outside}",
    )  # fmt: skip
    assert run.returncode == 1
    errors = [line for line in run.stderr.splitlines() if not line.startswith("{")]
    host = format_cpus(range(os.cpu_count() or 1))
    assert errors == [
        f"{command}: error: --cpus names CPUs this process may not use: {outside} "
        f"(this host has {host})"
    ], run.stderr


def test_a_bad_mj_cpus_stops_a_service_before_it_starts(tmp_path: Path) -> None:
    run = python(
        "-m", "services.scheduler.main", "--port", "0", "--data-dir", str(tmp_path),
        env=clean_env(MJ_CPUS="first"),
    )  # fmt: skip
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "mj-scheduler: error: MJ_CPUS='first': not a CPU list (like 0, 1-3 or 0,2): 'first'"
    ]


@pytest.mark.parametrize(
    ("argv", "env", "said"),
    [
        (["--cpu-layout", "split"], {}, "argument --cpu-layout: invalid choice: 'split'"),
        ([], {"MJ_CPU_LAYOUT": "split"}, "MJ_CPU_LAYOUT='split': choose one of apart, any"),
    ],
)
def test_make_up_refuses_an_unknown_cpu_layout_in_one_line(
    tmp_path: Path, argv: list[str], env: dict[str, str], said: str
) -> None:
    run = python("-m", "services.stack", "--data-dir", str(tmp_path), *argv, env=clean_env(**env))
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stack: error: ") and said in lines[0]
    assert not (tmp_path / "service-logs").exists()


@TWO_CPUS
@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_a_stack_laid_out_apart_runs_the_scheduler_alone_on_its_first_cpu(
    tmp_path: Path,
) -> None:
    cpus = available()
    first = min(cpus)
    with Stack(
        tmp_path, replicas=1, simcloud_args=[], env=clean_env(), cpu_layout="apart"
    ) as stack:
        placed = {s.name: thread_cpus(s.process.pid) for s in stack.services if s.process}
        assert stack.scheduler.process is not None
        task_dir = Path(f"/proc/{stack.scheduler.process.pid}/task")
        names = {int(t.name): (t / "comm").read_text().strip() for t in task_dir.iterdir()}
    assert set(placed) == {"simcloud", "scheduler", "logs", "controller-1"}
    # Every thread, gRPC's included, not just the main one; but for SQLite's worker
    # threads (background writes), which may run on every CPU to overlap the loop.
    scheduler = placed["scheduler"]
    assert scheduler[stack.scheduler.process.pid] == {first}
    grpc_threads = [tid for tid, name in names.items() if name == "event_engine"]
    assert grpc_threads and all(scheduler[tid] == {first} for tid in grpc_threads)
    assert set(scheduler.values()) == {frozenset({first}), cpus}
    for name in ("simcloud", "logs", "controller-1"):
        assert set(placed[name].values()) == {cpus - {first}}, name


@TWO_CPUS
@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_a_local_task_runs_on_every_cpu_though_its_replica_is_set_apart(tmp_path: Path) -> None:
    job = tmp_path / "cpus.yaml"
    job.write_text("name: cpus\nrun: grep Cpus_allowed_list /proc/self/status\n")
    with Stack(tmp_path / "data", replicas=1, env=clean_env(), cpu_layout="apart") as stack:
        replica = stack.controllers[0].process
        assert replica is not None
        assert set(thread_cpus(replica.pid).values()) == {available() - {min(available())}}
        run = mj(stack, "launch", str(job))
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"Cpus_allowed_list:\t{format_cpus(available())}" in run.stdout


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_a_stack_laid_out_any_pins_nothing(tmp_path: Path) -> None:
    # A CPU list in the caller's shell does not leak into the services.
    with Stack(tmp_path, replicas=1, env=clean_env(MJ_CPUS=str(min(available())))) as stack:
        placed = {s.name: thread_cpus(s.process.pid) for s in stack.services if s.process}
    for name, threads in placed.items():
        assert set(threads.values()) == {available()}, name

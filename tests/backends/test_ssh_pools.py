"""The ssh backend's pure parts: the node pools file, placement, judging ranks, the
reaper's decisions, and the setting that checks the file (no sshd needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.backends import (
    BACKEND,
    ClusterStatus,
    LaunchPlan,
    Observation,
    PrecheckError,
    TaskEnd,
    TaskStatus,
    backend_settings,
)
from services.backends.ssh.config import Accelerators, load_node_pools, parse_node_pools
from services.backends.ssh.placement import Need, fits, parse_need, pools_to_try
from services.backends.ssh.reaper import newest_launches, releases
from services.backends.ssh.state import HostScan, RankState, Reservation, judge
from services.common.settings import parse
from services.launcher.main import main as stack_main
from services.launcher.stack import Stack

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home with the files the example pools file names."""
    ssh = tmp_path / ".ssh"
    ssh.mkdir()
    for name in ("known_hosts", "id_ed25519", "admin_key"):
        (ssh / name).write_text("")
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def pools_text(body: str) -> str:
    return "p:\n  known_hosts: ~/.ssh/known_hosts\n" + body


def test_the_example_file_reads_with_pool_defaults_and_host_overrides(home: Path) -> None:
    pools = load_node_pools(ROOT / "examples/ssh_node_pools.yaml")

    assert list(pools) == ["gpu-lab", "cpu-boxes"]
    first, second = pools["gpu-lab"].hosts
    assert (first.ip, first.port, first.user) == ("10.0.0.11", 22, "ubuntu")
    assert first.identity_file == str(home / ".ssh/id_ed25519")
    assert first.known_hosts == str(home / ".ssh/known_hosts")
    assert (first.accelerators, first.cpus, first.memory) == (Accelerators("A100", 8), 96, 1024)
    assert (second.port, second.user) == (2222, "admin")
    assert second.identity_file == str(home / ".ssh/admin_key")
    assert second.id == "admin@10.0.0.12:2222"
    assert pools["gpu-lab"].unreachable_timeout == 120
    boxes = pools["cpu-boxes"].hosts
    assert [h.ip for h in boxes] == ["10.0.1.21", "10.0.1.22", "10.0.1.23"]
    assert all(h.accelerators is None and h.cpus is None for h in boxes)


def test_accelerators_memory_and_timeouts_take_every_documented_form(home: Path) -> None:
    pools = parse_node_pools(
        pools_text(
            "  unreachable_timeout: 30\n"
            "  user: u\n"
            "  hosts:\n"
            "    - {ip: a, accelerators: {H100: 4}, memory: 64GB}\n"
            "    - {ip: b, accelerators: T4}\n"
            "    - {ip: 'fe80::1', port: 2200}\n"
        )
    )

    a, b, c = pools["p"].hosts
    assert (a.accelerators, a.memory) == (Accelerators("H100", 4), 64)
    assert b.accelerators == Accelerators("T4", 1)
    assert c.id == "u@[fe80::1]:2200"
    assert pools["p"].unreachable_timeout == 30


@pytest.mark.parametrize(
    ("document", "problem"),
    [
        ("- a\n", "must map pool names to pools"),
        ("p: [", "not valid YAML"),
        ("'bad name!': {hosts: [a]}\n", "a pool name is"),
        (pools_text("  hosts: []\n"), "p.hosts: must be a non-empty list"),
        (pools_text("  hostz: [a]\n"), "p.hostz: unknown field"),
        (pools_text("  hosts: [{ip: a, gpus: 2}]\n"), "p.hosts[0].gpus: unknown field"),
        (pools_text("  hosts: [a, {port: 22}]\n"), "p.hosts[1].ip: is required"),
        (pools_text("  hosts: [{ip: a, port: 70000}]\n"), "p.hosts[0].port: must be a port"),
        (pools_text("  hosts: [{ip: a, cpus: -1}]\n"), "p.hosts[0].cpus: must be a positive"),
        (pools_text("  hosts: [{ip: a, accelerators: ':2'}]\n"), "no accelerator kind"),
        (pools_text("  hosts: [{ip: a, accelerators: 'A100:x'}]\n"), "p.hosts[0].accelerators"),
        (pools_text("  hosts: [{ip: 'a b'}]\n"), "p.hosts[0].ip: is not a host address"),
        (pools_text("  user: 'x y'\n  hosts: [a]\n"), "p.user: is not a user name"),
        (pools_text("  identity_file: /nope/key\n  hosts: [a]\n"), "p.identity_file"),
        (pools_text("  unreachable_timeout: soon\n  hosts: [a]\n"), "p.unreachable_timeout"),
        (pools_text("  user: u\n  hosts: [a, a]\n"), "u@a:22 is twice in it"),
        ("p: {known_hosts: /nope, hosts: [a]}\n", "p.known_hosts: /nope is not a readable"),
    ],
)
def test_a_bad_file_is_a_value_error_naming_the_file_and_the_field(
    home: Path, tmp_path: Path, document: str, problem: str
) -> None:
    path = tmp_path / "pools.yaml"
    path.write_text(document)

    with pytest.raises(ValueError) as error:
        load_node_pools(path)

    assert str(error.value).startswith(f"ssh node pools file {path}: ")
    assert problem in str(error.value)
    assert "\n" not in str(error.value)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"ssh node pools file {tmp_path}/none.yaml: cannot read"):
        load_node_pools(tmp_path / "none.yaml")


def test_a_service_given_a_bad_file_prints_one_line_and_exits(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "pools.yaml"
    path.write_text(pools_text("  hosts: [{ip: a, port: 0}]\n"))
    settings = (BACKEND, *backend_settings())

    with pytest.raises(SystemExit) as exit_:
        parse("mj-logs", "", settings, [], environ={"MJ_SSH_NODE_POOLS": str(path)})

    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("mj-logs: error: MJ_SSH_NODE_POOLS=")
    assert f"ssh node pools file {path}: p.hosts[0].port" in error
    good = tmp_path / "good.yaml"
    good.write_text(pools_text("  hosts: [a]\n"))
    parsed = parse("mj-logs", "", settings, ["--ssh-node-pools", str(good)], environ={})
    assert parsed.ssh_node_pools == str(good)


def request(**fields: object) -> LaunchPlan:
    return LaunchPlan(job_id=1, task_id=0, epoch=1, cluster_name="c", **fields)  # type: ignore[arg-type]


def test_needs_read_at_least_and_accelerator_counts() -> None:
    assert parse_need(request(cpus="4", memory="16+", accelerators="A100:2")) == Need(
        4, 16, Accelerators("A100", 2)
    )
    assert parse_need(request(cpus="4+", accelerators="T4")) == Need(4, None, Accelerators("T4", 1))
    assert parse_need(request()) == Need()
    for bad in ({"cpus": "four"}, {"memory": "-1"}, {"accelerators": "A100:0"}):
        with pytest.raises(PrecheckError):
            parse_need(request(**bad))


@pytest.fixture
def two_pools(home: Path) -> dict[str, object]:
    return parse_node_pools(
        "gpus:\n"
        "  known_hosts: ~/.ssh/known_hosts\n"
        "  hosts:\n"
        "    - {ip: g1, accelerators: A100:8, cpus: 32, memory: 256}\n"
        "    - {ip: g2, accelerators: A100:4, cpus: 32, memory: 256}\n"
        "cpus:\n"
        "  known_hosts: ~/.ssh/known_hosts\n"
        "  hosts:\n"
        "    - {ip: c1, cpus: 8}\n"
        "    - {ip: c2}\n"
    )  # type: ignore[return-value]


def test_fits_checks_what_a_host_declares_and_trusts_what_it_leaves_out(
    two_pools: dict[str, object],
) -> None:
    g1, g2 = two_pools["gpus"].hosts  # type: ignore[attr-defined]
    c1, c2 = two_pools["cpus"].hosts  # type: ignore[attr-defined]
    a100x8 = Need(accelerators=Accelerators("a100", 8))
    assert fits(g1, a100x8) and not fits(g2, a100x8) and not fits(c2, a100x8)
    assert fits(c1, Need(cpus=8)) and not fits(c1, Need(cpus=9)) and fits(c2, Need(cpus=500))


def plan_names(pools: dict[str, object], **fields: object) -> list[tuple[str, list[str]]]:
    candidates = fields.pop("candidates", ())
    blocked = fields.pop("blocked", ())
    plan = request(**fields).within(candidates, blocked)  # type: ignore[arg-type]
    tried = pools_to_try(pools, plan, parse_need(plan))  # type: ignore[arg-type]
    return [(pool.name, [h.ip for h in hosts]) for pool, hosts in tried]


def test_pools_are_tried_in_order_pinned_filtered_and_blocked(
    two_pools: dict[str, object],
) -> None:
    assert plan_names(two_pools) == [("gpus", ["g1", "g2"]), ("cpus", ["c1", "c2"])]
    assert plan_names(two_pools, accelerators="A100:8") == [("gpus", ["g1"])]
    assert plan_names(two_pools, cpus="16", num_nodes=2) == [("gpus", ["g1", "g2"])]
    assert plan_names(two_pools, region="cpus") == [("cpus", ["c1", "c2"])]
    assert plan_names(two_pools, candidates=["cpus", "gpus"]) == [
        ("cpus", ["c1", "c2"]),
        ("gpus", ["g1", "g2"]),
    ]
    assert plan_names(two_pools, blocked=["gpus"]) == [("cpus", ["c1", "c2"])]


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"accelerators": "A100:16"}, "could ever fit A100:16"),
        ({"accelerators": "A100:8", "num_nodes": 2}, "no 2 host(s) of any pool"),
        ({"region": "cpus", "accelerators": "A100:1"}, "of pool cpus could ever fit"),
        ({"region": "mars"}, "unknown region 'mars'"),
        ({"cloud": "aws"}, "unknown cloud 'aws'"),
        ({"zone": "z1"}, "no zones"),
        ({"num_nodes": 0}, "num_nodes must be >= 1"),
        ({"candidates": ["moon"]}, "unknown candidate regions"),
        ({"region": "gpus", "blocked": ["gpus"]}, "minus blocked ['gpus']"),
    ],
)
def test_requests_no_pool_can_ever_serve_fail_the_precheck(
    two_pools: dict[str, object], fields: dict[str, object], problem: str
) -> None:
    with pytest.raises(PrecheckError) as error:
        plan_names(two_pools, **fields)
    assert problem in str(error.value)


def rank(**fields: object) -> RankState:
    base: dict[str, object] = {"present": True, "ready": True, "alive": True, "phase": "RUNNING"}
    return RankState(**{**base, **fields})  # type: ignore[arg-type]


def ended(run_exit: int = 0, at: float = 10.0, setup_exit: int | None = None) -> RankState:
    return rank(alive=False, run_exit=run_exit, setup_exit=setup_exit, end_time=at)


@pytest.mark.parametrize(
    ("ranks", "expected"),
    [
        ([rank(), rank()], Observation(ClusterStatus.UP, TaskStatus.RUNNING)),
        ([rank(phase="SETTING_UP"), rank()], Observation(ClusterStatus.UP, TaskStatus.SETTING_UP)),
        ([rank(phase="PENDING"), rank()], Observation(ClusterStatus.UP, TaskStatus.PENDING)),
        (
            [ended(at=5), ended(at=7)],
            Observation(
                ClusterStatus.UP, TaskStatus.SUCCEEDED, TaskEnd(TaskStatus.SUCCEEDED, 0, 7)
            ),
        ),
        # One rank failed: the task failed, even while the other still runs.
        (
            [rank(), ended(run_exit=3, at=4)],
            Observation(ClusterStatus.UP, TaskStatus.FAILED, TaskEnd(TaskStatus.FAILED, 3, 4)),
        ),
        (
            [ended(run_exit=2, at=9), ended(setup_exit=5, run_exit=None, at=8)],
            Observation(
                ClusterStatus.UP,
                TaskStatus.FAILED_SETUP,
                TaskEnd(TaskStatus.FAILED_SETUP, 5, 8),
            ),
        ),
        # A runner gone without an end time was killed: preempted.
        ([rank(), rank(alive=False)], Observation(ClusterStatus.DOWN)),
        # Its end stays readable when another rank's host lost the launch.
        (
            [ended(run_exit=1, at=3), RankState(present=False)],
            Observation(ClusterStatus.DOWN, None, TaskEnd(TaskStatus.FAILED, 1, 3)),
        ),
        ([ended(), RankState(present=False)], Observation(ClusterStatus.DOWN)),
        ([rank(ready=False, age=5), rank()], Observation(ClusterStatus.INIT)),
        ([rank(ready=False, age=500), rank()], Observation(ClusterStatus.DOWN)),
    ],
)
def test_judging_a_clusters_ranks(ranks: list[RankState], expected: Observation) -> None:
    assert judge(ranks, launch_timeout=60) == expected


def held(cluster: str, launch: str, key: tuple[int, int], **fields: object) -> HostScan:
    reservation = Reservation(
        cluster=cluster,
        job=1,
        epoch=key[0],
        launch=launch,
        started=key[1],
        pool="p",
        age=float(fields.pop("age", 1.0)),  # type: ignore[arg-type]
        ready=bool(fields.pop("ready", True)),
        hosts=tuple(fields.pop("hosts", ())),  # type: ignore[arg-type]
    )
    return HostScan(reservation)


def test_the_reaper_releases_only_reservations_no_cluster_owns() -> None:
    scans = {
        # Relaunched elsewhere (same epoch, later): h1's launch is superseded.
        "h1": held("moved", "old", (1, 100), hosts=("h1",)),
        "h2": held("moved", "new", (1, 200), hosts=("h2",)),
        # A healthy two-node cluster.
        "h3": held("pair", "p1", (1, 50), hosts=("h3", "h4")),
        "h4": held("pair", "p1", (1, 50), hosts=("h3", "h4")),
        # Half of a cluster whose other host was released.
        "h5": held("half", "x1", (2, 10), hosts=("h5", "h6")),
        "h6": HostScan(None),
        # A launch that never finished, one still within its time.
        "h7": held("stuck", "s1", (1, 10), ready=False, age=700),
        "h8": held("young", "y1", (1, 10), ready=False, age=5),
        # Its newest launch was recorded, then terminated: only the record remains.
        "h9": held("gone", "g1", (3, 5), hosts=("h9",)),
        "h10": HostScan(None, fences={"gone": (4, 1)}),
    }

    decided = releases(scans, newest_launches(scans.values()), launch_timeout=600)

    assert sorted((r.host, r.launch) for r in decided) == [
        ("h1", "old"),
        ("h5", "x1"),
        ("h7", "s1"),
        ("h9", "g1"),
    ]


def test_the_stack_runs_controllers_and_logs_on_the_pools_file(home: Path, tmp_path: Path) -> None:
    path = tmp_path / "pools.yaml"
    path.write_text(pools_text("  hosts: [a]\n"))

    stack = Stack(tmp_path / "data", replicas=2, ssh_node_pools=str(path))

    for service in (stack.logs, *stack.controllers):
        assert service.env["MJ_BACKEND"] == "ssh"
        assert service.env["MJ_SSH_NODE_POOLS"] == str(path.resolve())
    assert stack.simcloud is None


def test_the_stack_refuses_ssh_without_a_good_pools_file(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("MJ_SSH_NODE_POOLS", raising=False)
    with pytest.raises(SystemExit):
        stack_main(["--backend", "ssh", "--data-dir", str(tmp_path)])
    assert "--backend ssh needs --ssh-node-pools" in capsys.readouterr().err
    bad = tmp_path / "pools.yaml"
    bad.write_text(pools_text("  hosts: [{ip: a, cpus: lots}]\n"))
    monkeypatch.setenv("MJ_SSH_NODE_POOLS", str(bad))
    with pytest.raises(SystemExit):
        stack_main(["--backend", "ssh", "--data-dir", str(tmp_path)])
    assert "p.hosts[0].cpus: must be a positive number" in capsys.readouterr().err

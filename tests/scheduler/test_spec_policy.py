"""Secrets, resources, regions, recovery policy and timeouts in a job spec.

Contract §14, §18 and §19.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from managedjobs.v1 import job_pb2
from services.scheduler.spec.parse import SpecError, parse_job_spec

NONE = job_pb2.RECOVERY_STRATEGY_NONE
FAILOVER = job_pb2.RECOVERY_STRATEGY_FAILOVER


def refused(text: str, **kwargs: object) -> SpecError:
    with pytest.raises(SpecError) as info:
        parse_job_spec(text, **kwargs)  # type: ignore[arg-type]
    assert str(info.value) == f"{info.value.field}: {info.value.message}"
    return info.value


# --- secrets -------------------------------------------------------------------------


def test_secrets_are_kept_apart_from_the_task_spec() -> None:
    text = "envs: {MODE: fast}\nsecrets: {HF_TOKEN: null, PORT: 8080}\nrun: x\n"
    job = parse_job_spec(text, extra_secrets={"HF_TOKEN": "hf-123"})
    [task] = job.tasks
    assert job.secrets == [{"HF_TOKEN": "hf-123", "PORT": "8080"}]
    assert dict(task.envs) == {"MODE": "fast"}
    serialized = task.SerializeToString()
    assert b"hf-123" not in serialized
    assert b"HF_TOKEN" not in serialized


def test_every_task_gets_its_own_secrets_map_with_request_secrets_merged() -> None:
    text = "secrets: {A: spec}\nrun: a\n---\nrun: b\n---\nsecrets: {C: c}\nrun: c\n"
    job = parse_job_spec(text, extra_secrets={"A": "request", "B": "b"})
    assert job.secrets == [
        {"A": "request", "B": "b"},
        {"A": "request", "B": "b"},
        {"C": "c", "A": "request", "B": "b"},
    ]
    assert all(not task.envs for task in job.tasks)


def test_tasks_without_secrets_have_empty_maps() -> None:
    job = parse_job_spec("run: a\n---\nrun: b\n")
    assert job.secrets == [{}, {}]


@pytest.mark.parametrize(
    ("text", "kwargs", "field"),
    [
        pytest.param("secrets: {TOKEN: null}\n", {}, "secrets.TOKEN", id="secret without value"),
        pytest.param("secrets: [TOKEN]\n", {}, "secrets", id="secrets is a list"),
        pytest.param("secrets: {9TOKEN: x}\n", {}, "secrets", id="bad secret name"),
        pytest.param("secrets: {T: [1]}\n", {}, "secrets.T", id="secret value is a list"),
        pytest.param("envs: {A: 1}\nsecrets: {A: 2}\n", {}, "secrets.A", id="env and secret"),
        pytest.param("envs: {A: 1}\n", {"extra_secrets": {"A": "2"}}, "secrets.A", id="extra"),
        pytest.param("secrets: {A: 1}\n", {"extra_envs": {"A": "2"}}, "secrets.A", id="extra env"),
        pytest.param(
            "run: a\n---\nsecrets: {A: 1}\n",
            {"extra_envs": {"A": "2"}},
            "tasks[1].secrets.A",
            id="clash in chain",
        ),
        pytest.param("run: x\n", {"extra_secrets": {"bad-name": "1"}}, "secrets", id="extra name"),
    ],
)
def test_invalid_secrets_name_the_field(text: str, kwargs: dict[str, object], field: str) -> None:
    assert refused(text, **kwargs).field == field


@given(
    st.dictionaries(st.from_regex(r"[A-Z_][A-Z0-9_]{0,8}", fullmatch=True), st.text(), max_size=8),
    st.dictionaries(st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True), st.text(), max_size=8),
)
def test_secrets_never_reach_a_task_spec(envs: dict[str, str], secrets: dict[str, str]) -> None:
    job = parse_job_spec("run: a\n---\nrun: b\n", extra_envs=envs, extra_secrets=secrets)
    for task, task_secrets in zip(job.tasks, job.secrets, strict=True):
        assert dict(task.envs) == envs
        assert task_secrets == secrets
        assert not set(task.envs) & set(task_secrets)


# --- resources -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "stored"),
    [
        ("cpus", "4", "4"),
        ("cpus", "4+", "4+"),
        ("cpus", "0.5", "0.5"),
        ("cpus", "' 8+ '", "8+"),
        ("memory", "16", "16"),
        ("memory", "16+", "16+"),
        ("memory", "16GB", "16GB"),
        ("memory", "16G+", "16G+"),
        ("memory", "512mb", "512mb"),
        ("memory", "1.5TB", "1.5TB"),
        ("accelerators", "A100", "A100"),
        ("accelerators", "A100:8", "A100:8"),
        ("accelerators", "{H100-80GB: 1}", "H100-80GB:1"),
        ("accelerators", "tpu-v4-8", "tpu-v4-8"),
    ],
)
def test_valid_resources_are_stored_as_written(field: str, value: str, stored: str) -> None:
    [task] = parse_job_spec(f"resources: {{{field}: {value}}}\n").tasks
    assert getattr(task.resources, field) == stored


@pytest.mark.parametrize(
    ("field", "value"),
    [
        *[("cpus", v) for v in ("-1", "0", "0.0", "abc", "4++", "'+4'", "1e3", "'4 +'", "true")],
        *[("memory", v) for v in ("-1", "0", "0GB", "abc", "16XB", "GB", "16GB++", "'-16G'")],
        *[("memory", v) for v in ("1234567890",)],  # more than nine digits
        *[("accelerators", v) for v in ("'A100:-1'", "'A100:0'", "'A100:abc'", "'A100:1.5'")],
        *[("accelerators", v) for v in ("':8'", "'A100:'", "'A 100'", "'A100:99999'")],
    ],
)
def test_bad_resources_are_refused_with_the_field_path(field: str, value: str) -> None:
    err = refused(f"run: a\n---\nresources: {{{field}: {value}}}\n")
    assert err.field == f"tasks[1].resources.{field}"


@pytest.mark.parametrize(
    ("count", "field"),
    [("-1", "resources.accelerators.A100"), ("0", "resources.accelerators.A100")]
    + [("0.5", "resources.accelerators.A100"), ("1025", "resources.accelerators.A100")],
)
def test_accelerator_counts_in_a_mapping_are_integers_of_at_least_one(
    count: str, field: str
) -> None:
    assert refused(f"resources: {{accelerators: {{A100: {count}}}}}\n").field == field


def test_known_regions_are_enforced_when_given() -> None:
    regions = ["us-east-1", "us-west-2", "eu-west-1"]
    [task] = parse_job_spec("resources: {region: us-west-2}\n", known_regions=regions).tasks
    assert task.resources.region == "us-west-2"
    err = refused("run: a\n---\nresources: {region: mars-1}\n", known_regions=regions)
    assert err.field == "tasks[1].resources.region"
    assert "'mars-1'" in err.message
    assert "eu-west-1, us-east-1, us-west-2" in err.message


def test_unknown_region_names_only_a_few_known_ones() -> None:
    regions = [f"region-{i:02}" for i in range(40)]
    err = refused("resources: {region: nowhere}\n", known_regions=regions)
    assert err.field == "resources.region"
    assert "region-04 and 35 more" in err.message
    assert "region-05" not in err.message


def test_regions_are_free_when_the_backend_names_none() -> None:
    [task] = parse_job_spec("resources: {region: anywhere}\n").tasks
    assert task.resources.region == "anywhere"


# --- recovery policy -----------------------------------------------------------------


def test_every_recovery_field_is_parsed() -> None:
    text = """\
resources:
  job_recovery:
    strategy: failover
    max_restarts_on_errors: 2
    recover_on_exit_codes: [137, 1, 137]
    fail_on_exit_codes: [2, -9]
    max_recoveries: 5
    on_demand_after_preemptions: 3
    unreachable_timeout: 10m
"""
    res = parse_job_spec(text).tasks[0].resources
    assert res.recovery_strategy == FAILOVER
    assert res.max_restarts_on_errors == 2
    assert list(res.recover_on_exit_codes) == [1, 137]
    assert list(res.fail_on_exit_codes) == [-9, 2]
    assert (res.max_recoveries, res.on_demand_after_preemptions) == (5, 3)
    assert res.unreachable_timeout_seconds == 600


def test_unset_recovery_fields_have_no_presence() -> None:
    res = parse_job_spec("resources: {job_recovery: FAILOVER}\n").tasks[0].resources
    for name in ("max_recoveries", "on_demand_after_preemptions", "unreachable_timeout_seconds"):
        assert not res.HasField(name)  # type: ignore[arg-type]
    assert not res.recover_on_exit_codes
    res = parse_job_spec("resources: {job_recovery: {max_recoveries: 0}}\n").tasks[0].resources
    assert res.HasField("max_recoveries")
    assert res.max_recoveries == 0


def test_strategy_none_is_accepted() -> None:
    for text in ("NONE", "none", "{strategy: NONE, fail_on_exit_codes: [3]}"):
        res = parse_job_spec(f"resources: {{job_recovery: {text}}}\n").tasks[0].resources
        assert res.recovery_strategy == NONE


RECOVERY = "resources.job_recovery"


@pytest.mark.parametrize(
    ("policy", "field"),
    [
        ("{recover_on_exit_codes: 137}", f"{RECOVERY}.recover_on_exit_codes"),
        ("{recover_on_exit_codes: [0]}", f"{RECOVERY}.recover_on_exit_codes[0]"),
        ("{recover_on_exit_codes: [1, 256]}", f"{RECOVERY}.recover_on_exit_codes[1]"),
        ("{fail_on_exit_codes: [-65]}", f"{RECOVERY}.fail_on_exit_codes[0]"),
        ("{fail_on_exit_codes: [1.5]}", f"{RECOVERY}.fail_on_exit_codes[0]"),
        ("{fail_on_exit_codes: ['1']}", f"{RECOVERY}.fail_on_exit_codes[0]"),
        (
            "{recover_on_exit_codes: [1, 2], fail_on_exit_codes: [2]}",
            f"{RECOVERY}.fail_on_exit_codes",
        ),
        ("{max_recoveries: -1}", f"{RECOVERY}.max_recoveries"),
        ("{max_recoveries: 2147483648}", f"{RECOVERY}.max_recoveries"),
        ("{max_recoveries: true}", f"{RECOVERY}.max_recoveries"),
        ("{on_demand_after_preemptions: 0}", f"{RECOVERY}.on_demand_after_preemptions"),
        ("{unreachable_timeout: 0}", f"{RECOVERY}.unreachable_timeout"),
        ("{unreachable_timeout: soon}", f"{RECOVERY}.unreachable_timeout"),
        ("{strategy: NONE, max_recoveries: 3}", f"{RECOVERY}.max_recoveries"),
        (
            "{strategy: NONE, on_demand_after_preemptions: 1}",
            f"{RECOVERY}.on_demand_after_preemptions",
        ),
        ("{strategy: SOMETIMES}", f"{RECOVERY}.strategy"),
    ],
)
def test_bad_recovery_policy_names_the_field(policy: str, field: str) -> None:
    assert refused(f"resources: {{job_recovery: {policy}}}\n").field == field


# --- timeouts ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("12h", 43_200),
        ("5s", 5),
        ("30m", 1_800),
        ("1h30m", 5_400),
        ("2d", 172_800),
        ("1d2h3m4s", 93_784),
        ("500ms", 0.5),
        ("1.5h", 5_400),
        ("90", 90),
        ("'90'", 90),
        ("0.25", 0.25),
        ("366d", 366 * 86_400),
    ],
)
def test_durations(text: str, seconds: float) -> None:
    [task] = parse_job_spec(f"max_duration: {text}\nrun: x\n").tasks
    assert task.max_duration_seconds == pytest.approx(seconds)


@pytest.mark.parametrize(
    "text",
    [
        "0",
        "0s",
        "-5",
        "'-5s'",
        "367d",
        "30m1h",
        "1h1h",
        "5 s",
        "5x",
        "h",
        "''",
        "true",
        "[5]",
        ".inf",
    ],
)
def test_bad_durations_are_refused(text: str) -> None:
    err = refused(f"run: a\n---\nrun: b\ngrace_period: {text}\n")
    assert err.field == "tasks[1].grace_period"


def test_task_timeouts_are_on_the_task_spec() -> None:
    text = "run: x\nmax_duration: 12h\nlaunch_timeout: 10m\ngrace_period: 45s\n"
    job = parse_job_spec(text)
    [task] = job.tasks
    assert task.max_duration_seconds == 43_200
    assert task.launch_timeout_seconds == 600
    assert task.grace_period_seconds == 45
    assert job.timeouts == job_pb2.JobTimeouts()


def test_tasks_without_timeouts_have_no_presence() -> None:
    [task] = parse_job_spec("run: x\n").tasks
    for name in ("max_duration_seconds", "launch_timeout_seconds", "grace_period_seconds"):
        assert not task.HasField(name)  # type: ignore[arg-type]


def test_header_timeouts_apply_to_the_whole_job() -> None:
    text = """\
name: pipeline
max_pending: 2h
max_duration: 1d
launch_timeout: 15m
grace_period: 1m
---
run: prep
---
run: train
grace_period: 5m
max_duration: 20h
"""
    job = parse_job_spec(text)
    assert job.name == "pipeline"
    assert len(job.tasks) == 2
    timeouts = job.timeouts
    assert timeouts.max_pending_seconds == 7_200
    assert timeouts.max_duration_seconds == 86_400
    assert timeouts.launch_timeout_seconds == 900
    assert timeouts.grace_period_seconds == 60
    prep, train = job.tasks
    # launch_timeout and grace_period are defaults for the tasks; max_duration is the job's.
    assert (prep.launch_timeout_seconds, prep.grace_period_seconds) == (900, 60)
    assert not prep.HasField("max_duration_seconds")
    assert (train.launch_timeout_seconds, train.grace_period_seconds) == (900, 300)
    assert train.max_duration_seconds == 72_000


def test_header_is_name_plus_job_level_keys_only() -> None:
    # A first document with any task field is a task, not a header.
    job = parse_job_spec("name: solo\nmax_duration: 1h\nrun: x\n")
    assert job.tasks[0].max_duration_seconds == 3_600
    assert job.timeouts == job_pb2.JobTimeouts()
    err = refused("name: lonely\nmax_duration: 1h\n")
    assert err.field == "tasks"
    assert "names the job" in err.message


def test_max_pending_in_the_first_document_is_the_jobs() -> None:
    job = parse_job_spec("max_pending: 30m\nrun: a\n---\nrun: b\n")
    assert job.timeouts.max_pending_seconds == 1_800
    assert job.tasks[0].ByteSize() == job.tasks[1].ByteSize() - len("b") + len("a")


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("run: a\n---\nmax_pending: 1h\nrun: b\n", "tasks[1].max_pending"),
        ("name: job\n---\nmax_pending: 1h\nrun: b\n", "max_pending"),
        ("name: job\n---\nmax_pending: 1h\nrun: a\n---\nrun: b\n", "tasks[0].max_pending"),
    ],
)
def test_max_pending_anywhere_else_is_refused(text: str, field: str) -> None:
    err = refused(text)
    assert err.field == field
    assert "first document" in err.message


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("name: job\nmax_pending: 0\n---\nrun: x\n", "max_pending"),
        ("name: job\nmax_duration: forever\n---\nrun: x\n", "max_duration"),
        ("name: job\nlaunch_timeout: -1\n---\nrun: x\n", "launch_timeout"),
        ("name: job\ngrace_period: [1]\n---\nrun: x\n", "grace_period"),
        ("name: Job\ngrace_period: 1s\n---\nrun: x\n", "name"),
    ],
)
def test_bad_header_fields_name_the_field(text: str, field: str) -> None:
    assert refused(text).field == field

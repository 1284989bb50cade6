"""Job spec parsing and validation (contract §3)."""

from __future__ import annotations

import json
import textwrap
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from managedjobs.v1 import job_pb2
from services.scheduler.spec.parse import (
    MAX_SPEC_BYTES,
    NAME_RE,
    SpecError,
    parse_job_spec,
    resources_summary,
)

EAGER = job_pb2.RECOVERY_STRATEGY_EAGER_NEXT_REGION
FAILOVER = job_pb2.RECOVERY_STRATEGY_FAILOVER


def spec(text: str) -> str:
    return textwrap.dedent(text).lstrip()


def test_single_task_is_parsed_into_a_task_spec() -> None:
    job = parse_job_spec(
        spec(
            """
            name: train
            setup: pip install torch
            run: python train.py
            workdir: ~/src
            num_nodes: 2
            resources:
              cloud: gcp
              region: us-east1
              zone: us-east1-b
              cpus: 4+
              memory: 16
              accelerators: A100:1
              use_spot: true
            """
        )
    )
    assert job.name == "train"
    [task] = job.tasks
    assert task.name == "train"
    assert task.setup == "pip install torch"
    assert task.run == "python train.py"
    assert task.workdir == "~/src"
    assert task.num_nodes == 2
    res = task.resources
    assert (res.cloud, res.region, res.zone) == ("gcp", "us-east1", "us-east1-b")
    assert (res.cpus, res.memory, res.accelerators) == ("4+", "16", "A100:1")
    assert res.use_spot is True
    assert res.recovery_strategy == EAGER
    assert res.max_restarts_on_errors == 0
    assert task.sim_json == ""


def test_defaults_for_a_minimal_task() -> None:
    [task] = parse_job_spec("run: echo hi\n").tasks
    assert task.num_nodes == 1
    assert task.HasField("resources")
    assert task.resources.recovery_strategy == EAGER
    assert task.resources.use_spot is False


def test_chain_with_name_only_first_document_names_the_job() -> None:
    job = parse_job_spec(
        spec(
            """
            name: pipeline
            ---
            name: prep
            run: echo prep
            ---
            run: echo train
            ---
            """
        )
    )
    assert job.name == "pipeline"
    assert [t.name for t in job.tasks] == ["prep", "pipeline"]
    assert [t.run for t in job.tasks] == ["echo prep", "echo train"]


def test_chain_without_header_takes_the_first_task_name() -> None:
    job = parse_job_spec("name: first\nrun: a\n---\nname: second\nrun: b\n")
    assert job.name == "first"
    assert [t.name for t in job.tasks] == ["first", "second"]


def test_unnamed_job_and_tasks_get_default_names() -> None:
    job = parse_job_spec("run: a\n---\nrun: b\n")
    assert job.name == "job"
    assert [t.name for t in job.tasks] == ["task-0", "task-1"]


def test_name_override_replaces_the_job_name_and_names_unnamed_tasks() -> None:
    job = parse_job_spec("name: header\n---\nrun: a\n---\nrun: b\n", name_override="mine")
    assert job.name == "mine"
    assert [t.name for t in job.tasks] == ["mine", "mine"]


def test_task_without_run_or_setup_is_allowed() -> None:
    [task] = parse_job_spec("name: noop\nnum_nodes: 1\n").tasks
    assert (task.run, task.setup) == ("", "")


def test_null_values_mean_unset() -> None:
    [task] = parse_job_spec("run:\nresources:\nnum_nodes:\nsim:\n").tasks
    assert task.run == ""
    assert task.num_nodes == 1
    assert task.resources.recovery_strategy == EAGER


def test_envs_are_converted_to_strings_and_extra_envs_override() -> None:
    text = spec(
        """
        envs:
          EPOCHS: 3
          LR: 0.5
          DEBUG: true
          MODEL: gpt
          _PRIVATE1: "x"
        run: train
        ---
        envs: {OTHER: 1}
        run: eval
        """
    )
    job = parse_job_spec(text, extra_envs={"MODEL": "llama", "NEW": "1"})
    first, second = job.tasks
    assert dict(first.envs) == {
        "EPOCHS": "3",
        "LR": "0.5",
        "DEBUG": "true",
        "MODEL": "llama",
        "_PRIVATE1": "x",
        "NEW": "1",
    }
    assert dict(second.envs) == {"OTHER": "1", "MODEL": "llama", "NEW": "1"}


def test_null_env_value_must_be_given_at_submission() -> None:
    text = "envs: {TOKEN: null}\nrun: x\n"
    with pytest.raises(SpecError) as info:
        parse_job_spec(text)
    assert info.value.field == "envs.TOKEN"
    [task] = parse_job_spec(text, extra_envs={"TOKEN": "t"}).tasks
    assert task.envs["TOKEN"] == "t"


@pytest.mark.parametrize(
    ("recovery", "strategy", "max_restarts"),
    [
        ("FAILOVER", FAILOVER, 0),
        ("eager_next_region", EAGER, 0),
        ("{strategy: failover, max_restarts_on_errors: 3}", FAILOVER, 3),
        ("{max_restarts_on_errors: 2}", EAGER, 2),
        ("{strategy: EAGER_NEXT_REGION}", EAGER, 0),
    ],
)
def test_job_recovery_as_string_or_mapping(recovery: str, strategy: int, max_restarts: int) -> None:
    [task] = parse_job_spec(f"run: x\nresources:\n  job_recovery: {recovery}\n").tasks
    assert task.resources.recovery_strategy == strategy
    assert task.resources.max_restarts_on_errors == max_restarts


@pytest.mark.parametrize(
    ("accelerators", "expected"),
    [("{A100: 8}", "A100:8"), ("T4", "T4"), ("V100:2", "V100:2"), ("4", "4")],
)
def test_accelerators_string_number_or_mapping(accelerators: str, expected: str) -> None:
    [task] = parse_job_spec(f"resources:\n  accelerators: {accelerators}\n").tasks
    assert task.resources.accelerators == expected


def test_sim_fields_are_stored_as_sorted_compact_json() -> None:
    text = spec(
        """
        run: x
        sim:
          runtime_seconds: 2.5
          setup_seconds: 0
          exit_code: 3
          setup_exit_code: 0
          log_lines: [hello, world]
          preempt_after_seconds: 1
        """
    )
    [task] = parse_job_spec(text).tasks
    assert json.loads(task.sim_json) == {
        "runtime_seconds": 2.5,
        "setup_seconds": 0,
        "exit_code": 3,
        "setup_exit_code": 0,
        "log_lines": ["hello", "world"],
        "preempt_after_seconds": 1,
    }
    assert task.sim_json.startswith('{"exit_code":3,"log_lines":["hello","world"]')
    assert " " not in task.sim_json.replace("hello", "").replace("world", "")


@pytest.mark.parametrize(
    ("value", "stored"),
    [("0", 0), ("30", 30), ("never", "never"), ("null", None)],
)
def test_sigterm_exit_seconds_is_seconds_or_never(value: str, stored: object) -> None:
    [task] = parse_job_spec(f"run: x\nsim: {{sigterm_exit_seconds: {value}}}\n").tasks
    assert json.loads(task.sim_json or "{}").get("sigterm_exit_seconds") == stored


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("run: x\n", "1x()"),
        ("num_nodes: 2\nresources: {cpus: 4}\n", "2x(cpus=4)"),
        (
            "resources: {use_spot: true, cpus: 2, memory: 4, accelerators: {A100: 8}}\n",
            "1x[spot](cpus=2, memory=4, A100:8)",
        ),
        (
            "resources: {cloud: gcp, region: us-east1, cpus: 2, use_spot: true}\n",
            "1x[spot](gcp, us-east1, cpus=2)",
        ),
    ],
)
def test_resources_summary(text: str, expected: str) -> None:
    [task] = parse_job_spec(text).tasks
    assert resources_summary(task) == expected


def test_resources_summary_of_an_empty_task_spec() -> None:
    assert resources_summary(job_pb2.TaskSpec()) == "1x()"


def test_spec_error_reads_as_field_then_message() -> None:
    with pytest.raises(SpecError) as info:
        parse_job_spec("run: a\n---\nrun: b\nresources: {cpus: [1, 2]}\n")
    err = info.value
    assert isinstance(err, ValueError)
    assert err.field == "tasks[1].resources.cpus"
    assert err.message == "expected a number such as 4 or 4+, got list"
    assert str(err) == "tasks[1].resources.cpus: expected a number such as 4 or 4+, got list"


def test_malformed_yaml_names_the_line() -> None:
    with pytest.raises(SpecError) as info:
        parse_job_spec("name: a\nrun: echo\nresources: {cpus: [\n")
    assert info.value.field == "spec_yaml"
    assert "line 4" in info.value.message


SIGTERM = "sim.sigterm_exit_seconds"
SPEC_ERRORS: list[tuple[str, str, str]] = [  # (case, spec text, field path)
    ("malformed yaml", "run: [unclosed\n", "spec_yaml"),
    ("tab indentation", "resources:\n\tcpus: 2\n", "spec_yaml"),
    ("impossible date", "run: 2024-13-01\n", "spec_yaml"),
    ("document is a list", "- run: x\n", "spec_yaml"),
    ("chained document is a string", "run: a\n---\njust text\n", "tasks[1]"),
    ("unknown top-level field", "run: x\nimage: ubuntu\n", "image"),
    ("unknown resources field", "resources: {gpus: 1}\n", "resources.gpus"),
    ("unknown field in a chain", "run: a\n---\nresources: {gpus: 1}\n", "tasks[1].resources.gpus"),
    (
        "unknown job_recovery field",
        "resources: {job_recovery: {retries: 1}}\n",
        "resources.job_recovery.retries",
    ),
    ("unknown sim field", "sim: {speed: 1}\n", "sim.speed"),
    ("run is a list", "run: [a, b]\n", "run"),
    ("resources is a string", "resources: big\n", "resources"),
    ("cpus is a mapping", "resources: {cpus: {a: 1}}\n", "resources.cpus"),
    ("use_spot is a string", "resources: {use_spot: 'yes'}\n", "resources.use_spot"),
    ("num_nodes is a bool", "num_nodes: true\n", "num_nodes"),
    ("num_nodes is a float", "num_nodes: 2.0\n", "num_nodes"),
    ("num_nodes is zero", "num_nodes: 0\n", "num_nodes"),
    ("num_nodes too many", "num_nodes: 1001\n", "num_nodes"),
    ("envs is a list", "envs: [A]\n", "envs"),
    ("env name invalid", "envs: {1BAD: x}\n", "envs"),
    ("env value is a list", "envs: {A: [1]}\n", "envs.A"),
    ("env name too long", f"envs: {{{'A' * 201}: x}}\n", "envs"),
    ("negative cpus", "resources: {cpus: -1}\n", "resources.cpus"),
    ("zero memory", "resources: {memory: 0}\n", "resources.memory"),
    ("negative accelerators", "resources: {accelerators: 'A100:-1'}\n", "resources.accelerators"),
    (
        "fractional accelerators",
        "resources: {accelerators: {T4: 0.5}}\n",
        "resources.accelerators.T4",
    ),
    ("sim runtime over a year", "sim: {runtime_seconds: 1.0e+9}\n", "sim.runtime_seconds"),
    (
        "two accelerator types",
        "resources: {accelerators: {A100: 1, T4: 1}}\n",
        "resources.accelerators",
    ),
    ("zero accelerators", "resources: {accelerators: {A100: 0}}\n", "resources.accelerators.A100"),
    ("empty accelerator type", "resources: {accelerators: {'': 1}}\n", "resources.accelerators"),
    ("infinite cpus", "resources: {cpus: .inf}\n", "resources.cpus"),
    ("uppercase name", "name: Train\nrun: x\n", "name"),
    ("name starts with digit", "name: 1train\nrun: x\n", "name"),
    ("name too long", f"name: {'a' * 64}\nrun: x\n", "name"),
    ("name with underscore", "name: my_job\nrun: x\n", "name"),
    ("name is a number", "name: 123\nrun: x\n", "name"),
    ("bad header name", "name: Bad\n---\nrun: x\n", "name"),
    ("bad task name in chain", "run: a\n---\nname: Bad\nrun: b\n", "tasks[1].name"),
    ("empty string", "", "tasks"),
    ("only empty documents", "---\n---\n", "tasks"),
    ("only a name document", "name: lonely\n", "tasks"),
    ("oversized spec", "run: " + "x" * MAX_SPEC_BYTES + "\n", "spec_yaml"),
    ("bad strategy string", "resources: {job_recovery: FASTEST}\n", "resources.job_recovery"),
    (
        "bad strategy in mapping",
        "resources: {job_recovery: {strategy: nope}}\n",
        "resources.job_recovery.strategy",
    ),
    ("job_recovery is a list", "resources: {job_recovery: [FAILOVER]}\n", "resources.job_recovery"),
    (
        "negative max_restarts",
        "resources: {job_recovery: {max_restarts_on_errors: -1}}\n",
        "resources.job_recovery.max_restarts_on_errors",
    ),
    (
        "bool max_restarts",
        "resources: {job_recovery: {max_restarts_on_errors: true}}\n",
        "resources.job_recovery.max_restarts_on_errors",
    ),
    ("negative sim runtime", "sim: {runtime_seconds: -1}\n", "sim.runtime_seconds"),
    ("sim exit_code is a float", "sim: {exit_code: 1.5}\n", "sim.exit_code"),
    ("sim log line is a number", "sim: {log_lines: [ok, 3]}\n", "sim.log_lines[1]"),
    *(
        (f"sigterm_exit_seconds {value}", f"sim: {{sigterm_exit_seconds: {value}}}\n", SIGTERM)
        for value in ("-1", "forever", "Never", "true", "[1]", ".inf", "1.0e+9")
    ),
]


@pytest.mark.parametrize(
    ("text", "field"),
    [case[1:] for case in SPEC_ERRORS],
    ids=[case[0] for case in SPEC_ERRORS],
)
def test_invalid_spec_names_the_offending_field(text: str, field: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_job_spec(text)
    assert info.value.field == field
    assert str(info.value) == f"{field}: {info.value.message}"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        pytest.param({"extra_envs": {"BAD-NAME": "1"}}, "envs", id="extra env name invalid"),
        pytest.param({"name_override": "Bad_Name"}, "name", id="bad name_override"),
        pytest.param({"name_override": "a" * 64}, "name", id="name_override too long"),
        pytest.param({"name_override": "9lives"}, "name", id="name_override starts with digit"),
    ],
)
def test_invalid_submission_arguments_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_job_spec("run: x\n", **kwargs)
    assert info.value.field == field


def test_spec_of_exactly_the_size_limit_is_accepted() -> None:
    text = "run: x\n# " + "x" * (MAX_SPEC_BYTES - len("run: x\n# "))
    assert len(text.encode()) == MAX_SPEC_BYTES
    assert parse_job_spec(text).tasks[0].run == "x"


def test_size_limit_counts_bytes_not_characters() -> None:
    text = "run: x\n# " + "é" * (MAX_SPEC_BYTES // 2)
    with pytest.raises(SpecError) as info:
        parse_job_spec(text)
    assert info.value.field == "spec_yaml"


@given(st.from_regex(NAME_RE, fullmatch=True))
def test_every_valid_name_round_trips(name: str) -> None:
    # Dumped, not pasted: names like "yes" or "null" are not strings in plain YAML.
    text = yaml.safe_dump({"name": name, "run": "echo hi"})
    job = parse_job_spec(text)
    assert job.name == name
    assert job.tasks[0].name == name
    assert parse_job_spec("run: x\n", name_override=name).name == name


_FIELD_NAMES = [
    *("name", "envs", "setup", "run", "workdir", "num_nodes", "resources", "sim"),
    *("cloud", "region", "zone", "cpus", "memory", "accelerators", "use_spot"),
    *("job_recovery", "strategy", "max_restarts_on_errors", "A100", "PATH"),
    *("runtime_seconds", "setup_seconds", "exit_code", "log_lines", "preempt_after_seconds"),
    *("secrets", "max_duration", "max_pending", "launch_timeout", "grace_period"),
    *("recover_on_exit_codes", "fail_on_exit_codes", "max_recoveries", "unreachable_timeout"),
    "on_demand_after_preemptions",
]
_yaml_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(_FIELD_NAMES) | st.text(max_size=5), children, max_size=5)
    ),
    max_leaves=20,
)


@settings(max_examples=300)
@given(st.text(max_size=200) | st.lists(_yaml_values, max_size=3).map(yaml.safe_dump_all))
def test_junk_never_raises_anything_but_spec_error(text: str) -> None:
    try:
        job = parse_job_spec(text)
    except SpecError as err:
        assert err.field
        return
    assert job.tasks
    assert NAME_RE.fullmatch(job.name)
    assert len(job.secrets) == len(job.tasks)
    for task, secrets in zip(job.tasks, job.secrets, strict=True):
        assert task.num_nodes >= 1
        assert task.resources.recovery_strategy != job_pb2.RECOVERY_STRATEGY_UNSPECIFIED
        assert not set(task.envs) & set(secrets)
        assert not set(task.resources.recover_on_exit_codes) & set(
            task.resources.fail_on_exit_codes
        )
    for _, value in job.timeouts.ListFields():
        assert 0 < value <= 366 * 24 * 3600

"""Bounds on a job spec (contract §19): YAML that cannot amplify, sizes, counts and quoting."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.bounds import (
    MAX_ENV_BYTES,
    MAX_ENV_KEYS,
    MAX_JOB_BYTES,
    MAX_SPEC_BYTES,
    MAX_TASKS,
    MAX_YAML_DEPTH,
    QUOTE_LIMIT,
)
from services.common.server import MAX_MESSAGE_BYTES
from services.scheduler.spec.loader import LOADER, load_documents
from services.scheduler.spec.parse import SpecError, parse_job_spec


def refused(text: str, **kwargs: object) -> SpecError:
    with pytest.raises(SpecError) as info:
        parse_job_spec(text, **kwargs)  # type: ignore[arg-type]
    return info.value


def alias_bomb(levels: int, width: int = 10) -> str:
    """A billion-laughs spec: each level lists the previous one `width` times."""
    lines = ["x-laughs:", '  l0: &l0 "' + "ha" * 10 + '"']
    for level in range(1, levels + 1):
        refs = ", ".join([f"*l{level - 1}"] * width)
        lines.append(f"  l{level}: &l{level} [{refs}]")
    return "\n".join(lines) + "\n"


# --- YAML that cannot amplify -------------------------------------------------------


def test_alias_bomb_is_refused_without_being_expanded() -> None:
    # 10**30 expanded copies: any expansion would never finish, so refusing proves the
    # measure counted aliases without walking them one by one.
    text = "run: x\n" + alias_bomb(levels=30)
    assert len(text) < 3_000
    err = refused(text)
    assert err.field == "spec_yaml"
    assert str(MAX_SPEC_BYTES) in err.message
    assert "aliases" in err.message


def test_bomb_under_the_byte_limit_before_expansion_is_refused_after() -> None:
    # About 20 KB of text expanding to about 10 MB: the old check (before expansion) let it in.
    laughs = '"' + "x" * 1000 + '"'
    text = f"x: &a [{', '.join([laughs] * 10)}]\n"
    text += f"y: &b [{', '.join(['*a'] * 10)}]\n"
    text += f"z: [{', '.join(['*b'] * 100)}]\n"
    assert len(text.encode()) < 20_000
    assert refused(text).field == "spec_yaml"


def test_aliases_that_stay_under_the_limit_are_accepted() -> None:
    # Anchors live within one document.
    [task] = parse_job_spec("envs: {A: &v hello, B: *v}\nrun: *v\n").tasks
    assert (dict(task.envs), task.run) == ({"A": "hello", "B": "hello"}, "hello")


def test_recursive_alias_is_refused() -> None:
    err = refused("run: x\nx-loop: &loop [*loop]\n")
    assert err.field == "spec_yaml"
    assert str(MAX_YAML_DEPTH) in err.message


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_nesting_deeper_than_the_limit_is_refused() -> None:
    # The task document's mapping is level 1: a value nested `depth` levels is level 1 + depth.
    err = refused(f"run: x\nsim: {{log_lines: {nested(MAX_YAML_DEPTH)}}}\n")
    assert err.field == "spec_yaml"
    assert f"more than {MAX_YAML_DEPTH} levels" in err.message


def test_nesting_at_the_limit_reaches_field_validation() -> None:
    # Depth 32 exactly passes the YAML bound; the value is then refused as a field.
    err = refused(f"run: x\nsim: {{log_lines: {nested(MAX_YAML_DEPTH - 2)}}}\n")
    assert err.field == "sim.log_lines[0]"


def test_alias_reached_deeper_than_its_anchor_counts_at_its_deepest() -> None:
    anchor = f"x-a: &a {nested(20)}\n"
    # Referenced one level down: 22 levels, within the bound; the unknown field is next.
    assert refused(f"{anchor}x-b: [*a]\n").field == "x-a"
    # Referenced 15 levels down: 36 levels, although the anchor itself is at 21.
    assert refused(f"{anchor}x-b: {'[' * 15}*a{']' * 15}\n").field == "spec_yaml"


def test_depth_refusal_does_not_depend_on_libyaml_limits() -> None:
    # libyaml itself stops at 1,000 levels; ours is far below, with a clear message.
    err = refused("run: " + nested(999) + "\n")
    assert err.field == "spec_yaml"
    assert "levels deep" in err.message


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=1, max_value=14), st.integers(min_value=2, max_value=12))
def test_bombs_are_refused_exactly_when_their_expansion_is_too_large(
    levels: int, width: int
) -> None:
    # The innermost scalar is 20 characters; every level multiplies it by `width`.
    expanded = 20 * width**levels
    try:
        parse_job_spec("run: x\n" + alias_bomb(levels, width))
    except SpecError as err:
        if expanded <= MAX_SPEC_BYTES // 2:
            assert err.field == "x-laughs"  # past the YAML bound, refused as a field
        elif expanded >= 2 * MAX_SPEC_BYTES:
            assert err.field == "spec_yaml"
        return
    raise AssertionError("x-laughs is not a task field")


# --- chain, envs and job size ----------------------------------------------------------


def chain(n: int) -> str:
    return "---\n".join("run: x\n" for _ in range(n))


def test_chain_of_the_maximum_length_is_accepted() -> None:
    assert len(parse_job_spec(chain(MAX_TASKS)).tasks) == MAX_TASKS


def test_chain_longer_than_the_maximum_is_refused() -> None:
    err = refused(chain(MAX_TASKS + 1))
    assert err.field == "tasks"
    assert str(MAX_TASKS) in err.message


def test_header_does_not_count_as_a_task() -> None:
    assert len(parse_job_spec("name: long\n---\n" + chain(MAX_TASKS)).tasks) == MAX_TASKS


def envs_yaml(count: int, prefix: str = "E") -> str:
    return "{" + ", ".join(f"{prefix}{i}: v" for i in range(count)) + "}"


def test_envs_at_the_key_limit_are_accepted() -> None:
    [task] = parse_job_spec(f"envs: {envs_yaml(MAX_ENV_KEYS)}\n").tasks
    assert len(task.envs) == MAX_ENV_KEYS


@pytest.mark.parametrize(
    ("text", "kwargs", "field"),
    [
        pytest.param(f"envs: {envs_yaml(MAX_ENV_KEYS + 1)}\n", {}, "envs", id="spec envs"),
        pytest.param(
            f"envs: {envs_yaml(MAX_ENV_KEYS)}\n",
            {"extra_envs": {"MORE": "1"}},
            "envs",
            id="request envs counted",
        ),
        pytest.param(
            f"envs: {envs_yaml(600)}\nsecrets: {envs_yaml(401, 'S')}\n",
            {},
            "secrets",
            id="envs plus secrets",
        ),
        pytest.param(
            f"envs: {envs_yaml(999)}\n",
            {"extra_secrets": {"S1": "1", "S2": "2"}},
            "secrets",
            id="request secrets counted",
        ),
        pytest.param(
            f"run: a\n---\nenvs: {envs_yaml(MAX_ENV_KEYS + 1)}\n", {}, "tasks[1].envs", id="chain"
        ),
    ],
)
def test_too_many_envs_and_secrets_are_refused(
    text: str, kwargs: dict[str, object], field: str
) -> None:
    err = refused(text, **kwargs)
    assert err.field == field
    assert str(MAX_ENV_KEYS) in err.message


def test_envs_and_secrets_bytes_are_bounded_per_task() -> None:
    half = "x" * (MAX_ENV_BYTES // 2)
    # Exactly the limit: two names of one byte plus values filling the rest.
    fits = {"A": half[:-1], "B": half[:-1]}
    [task] = parse_job_spec("run: x\n", extra_envs=fits).tasks
    assert sum(len(k) + len(v) for k, v in task.envs.items()) == MAX_ENV_BYTES
    err = refused("run: x\n", extra_envs={"A": half, "B": half})
    assert (err.field, str(MAX_ENV_BYTES) in err.message) == ("envs", True)
    err = refused("run: x\n", extra_envs={"A": half}, extra_secrets={"B": half})
    assert err.field == "secrets"
    err = refused(f"run: x\nenvs: {{A: {half}}}\n", extra_secrets={"B": half})
    assert err.field == "secrets"


def test_env_bytes_count_utf8_not_characters() -> None:
    value = "é" * (MAX_ENV_BYTES // 2)  # 2 bytes each: one name byte over the limit
    assert refused("run: x\n", extra_envs={"A": value}).field == "envs"


def test_the_whole_job_is_bounded_once_request_envs_are_merged_into_every_task() -> None:
    # Each part fits its own bound; the spec's big task plus 100 KiB of envs merged into
    # each of 11 tasks does not fit the job's.
    big_run = "x" * 1_000_000
    text = f"run: {big_run}\n---\n" + chain(10)
    extra = {"PAYLOAD": "y" * (100 * 1024)}
    err = refused(text, extra_envs=extra)
    assert err.field == "tasks"
    assert str(MAX_JOB_BYTES) in err.message
    job = parse_job_spec(text, extra_envs={"PAYLOAD": "y" * (80 * 1024)})
    assert sum(task.ByteSize() for task in job.tasks) <= MAX_JOB_BYTES


def test_request_extras_that_cannot_fit_any_chain_are_refused_before_building_it() -> None:
    extra = {"PAYLOAD": "y" * (4 * 1024)}
    err = refused(chain(MAX_TASKS), extra_envs=extra)
    assert err.field == "tasks"
    assert "each of 1000 tasks" in err.message


def test_secrets_count_towards_the_job_size() -> None:
    secret = {"TOKEN": "s" * (200 * 1024)}
    assert len(parse_job_spec(chain(9), extra_secrets=secret).secrets) == 9
    assert refused(chain(11), extra_secrets=secret).field == "tasks"


def test_the_job_bound_leaves_room_in_a_grpc_message() -> None:
    assert MAX_JOB_BYTES * 2 <= MAX_MESSAGE_BYTES


# --- quoting -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "field"),
    [
        pytest.param("name: " + "a" * 1_000_000 + "\nrun: x\n", "name", id="name"),
        pytest.param("resources: {cpus: '" + "9" * 900_000 + "'}\n", "resources.cpus", id="cpus"),
        pytest.param(
            "resources: {region: " + "r" * 900_000 + "}\n", "resources.region", id="region"
        ),
        pytest.param(
            "resources: {job_recovery: " + "X" * 900_000 + "}\n",
            "resources.job_recovery",
            id="strategy",
        ),
        pytest.param("max_duration: " + "1" * 900_000 + "h\n", "max_duration", id="duration"),
        pytest.param("? " + "a" * 900_000 + "\n: 1\n", "a" * 200, id="unknown key"),
    ],
)
def test_error_messages_quote_at_most_200_characters(text: str, field: str) -> None:
    err = refused(text, known_regions=["us-east-1", "us-west-2"])
    assert err.field == field
    assert len(str(err)) <= 2 * QUOTE_LIMIT + 250
    longest_run = max(len(run) for run in str(err).replace("'", " ").split())
    assert longest_run <= QUOTE_LIMIT + 30


def test_a_huge_invalid_name_gives_a_short_message() -> None:
    err = refused("name: " + "B" * 1_000_000 + "\nrun: x\n")
    assert err.field == "name"
    assert len(str(err)) <= 350
    assert "1,000,000 characters" in err.message


# --- without libyaml -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "outcome"),
    [
        pytest.param(
            "run: x\nenvs: {A: &v 1, B: *v}\n", [{"run": "x", "envs": {"A": 1, "B": 1}}], id="alias"
        ),
        pytest.param("name: j\n---\nrun: a\n---\n", [{"name": "j"}, {"run": "a"}], id="chain"),
        pytest.param("run: x\n" + alias_bomb(levels=30), "spec_yaml", id="bomb"),
        pytest.param("run: " + nested(MAX_YAML_DEPTH + 1) + "\n", "spec_yaml", id="deep"),
        pytest.param("run: " + nested(5_000) + "\n", "spec_yaml", id="deeper than the stack"),
        pytest.param("run: &a [*a]\n", "spec_yaml", id="recursive"),
    ],
)
def test_the_pure_python_loader_gives_the_same_answers(text: str, outcome: object) -> None:
    for loader in {LOADER, yaml.SafeLoader}:
        if isinstance(outcome, str):
            with pytest.raises(SpecError) as info:
                load_documents(text, loader)
            assert info.value.field == outcome
        else:
            assert load_documents(text, loader) == outcome


def test_expanded_size_counts_utf8_bytes() -> None:
    # 200,000 two-byte characters repeated three times: 1.2 MB expanded, 0.6 M characters.
    text = f"run: x\nx-a: &a {'é' * 200_000}\nx-b: [*a, *a]\n"
    assert len(text.encode()) < MAX_SPEC_BYTES
    assert refused(text).field == "spec_yaml"

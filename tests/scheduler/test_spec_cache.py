"""Parsed specs, remembered (services/scheduler/spec/cache.py): the same answer as a
fresh parse, a copy each time, never a secret kept, bounded."""

from __future__ import annotations

import pytest

from services.scheduler.spec.cache import SpecCache
from services.scheduler.spec.parse import SpecError, parse_job_spec

SPEC = "name: sweep\nrun: python train.py\nenvs: {LR: '0.1'}\n"
IN_REGION = "name: r\nrun: echo\nresources: {cloud: gcp, region: us-east1}\n"


def test_a_repeated_submission_gets_the_answer_a_fresh_parse_gives() -> None:
    cache = SpecCache()
    first = cache.parse(SPEC, extra_envs={"SEED": "1"})
    again = cache.parse(SPEC, extra_envs={"SEED": "1"})
    assert cache.hits == 1
    fresh = parse_job_spec(SPEC, extra_envs={"SEED": "1"})
    for spec in (first, again):
        assert spec.name == fresh.name
        assert [t.SerializeToString() for t in spec.tasks] == [
            t.SerializeToString() for t in fresh.tasks
        ]
        assert spec.timeouts == fresh.timeouts


def test_every_answer_is_a_copy() -> None:
    cache = SpecCache()
    first = cache.parse(SPEC)
    first.tasks[0].run = "rm -rf /"
    first.tasks[0].envs["LR"] = "9"
    again = cache.parse(SPEC)
    assert cache.hits == 1
    assert again.tasks[0].run == "python train.py"
    assert again.tasks[0].envs["LR"] == "0.1"


def test_name_envs_and_regions_are_part_of_the_key() -> None:
    cache = SpecCache()
    assert cache.parse(SPEC, name_override="a").name == "a"
    assert cache.parse(SPEC, name_override="b").name == "b"
    assert cache.parse(SPEC, extra_envs={"LR": "0.5"}).tasks[0].envs["LR"] == "0.5"
    assert cache.parse(SPEC).tasks[0].envs["LR"] == "0.1"
    assert cache.hits == 0
    assert cache.parse(IN_REGION, known_regions={"us-east1"}).tasks[0].resources.region
    # The replicas no longer offer the region: refused, not answered from the cache.
    with pytest.raises(SpecError, match="region"):
        cache.parse(IN_REGION, known_regions={"europe-west4"})


def test_no_secret_is_kept() -> None:
    cache = SpecCache()
    in_yaml = "name: s\nrun: echo\nsecrets: {TOKEN: hunter2}\n"
    assert cache.parse(in_yaml).secrets == [{"TOKEN": "hunter2"}]
    assert cache.parse(SPEC, extra_secrets={"TOKEN": "hunter2"}).secrets == [{"TOKEN": "hunter2"}]
    assert len(cache) == 0
    assert cache.parse(in_yaml).secrets == [{"TOKEN": "hunter2"}]
    assert cache.hits == 0


def test_a_failing_spec_is_not_kept_and_fails_again() -> None:
    cache = SpecCache()
    for _ in range(2):
        with pytest.raises(SpecError):
            cache.parse("name: x\n")
    assert len(cache) == 0


def test_the_cache_is_bounded_in_entries_and_in_size() -> None:
    cache = SpecCache(entries=2, key_bytes=200)
    specs = [f"name: j{i}\nrun: echo {i}\n" for i in range(3)]
    for spec in specs:
        cache.parse(spec)
    assert len(cache) == 2
    cache.parse(specs[0])  # the least recently used went first
    assert cache.hits == 0
    cache.parse(specs[2])
    assert cache.hits == 1
    big = "name: big\nrun: echo " + "x" * 200 + "\n"
    cache.parse(big)
    cache.parse(big)
    assert cache.hits == 1
    assert len(cache) == 2

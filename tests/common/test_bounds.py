"""Shared input bounds: quoting and identifier rules (contract §19)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.common.bounds import (
    MAX_IDENTIFIER_CHARS,
    QUOTE_LIMIT,
    BoundsError,
    check_controller_id,
    check_identifier,
    check_pool,
    check_user,
    quote,
)


def test_short_strings_are_quoted_whole() -> None:
    assert quote("Bad_Name") == "'Bad_Name'"
    assert quote("") == "''"


def test_long_strings_are_cut_and_their_length_given() -> None:
    text = quote("x" * 1_000_000)
    assert text == "'" + "x" * QUOTE_LIMIT + "...' (1,000,000 characters)"


def test_escapes_do_not_lengthen_a_quote_past_the_limit() -> None:
    text = quote("\x00" * QUOTE_LIMIT)
    assert len(text) <= QUOTE_LIMIT + 40
    assert text.endswith(f"...' ({QUOTE_LIMIT} characters)")


def test_other_values_are_quoted_by_a_bounded_repr() -> None:
    assert quote(42) == "42"
    assert len(quote(list(range(1_000_000)))) <= QUOTE_LIMIT + 3
    assert len(quote(10**4000)) <= QUOTE_LIMIT + 3


@given(st.text(max_size=2_000) | st.binary(max_size=2_000) | st.lists(st.text(), max_size=50))
def test_a_quote_is_always_short(value: object) -> None:
    assert len(quote(value)) <= QUOTE_LIMIT + 40


@pytest.mark.parametrize("value", ["alice", "ci-bot.2", "a_b", "0", "x" * MAX_IDENTIFIER_CHARS])
def test_valid_identifiers_pass_unchanged(value: str) -> None:
    assert check_identifier(value, "user") == value
    assert check_controller_id(value) == value


@pytest.mark.parametrize(
    "value", ["Alice", "a b", "a/b", "é", "a@b", "x" * (MAX_IDENTIFIER_CHARS + 1), "a\n"]
)
def test_invalid_identifiers_are_refused_naming_the_field(value: str) -> None:
    for check, field in ((check_user, "user"), (check_pool, "pool")):
        with pytest.raises(BoundsError) as info:
            check(value)
        assert info.value.field == field
    with pytest.raises(BoundsError) as info:
        check_controller_id(value, "hello.controller_id")
    assert info.value.field == "hello.controller_id"


def test_empty_means_not_given_for_users_and_pools_only() -> None:
    assert check_user("") == ""
    assert check_pool("") == ""
    with pytest.raises(BoundsError) as info:
        check_controller_id("")
    assert info.value.field == "controller_id"


def test_refusing_a_huge_identifier_quotes_a_bounded_part() -> None:
    with pytest.raises(BoundsError) as info:
        check_user("U" * 1_000_000)
    assert len(str(info.value)) <= 2 * QUOTE_LIMIT + 100

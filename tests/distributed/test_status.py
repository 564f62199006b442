"""The one status codec (fpipe/_distributed/_status.py, NOTE [one status codec]): records with
named fields as a fixed number of int64 words and as JSON by name, and each status fpipe sends
built on it (multi-process runs: tests/test_distributed.py, tests/test_faults.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fpipe._distributed._board import RAISED, SILENT, Failure
from fpipe._distributed._rank_step import _Tally
from fpipe._distributed._status import Status, words
from fpipe._distributed._wire import ERROR, FailureCode, error_code
from fpipe.schedules import Action


@dataclass(frozen=True)
class _Inner(Status):
    flag: bool
    count: int


@dataclass(frozen=True)
class _Outer(Status):
    first: int
    inner: _Inner
    tail: tuple[int, ...] = words(3)


@dataclass(frozen=True)
class _Named(Status):
    error: str | None
    action: Action | None
    value: Any


_INT64 = st.integers(-(1 << 63), (1 << 63) - 1)


@given(_INT64, st.booleans(), _INT64, st.tuples(_INT64, _INT64, _INT64))
def test_words_round_trip_at_a_fixed_width(first: int, flag: bool, count: int, tail: tuple[int, int, int]) -> None:
    status = _Outer(first, _Inner(flag, count), tail)
    encoded = status.encode()
    assert len(encoded) == _Outer.width() == 6
    assert encoded == [first, int(flag), count, *tail]  # field by field, nested records inline
    back = _Outer.decode(encoded)
    assert back == status and type(back.inner.flag) is bool


def test_words_refuse_a_wrong_width() -> None:
    with pytest.raises(ValueError, match="has 2 words, not 3"):
        _Outer(1, _Inner(True, 2), (1, 2)).encode()
    with pytest.raises(ValueError, match="takes 6 words, got 5"):
        _Outer.decode([0] * 5)
    with pytest.raises(TypeError, match="not words"):
        _Named.width()


@given(
    st.none() | st.text(max_size=20),
    st.none() | st.builds(Action, st.integers(0, 9), st.sampled_from("FBIW"), st.integers(0, 99)),
    st.recursive(st.none() | st.integers() | st.text(max_size=5), lambda c: st.lists(c, max_size=3), max_leaves=8),
)
def test_json_round_trips_by_name(error: str | None, action: Action | None, value: Any) -> None:
    status = _Named(error, action, value)
    text = json.dumps(status.to_json())
    assert set(json.loads(text)) == {"error", "action", "value"}
    back = _Named.from_json(json.loads(text))
    assert back == status and (action is None or type(back.action) is Action)


def test_a_failure_code_travels_in_an_error_meta_and_names_its_action() -> None:
    code = FailureCode.of(3, Action(1, "I", 4))
    assert code == FailureCode(3, 1, 2, 4) and code.action() == Action(1, "I", 4)
    assert FailureCode.of(2, None) == FailureCode(2) and FailureCode(2).action() is None
    assert error_code([ERROR, *code.encode(), 0]) == code


def test_the_boards_record_is_json_by_name() -> None:
    failure = Failure(2, Action(1, "B", 0), RAISED, "failed in ...", 1, "rank 2 (dp 1, pp 0)")
    assert json.loads(failure.dumps())["action"] == {"stage": 1, "kind": "B", "microbatch": 0}
    assert Failure.loads(failure.dumps()) == failure
    unknown = Failure(None, None, SILENT, "went silent")
    assert Failure.loads(unknown.dumps()) == unknown


def test_statuses_summed_word_by_word_are_their_fields_summed() -> None:
    """The data-parallel and tensor-parallel tallies (``_across``) are all-reduced as words."""
    a, b = _Tally(1, 5, 0, 3, 9, 2, 4), _Tally(0, 7, 11, 3, 9, 2, 4)
    total = _Tally.decode([x + y for x, y in zip(a.encode(), b.encode(), strict=True)])
    assert (total.rejected, total.count, total.key, total.low, total.low_squared) == (1, 12, 11, 6, 18)

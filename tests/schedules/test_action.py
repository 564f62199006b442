"""Actions: compact ``2F0`` notation, parsed and printed."""

from __future__ import annotations

import pytest

from fpipe.schedules import Action


@pytest.mark.parametrize("text", ["0F0", "2F0", "1B3", "12I7", "3W10"])
def test_str_inverts_parse(text: str) -> None:
    assert str(Action.parse(text)) == text


def test_parse_fields() -> None:
    assert Action.parse("12I7") == Action(stage=12, kind="I", microbatch=7)


def test_parse_tolerates_whitespace() -> None:
    assert Action.parse(" 2 F 0 ") == Action(2, "F", 0)


@pytest.mark.parametrize(
    "action",
    [Action(s, kind, i) for s in (0, 1, 11) for kind in "FBIW" for i in (0, 5, 100)],
)
def test_parse_inverts_str(action: Action) -> None:
    assert Action.parse(str(action)) == action


@pytest.mark.parametrize("text", ["", "F0", "0F", "0X0", "0f0", "-1F0", "0F-1", "0FB0", "1.0F0", "0F0,1F0"])
def test_parse_rejects_bad_input(text: str) -> None:
    with pytest.raises(ValueError, match=r"cannot parse action .*e\.g\. '2F0'"):
        Action.parse(text)


def test_describe_names_everything() -> None:
    assert Action(2, "W", 3).describe() == "weight-grad backward of stage 2 on microbatch 3 (2W3)"

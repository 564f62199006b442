"""Counted nouns, and the messages that count: a count of one reads in the singular; values named briefly."""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest
import torch
from torch import nn

import fpipe
from fpipe import _cli as cli
from fpipe._plural import brief, listing, plural
from fpipe.schedules import GPipe, Interleaved1F1B, LoopedBFS, Program, ScheduleError, ZeroBubbleH1, ZeroBubbleV
from fpipe.schedules._program import validate


@pytest.mark.parametrize(
    ("count", "noun", "expected"),
    [
        (1, "tick", "1 tick"),
        (0, "tick", "0 ticks"),
        (2, "tick", "2 ticks"),
        (1, "entry", "1 entry"),
        (3, "entry", "3 entries"),
        (2, "process", "2 processes"),
        (4, "microbatch", "4 microbatches"),
        (2, "key", "2 keys"),
        (-1, "rank", "-1 ranks"),
    ],
)
def test_plural(count: int, noun: str, expected: str) -> None:
    assert plural(count, noun) == expected


@pytest.mark.parametrize(
    ("names", "limit", "expected"),
    [([], 8, "none"), (["a"], 8, "a"), (["a", "b", "c"], 3, "a, b, c"), (["a", "b", "c"], 2, "a, b and 1 more")],
)
def test_listing(names: list[str], limit: int, expected: str) -> None:
    assert listing(names, limit) == expected


class _BrokenRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1.0, "1.0, type float"),
        ("zbv", "'zbv', type str"),
        (GPipe, "the class GPipe"),
        (GPipe(2), "GPipe(num_microbatches=2), type GPipe"),
        (
            list(range(100)),
            "type list, repr of 390 characters: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 1...",
        ),
        (_BrokenRepr(), "type _BrokenRepr"),
    ],
)
def test_brief_names_the_type_and_cuts_a_long_repr(value: object, expected: str) -> None:
    assert brief(value) == expected
    assert len(brief(object() if value is None else ZeroBubbleV(8).program(64))) < 130  # 4 KB of repr


def _message(fn: Callable[[], object]) -> str:
    with pytest.raises(Exception) as caught:
        fn()
    return str(caught.value)


def _step_with_one_entry() -> object:
    step = fpipe.pipeline(lambda y, b: y.sum(), [lambda p, x: x * p] * 2, GPipe(1))
    return step([torch.ones(())], torch.ones(2))


def _split_one_module() -> object:
    return fpipe.split_module(nn.Sequential(nn.ModuleList([nn.Linear(2, 2)])), ["0[0:2]"])


@pytest.mark.parametrize(
    ("fn", "fragment"),
    [
        (lambda: GPipe(2).program(1, 2), "1 stage cannot be laid out on 2 ranks"),
        (lambda: GPipe(2).program(3, 2), "3 stages cannot be laid out on 2 ranks"),
        (lambda: Interleaved1F1B(2, stages_per_rank=2).program(1), "1 stage cannot be spread 2 per rank"),
        (lambda: LoopedBFS(2, stages_per_rank=2).program(1), "1 stage cannot be spread 2 per rank"),
        (lambda: ZeroBubbleH1(2).program(2, 1), "was asked for 2 stages on 1 rank"),
        (lambda: ZeroBubbleV(2).program(2, 3), "2 stages in a V need 1 rank "),
        (lambda: fpipe.pipeline(lambda y, b: y, [lambda p, x: x] * 2, [["0F0", "0B0"]]), "1 stage but stages has 2"),
        (_step_with_one_entry, "params has 1 entry but the pipeline has 2 stages"),
        (_split_one_module, "its list has 1 module (0 to 0)"),
    ],
)
def test_messages_count_one_in_the_singular(fn: Callable[[], object], fragment: str) -> None:
    assert fragment in _message(fn)


def test_a_deadlock_after_one_tick() -> None:
    deadlock = [["0F0", "0B0", "0F1", "0B1"], ["1F1", "1F0", "1B0", "1B1"]]
    with pytest.raises(ScheduleError, match="deadlocks after 1 tick: "):
        validate(Program.from_lists(deadlock))


def test_step_repr_and_cli_header_in_the_singular() -> None:
    step = fpipe.pipeline(lambda y, b: y.sum(), [lambda p, x: x * p], GPipe(1))
    assert repr(step) == "<fpipe.Step: 1 stage, 1 microbatch, 1 rank>"
    out = io.StringIO()
    assert cli.main(["show", "gpipe", "--ranks", "1", "--microbatches", "1"], stdout=out) == 0
    assert out.getvalue().startswith("GPipe(num_microbatches=1): 1 rank, 1 stage, 1 microbatch\n")

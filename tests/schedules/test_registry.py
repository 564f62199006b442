"""The registry of built-in schedules (fpipe/schedules/_registry.py): one entry per built-in class,
each entry true to its class, and every list of the built-ins reading it."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import itertools
from dataclasses import replace
from pathlib import Path

import pytest

import fpipe.schedules
from fpipe._cli import SCHEDULES
from fpipe.schedules import Program, ScheduleError
from fpipe.schedules._placement import BuiltinSchedule
from fpipe.schedules._registry import BUILTINS, Builtin, builtins_for
from tests.conformance import CONFORMANCE

ROOT = Path(__file__).resolve().parents[2]


def test_every_builtin_class_has_one_entry_named_after_it() -> None:
    classes = {
        value
        for name in fpipe.schedules.__all__
        if isinstance(value := getattr(fpipe.schedules, name), type) and issubclass(value, BuiltinSchedule)
    }
    assert sorted(b.name for b in BUILTINS) == sorted(cls.__name__ for cls in classes)
    assert all(b.schedule.__name__ == b.name for b in BUILTINS)
    assert len({b.command for b in BUILTINS}) == len(BUILTINS)


@pytest.mark.parametrize("builtin", BUILTINS, ids=lambda b: b.name)
def test_an_entry_lays_out_what_it_says_and_refuses_what_it_does_not_allow(builtin: Builtin) -> None:
    for p, v, m in itertools.product((1, 2, 3, 4), (1, 2, 3), (1, 2, 5, 8)):
        S = 2 * p if builtin.placement == "v" else p * v
        if builtin.placement in ("v", "dual") and v != builtin.stages_per_rank:
            continue
        takes = builtin.field or builtin.lays_out(v)  # a field takes any count, below its least as another entry
        try:
            program = builtin.build(m, v).program(S, p)
        except ScheduleError:
            assert not (takes and builtin.allows(p, m)), (p, v, m)
            continue
        assert isinstance(program, Program) and takes and builtin.allows(p, m), (p, v, m)
        fpipe.schedules.validate(program)
        if builtin.placement == "dual":  # (NOTE [a stage on several ranks])
            assert [program.holders(s) for s in range(S)] == [(s, p - 1 - s) for s in range(S)]
            continue
        expected = tuple(s % p for s in range(S)) if builtin.placement == "looped" else tuple(range(p)) * 2
        assert sorted(program.placement()) == sorted(expected)


def test_search_compares_with_the_registry_s_builtins_in_its_order() -> None:
    def names(placement: str, v: int, p: int, m: int) -> list[str]:
        return [b.name for b in builtins_for(placement, v, p, m)]

    assert names("looped", 1, 4, 8) == [
        "GPipe",
        "OneFOneB",
        "ZeroBubbleH1",
        "ZeroBubbleH2",
        "Interleaved1F1B",
        "LoopedBFS",
    ]
    assert "ZeroBubbleH2" not in names("looped", 1, 4, 6)  # m >= 2p - 1
    assert names("looped", 2, 4, 8) == ["GPipe", "OneFOneB", "Interleaved1F1B", "InterleavedZeroBubble", "LoopedBFS"]
    assert names("v", 2, 4, 8) == ["ZeroBubbleV", "DualPipeV", "VHalf", "VMin"]


def test_the_command_line_the_conformance_list_and_the_notes_read_the_registry() -> None:
    assert list(SCHEDULES) == [b.command for b in BUILTINS]
    assert all(SCHEDULES[b.command] is b for b in BUILTINS)
    listed = {entry.name for entry in CONFORMANCE}
    assert all((f"{b.name}-{b.stages_per_rank}" if b.field else b.name) in listed for b in BUILTINS)


def test_a_new_entry_is_in_the_notes_table_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("schedules_table", ROOT / "notes" / "schedules_table.py")
    assert spec is not None and spec.loader is not None
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    new = replace(BUILTINS[0], name="NewSchedule", command="new", about="a new schedule")
    monkeypatch.setattr(table, "BUILTINS", (*BUILTINS, new))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        table.main("readme")
    assert printed.getvalue().splitlines()[-1] == "| a new schedule | `NewSchedule(m)` | looped | - | - | - |"

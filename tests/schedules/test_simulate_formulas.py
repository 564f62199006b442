"""Every bubble, peak and idle-time formula the README and notes/schedules.md state, checked against
``simulate`` over a grid of counts: equal wherever the documents say it holds, and (for an exact
range) different everywhere else. The formulas are data in notes/schedules_table.py, which prints
the documents' tables; the README's and the docs site's Schedules tables are its output."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from fpipe.schedules import (
    Costs,
    Interleaved1F1B,
    OneFOneB,
    Simulation,
    VHalf,
    VMin,
    ZeroBubbleH1,
    ZeroBubbleV,
    simulate,
)

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def table() -> ModuleType:
    """notes/schedules_table.py, loaded as a module."""
    spec = importlib.util.spec_from_file_location("schedules_table", ROOT / "notes" / "schedules_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def grid(row: Any) -> list[tuple[int, int, int, int]]:
    """The counts a row is checked at: ``p`` 1..6, each of its ``v``, ``m`` 1..3p+5 (5p+5 for
    DualPipe, which takes even ``m >= 2p`` only), and for the microbatch groups each ``g`` from
    ``p`` to ``2p+1``."""
    return [
        (p, v, m, g)
        for p in range(1, 7)
        for v in row.stages_per_rank
        for m in range(1, (5 if row.builtin == "DualPipe" else 3) * p + 6)
        for g in (range(p, 2 * p + 2) if row.groups else (p,))
    ]


@functools.cache
def simulated(name: str, p: int, v: int, m: int, g: int) -> Simulation | None:
    """The row's step at its own costs, or ``None`` for counts it does not take."""
    row = next(r for r in table().ROWS if r.name == name)
    try:
        return row.simulate(p, v, m, g)  # type: ignore[no-any-return]
    except ValueError:  # ScheduleError: e.g. ZeroBubbleH2 with m < 2p - 1
        return None


def rows() -> list[Any]:
    return list(table().ROWS)


@pytest.mark.parametrize("row", rows(), ids=lambda row: row.short)
@pytest.mark.parametrize("quantity", ["bubble", "peak"])
def test_each_formula_holds_exactly_where_the_documents_say(row: Any, quantity: str) -> None:
    formula = getattr(row, quantity)
    wrong, unsaid, checked = [], [], 0
    for p, v, m, g in grid(row):
        sim = simulated(row.name, p, v, m, g)
        if sim is None:
            continue
        value = sim.bubble_fraction if quantity == "bubble" else max(sim.peak_activations)
        equal = math.isclose(value, formula.value(p, v, m, g), rel_tol=1e-9, abs_tol=1e-12)
        if formula.holds(p, v, m, g):
            checked += 1
            if not equal:
                wrong.append((p, v, m, g, value, formula.value(p, v, m, g)))
        elif formula.exact and p >= 2 and equal:
            unsaid.append((p, v, m, g))
    assert checked >= 20, checked
    assert not wrong, (
        f"{row.short}: `{formula.text}` {formula.where} is wrong at (p, v, m, g, sim, formula) {wrong[:5]}"
    )
    assert not unsaid, f"{row.short}: `{formula.text}` also holds at (p, v, m, g) {unsaid[:5]}: widen its range"


@pytest.mark.parametrize("row", [r for r in rows() if r.idle is not None], ids=lambda row: row.short)
def test_each_idle_time_holds_on_every_rank_at_the_costs_it_names(row: Any) -> None:
    """Where the bubble formula holds, at every cost point listed (each within the stated costs)."""
    checked = 0
    for p, v, m, g in grid(row):
        if p < 2 or m > 2 * p + 4 or not row.bubble.holds(p, v, m, g) or simulated(row.name, p, v, m, g) is None:
            continue
        for costs in row.idle.checked:
            sim = row.simulate(p, v, m, g, costs)
            idle = [sim.makespan - busy for busy in sim.busy]
            expected = row.idle.value(p, v, costs)
            assert all(math.isclose(x, expected, abs_tol=1e-9) for x in idle), (row.short, p, v, m, costs, idle)
            checked += 1
    assert checked >= 10, checked


def test_the_stated_costs_are_needed() -> None:
    """The idle formulas of ZB-H1 and ZB-V fail outside the costs they name (so naming them is no
    formality): ZB-H1 with T_W > T_F, ZB-V with T_I = 2 T_F."""
    by_name = {r.short: r for r in rows()}
    for short, costs in [
        ("ZB-H1", Costs(forward=1, backward_input=1, backward_weight=2)),
        ("ZB-V", Costs(forward=1, backward_input=2, backward_weight=1)),
    ]:
        row = by_name[short]
        sim = row.simulate(4, row.stages_per_rank[0], 8, 4, costs)
        assert max(sim.makespan - busy for busy in sim.busy) != row.idle.value(4, row.stages_per_rank[0], costs)


def test_the_controllable_memory_bubbles_against_1f1b() -> None:
    """The README's "at most 0.6 (0.75) of 1F1B's" for V-Half (V-Min) from m = 2p on, and V-Min
    above 1F1B's with T_I = 2 T_F at p = 8, m = 32."""
    equal = Costs(forward=0.5, backward_input=0.5, backward_weight=0.5)
    for schedule, most in ((VHalf, 0.6), (VMin, 0.75)):
        for p in range(2, 9):
            for m in (2 * p, 2 * p + 1, 3 * p + 2):
                one_f_one_b = (p - 1) / (m + p - 1)
                assert simulate(schedule(m).program(2 * p), equal).bubble_fraction <= most * one_f_one_b, (p, m)
    slow_input = Costs(forward=1, backward_input=2, backward_weight=1)
    half_stages = Costs(forward=0.5, backward_input=1, backward_weight=0.5)
    one_f_one_b = simulate(OneFOneB(32).program(8), slow_input).bubble_fraction
    assert simulate(VMin(32).program(16), half_stages).bubble_fraction > one_f_one_b


def test_the_per_rank_peaks_and_pieces_the_notes_state() -> None:
    """notes/schedules.md's prose: 1F1B's rank r holds min(m, p-r), ZB-V's min(m, p, (m+r+1)/2),
    every ZB-H1 rank min(m, p); interleaved 1F1B's peak is (m+(v-1)p)/v for p <= m <= 2p-1; V-Half's
    and V-Min's bubble is I/(3m+I) at some m < 2p too (p = 3: from m = 3 and 4 on)."""
    split = Costs(forward=1, backward_input=1, backward_weight=1)
    for p in range(1, 7):
        for m in range(1, 3 * p + 6):
            assert simulate(OneFOneB(m).program(p)).peak_activations == tuple(min(m, p - r) for r in range(p))
            zbv = simulate(ZeroBubbleV(m).program(2 * p), split).peak_activations
            assert zbv == tuple(min(m, p, (m + r + 1) / 2) for r in range(p)), (p, m)
            assert set(simulate(ZeroBubbleH1(m).program(p), split).peak_activations) == {min(m, p)}
            for v in (2, 3):
                peak = max(simulate(Interleaved1F1B(m, stages_per_rank=v).program(p * v)).peak_activations)
                if p <= m <= 2 * p - 1:
                    assert math.isclose(peak, (m + (v - 1) * p) / v), (p, v, m)
    by_name = {r.short: r for r in rows()}
    for short, first in (("V-Half", 3), ("V-Min", 4)):
        row = by_name[short]
        for m in range(first, 6):  # p = 3, below 2p
            sim = simulated(row.name, 3, 2, m, 3)
            assert sim is not None and math.isclose(sim.bubble_fraction, row.bubble.value(3, 2, m, 3)), (short, m)


def printed(**options: Any) -> list[str]:
    """The table rows notes/schedules_table.py prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        table().main(**options)
    return [line for line in out.getvalue().splitlines() if line.startswith("|")]


@pytest.mark.parametrize("page", ["README.md", "docs/schedules.md"])
def test_the_schedules_table_is_the_script_output(page: str) -> None:
    """The README's (and the docs site's) Schedules table: the header and every row as
    notes/schedules_table.py --readme prints them, in order."""
    path = ROOT / page
    if not path.is_file():
        pytest.skip(f"no {page}")
    rows = printed(table="readme")
    lines = path.read_text().splitlines()
    assert rows[0] in lines, f"{page} has no Schedules table"
    start = lines.index(rows[0])
    assert lines[start : start + len(rows)] == rows, (
        f"{page}'s Schedules table differs; rerun notes/schedules_table.py --readme"
    )


def test_a_wrong_formula_or_range_is_caught() -> None:
    """The checks can fail: a range too wide, a range too narrow, a wrong formula."""
    formula = table().Formula
    zbv = next(r for r in rows() if r.short == "ZB-V")

    def mismatches(f: Any) -> tuple[int, int]:
        wrong = unsaid = 0
        for p, v, m, g in grid(zbv):
            sim = simulated(zbv.name, p, v, m, g)
            assert sim is not None
            equal = math.isclose(sim.bubble_fraction, f.value(p, v, m, g), rel_tol=1e-9, abs_tol=1e-12)
            wrong += f.holds(p, v, m, g) and not equal
            unsaid += not f.holds(p, v, m, g) and p >= 2 and equal
        return wrong, unsaid

    assert mismatches(zbv.bubble) == (0, 0)
    too_wide = formula(zbv.bubble.text, zbv.bubble.value, "for `m >= p`", lambda p, v, m, g: m >= p)
    too_narrow = formula(zbv.bubble.text, zbv.bubble.value, "for `m >= 2p-1`", lambda p, v, m, g: m >= 2 * p - 1)
    wrong = formula("(p-1)/(3vm+p-1)", lambda p, v, m, g: (p - 1) / (3 * v * m + p - 1) * 1.01)
    assert (
        mismatches(too_wide)[0] > 0
        and mismatches(too_narrow)[1] > 0 == mismatches(too_narrow)[0]
        and mismatches(wrong)[0] > 0
    )

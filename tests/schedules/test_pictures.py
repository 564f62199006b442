"""Pictures: the terminal grid (literal), the Chrome trace (its events), the SVG (well-formed, one box per action)."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from textwrap import dedent
from typing import Any

import pytest

from fpipe.planning import fit_costs
from fpipe.schedules import (
    Costs,
    GPipe,
    Interleaved1F1B,
    OneFOneB,
    ScheduleError,
    Simulation,
    ZeroBubbleH1,
    ZeroBubbleV,
    chrome_trace,
    render,
    replay,
    simulate,
    svg,
    terminal_grid,
)
from fpipe.schedules._pictures import legend

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.mark.parametrize(
    "program",
    [GPipe(3).program(2), OneFOneB(5).program(3), Interleaved1F1B(4).program(4), ZeroBubbleV(3).program(4)],
)
def test_program_grid_without_color_is_render(program: object) -> None:
    assert terminal_grid(program, color=False) == render(program)  # type: ignore[arg-type]


def test_simulation_grid_spans_durations() -> None:
    sim = simulate(OneFOneB(3).program(2), Costs(backward=2))
    assert terminal_grid(sim, color=False) == dedent("""\
        rank 0 | 0F0 0F1  .   .  0B0---- 0F2 0B1----  .  0B2----
        rank 1 |  .  1F0 1B0---- 1F1 1B1---- 1F2 1B2----  .   .""")


def test_simulation_grid_with_send_latency_uses_half_columns() -> None:
    # One column is 0.5: actions span two, each hop idles one.
    sim = simulate(GPipe(1).program(2), Costs(forward=1, backward=1, send=0.5))
    assert terminal_grid(sim, color=False) == dedent("""\
        rank 0 | 0F0----  .   .   .   .   .   .  0B0----
        rank 1 |  .   .   .  1F0---- 1B0----  .   .   .""")


def test_colors_wrap_each_action_and_strip_to_the_plain_grid() -> None:
    sim = simulate(ZeroBubbleH1(3).program(2))
    colored = terminal_grid(sim)
    assert "\x1b[44;97m0F0\x1b[0m" in colored  # forward: blue background
    assert "\x1b[43;30m1I0\x1b[0m" in colored  # input-grad: yellow
    assert "\x1b[45;97m1W0\x1b[0m" in colored  # weight-grad: magenta
    assert ANSI.sub("", colored) == terminal_grid(sim, color=False)
    assert "\x1b" not in terminal_grid(sim, color=False)


def test_legend() -> None:
    assert legend(color=False) == "F forward   B backward   I input-grad backward   W weight-grad backward   . idle"
    assert ANSI.sub("", legend()) == legend(color=False)


def test_chrome_trace_events() -> None:
    sim = simulate(OneFOneB(2).program(2), Costs(backward=2))
    trace = json.loads(json.dumps(chrome_trace(sim, microseconds_per_unit=10)))
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    spans = [(e["tid"], e["name"], e["ts"], e["dur"]) for e in events if e["ph"] == "X"]
    assert sorted(spans) == [
        (0, "0B0", 40, 20), (0, "0B1", 70, 20), (0, "0F0", 0, 10), (0, "0F1", 10, 10),
        (1, "1B0", 20, 20), (1, "1B1", 50, 20), (1, "1F0", 10, 10), (1, "1F1", 40, 10),
    ]  # fmt: skip
    first = next(e for e in events if e["name"] == "1B0")
    assert first["cat"] == "backward"
    assert first["args"] == {"stage": 1, "microbatch": 0, "kind": "B"}
    counters = [(e["ts"], e["args"]["alive"]) for e in events if e["name"] == "activations rank 0"]
    assert counters == [(0, 1), (10, 2), (60, 1), (90, 0)]


def test_chrome_trace_of_a_program_uses_unit_ticks() -> None:
    trace = chrome_trace(GPipe(1).program(2))
    spans = sorted((e["tid"], e["name"], e["ts"], e["dur"]) for e in trace["traceEvents"] if e["ph"] == "X")
    assert spans == [(0, "0B0", 3000, 1000), (0, "0F0", 0, 1000), (1, "1B0", 2000, 1000), (1, "1F0", 1000, 1000)]


def test_svg_is_well_formed_with_a_box_per_action() -> None:
    sim = simulate(ZeroBubbleV(4).program(4))
    root = ET.fromstring(svg(sim, unit_width=10))
    ns = "{http://www.w3.org/2000/svg}"
    assert root.tag == f"{ns}svg"
    assert float(root.attrib["width"]) == 64 + sim.makespan * 10 + 16
    boxes = root.findall(f"{ns}g")
    assert len(boxes) == sum(len(row) for row in sim.program.ranks)
    title = boxes[0].find(f"{ns}title")
    assert title is not None
    assert title.text == "forward of stage 0 on microbatch 0 (0F0): 0 to 1"
    labels = {t.text for t in root.iter(f"{ns}text")}
    assert {"rank 0", "rank 1", "0F0", "3W3", "W weight-grad backward"} <= labels


def test_grid_of_a_measured_timeline_with_a_zero_length_action() -> None:
    # A measured action can last 0 (clock resolution, or skew clamped by fpipe.record). The column
    # unit used to fall to the float gcd of unrelated times (~1e-19 s): a MemoryError.
    sim = simulate(OneFOneB(4).program(2), [Costs(forward=1.03e-3, backward=2.07e-3), Costs(forward=0.97e-3)])
    ends = [list(row) for row in sim.ends]
    ends[0][0] = sim.starts[0][0]
    measured = Simulation(sim.program, None, sim.starts, tuple(tuple(row) for row in ends))
    grid = terminal_grid(measured, color=False)
    assert len(grid) < 10 * len(terminal_grid(sim, color=False))
    assert grid.startswith("rank 0 | 0F0 ")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("draw", [terminal_grid, chrome_trace, svg, replay, fit_costs])
def test_a_timeline_with_a_time_that_is_not_finite_is_rejected(bad: float, draw: Any) -> None:
    # terminal_grid raised "cannot convert float NaN to integer", chrome_trace and svg wrote NaN
    # (invalid JSON for Perfetto), replay returned a NaN makespan.
    sim = simulate(GPipe(2).program(2))
    ends = tuple(tuple(bad if (r, k) == (1, 2) else e for k, e in enumerate(row)) for r, row in enumerate(sim.ends))
    with pytest.raises(
        ScheduleError, match=r"time that is not finite for backward of stage 1 on microbatch 0 \(1B0\) on rank 1"
    ):
        draw(Simulation(sim.program, None, sim.starts, ends))


def test_a_grid_too_wide_to_draw_is_an_error() -> None:
    # A column is at least 1/8 of the shortest action: 1e-12 against 1 would be ~1e13 columns.
    sim = simulate(GPipe(2).program(2), Costs(forward=1e-12, backward=1.0))
    with pytest.raises(ScheduleError, match=r"terminal_grid: the grid would be \d+ columns wide \(at most 100000\)"):
        terminal_grid(sim)
    assert len(chrome_trace(sim)["traceEvents"]) > 0 and svg(sim).startswith("<svg")

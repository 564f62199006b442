"""Pictures of a schedule: a colored terminal grid, a Chrome trace, and an SVG.

Each takes a ``Program`` (drawn with unit cost per action, as ``render`` does) or a
``Simulation`` (drawn with its durations). Time runs left to right, one row (or track) per rank,
and the color says the kind of action::

    F forward   B backward   I input-grad backward   W weight-grad backward   . idle

In the terminal grid one column is the longest time unit that divides every start and end, so
with ``T_F = 1, T_B = 2`` a backward spans two columns: ``0B0----``.
"""

from __future__ import annotations

import math
from typing import Any

from ._action import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, KIND_NAMES, KINDS
from ._program import Program, ScheduleError, checked_program
from ._simulate import Costs, Simulation, activations_alive, checked, simulate, stages_held

UNIT = Costs(forward=1, backward=1, backward_input=1, backward_weight=1)

# ANSI SGR codes (background; foreground) per kind, and the SVG fill of each kind.
_ANSI = {FORWARD: "44;97", BACKWARD: "42;30", BACKWARD_INPUT: "43;30", BACKWARD_WEIGHT: "45;97"}
_FILL = {FORWARD: "#4c78a8", BACKWARD: "#54a24b", BACKWARD_INPUT: "#eeca3b", BACKWARD_WEIGHT: "#b279a2"}
_TEXT = {FORWARD: "#ffffff", BACKWARD: "#000000", BACKWARD_INPUT: "#000000", BACKWARD_WEIGHT: "#ffffff"}


def as_simulation(timeline: Program | Simulation, function: str = "terminal_grid") -> Simulation:
    """A ``Simulation`` checked (one finite start and end per action); a ``Program`` simulated with
    unit cost per action (``render``'s ticks). ``function`` names the caller in errors."""
    if isinstance(timeline, Simulation):
        return checked(function, timeline)[0]
    return simulate(checked_program(function, timeline), UNIT)


def legend(*, color: bool = True) -> str:
    """One line naming the kinds, each in its color."""
    return "   ".join([*(f"{_paint(kind, kind, color)} {KIND_NAMES[kind]}" for kind in KINDS), ". idle"])


MAX_COLUMNS = 100_000  # a grid wider than this would not be read, only exhaust memory


def terminal_grid(timeline: Program | Simulation, *, color: bool = True) -> str:
    """The rank x time grid, with ANSI colors unless ``color=False``.

    For a ``Program``, ``terminal_grid(program, color=False) == render(program)``. For a
    ``Simulation``, an action lasting ``n`` columns is its name padded with ``-`` to ``n``
    cells; times are rounded to columns if no common unit divides them.

    Raises:
        ScheduleError: if the grid would be wider than ``MAX_COLUMNS`` (actions whose lengths
            differ by a factor of thousands; ``chrome_trace`` and ``svg`` draw those).

    Examples:
        >>> from fpipe.schedules import Costs, GPipe, simulate
        >>> print(terminal_grid(simulate(GPipe(2).program(2), Costs(backward=2)), color=False))
        rank 0 | 0F0 0F1  .   .   .  0B0---- 0B1----
        rank 1 |  .  1F0 1F1 1B0---- 1B1----  .   .
    """
    sim = as_simulation(timeline)
    program = sim.program
    width = max((len(str(a)) for row in program.ranks for a in row), default=1)
    unit = _column_unit(sim)
    columns = round(sim.makespan / unit)
    if columns > MAX_COLUMNS:
        raise ScheduleError(
            f"fpipe.schedules.terminal_grid: the grid would be {columns} columns wide (at most {MAX_COLUMNS}): "
            f"a column is at least 1/8 of the shortest action, and actions differ too much in length "
            f"(makespan {sim.makespan:g}, column {unit:g}). Draw it with chrome_trace or svg."
        )
    lines = []
    for r, row in enumerate(program.ranks):
        cells: list[str] = []
        for a, start, end in zip(row, sim.starts[r], sim.ends[r]):
            first = round(start / unit)
            span = max(round(end / unit) - first, 1)
            cells += [".".center(width)] * (first - len(cells))
            text = str(a).center(width) if span == 1 else str(a).ljust(span * (width + 1) - 1, "-")
            cells.append(_paint(text, a.kind, color))
            cells += [""] * (span - 1)  # columns covered by the span
        cells += [".".center(width)] * (columns - len(cells))
        lines.append(f"rank {r} | " + " ".join(c for c in cells if c).rstrip())
    return "\n".join(lines)


def chrome_trace(timeline: Program | Simulation, *, microseconds_per_unit: float = 1000.0) -> dict[str, Any]:
    """The timeline in Chrome's trace-event format: ``json.dump`` it and open it in Perfetto.

    One track (thread) per rank with a complete event (``"ph": "X"``) per action, named like
    ``2F0``, whose ``args`` hold the stage, microbatch and kind; plus, per rank, a counter of the
    activations alive (``F`` to ``B``/``W``) in microbatches of the rank's layers, as
    ``Simulation.peak_activations`` counts them (NOTE [activation units]). One cost unit lasts
    ``microseconds_per_unit`` (default 1 ms).
    """
    sim = as_simulation(timeline, "chrome_trace")
    scale = microseconds_per_unit
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "fpipe schedule"}},
    ]
    for r in range(sim.program.num_ranks):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": r, "args": {"sort_index": r}})
    for r, a, start, end in sim.intervals():
        events.append(
            {
                "name": str(a),
                "cat": KIND_NAMES[a.kind],
                "ph": "X",
                "pid": 0,
                "tid": r,
                "ts": start * scale,
                "dur": (end - start) * scale,
                "args": {"stage": a.stage, "microbatch": a.microbatch, "kind": a.kind},
            }
        )
    for r, row in enumerate(sim.program.ranks):
        held = stages_held(sim.program, r)
        for k, alive in activations_alive(row):
            t = sim.starts[r][k] if row[k].kind == FORWARD else sim.ends[r][k]
            events.append(
                {"name": f"activations rank {r}", "ph": "C", "pid": 0, "tid": r, "ts": t * scale,
                 "args": {"alive": alive / held}}
            )  # fmt: skip
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def svg(timeline: Program | Simulation, *, unit_width: float = 32.0, row_height: float = 24.0) -> str:
    """The timeline as a standalone SVG document: a colored box per action, one row per rank.

    One cost unit is ``unit_width`` pixels wide. Labels are the actions (``2F0``); a legend and a
    time axis in cost units sit below the rows.
    """
    sim = as_simulation(timeline, "svg")
    program = sim.program
    left, top, gap = 64.0, 8.0, 4.0
    width = left + sim.makespan * unit_width + 16
    rows_bottom = top + program.num_ranks * (row_height + gap)
    height = rows_bottom + 3 * row_height
    font = max(row_height * 0.45, 6.0)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:g}" height="{height:g}" '
        f'viewBox="0 0 {width:g} {height:g}" font-family="monospace" font-size="{font:g}">',
        f'<rect x="0" y="0" width="{width:g}" height="{height:g}" fill="#ffffff"/>',
    ]
    for r in range(program.num_ranks):
        y = top + r * (row_height + gap)
        parts += [
            f'<text x="{left - 8:g}" y="{y + row_height / 2:g}" text-anchor="end" '
            f'dominant-baseline="central">rank {r}</text>',
            f'<rect x="{left:g}" y="{y:g}" width="{sim.makespan * unit_width:g}" height="{row_height:g}" '
            'fill="#f2f2f2"/>',
        ]
        for a, start, end in zip(program.ranks[r], sim.starts[r], sim.ends[r]):
            x, w = left + start * unit_width, (end - start) * unit_width
            parts.append(
                f"<g><title>{a.describe()}: {start:g} to {end:g}</title>"
                f'<rect x="{x:g}" y="{y:g}" width="{w:g}" height="{row_height:g}" fill="{_FILL[a.kind]}" '
                'stroke="#ffffff" stroke-width="1"/>'
                f'<text x="{x + w / 2:g}" y="{y + row_height / 2:g}" text-anchor="middle" '
                f'dominant-baseline="central" fill="{_TEXT[a.kind]}">{a}</text></g>'
            )
    step = _axis_step(sim.makespan)
    ticks = [i * step for i in range(int(sim.makespan / step) + 1)]
    for t in ticks:
        x = left + t * unit_width
        parts.append(f'<line x1="{x:g}" y1="{rows_bottom:g}" x2="{x:g}" y2="{rows_bottom + 4:g}" stroke="#000000"/>')
        parts.append(f'<text x="{x:g}" y="{rows_bottom + 4 + font:g}" text-anchor="middle">{t:g}</text>')
    x = left
    y = rows_bottom + 2 * row_height
    for kind in KINDS:
        parts.append(f'<rect x="{x:g}" y="{y - font:g}" width="{font:g}" height="{font:g}" fill="{_FILL[kind]}"/>')
        parts.append(f'<text x="{x + font * 1.5:g}" y="{y:g}">{kind} {KIND_NAMES[kind]}</text>')
        x += font * (len(KIND_NAMES[kind]) + 6) * 0.62
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _paint(text: str, kind: str, color: bool) -> str:
    return f"\x1b[{_ANSI[kind]}m{text}\x1b[0m" if color else text


def _column_unit(sim: Simulation) -> float:
    """The largest time unit dividing every start and end (within rounding), at least 1/8 of the
    shortest action that lasts (a measured action can last 0, or less with clock skew)."""
    durations = [e - s for starts, ends in zip(sim.starts, sim.ends) for s, e in zip(starts, ends)]
    shortest = min((d for d in durations if d > 0), default=1.0)
    unit = shortest
    for t in {t for row in (*sim.starts, *sim.ends) for t in row}:
        unit = _float_gcd(unit, t, floor=shortest / 8)
    return unit


def _float_gcd(a: float, b: float, *, floor: float) -> float:
    """Euclid's algorithm on floats; ``floor`` if the common unit would be smaller than that."""
    a, b = abs(a), abs(b)
    while b > floor * 1e-6:
        a, b = b, math.fmod(a, b)
        if b > a - floor * 1e-6:  # a remainder within rounding of a: treat as exact
            b = 0.0
    return max(a, floor)


def _axis_step(span: float) -> float:
    """A round tick spacing giving about ten ticks over ``span``."""
    raw = max(span / 10, 1e-9)
    magnitude = 10.0 ** math.floor(math.log10(raw))
    return next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)

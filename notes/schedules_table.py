"""Print the tables of notes/schedules.md and the README's Schedules table: every schedule's bubble
and peak, simulated, next to the formula the documents state and the counts it holds for.

Run from the repository root (prints the comparison table, the formulas, the table of microbatch
groups; with ``--readme``, the README's table):

    /work/venv/bin/python notes/schedules_table.py > /tmp/table.md
    /work/venv/bin/python notes/schedules_table.py --readme

Costs: fused-backward schedules use T_F = 1, T_B = 2; split-backward ones T_F = T_I = T_W = 1 (the
same work). A schedule with v stages per rank gets 1/v of those per stage, so that every row does
the same work per rank and idle times compare directly (in units of one 1F1B-stage forward).

Each formula is data (``Formula``): its text, its value at ``(p, v, m, g)`` (ranks, stages per
rank, microbatches, Megatron-Core's microbatch group), and the counts it holds for, in words and
as a predicate. tests/schedules/test_simulate_formulas.py checks every one against ``simulate``
over a grid of counts: equal wherever the predicate holds, and, for an ``exact`` range, different
everywhere else (``p >= 2``; on one rank every bubble is 0). The documents' tables are what this
script prints (tests/schedules/test_notes_table.py, test_simulate_formulas.py).
"""

# No ``from __future__ import annotations``: the tests load this file without registering it as a
# module, and dataclasses look string annotations up in their module.
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace

from fpipe.schedules import Costs, Schedule, Simulation, simulate
from fpipe.schedules._registry import BUILTINS

Counts = Callable[[int, int, int, int], float]  # (p, v, m, g) -> a value
Where = Callable[[int, int, int, int], bool]  # (p, v, m, g) -> whether a formula holds there


def _any(p: int, v: int, m: int, g: int) -> bool:
    return True


@dataclass(frozen=True)
class Formula:
    """A figure the documents state, and the counts it holds for.

    Attributes:
        text: the formula as the documents write it (in a code span).
        value: its value at ``(p, v, m, g)``.
        where: the counts it holds for, as the documents say it after the formula ("" for every
            count the schedule takes).
        holds: ``where`` as a predicate.
        exact: whether it fails at every other count (``p >= 2``) of the tests' grid; ``False``
            when it holds at some counts outside ``where`` too (the documents say so).
    """

    text: str
    value: Counts
    where: str = ""
    holds: Where = _any
    exact: bool = True

    def cell(self, note: str = "") -> str:
        """The formula, its note and its counts, as a table cell: ``(p-1)/(m+p-1)`` for ``m >= p``."""
        return f"`{self.text}`" + (f" {self.where}" if self.where else "") + (f" ({note})" if note else "")


@dataclass(frozen=True)
class Idle:
    """Each rank's idle time per step, in the costs of one 1F1B stage (``T_F``, ``T_B`` or ``T_I``,
    ``T_W``), at the counts where the row's bubble formula holds: its cell (markdown), its value,
    the costs it holds for (in words, and the points checked)."""

    text: str
    value: Callable[[int, int, Costs], float]  # (p, v, the costs of a rank's layers) -> idle time
    costs: str
    checked: tuple[Costs, ...]


FUSED = Costs(forward=1, backward=2)
SPLIT = Costs(forward=1, backward_input=1, backward_weight=1)
# The cost points the idle formulas are checked at, each within the formula's stated costs.
ANY_FUSED = (FUSED, Costs(forward=1, backward=1), Costs(forward=1, backward=3), Costs(forward=2, backward=1))
W_AT_MOST = (
    SPLIT,
    Costs(forward=1, backward_input=2, backward_weight=1),
    Costs(forward=2, backward_input=1, backward_weight=1),
    Costs(forward=1, backward_input=1, backward_weight=0.5),
)
ANY_SPLIT = (
    *W_AT_MOST,
    Costs(forward=1, backward_input=1, backward_weight=2),
    Costs(forward=0.5, backward_input=1, backward_weight=1),
)


def _torch_count(p: int, m: int) -> bool:
    """Whether torch's ``ScheduleInterleavedZeroBubble`` takes ``m`` microbatches on ``p`` ranks."""
    return m % max(1, m // p) == 0


def _round(p: int, m: int) -> int:
    """Microbatches per round of ``InterleavedZeroBubble``: torch's ``m // (m // p)`` of the next count it takes."""
    n = m
    while not _torch_count(p, n):
        n += 1
    return n // max(1, n // p)


def _v_half_idle(p: int) -> float:
    return 3 * ((p - 1) // 2) - 0.5 if p >= 3 else 0.5 * (p - 1)


def _v_min_idle(p: int) -> float:
    return 2 * p - 2.5 - (p % 3 == 0)


@dataclass(frozen=True)
class Row:
    """A schedule's row: the README's columns, its formulas, and how to build it.

    ``builtin`` names its entry of the registry (fpipe/schedules/_registry.py), which ``make(m, v,
    g)`` builds it with (``g``: the microbatch group, for ``Interleaved1F1B``'s row of groups
    only); ``stages_per_rank`` are the ``v`` it is checked with; ``split``: its costs are
    ``SPLIT`` (else ``FUSED``). The peak is the busiest rank's (``max(peak_activations)``).
    """

    name: str
    short: str  # in the notes' tables
    schedule: str
    placement: str
    paper: str
    source: str  # the notes' formulas table
    builtin: str
    stages_per_rank: tuple[int, ...]
    split: bool
    bubble: Formula
    peak: Formula
    idle: Idle | None = None
    bubble_note: str = ""
    groups: bool = False

    def make(self, m: int, v: int, g: int) -> Schedule:
        """The row's schedule for ``m`` microbatches, ``v`` stages per rank, groups of ``g``."""
        schedule = next(b for b in BUILTINS if b.name == self.builtin).build(m, v)
        return replace(schedule, microbatch_group=g) if self.groups else schedule

    def simulate(self, p: int, v: int, m: int, g: int, costs: Costs | None = None) -> Simulation:
        """The step of ``p`` ranks, ``v`` stages per rank, ``m`` microbatches (groups of ``g``),
        each stage ``1/v`` of ``costs`` (default: the row's)."""
        c = costs or (SPLIT if self.split else FUSED)
        per_stage = Costs(
            forward=c.forward / v,
            backward=None if c.backward is None else c.backward / v,
            backward_input=c.backward_input / v,
            backward_weight=c.backward_weight / v,
        )
        return simulate(self.make(m, v, g).program(p * v, p), per_stage)


def _bubble(v: int | str, split: int) -> Counts:
    return lambda p, v_, m, g: (p - 1) / (split * (v_ if v == "v" else int(v)) * m + p - 1)


ONE_F_ONE_B_BUBBLE = Formula("(p-1)/(m+p-1)", _bubble(1, 1))
INTERLEAVED_BUBBLE = "(p-1)/(vm+p-1)"

ROWS: list[Row] = [
    Row(
        "GPipe",
        "GPipe",
        "`GPipe(m)`",
        "stage `s` on rank `s`",
        'Huang et al., "GPipe", NeurIPS 2019',
        "Huang et al. 2019",
        "GPipe",
        (1,),
        False,
        ONE_F_ONE_B_BUBBLE,
        Formula("m", lambda p, v, m, g: m),
        Idle("`(p-1)(T_F+T_B)`", lambda p, v, c: (p - 1) * (c.forward + c.of("B")), "any `T_F`, `T_B`", ANY_FUSED),
    ),
    Row(
        "1F1B (PipeDream-flush)",
        "1F1B",
        "`OneFOneB(m)`",
        "stage `s` on rank `s`",
        'Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021',
        "Narayanan et al. 2021 (PipeDream-flush); rank `r` holds `min(m, p-r)`",
        "OneFOneB",
        (1,),
        False,
        ONE_F_ONE_B_BUBBLE,
        Formula("min(m, p)", lambda p, v, m, g: min(m, p)),
        Idle("`(p-1)(T_F+T_B)`", lambda p, v, c: (p - 1) * (c.forward + c.of("B")), "any `T_F`, `T_B`", ANY_FUSED),
    ),
    Row(
        "Interleaved 1F1B",
        "Interleaved1F1B",
        "`Interleaved1F1B(m, stages_per_rank=v)`",
        "looped: stage `s` on rank `s % p`",
        'Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC 2021',
        "Narayanan et al. 2021 (Megatron-LM); peak from the warm-up count, `(m+(v-1)p)/v` for `p <= m < 2p-1`",
        "Interleaved1F1B",
        (2, 3),
        False,
        Formula(INTERLEAVED_BUBBLE, _bubble("v", 1), "when `p` divides `m`", lambda p, v, m, g: m % p == 0),
        Formula(
            "p(1+1/v) - 1/v",
            lambda p, v, m, g: m if m <= p else p + (p - 1) / v,
            "for `m >= 2p-1` (`m` for `m <= p`)",
            lambda p, v, m, g: m <= p or m >= 2 * p - 1,
        ),
        Idle(
            "`(p-1)(T_F+T_B)/v`", lambda p, v, c: (p - 1) * (c.forward + c.of("B")) / v, "any `T_F`, `T_B`", ANY_FUSED
        ),
    ),
    Row(
        "Interleaved 1F1B, groups of `g`",
        "Interleaved1F1B, groups",
        "`Interleaved1F1B(m, stages_per_rank=v, microbatch_group=g)`, `g >= p`",
        "looped",
        "Megatron-Core, `microbatch_group_size_per_vp_stage` (`megatron/core/pipeline_parallel/schedules.py`)",
        "Megatron-Core",
        "Interleaved1F1B",
        (2, 3),
        False,
        Formula(
            INTERLEAVED_BUBBLE,
            _bubble("v", 1),
            "when the last group holds `>= p`",
            lambda p, v, m, g: (m % g or g) >= p,
        ),
        Formula(
            "min(m, (2p-1+(v-1)g)/v)",
            lambda p, v, m, g: min(m, (2 * p - 1 + (v - 1) * g) / v),
            "for `m <= g` and `m >= g+p-1` (between, at some counts only)",
            lambda p, v, m, g: not g < m < g + p - 1,
            exact=False,
        ),
        groups=True,
    ),
    Row(
        "Interleaved zero bubble",
        "ZB interleaved",
        "`InterleavedZeroBubble(m, stages_per_rank=v)`",
        "looped",
        "Qi et al., ICLR 2024 (ZB-H1 on `v` stages per rank), as torch's `ScheduleInterleavedZeroBubble`",
        "Qi et al. 2024 (ZB-H1) on torch's interleaved order (`ScheduleInterleavedZeroBubble`)",
        "InterleavedZeroBubble",
        (2, 3),
        True,
        Formula(
            "(p-1)/(3vm+p-1)",
            _bubble("v", 3),
            "for `m >= p` that `m // p` divides (torch's counts)",
            lambda p, v, m, g: m >= p and _torch_count(p, m),
        ),
        Formula(
            "((v-1)k+p)/v",
            lambda p, v, m, g: m if m <= p else ((v - 1) * _round(p, m) + p) / v,
            "for `m >= p`, `k` microbatches per round (`p` when `p` divides `m`; `m` for `m <= p`)",
        ),
        Idle(
            "`(p-1)(T_F+T_I-T_W)/v`",
            lambda p, v, c: (p - 1) * (c.forward + c.backward_input - c.backward_weight) / v,
            "`T_W <= T_F`, `T_W <= T_I`",
            W_AT_MOST,
        ),
        "split backward, `T_F = T_I = T_W`",
    ),
    Row(
        "Looped BFS",
        "LoopedBFS",
        "`LoopedBFS(m, stages_per_rank=v)`",
        "looped",
        'Lamy-Poirier, "Breadth-First Pipeline Parallelism", MLSys 2023',
        "Lamy-Poirier 2023",
        "LoopedBFS",
        (2, 3),
        False,
        Formula(INTERLEAVED_BUBBLE, _bubble("v", 1), "for `m >= p`", lambda p, v, m, g: m >= p),
        Formula("m", lambda p, v, m, g: m),
        Idle(
            "`(p-1)(T_F+T_B)/v`", lambda p, v, c: (p - 1) * (c.forward + c.of("B")) / v, "any `T_F`, `T_B`", ANY_FUSED
        ),
    ),
    Row(
        "ZB-H1",
        "ZB-H1",
        "`ZeroBubbleH1(m)`",
        "stage `s` on rank `s`",
        'Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024',
        "Qi et al. 2024, table of handcrafted schedules; every rank holds `min(m, p)`",
        "ZeroBubbleH1",
        (1,),
        True,
        Formula("(p-1)/(3m+p-1)", _bubble(1, 3), "for `m >= p`", lambda p, v, m, g: m >= p),
        Formula("min(m, p)", lambda p, v, m, g: min(m, p)),
        Idle(
            "`(p-1)(T_F+T_I-T_W)`",
            lambda p, v, c: (p - 1) * (c.forward + c.backward_input - c.backward_weight),
            "`T_W <= T_F`, `T_W <= T_I`",
            W_AT_MOST,
        ),
        "split backward, `T_F = T_I = T_W`",
    ),
    Row(
        "ZB-H2",
        "ZB-H2",
        "`ZeroBubbleH2(m)`, `m >= 2p-1`",
        "stage `s` on rank `s`",
        "Qi et al., ICLR 2024",
        "Qi et al. 2024, section 3.1 (handcrafted ZB-H2); `0` with post-validation; every rank holds `2p-1`",
        "ZeroBubbleH2",
        (1,),
        True,
        Formula("(p-1)/(3m+p-1)", _bubble(1, 3)),
        Formula("2p-1", lambda p, v, m, g: 2 * p - 1),
        Idle(
            "`(p-1) T_F`",
            lambda p, v, c: (p - 1) * c.forward,
            "any `T_F`, `T_I`, `T_W`, all at the step's ends",
            ANY_SPLIT,
        ),
        "same costs; zero inside the step, whose end waits `(p-1) T_F` without the paper's optimizer post-validation",
    ),
    Row(
        "ZB-V",
        "ZB-V",
        "`ZeroBubbleV(m)`",
        "V: rank `r` holds stages `r` and `2p-1-r`",
        "Qi et al., ICLR 2024",
        "derived here, see below; `2p` half-size chunks at the peak",
        "ZeroBubbleV",
        (2,),
        True,
        Formula("(p-1)/(6m+p-1)", _bubble(2, 3), "for `m >= 3p//2`", lambda p, v, m, g: m >= 3 * p // 2),
        Formula("min(m, p)", lambda p, v, m, g: min(m, p)),
        Idle("`(p-1) T_F / 2`", lambda p, v, c: (p - 1) * c.forward / 2, "`T_F = T_I = T_W`", (SPLIT,)),
        "same costs",
    ),
    Row(
        "V-Half",
        "V-Half",
        "`VHalf(m)`",
        "V, as ZB-V",
        'Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS 2024 (the order of their repository\'s '
        "`zbv_greedy.py`)",
        'Qi et al., "Pipeline Parallelism with Controllable Memory", 2024 (their table: `B/2`, `B` 1F1B\'s); '
        "the order of the repository's `zbv_greedy.py`",
        "VHalf",
        (2,),
        True,
        Formula(
            "I/(3m+I)",
            lambda p, v, m, g: _v_half_idle(p) / (3 * m + _v_half_idle(p)),
            "for `m >= 2p` (and some smaller `m`), `I = 3((p-1)//2) - 1/2` (`p >= 3`)",
            lambda p, v, m, g: m >= 2 * p and p >= 3,
            exact=False,
        ),
        Formula("min(m, (p+2)//2)", lambda p, v, m, g: min(m, (p + 2) // 2)),
        Idle(
            "`I = 3((p-1)//2) - 1/2`",
            lambda p, v, c: _v_half_idle(p),
            "`T_F = T_I = T_W`, `p >= 3`, `m >= 2p`",
            (SPLIT,),
        ),
        "same costs; at most 0.6 of 1F1B's",
    ),
    Row(
        "V-Min",
        "V-Min",
        "`VMin(m)`",
        "V, as ZB-V",
        "Qi et al., NeurIPS 2024 (as V-Half)",
        'as V-Half (their table: `2B/3`, "+ O(n) overhead")',
        "VMin",
        (2,),
        True,
        Formula(
            "I/(3m+I)",
            lambda p, v, m, g: _v_min_idle(p) / (3 * m + _v_min_idle(p)),
            "for `m >= 2p` (and some smaller `m`), `I = 2p - 5/2`, one less when `3` divides `p` (`p >= 2`)",
            lambda p, v, m, g: m >= 2 * p and p >= 2,
            exact=False,
        ),
        Formula("min(m, (p+4)//3)", lambda p, v, m, g: min(m, (p + 4) // 3)),
        Idle(
            "`I = 2p - 5/2`, one less when `3` divides `p`",
            lambda p, v, c: _v_min_idle(p),
            "`T_F = T_I = T_W`, `p >= 2`, `m >= 2p`",
            (SPLIT,),
        ),
        "same costs; at most 0.75 of 1F1B's; with `T_I = 2 T_F` above it at `p = 8`, `m = 32`",
    ),
    Row(
        "DualPipeV",
        "DualPipeV",
        "`DualPipeV(m)`",
        "V, as ZB-V",
        'DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024 (DualPipe, cut in half)',
        "DeepSeek-AI 2024; torch's `ScheduleDualPipeV` with its overlapped pairs run `F` then `B`",
        "DualPipeV",
        (2,),
        True,
        Formula("(p-1)/(6m+p-1)", _bubble(2, 3), "for `m >= 2p`", lambda p, v, m, g: m >= 2 * p),
        Formula("min(m, p + 1/2)", lambda p, v, m, g: min(m, p + 0.5)),
        Idle("`(p-1) T_F / 2`", lambda p, v, c: (p - 1) * c.forward / 2, "`T_F = T_I = T_W`, `B = I + W`", (SPLIT,)),
        "same costs, `T_B = T_I + T_W`; its `F`+`B` pairs run in turn, or interleaved at the experts' all-to-alls "
        "with `Overlapped(DualPipeV(m))` (notes/pairs.md)",
    ),
    Row(
        "DualPipe",
        "DualPipe",
        "`DualPipe(m)`",
        "stage `s` on ranks `s` and `p-1-s`, half of the microbatches each (parameters held twice)",
        'DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024',
        "DeepSeek-AI 2024 (`PP+1`); deepseek-ai/DualPipe's `DualPipe` with its overlapped pairs run `F` then `B`",
        "DualPipe",
        (1,),
        True,
        Formula(
            "(p-2)/(6m+p-2)",
            lambda p, v, m, g: (p - 2) / (6 * m + p - 2),
            "for every count it takes (`p`, `m` even, `m >= 2p`)",
            lambda p, v, m, g: p % 2 == 0 and m % 2 == 0 and m >= 2 * p,
        ),
        Formula("p + 1", lambda p, v, m, g: p + 1),
        Idle(
            "`(p/2-1) T_F`",
            lambda p, v, c: (p / 2 - 1) * c.forward,
            "`T_I <= T_F <= 2 T_I`, `T_W >= T_I`, `B = I + W` (not at `T_F = 3 T_I` or `T_W < T_I`)",
            tuple(
                Costs(forward=f, backward_input=1, backward_weight=w)
                for f, w in [(1, 1), (1.5, 1), (2, 1), (1, 1.5), (1, 2), (1, 3), (2, 2), (1.5, 1.5)]
            ),
        ),
        "same costs; its `F`+`B` pairs interleave at the experts' all-to-alls with `Overlapped(DualPipe(m))`",
    ),
]

# Interleaved 1F1B with Megatron-Core's microbatch groups of g (v = 2): (p, m, groups).
GROUPS = [(4, 16, (4, 5, 6, 8, 16)), (8, 32, (8, 9, 10, 16, 32))]


def _shown(formula: Formula, p: int, v: int, m: int, g: int, digits: int) -> str:
    """The formula's value, or "-" outside the counts it holds for."""
    return f"{formula.value(p, v, m, g):.{digits}f}" if formula.holds(p, v, m, g) else "-"


def compared() -> None:
    """The first table: each schedule's simulated bubble, idle time and peak next to its formulas."""
    print("| schedule | p | m | bubble, sim. | bubble, formula | idle per rank | peak, sim. | peak, formula |")
    print("|---|---|---|---|---|---|---|---|")
    for p, m in [(4, 8), (4, 32), (8, 16), (8, 64)]:
        for row in ROWS:
            if row.groups:
                continue
            v = row.stages_per_rank[0]
            sim = row.simulate(p, v, m, p)
            idle = max(sim.makespan - busy for busy in sim.busy)
            peak = row.peak.value(p, v, m, p) if row.peak.holds(p, v, m, p) else None
            name = row.short + (f" v={v}" if v > 1 and row.schedule.count("stages_per_rank") else "")
            print(
                f"| {name} | {p} | {m} | {sim.bubble_fraction:.4f} | {_shown(row.bubble, p, v, m, p, 4)} | {idle:g} "
                f"| {max(sim.peak_activations):g} | {row.peak.text} = {'-' if peak is None else f'{peak:g}'} |"
            )


def formulas() -> None:
    """The second table: each formula with the counts and costs it holds for."""
    print("| schedule | bubble fraction | idle per rank | peak (1F1B-stage units) | source |")
    print("|---|---|---|---|---|")
    for row in ROWS:
        if row.groups:
            continue
        idle = "-" if row.idle is None else f"{row.idle.text} ({row.idle.costs})"
        print(f"| {row.short} | {row.bubble.cell()} | {idle} | {row.peak.cell()} | {row.source} |")


def groups() -> None:
    """The third table: bubble and peak of Interleaved1F1B(m, stages_per_rank=2, microbatch_group=g)."""
    v = 2
    row = next(r for r in ROWS if r.groups)
    print("| p | m | g | last group | bubble, sim. | bubble, formula | peak, sim. | peak, formula |")
    print("|---|---|---|---|---|---|---|---|")
    for p, m, gs in GROUPS:
        for g in gs:
            sim = row.simulate(p, v, m, g)
            last = m % g or g
            print(
                f"| {p} | {m} | {g} | {last} | {sim.bubble_fraction:.4f} | {_shown(row.bubble, p, v, m, g, 4)} "
                f"| {max(sim.peak_activations):g} | (2p-1+(v-1)g)/v = {(2 * p - 1 + (v - 1) * g) / v:g} |"
            )


def readme() -> None:
    """The README's Schedules table: every row's formulas with the counts they hold for, then a
    built-in of the registry that has no row yet, with its description and no formulas."""
    print("| name | class | placement | bubble fraction | peak activations | paper |")
    print("|---|---|---|---|---|---|")
    for row in ROWS:
        print(
            f"| {row.name} | {row.schedule} | {row.placement} | {row.bubble.cell(row.bubble_note)} "
            f"| {row.peak.cell()} | {row.paper} |"
        )
    for b in BUILTINS:
        if all(row.builtin != b.name for row in ROWS):
            print(f"| {b.about} | `{b.name}(m)` | {b.placement} | - | - | - |")


def main(table: str = "notes") -> None:
    """Print notes/schedules.md's tables (``table="notes"``) or the README's (``"readme"``)."""
    if table == "readme":
        readme()
        return
    compared()
    print()
    formulas()
    print()
    groups()


if __name__ == "__main__":
    main("readme" if "--readme" in sys.argv[1:] else "notes")

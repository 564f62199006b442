"""Print the table of notes/schedules.md: simulated bubble and memory of every schedule vs the papers.

Run from the repository root (prints the main table, then the one of microbatch groups):

    /work/venv/bin/python notes/schedules_table.py > /tmp/table.md

Costs: fused-backward schedules use T_F = 1, T_B = 2; split-backward ones T_F = T_I = T_W = 1 (the
same work). A schedule with v stages per rank gets 1/v of those per stage, so that every row does
the same work per rank and idle times compare directly (in units of one 1F1B-stage forward).
"""

from __future__ import annotations

from collections.abc import Callable

from fpipe.schedules import (
    Costs,
    DualPipeV,
    GPipe,
    Interleaved1F1B,
    InterleavedZeroBubble,
    LoopedBFS,
    OneFOneB,
    Schedule,
    VHalf,
    VMin,
    ZeroBubbleH1,
    ZeroBubbleH2,
    ZeroBubbleV,
    simulate,
)

Row = tuple[str, Callable[[int], Schedule], int, Callable[[int, int], float], Callable[[int, int], str]]

ROWS: list[Row] = [
    ("GPipe", GPipe, 1, lambda p, m: (p - 1) / (m + p - 1), lambda p, m: f"m = {m}"),
    ("1F1B", OneFOneB, 1, lambda p, m: (p - 1) / (m + p - 1), lambda p, m: f"p = {p}"),
    (
        "Interleaved1F1B v=2",
        lambda m: Interleaved1F1B(m, stages_per_rank=2),
        2,
        lambda p, m: (p - 1) / 2 / (m + (p - 1) / 2),
        lambda p, m: f"(2(p-1)+p+1)/2 = {(2 * (p - 1) + p + 1) / 2:g}",
    ),
    (
        "LoopedBFS v=2",
        lambda m: LoopedBFS(m, stages_per_rank=2),
        2,
        lambda p, m: (p - 1) / 2 / (m + (p - 1) / 2),
        lambda p, m: f"m = {m}",
    ),
    ("ZB-H1", ZeroBubbleH1, 1, lambda p, m: (p - 1) / (3 * m + p - 1), lambda p, m: f"p = {p}"),
    # Zero bubble inside the step; its end still waits (p-1) T_F without post-validation.
    ("ZB-H2", ZeroBubbleH2, 1, lambda p, m: (p - 1) / (3 * m + p - 1), lambda p, m: f"2p-1 = {2 * p - 1}"),
    (
        "ZB interleaved v=2",
        lambda m: InterleavedZeroBubble(m, stages_per_rank=2),
        2,
        lambda p, m: (p - 1) / (6 * m + p - 1),
        lambda p, m: f"p = {p}",
    ),
    ("ZB-V", ZeroBubbleV, 2, lambda p, m: (p - 1) / (6 * m + p - 1), lambda p, m: f"p = {p}"),
    # Controllable memory: the repository's table gives B/2 and 2B/3, B = 1F1B's (p-1)/(m+p-1).
    ("V-Half", VHalf, 2, lambda p, m: (p - 1) / (m + p - 1) / 2, lambda p, m: f"(p+2)//2 = {(p + 2) // 2}"),
    ("V-Min", VMin, 2, lambda p, m: 2 * (p - 1) / (m + p - 1) / 3, lambda p, m: f"(p+4)//3 = {(p + 4) // 3}"),
    # Overlapped F+B pairs run one after the other: no overlap to gain from, ZB-V's bubble.
    ("DualPipeV", DualPipeV, 2, lambda p, m: (p - 1) / (6 * m + p - 1), lambda p, m: f"p + 1/2 = {p + 0.5:g}"),
]

# Interleaved 1F1B with Megatron-Core's microbatch groups of g (v = 2): (p, m, groups).
GROUPS = [(4, 16, (4, 5, 6, 8, 16)), (8, 32, (8, 9, 10, 16, 32))]


def groups() -> None:
    """The second table: bubble and peak of Interleaved1F1B(m, stages_per_rank=2, microbatch_group=g)."""
    v = 2
    print("| p | m | g | last group | bubble, sim. | bubble, formula | peak, sim. | peak, formula |")
    print("|---|---|---|---|---|---|---|---|")
    for p, m, gs in GROUPS:
        for g in gs:
            program = Interleaved1F1B(m, stages_per_rank=v, microbatch_group=g).program(p * v)
            sim = simulate(program, Costs(forward=1 / v, backward=2 / v))
            last = m % g or g
            print(
                f"| {p} | {m} | {g} | {last} | {sim.bubble_fraction:.4f} | {(p - 1) / v / (m + (p - 1) / v):.4f} "
                f"| {max(sim.peak_activations):g} | (2p-1+(v-1)g)/v = {(2 * p - 1 + (v - 1) * g) / v:g} |"
            )


def main() -> None:
    print("| schedule | p | m | bubble, sim. | bubble, formula | idle per rank | peak, sim. | peak, formula |")
    print("|---|---|---|---|---|---|---|---|")
    for p, m in [(4, 8), (4, 32), (8, 16), (8, 64)]:
        for name, make, v, bubble, peak in ROWS:
            split = name.startswith(("ZB", "V-", "DualPipe"))  # DualPipeV mixes B with I and W
            costs = (
                Costs(forward=1 / v, backward_input=1 / v, backward_weight=1 / v)
                if split
                else Costs(forward=1 / v, backward=2 / v)
            )
            sim = simulate(make(m).program(p * v), costs)
            idle = max(sim.makespan - busy for busy in sim.busy)
            print(
                f"| {name} | {p} | {m} | {sim.bubble_fraction:.4f} | {bubble(p, m):.4f} | {idle:g} "
                f"| {max(sim.peak_activations):g} | {peak(p, m)} |"
            )
    print()
    groups()


if __name__ == "__main__":
    main()

"""Print the tables of notes/search.md: the searched program against every built-in that fits, and
against the lower bound and the exact optimum.

Run from the repository root (takes about a minute for the first table, up to ten for the second):

    /work/venv/bin/python notes/search_table.py > /tmp/search.md

and, for the third (the two-stages-per-rank problems of the first table, ``p = 4, m = 8``, with
the exact search run up to ``SECONDS`` per case, 60 by default; one placement per run,
``looped`` or ``v``; with OR-Tools installed, ``pip install -e '.[solver]'``, the exact search
is CP-SAT's and ``large 20`` takes about 10 minutes a placement, else the branch and bound's):

    /work/venv/bin/python notes/search_table.py large [SECONDS] [PLACEMENT]

and, to check the two exact engines against each other on the second table's cases (about
five minutes; OR-Tools needed):

    /work/venv/bin/python notes/search_table.py cross

Costs, in units of one stage's forward (``T_F = T_I = 1``): every stage alike, or the last 2x or
3x heavier (a vocabulary head: all its costs scaled); ``T_W`` 0.3, 1 or 2 times ``T_I``; a message
latency of 0, 0.3 or 1 forward. Memory per rank in activation units (NOTE [activation units]):
``p`` (1F1B's), ``2p - 1`` (ZB-H2's) or ``p / 2``. With ``v`` stages per rank each stage costs
``1/v`` of that, so every row does the same work per rank.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Iterator, Sequence

from fpipe.planning import search
from fpipe.planning._arguments import checked_problem
from fpipe.planning._bound import lower_bound
from fpipe.planning._exact import exact
from fpipe.planning._solver import available, solve
from fpipe.schedules import Costs

P, M = 4, 8
PLACEMENTS = [("looped", 1), ("looped", 2), ("v", 2)]
HEAVY = (1, 2, 3)
WEIGHT = (0.3, 1.0, 2.0)
SEND = (0.0, 0.3, 1.0)
MEMORY = {"p": P, "2p-1": 2 * P - 1, "p/2": P / 2}
# the small problems the exact search is run on to the end: (placement, v, p, m)
SMALL = [
    ("looped", 1, 2, 4),
    ("looped", 1, 3, 6),
    ("looped", 1, 4, 8),
    ("looped", 2, 2, 4),
    ("v", 2, 2, 4),
    ("looped", 2, 3, 4),
    ("v", 2, 3, 4),
]
PROOF_SECONDS = (
    20.0  # the exact search's budget per case in the second table (``search`` gives it the rest of its 10 s)
)
LARGE = [("looped", 2, P, M), ("v", 2, P, M)]  # the third table's problems: two stages per rank in the first
LARGE_SECONDS = 60.0  # the exact search's budget per case in the third table, by default


def costs_of(num_stages: int, v: int, heavy: float, weight: float, send: float) -> list[Costs]:
    """Per-stage costs of one row (see the module docstring)."""
    light = Costs(forward=1 / v, backward_input=1 / v, backward_weight=weight / v, send=send)
    last = Costs(forward=heavy / v, backward_input=heavy / v, backward_weight=heavy * weight / v, send=send)
    return [light] * (num_stages - 1) + [last]


def cases(p: int = P) -> Iterator[tuple[int, float, float, float, str, float]]:
    """``(heavy, weight, send, memory name, memory)`` of every cost and memory case for ``p`` ranks."""
    for heavy in HEAVY:
        for weight in WEIGHT:
            for send in SEND:
                for name, memory in (("p", p), ("2p-1", 2 * p - 1), ("p/2", p / 2)):
                    yield heavy, weight, send, name, memory


def row(placement: str, v: int, heavy: int, weight: float, send: float, memory: str) -> str:
    """One line of the first table."""
    costs = costs_of(P * v, v, heavy, weight, send)
    found = search(P, M, costs, placement=placement, stages_per_rank=v, memory=MEMORY[memory], exact=False)
    builtins = [(t, n) for n, t in found.candidates if not n.startswith("list")]
    best = min(builtins, default=None)
    versus = f"{best[1]} {best[0]:.4g} | {found.makespan / best[0]:.3f}" if best else "none fits | "
    source = "built-in" if found.name == (best and best[1]) else "list"
    gap = max(0.0, found.makespan / found.lower_bound - 1)
    where = "V" if placement == "v" else f"looped v={v}"
    return (
        f"| {where} | {heavy}x | {weight:g} | {send:g} | {memory} | {versus} | {source} {found.makespan:.4g} "
        f"| {found.lower_bound:.4g} | {gap:.1%} |"
    )


def exact_case(
    placement: str, v: int, p: int, m: int, costs: list[Costs], memory: float, seconds: float = PROOF_SECONDS
) -> dict[str, float]:
    """One small case: the built-ins and the list scheduler alone, ``search`` with its exact
    search (the rest of its 10 s budget; CP-SAT when OR-Tools is installed, else the branch and
    bound), and that exact search run on (``seconds``): the optimum of its space, ``math.nan``
    if it did not finish."""
    listed = search(p, m, costs, placement=placement, stages_per_rank=v, memory=memory, exact=False)
    found = search(p, m, costs, placement=placement, stages_per_rank=v, memory=memory)
    optimum = found.makespan if found.optimal else math.nan
    if not found.optimal:
        problem = checked_problem(p, m, costs, placement, v, memory, None)
        deadline = time.perf_counter() + seconds
        if available():
            _, best, outcome = solve(problem, found.program, found.makespan, lower_bound(problem), deadline)
        else:
            _, best, outcome = exact(problem, found.makespan, deadline)
        optimum = best if outcome == "optimal" else math.nan
    if found.lower_bound > optimum * (1 + 1e-9):  # never, or the bound is wrong (NaN compares False)
        raise AssertionError(
            f"lower bound {found.lower_bound} above the optimum {optimum}: {placement, v, p, m, costs}"
        )
    return {"listed": listed.makespan, "found": found.makespan, "optimum": optimum, "bound": found.lower_bound}


def exact_row(placement: str, v: int, p: int, m: int, seconds: float = PROOF_SECONDS, behind: bool = False) -> str:
    """One line of the second table: every cost and memory case of one small problem (``behind``:
    and the third's columns, how far ``exact=False`` is above the optimum)."""
    results = []
    for h, w, s, name, memory in cases(p):
        costs = costs_of(2 * p if placement == "v" else p * v, v, h, w, s)
        results.append(exact_case(placement, v, p, m, costs, memory, seconds))
        if behind:  # the third table's cases one by one, for the notes' comments
            print(f"{placement} {h}x W {w:g} latency {s:g} memory {name}: {results[-1]}", file=sys.stderr, flush=True)
    proven = [r for r in results if not math.isnan(r["optimum"])]
    close = [r for r in proven if r["found"] <= r["optimum"] * (1 + 1e-9)]
    listed = [r for r in proven if r["listed"] <= r["optimum"] * (1 + 1e-9)]
    tight = [r for r in proven if r["bound"] >= r["optimum"] * (1 - 1e-9)]
    gaps = sorted(r["optimum"] / r["bound"] - 1 for r in proven)
    gap = f"{statistics.median(gaps):.1%} | {gaps[-1]:.1%}" if gaps else " | "
    where = "V" if placement == "v" else f"looped v={v}"
    line = (
        f"| {where} | {p} | {m} | {len(proven)} of {len(results)} | {len(close)} | {len(listed)} | {len(tight)} "
        f"| {gap} |"
    )
    if not behind:
        return line
    late = sorted(r["listed"] / r["optimum"] - 1 for r in proven)
    return f"{line} {statistics.median(late):.1%} | {late[-1]:.1%} |" if late else f"{line} | |"


def main(every: int = 1, small: Sequence[tuple[str, int, int, int]] = SMALL) -> None:
    """Print both tables (``every``: only every ``every``-th row of the first; ``small``: the
    problems of the second; fewer for the tests)."""
    print(
        "| placement | last stage | W / I | latency | memory | best built-in | searched / it | searched | bound | gap |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    k = 0
    for placement, v in PLACEMENTS:
        for heavy, weight, send, memory, _ in cases():
            if k % every == 0:
                print(row(placement, v, heavy, weight, send, memory))
            k += 1
    print()
    print(
        "| placement | p | m | optimum known | search finds it | list + built-ins find it | bound is it "
        "| median gap optimum / bound | largest |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for case in small:
        print(exact_row(*case))


def large(seconds: float = LARGE_SECONDS, placements: Sequence[str] = ("looped", "v")) -> None:
    """Print the third table: the second's columns for ``LARGE`` with the exact search run up to
    ``seconds`` per case, and how far the list scheduler with the built-ins (``exact=False``) is
    above the optimum where it is known."""
    print(
        "| placement | p | m | optimum known | search finds it | list + built-ins find it | bound is it "
        "| median gap optimum / bound | largest | median gap list + built-ins / optimum | largest |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for placement, v, p, m in LARGE:
        if placement in placements:
            print(exact_row(placement, v, p, m, seconds, behind=True))


def cross(seconds: float = PROOF_SECONDS) -> None:
    """Print, per problem of the second table, in how many of its 81 cases the two exact engines,
    the branch and bound and CP-SAT (OR-Tools needed), both run to the end from ``exact=False``'s
    program (``seconds`` each), prove the same optimum, and the cases where they differ."""
    print("| placement | p | m | both proven | same optimum | differ |")
    print("|---|---|---|---|---|---|")
    for placement, v, p, m in SMALL:
        proven, same, differ = 0, 0, []
        for h, w, s, name, memory in cases(p):
            costs = costs_of(2 * p if placement == "v" else p * v, v, h, w, s)
            listed = search(p, m, costs, placement=placement, stages_per_rank=v, memory=memory, exact=False)
            problem = checked_problem(p, m, costs, placement, v, memory, None)
            _, bb, bb_done = exact(problem, listed.makespan, time.perf_counter() + seconds)
            start = time.perf_counter()
            _, cp, cp_done = solve(problem, listed.program, listed.makespan, lower_bound(problem), start + seconds)
            if bb_done == cp_done == "optimal":
                proven += 1
                if abs(bb - cp) <= 1e-9 * bb:
                    same += 1
                else:
                    differ.append(f"{h}x W {w:g} latency {s:g} memory {name}: {bb:.4g} / {cp:.4g}")
        where = "V" if placement == "v" else f"looped v={v}"
        print(f"| {where} | {p} | {m} | {proven} of 81 | {same} | {'; '.join(differ)} |", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["cross"]:
        cross()
    elif sys.argv[1:2] == ["large"]:
        large(float(sys.argv[2]) if len(sys.argv) > 2 else LARGE_SECONDS, sys.argv[3:] or ("looped", "v"))
    else:
        main()

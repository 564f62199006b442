"""Print the tables of notes/search.md: the searched program against every built-in that fits, and
against the lower bound and the exact optimum.

Run from the repository root (takes about a minute):

    /work/venv/bin/python notes/search_table.py > /tmp/search.md

Costs, in units of one stage's forward (``T_F = T_I = 1``): every stage alike, or the last 2x or
3x heavier (a vocabulary head: all its costs scaled); ``T_W`` 0.3, 1 or 2 times ``T_I``; a message
latency of 0, 0.3 or 1 forward. Memory per rank in activation units (NOTE [activation units]):
``p`` (1F1B's), ``2p - 1`` (ZB-H2's) or ``p / 2``. With ``v`` stages per rank each stage costs
``1/v`` of that, so every row does the same work per rank.
"""

from __future__ import annotations

from collections.abc import Iterator

from fpipe.schedules import Costs, search

P, M = 4, 8
PLACEMENTS = [("looped", 1), ("looped", 2), ("v", 2)]
HEAVY = (1, 2, 3)
WEIGHT = (0.3, 1.0, 2.0)
SEND = (0.0, 0.3, 1.0)
MEMORY = {"p": P, "2p-1": 2 * P - 1, "p/2": P / 2}
# (p, m, heavy, weight, send, memory): small enough for the exact search to finish in well under a second
EXACT = [
    (2, 4, 1, 1.0, 0.0, None),
    (2, 4, 3, 0.3, 1.0, None),
    (2, 6, 2, 2.0, 0.3, 2),
    (3, 4, 1, 0.3, 0.3, None),
    (3, 4, 2, 2.0, 1.0, 3),
    (3, 6, 3, 1.0, 0.3, 3),
    (3, 6, 1, 2.0, 1.0, None),
]


def costs_of(num_stages: int, v: int, heavy: float, weight: float, send: float) -> list[Costs]:
    """Per-stage costs of one row (see the module docstring)."""
    light = Costs(forward=1 / v, backward_input=1 / v, backward_weight=weight / v, send=send)
    last = Costs(forward=heavy / v, backward_input=heavy / v, backward_weight=heavy * weight / v, send=send)
    return [light] * (num_stages - 1) + [last]


def cases() -> Iterator[tuple[str, int, int, float, float, str]]:
    for placement, v in PLACEMENTS:
        for heavy in HEAVY:
            for weight in WEIGHT:
                for send in SEND:
                    for memory in MEMORY:
                        yield placement, v, heavy, weight, send, memory


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


def exact_row(p: int, m: int, heavy: int, weight: float, send: float, memory: float | None) -> str:
    """One line of the second table: the list scheduler and built-ins alone, then with the exact search."""
    costs = costs_of(p, 1, heavy, weight, send)
    listed = search(p, m, costs, memory=memory, exact=False)
    found = search(p, m, costs, memory=memory)
    limit = "none" if memory is None else f"{memory:g}"
    gap = max(0.0, found.makespan / found.lower_bound - 1)
    return (
        f"| {p} | {m} | {heavy}x | {weight:g} | {send:g} | {limit} | {listed.makespan:.4g} | {found.makespan:.4g} "
        f"| {'yes' if found.optimal else 'no'} | {found.lower_bound:.4g} | {gap:.1%} |"
    )


def main(every: int = 1) -> None:
    """Print both tables (``every``: only every ``every``-th row of the first, for the tests)."""
    print(
        "| placement | last stage | W / I | latency | memory | best built-in | searched / it | searched | bound | gap |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for k, case in enumerate(cases()):
        if k % every == 0:
            print(row(*case))
    print()
    print("| p | m | last stage | W / I | latency | memory | list + built-ins | exact | optimal | bound | gap |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for case in EXACT:
        print(exact_row(*case))


if __name__ == "__main__":
    main()

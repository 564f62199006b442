"""The planner's ranking (fpipe/planning/_ranking.py): each schedule with its fastest split, fastest
first, the memory check, and what to do when nothing runs or fits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import pytest

from fpipe.planning import Transformer, search
from fpipe.planning._cost_model import GIB, Unit, measured_units, transformer_units
from fpipe.planning._plan import costs_text
from fpipe.planning._ranking import Candidate, PlanError, ranked
from fpipe.schedules import Costs, OneFOneB, Program, ScheduleError, simulate
from tests.helpers import DEVICE, MODEL, candidates


def test_plan_ranks_by_simulated_step_with_each_split() -> None:
    """Measured stages regrouped per schedule: the rows are simulate's figures for the split shown."""
    units = measured_units([Costs(), Costs(), Costs(), Costs(forward=2, backward_input=2, backward_weight=2, send=0.5)])
    rows = ranked(units, 2, candidates(4, 2))
    assert [r.name for r in rows] == ["zbv", "zbh1", "1f1b", "gpipe"]
    one_f_one_b = next(r for r in rows if r.name == "1f1b")
    assert one_f_one_b.stages == (range(0, 3), range(3, 4))
    stage_costs = [
        Costs(forward=3, backward_input=3, backward_weight=3),
        Costs(forward=2, backward_input=2, backward_weight=2, backward=4, send=0.5),
    ]
    assert one_f_one_b.simulation is not None and one_f_one_b.peak_bytes is None
    assert one_f_one_b.simulation.makespan == simulate(OneFOneB(4).program(2), stage_costs).makespan == 40.0


def test_more_stages_than_units_is_a_row_that_cannot_run() -> None:
    rows = ranked(measured_units([Costs(), Costs(), Costs()]), 2, candidates(4, 2))
    assert rows[-1].name == "zbv" and rows[-1].error == "needs 4 stages, has 3 units to split"


def test_no_candidate_that_can_run_is_an_error_saying_what_would() -> None:
    """Every row "cannot run" is no plan: fewer ranks, or more stages (layers and the head, or measured)."""
    with pytest.raises(PlanError) as raised:
        ranked(measured_units([Costs()] * 3), 4, candidates(4, 4))
    assert str(raised.value) == (
        "python -m fpipe plan: no schedule can run: on 4 ranks each needs at least 4 stages (gpipe: 1 per rank) and "
        "there are 3 units to split (3 measured stages). Use at most 3 ranks, or the costs of 4 stages."
    )
    with pytest.raises(
        PlanError, match=r"\(1 layer and the head\)\. Use at most 1 rank, or a model of at least 3 layers\.$"
    ):
        ranked(transformer_units(Transformer(1, 4, 8, 16, 2), DEVICE), 2, candidates(4, 2)[3:])  # zbv: 4 stages
    with pytest.raises(PlanError, match=r"\(1 measured stage\)\. Use the costs of 2 stages\.$"):  # no "at most 0 ranks"
        ranked(measured_units([Costs()]), 1, candidates(4, 1)[3:])
    with pytest.raises(PlanError, match=r"no schedule can run here \(zbh1: it cannot\)$"):
        ranked(measured_units([Costs()] * 3), 2, [Candidate("zbh1", 1, lambda costs: _refuse())])


def _refuse() -> Program:
    raise ScheduleError("it cannot")


def test_memory_marks_and_the_least_that_works() -> None:
    """Peak bytes = the rank's parameters + its activations at their peak; over the limit sorts
    after what fits; a limit nothing fits names the least any schedule needs."""
    units = transformer_units(MODEL, DEVICE)
    rows = {r.name: r for r in ranked(units, 2, candidates(4, 2))}
    gpipe, one_f_one_b = rows["gpipe"].peak_bytes, rows["1f1b"].peak_bytes
    assert gpipe is not None and one_f_one_b is not None
    # 1F1B's rank 0 (layer 0, with the embedding) holds 2 microbatches, GPipe's all 4.
    params0 = units[0].param_bytes or 0.0
    activation0 = units[0].activation_bytes or 0.0
    assert (one_f_one_b[0], gpipe[0]) == (params0 + 2 * activation0, params0 + 4 * activation0)
    limit = max(one_f_one_b)
    marked = ranked(units, 2, candidates(4, 2), memory=limit)
    assert not marked[-1].fits(limit) and marked[0].fits(limit)
    assert all(r.fits(limit) for r in marked[: [r.fits(limit) for r in marked].index(False)])
    least = min(max(r.peak_bytes) for r in rows.values() if r.peak_bytes is not None)  # zbv: 3 units, 4 stages
    with pytest.raises(PlanError, match=rf"the least any needs is {least / GIB:.4g} GiB \((1f1b|zbh1)\)"):
        ranked(units, 2, candidates(4, 2), memory=least * 0.99)


def test_a_searched_candidate_is_never_slower_than_a_built_in_of_its_stage_count() -> None:
    """NOTE [searched candidates]: tried on every other row's split too. Here (a last unit 3x
    heavier, messages as long as a unit's forward) the V searched on its own split is 60 against
    ZB-V's 55; on ZB-V's split it is at most ZB-V."""
    heavy = Costs(forward=3, backward_input=3, backward_weight=3, send=1.0)
    units = measured_units([Costs(send=1.0)] * 5 + [heavy])
    m, p = 4, 2

    def searched(placement: Literal["looped", "v"]) -> Callable[[tuple[Costs, ...]], Program]:
        return lambda costs: search(p, m, costs, placement=placement, exact=False).program

    tried = [Candidate("searched", 1, searched("looped"), adapts=True)]
    tried.append(Candidate("searched-v", 2, searched("v"), adapts=True))
    rows = ranked(units, p, [*candidates(m, p), *tried])
    step = {r.name: r.simulation.makespan for r in rows if r.simulation is not None}
    assert step["searched"] <= min(step["gpipe"], step["1f1b"], step["zbh1"])
    assert step["searched-v"] <= step["zbv"] == 55.0
    alone = ranked(units, p, [Candidate("searched-v", 2, searched("v"))])  # its own split only
    assert alone[0].simulation is not None and alone[0].simulation.makespan == 60.0


def test_data_parallel_reduction_starts_when_its_rank_finishes() -> None:
    """1F1B on 2 ranks: rank 1 finishes at 13, 2 before rank 0, so its reduction (8) hides 2
    behind rank 0's drain and ends the step at 21, after rank 0's (1, ending at 16)."""
    units = [Unit("a", Costs(), reduce_seconds=1.0), Unit("b", Costs(), reduce_seconds=8.0)]
    (row,) = ranked(units, 2, candidates(4, 2)[1:2])
    assert row.simulation is not None
    ends = [row.simulation.ends[r][-1] for r in range(2)]
    assert ends[1] < ends[0] == row.simulation.makespan == 15.0
    assert ends[1] == 13.0 and row.step == max(ends[0] + 1.0, ends[1] + 8.0) == 21.0
    (plain,) = ranked(measured_units([Costs(), Costs()]), 2, candidates(4, 2)[1:2])
    assert plain.step == plain.simulation.makespan == 15.0  # type: ignore[union-attr]


def test_memory_of_measured_costs_is_in_activation_units() -> None:
    """Measured units have no bytes: a limit is in microbatches of a rank's layers, the unit of
    ``Simulation.peak_activations``; nothing fitting names the least any needs in that unit."""
    units = measured_units([Costs(), Costs()])
    rows = {r.name: r for r in ranked(units, 2, candidates(4, 2), memory=2)}
    assert {name for name, row in rows.items() if row.fits(2)} == {"1f1b", "zbh1"}  # GPipe holds 4
    assert rows["gpipe"].peak() == 4 and rows["zbv"].error is not None and rows["zbv"].peak() is None
    with pytest.raises(PlanError, match=r"memory: 1 microbatches of a rank's layers\); the least any needs is 2 "):
        ranked(units, 2, candidates(4, 2), memory=1)


def test_measured_overhead_is_shown_and_paid_once_per_action_of_a_merged_stage() -> None:
    """NOTE [per-action overhead]: a stage of several measured stages runs one action per
    microbatch and kind, so it pays the largest of their overheads once, not their sum."""
    assert costs_text(Costs(overhead=2e-5)) == "F 1 s, I 1 s, W 1 s, send 0 s, overhead 20 us"
    assert costs_text(Costs(receive=3e-4)) == "F 1 s, I 1 s, W 1 s, send 0 s, receive 300 us"
    assert "overhead" not in costs_text(Costs())
    units = measured_units([Costs(overhead=0.25), Costs(overhead=0.5), Costs(overhead=0.125), Costs()])
    (row,) = ranked(units, 2, candidates(4, 2)[1:2])
    assert row.simulation is not None and row.stages == (range(0, 2), range(2, 4))
    assert [c.overhead for c in row.simulation.costs] == [0.5, 0.125]  # type: ignore[union-attr]

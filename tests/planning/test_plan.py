"""The planner's table (fpipe/planning/_plan.py): ``plan`` builds the rows of the schedules it is
given by name, ranks them, and returns the table ``python -m fpipe plan`` prints as a value."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from fpipe._cli import main
from fpipe.planning import Device, Experts, PlanError, Transformer, plan, save_costs
from fpipe.planning._cost_model import measured_units
from fpipe.planning._ranking import ranked
from fpipe.schedules import Costs
from tests.helpers import DEVICE, MODEL, candidates


def test_plan_is_the_ranked_rows_as_a_table_value(tmp_path: Path) -> None:
    """``plan`` builds the candidates by the command line's names, ranks them, and returns a value
    whose text is the table: from costs or from their file, the same rows."""
    costs = [Costs(), Costs(), Costs(), Costs(forward=2, backward_input=2, backward_weight=2, send=0.5)]
    found = plan(2, 4, costs=costs, schedules=["gpipe", "1f1b", "zbh1", "zbv"])
    expected = ranked(measured_units(costs), 2, candidates(4, 2))
    assert [(r.name, r.stages, r.step) for r in found.rows] == [(r.name, r.stages, r.step) for r in expected]
    assert found.fastest is found.rows[0] and found.tokens is None and found.memory is None
    assert found.about == "2 ranks, 4 microbatches; measured costs of 4 stages"
    assert str(found) == "\n".join([found.about, found.costs, found.table()])
    path = tmp_path / "costs.json"
    save_costs(path, costs)
    read = plan(2, 4, costs=path, schedules=["gpipe", "1f1b", "zbh1", "zbv"])
    assert read.about == f"2 ranks, 4 microbatches; measured costs of 4 stages ({path})" and read.rows == found.rows
    modelled = plan(2, 4, model=MODEL, device=DEVICE, schedules=["1f1b"])
    assert modelled.tokens == 2 * 8 * 4 and modelled.rows[0].peak_bytes is not None


def test_plan_errors() -> None:
    with pytest.raises(ValueError, match=r"pass measured costs \(costs=...\), or a model and a device"):
        plan(2, 4, costs=[Costs()] * 2, model=MODEL, device=DEVICE)
    with pytest.raises(ValueError, match=r"pass measured costs"):
        plan(2, 4, model=MODEL)
    with pytest.raises(ValueError, match=r"with a model the memory limit is the device's \(memory: 2\)"):
        plan(2, 4, model=MODEL, device=DEVICE, memory=2)
    with pytest.raises(PlanError, match=r"unknown schedules foo \(--schedules: 1f1b,foo\)\. Choose from gpipe, 1f1b"):
        plan(2, 4, costs=[Costs()] * 2, schedules=["1f1b", "foo"])
    with pytest.raises(PlanError, match=r"no schedule of 1f1b lays out 3 stages per rank"):
        plan(2, 4, costs=[Costs()] * 2, schedules=["1f1b"], stages_per_rank=[3])


def test_plan_of_a_mixture_of_experts_says_its_parameters_layout_and_device_hours() -> None:
    """NOTE [planner experts]: the line above the table names the experts, the parameters in
    all and active, and the devices of the layout; the throughput is per device, beside the
    device-hours a trillion tokens take at that rate."""
    model = Transformer(3, 4, 8, 16, 2, experts=Experts(routed=4, active=2, hidden=2, shared=1, dense_layers=1))
    device = Device(flops=2.0, bandwidth=4.0, latency=0.5, dp=2, ep=2)
    found = plan(2, 4, model=model, device=device, schedules=["1f1b"])
    assert found.about == (
        "2 ranks, 4 microbatches; 3 layers, hidden 4, vocabulary 16, 2 x 8 tokens per microbatch; "
        "4 routed experts (top-2, 1 shared, hidden 2), 1 dense layer first; 720 parameters, 624 active; "
        "tp 1, dp 2, ep 2: 8 devices (per device: TFLOP/s, memory, tokens/s)"
    )
    assert found.costs == (  # F: (2 x 152 x 16 + 4 b s^2 h) / 2 + 2 x (1/2 x t k h x 2 bytes / 4 + 0.5)
        "dense layer: F 4096 s, I 5120 s, W 3072 s, send 32.5 s; "
        "MoE layer: F 3521 s, I 4545 s, W 2432 s, send 32.5 s (all-to-all 65 s of F and of I); "
        "head: F 1024 s, I 1024 s, W 1024 s, send 32.5 s"
    )
    header, row = found.table().splitlines()[:2]
    assert header.split("  ")[-2:] == ["tokens/s/device", "device-hours/1T tokens"]
    rate = 2 * 8 * 4 / found.fastest.step / 2
    assert row.split()[-2:] == [f"{rate:,.0f}", f"{1e12 / rate / 3600:,.0f}"]
    with pytest.raises(ValueError, match=r"do not divide among the expert-parallel devices \(experts.routed: 4"):
        plan(2, 4, model=model, device=Device(flops=2.0, bandwidth=4.0, ep=3), schedules=["1f1b"])


def test_plan_with_overlap_pairs_the_rows_whose_pairs_hide_the_all_to_alls() -> None:
    """NOTE [planner overlap]: all-to-alls slow enough to be worth hiding (at 0.125 bytes/s, 2049 s
    of a MoE layer's F of 5505 s); the V schedules gain from their pairs and are named for them,
    1F1B's pairs would wait longer than they hide, so its row is unchanged. The command line's
    --overlap prints the same table."""
    model = Transformer(6, 4, 8, 16, 2, experts=Experts(routed=4, active=2, hidden=2, shared=1, dense_layers=1))
    device = Device(flops=2.0, bandwidth=4.0, latency=0.5, dp=2, ep=2, ep_bandwidth=0.125)
    schedules = ["1f1b", "zbv", "dualpipev"]
    plain = {r.name: r for r in plan(2, 8, model=model, device=device, schedules=schedules).rows}
    found = plan(2, 8, model=model, device=device, schedules=schedules, overlap=True)
    rows = {r.name: r for r in found.rows}
    assert set(rows) == {"zbv overlapped", "dualpipev overlapped", "1f1b"}
    for name in ("zbv", "dualpipev"):
        row = rows[f"{name} overlapped"]
        assert row.simulation is not None and row.simulation.program.pairs
        assert row.step < plain[name].step and row.peak_bytes == plain[name].peak_bytes  # pairs keep the order
    assert rows["1f1b"].step == plain["1f1b"].step and rows["1f1b"].simulation.program.pairs == frozenset()  # type: ignore[union-attr]
    assert found.about.endswith(
        "; overlap: F and B paired where faster, the all-to-alls hidden behind the other's compute"
    )
    out = io.StringIO()
    args = ["--layers", "6", "--hidden", "4", "--sequence", "8", "--vocabulary", "16", "--microbatch-size", "2"]
    args += ["--experts", "4", "--active-experts", "2", "--expert-hidden", "2", "--shared-experts", "1"]
    args += ["--dense-layers", "1", "--tflops", "2e-12", "--bandwidth", "4e-9", "--latency", "5e5", "--dp", "2"]
    args += ["--ep", "2", "--ep-bandwidth", "1.25e-10", "--schedules", ",".join(schedules), "--overlap"]
    assert main(["plan", "--ranks", "2", "--microbatches", "8", *args], stdout=out) == 0
    assert out.getvalue().splitlines()[2:] == found.table().splitlines()


def test_plan_with_overlap_and_nothing_to_hide_pairs_nothing() -> None:
    costs = [Costs(), Costs(), Costs(), Costs(forward=2, backward_input=2, backward_weight=2, send=0.5)]
    found = plan(2, 4, costs=costs, schedules=["1f1b", "dualpipev"], overlap=True)
    assert found.rows == plan(2, 4, costs=costs, schedules=["1f1b", "dualpipev"]).rows
    assert found.about.endswith("; overlap: nothing to hide (no all-to-all), no pairs")

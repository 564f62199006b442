"""``fpipe.balance``: contiguous split points minimizing the costliest stage.

Known costs with their partitions written out, a brute-force check of optimality over all
partitions of small random cost lists, parameter and time costs of real modules, and errors.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import fpipe


@pytest.mark.parametrize(
    ("costs", "num_stages", "expected"),
    [
        ([1, 1, 1, 1, 4], 2, [(0, 4), (4, 5)]),
        ([5, 1, 1, 1, 1, 1], 2, [(0, 1), (1, 6)]),
        ([3, 1, 2, 4, 1, 5, 2], 3, [(0, 3), (3, 5), (5, 7)]),  # max 7; (0,2),(2,5),(5,7) too, but less even
        ([1, 1, 1, 1], 3, [(0, 2), (2, 3), (3, 4)]),  # ties: earlier stages take more layers
        ([2, 2, 2, 2, 2, 2, 2, 2], 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
        ([0, 0, 0, 0], 2, [(0, 3), (3, 4)]),
        ([7], 1, [(0, 1)]),
        ([1, 2, 3], 3, [(0, 1), (1, 2), (2, 3)]),
        ([0.5, 0.25, 0.25, 1.0], 2, [(0, 3), (3, 4)]),
    ],
)
def test_known_costs(costs: list[float], num_stages: int, expected: list[tuple[int, int]]) -> None:
    assert fpipe.balance(costs, num_stages) == [range(a, b) for a, b in expected]


def partitions(n: int, k: int) -> list[list[range]]:
    """Every way to cut ``0..n-1`` into ``k`` non-empty contiguous runs."""
    result = []
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        result.append([range(a, b) for a, b in itertools.pairwise(bounds)])
    return result


@given(st.lists(st.integers(0, 20), min_size=1, max_size=8), st.integers(1, 8))
def test_optimal_against_brute_force(costs: list[int], num_stages: int) -> None:
    """The largest stage is as small as possible, and of those the stages are the most even."""
    num_stages = min(num_stages, len(costs))
    chosen = fpipe.balance(costs, num_stages)
    assert [r.start for r in chosen] == [0] + [r.stop for r in chosen[:-1]] and chosen[-1].stop == len(costs)
    assert all(len(r) > 0 for r in chosen)

    def key(parts: list[range]) -> tuple[int, int]:
        sums = [sum(costs[r.start : r.stop]) for r in parts]
        return max(sums), sum(c * c for c in sums)

    assert key(chosen) == min(key(p) for p in partitions(len(costs), num_stages))


def test_names_in_give_names_out() -> None:
    costs = {"embed": 1.0, "layers.0": 2.0, "layers.1": 2.0, "layers.2": 2.0, "head": 3.0}
    assert fpipe.balance(costs, 3) == [["embed", "layers.0"], ["layers.1", "layers.2"], ["head"]]


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("container", ["Sequential", "ModuleList"])
def test_a_container_gives_what_split_module_takes(container: str, num_stages: int) -> None:
    """``balance(model, k)`` names the container's children, so ``split_module(model, ...)`` takes it whole."""
    torch.manual_seed(0)
    layers = [nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)]
    model = nn.Sequential(*layers) if container == "Sequential" else nn.ModuleList(layers)
    cut = fpipe.balance(model, num_stages)
    assert [name for stage in cut for name in stage] == ["0", "1", "2", "3", "4"]
    stages, params = fpipe.split_module(model, cut)
    x = torch.randn(3, 4)
    y = x
    for stage, p in zip(stages, params):
        y = stage(p, y)
    expected = x
    for layer in layers:
        expected = layer(expected)
    torch.testing.assert_close(y, expected)


def test_a_module_dict_gives_its_keys() -> None:
    model = nn.ModuleDict({"embed": nn.Linear(4, 8), "act": nn.Tanh(), "head": nn.Linear(8, 8)})
    assert fpipe.balance(model, 2) == [["embed", "act"], ["head"]]


def test_by_params_counts_trainable_elements() -> None:
    layers = [nn.Linear(10, 10), nn.Linear(10, 10), nn.Linear(10, 30), nn.Tanh(), nn.Linear(30, 1)]
    # parameter counts: 110, 110, 330, 0, 31
    assert fpipe.balance(layers, 2) == [range(0, 2), range(2, 5)]
    layers[2].requires_grad_(False)  # frozen: costs nothing
    assert fpipe.balance(layers, 2) == [range(0, 1), range(1, 5)]
    model = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4), "c": nn.Linear(4, 40)})
    assert fpipe.balance(dict(model.items()), 2) == [["a", "b"], ["c"]]


class Clock:
    """A fake ``time.perf_counter``: it moves only when a layer says it took time."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class _Advance(torch.autograd.Function):
    """Identity that moves the clock by ``forward`` seconds when run, ``backward`` when differentiated."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, clock: Clock, forward: float, backward: float) -> torch.Tensor:
        clock.now += forward
        ctx.clock, ctx.backward = clock, backward
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        ctx.clock.now += ctx.backward
        return grad, None, None, None


class Slow(nn.Module):
    """A layer that takes ``forward`` seconds and ``backward`` seconds on ``clock``, recording its inputs."""

    def __init__(self, clock: Clock, forward: float, backward: float) -> None:
        super().__init__()
        self.clock, self.forward_seconds, self.backward_seconds = clock, forward, backward
        self.scale = nn.Parameter(torch.ones(()))
        self.inputs: list[Any] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs.append(x)
        return _Advance.apply(x, self.clock, self.forward_seconds, self.backward_seconds) * self.scale + 1


def test_by_time_measures_chained_forward_and_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cost of a layer is its forward plus its backward, run on the previous layer's output.

    The layers take their time on a fake clock (balance's ``time.perf_counter``), so the costs are
    exact on any machine under any load: forwards of 1, 1, 1, 1 s and backwards of 0, 0, 0, 6 s.
    Forward and backward together (1, 1, 1, 7) cut after layer 2; forwards alone, or parameter
    counts (1 each), would cut after layer 1.
    """
    clock = Clock()
    monkeypatch.setattr("fpipe._modules._balance.time", clock)
    layers = [Slow(clock, 1.0, 0.0), Slow(clock, 1.0, 0.0), Slow(clock, 1.0, 0.0), Slow(clock, 1.0, 6.0)]
    assert fpipe.balance(layers, 2) == [range(0, 2), range(2, 4)]  # by parameters
    chosen = fpipe.balance(layers, 2, by="time", sample_input=torch.zeros(3), repeats=1)
    assert chosen == [range(0, 3), range(3, 4)]  # 3 s and 7 s; by forwards alone it would be 2 s and 2 s
    assert [len(layer.inputs) for layer in layers] == [2, 2, 2, 2]  # a warm-up run, then one timed
    assert [layer.inputs[-1].tolist() for layer in layers] == [[0.0] * 3, [1.0] * 3, [2.0] * 3, [3.0] * 3]
    assert all(layer.scale.grad is None for layer in layers)  # timed with autograd.grad: .grad untouched


def test_by_time_leaves_buffers_and_random_state_alone() -> None:
    """Timing runs in train mode would update BatchNorm statistics and draw dropout masks."""
    layers = [nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2)]
    before = [{k: v.clone() for k, v in layer.state_dict().items()} for layer in layers]
    sample, rng = torch.randn(8, 4), torch.get_rng_state()
    fpipe.balance(layers, 2, by="time", sample_input=sample, repeats=1)
    assert torch.equal(torch.get_rng_state(), rng)
    for layer, state in zip(layers, before):
        assert all(torch.equal(v, state[k]) for k, v in layer.state_dict().items())


def test_by_time_with_adapters() -> None:
    """Layers taking extras are timed through the same adapters split_module uses."""
    layers = {"embed": nn.Embedding(5, 4), "layers.0": nn.Linear(4, 4), "layers.1": nn.Linear(4, 4)}
    call = {
        "embed": lambda embed, batch: {"hidden": embed(batch["tokens"]), "tag": "t"},
        "layers": lambda layer, x: {**x, "hidden": layer(x["hidden"])},
    }
    chosen = fpipe.balance(layers, 3, by="time", sample_input={"tokens": torch.tensor([[1, 2]])}, call=call)
    assert chosen == [["embed"], ["layers.0"], ["layers.1"]]


def test_errors() -> None:
    with pytest.raises(ValueError, match=r"num_stages must be between 1 and the number of layers, 2 \(num_stages: 3\)"):
        fpipe.balance([1, 2], 3)
    with pytest.raises(ValueError, match=r"the cost of layer '1' is -1.0; costs must be finite and >= 0"):
        fpipe.balance([1, -1], 1)
    with pytest.raises(TypeError, match=r"all modules or all numbers \(got: Linear, int\)"):
        fpipe.balance([nn.Linear(1, 1), 3], 1)  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r'by must be "params" or "time" \(by: \'flops\', type str\)'):
        fpipe.balance([nn.Linear(1, 1)], 1, by="flops")  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r'by must be "params" or "time" \(by: \'memory\', type str\)'):
        fpipe.balance([1.0, 2.0], 1, by="memory")  # type: ignore[call-overload]  # costs given: by is refused too
    with pytest.raises(ValueError, match=r'by="time" needs sample_input='):
        fpipe.balance([nn.Linear(1, 1)], 1, by="time")
    with pytest.raises(ValueError, match=r"repeats must be a positive int \(repeats: 0\)"):
        fpipe.balance([nn.Linear(1, 1)], 1, by="time", sample_input=torch.zeros(1), repeats=0)
    with pytest.raises(TypeError, match=r"fpipe.balance: call must be an adapter call\(module, x\) -> x or a dict"):
        fpipe.balance([nn.Linear(1, 1)], 1, by="time", sample_input=torch.zeros(1), call=3)  # type: ignore[arg-type]


def test_a_schedule_reproduces_torch_test_partition() -> None:
    """torch's test_partition: forward costs over 4 ranks, 8 microbatches of 1F1B; names work too."""
    costs = [8, 11, 2, 1, 18, 5, 4, 11]
    assert fpipe.balance(costs, 4) == [range(0, 1), range(1, 4), range(4, 5), range(5, 8)]
    schedule = fpipe.schedules.OneFOneB(8)
    assert fpipe.balance(costs, 4, schedule=schedule) == [range(0, 3), range(3, 5), range(5, 6), range(6, 8)]
    named = fpipe.balance({f"l{i}": c for i, c in enumerate(costs)}, 4, schedule=schedule)
    assert named == [["l0", "l1", "l2"], ["l3", "l4"], ["l5"], ["l6", "l7"]]


def test_a_schedule_sees_backward_costs_and_messages() -> None:
    """Backward costs count; a long send lengthens the fill and drain that a stage behind a heavy
    one waits for, so with it the heavy work moves to the front."""
    schedule = fpipe.schedules.GPipe(4)
    assert fpipe.balance([1, 1, 1, 1], 2, schedule=schedule) == [range(0, 2), range(2, 4)]
    assert fpipe.balance([1, 1, 1, 1], 2, schedule=schedule, backward=[2, 2, 2, 12]) == [range(0, 3), range(3, 4)]
    costs = [4, 1, 1, 1, 1, 4]
    assert fpipe.balance(costs, 3, schedule=fpipe.schedules.OneFOneB(3)) == [range(0, 1), range(1, 5), range(5, 6)]
    with_send = fpipe.balance(costs, 3, schedule=fpipe.schedules.OneFOneB(3), send=20)
    assert with_send == [range(0, 4), range(4, 5), range(5, 6)]  # a heavy stage first, as in torch's case


def test_a_schedule_takes_a_measured_time_as_a_forward_and_its_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """by="time" measures F + B together: with B = 2F, a layer of 3 s forwards in 1 s. That matters
    against a send of 2 s: read as forwards of 3 s, the cut would be after layer 3."""
    clock = Clock()
    monkeypatch.setattr("fpipe._modules._balance.time", clock)
    times = [4.0, 1.0, 1.0, 1.0, 1.0, 4.0]
    layers = [Slow(clock, t, 0.0) for t in times]
    schedule = fpipe.schedules.OneFOneB(3)
    chosen = fpipe.balance(layers, 3, by="time", sample_input=torch.zeros(3), repeats=1, schedule=schedule, send=2)
    assert chosen == fpipe.balance([t / 3 for t in times], 3, schedule=schedule, send=2)
    assert chosen == [range(0, 4), range(4, 5), range(5, 6)]
    assert fpipe.balance(times, 3, schedule=schedule, send=2) == [range(0, 3), range(3, 5), range(5, 6)]


def test_schedule_errors() -> None:
    schedule = fpipe.schedules.OneFOneB(4)
    with pytest.raises(ValueError, match=r"every cost must be a finite number > 0 \(layer '1': forward 0.0"):
        fpipe.balance([1, 0], 2, schedule=schedule)
    with pytest.raises(ValueError, match=r"one cost per layer \(layers: 2, backward: \[1\]\)"):
        fpipe.balance([1, 1], 2, schedule=schedule, backward=[1])
    with pytest.raises(ValueError, match=r"layer '0': forward 1.0, backward inf"):
        fpipe.balance([1, 1], 2, schedule=schedule, backward=[float("inf"), 1])
    with pytest.raises(ValueError, match=r"send must be a finite number >= 0 \(send: -1\)"):
        fpipe.balance([1, 1], 2, schedule=schedule, send=-1)
    with pytest.raises(ValueError, match=r"describe a schedule's step .* Pass schedule= too"):
        fpipe.balance([1, 1], 2, send=1.0)
    with pytest.raises(fpipe.schedules.ScheduleError, match=r"cannot be laid out on 2 ranks"):
        fpipe.balance([1, 1, 1], 3, schedule=schedule, num_ranks=2)

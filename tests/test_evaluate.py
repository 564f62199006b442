"""``step.evaluate``: forward-only steps, bitwise those of training, with one microbatch's memory."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
import torch.distributed as dist

import fpipe
from fpipe.schedules import GPipe, OneFOneB, Program, ScheduleError
from fpipe.schedules._program import forward_only
from tests._multiprocess import run_ranks
from tests.conformance import CONFORMANCE, Conformance
from tests.helpers import (
    MIXED_BATCH_DIMS,
    assert_bitwise,
    assert_close,
    compose,
    mixed_batch,
    mixed_block,
    mixed_first,
    mixed_loss,
    mixed_model,
    some_stage_count,
)

pytestmark = pytest.mark.timeout(180)

D = 3


def layer(p: torch.Tensor, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"h": torch.tanh(x["h"] @ p), "target": x["target"]}


def loss_fn(y: dict[str, torch.Tensor], microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((y["h"] - microbatch["target"]) ** 2).mean()


def model(num_stages: int, batch_size: int = 10) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    params = [torch.randn(D, D) / 2 for _ in range(num_stages)]
    return params, {"h": torch.randn(batch_size, D), "target": torch.randn(batch_size, D)}


@pytest.mark.parametrize("entry", CONFORMANCE, ids=str)
def test_evaluate_equals_training_and_the_unsplit_model(entry: Conformance) -> None:
    num_stages = some_stage_count(entry, 2)
    params, batch = model(num_stages)
    step = fpipe.pipeline(loss_fn, [layer] * num_stages, entry.make(num_stages, 4))
    loss, outputs = step.evaluate(params, batch, outputs=True)
    trained, _ = step(params, batch)
    assert_bitwise(loss, trained)  # the same forwards, weights and order of the sum
    assert_bitwise(step.evaluate(params, batch), loss)
    unsplit = compose([layer] * num_stages)(params, batch)
    assert_close(outputs, unsplit)
    assert_close(loss, loss_fn(unsplit, batch))
    assert not loss.requires_grad and not outputs["h"].requires_grad


def test_outputs_are_the_microbatches_outputs_in_example_order() -> None:
    params, batch = model(2, batch_size=10)
    step = fpipe.pipeline(loss_fn, [layer, layer], OneFOneB(4))  # microbatches of 3, 3, 2, 2
    _, outputs = step.evaluate(params, batch, outputs=True)
    pieces = [compose([layer, layer])(params, {k: v[a:b] for k, v in batch.items()}) for a, b in _cuts(3, 3, 2, 2)]
    assert_bitwise(outputs, {"h": torch.cat([p["h"] for p in pieces]), "target": batch["target"]})


def _cuts(*sizes: int) -> list[tuple[int, int]]:
    ends = torch.tensor(sizes).cumsum(0).tolist()
    return list(zip([0, *ends[:-1]], ends))


def test_aux_and_outputs() -> None:
    def with_aux(y: dict[str, torch.Tensor], mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        return loss_fn(y, mb), {"n": mb["h"].shape[0]}

    params, batch = model(2, batch_size=6)
    step = fpipe.pipeline(with_aux, [layer, layer], GPipe(3), has_aux=True)
    ((loss, aux), outputs) = step.evaluate(params, batch, outputs=True)
    ((trained, trained_aux), _) = step(params, batch)
    assert_bitwise((loss, aux), (trained, trained_aux))
    assert aux == {"n": (2, 2, 2)}
    assert outputs["h"].shape == (6, D)


def test_no_graph_no_gradients_and_params_untouched() -> None:
    params, batch = model(2)
    before = [p.clone() for p in params]
    saved: list[torch.Tensor] = []
    step = fpipe.pipeline(loss_fn, [layer, layer], GPipe(4))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        step.evaluate(params, batch)
    assert saved == []  # autograd saved nothing: no graph was recorded
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        step(params, batch)
    assert saved  # while a training step does (the census can fail)
    assert all(torch.equal(p, b) and p.grad is None for p, b in zip(params, before))


def live_activations_peak(evaluate: bool, num_microbatches: int) -> int:
    """The most stage outputs alive at once during a GPipe step with 2 stages (weak references)."""
    alive: list[weakref.ref[torch.Tensor]] = []
    peak = 0

    def watched(p: torch.Tensor, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        nonlocal peak
        y = layer(p, x)
        alive.append(weakref.ref(y["h"]))
        peak = max(peak, sum(r() is not None for r in alive))
        return y

    params, batch = model(2, batch_size=num_microbatches)
    step = fpipe.pipeline(loss_fn, [watched, watched], GPipe(num_microbatches))
    step.evaluate(params, batch) if evaluate else step(params, batch)
    return peak


def test_evaluate_holds_one_microbatch_per_stage() -> None:
    # In one process the ranks are virtual: rank 0's next output may be made before rank 1 takes
    # the last one (0F1 runs before 1F0 in the same tick), and the last stage's own output.
    assert live_activations_peak(evaluate=True, num_microbatches=8) == live_activations_peak(True, 4) == 3
    # Training keeps each microbatch's graph until its backward, but not the output tensors
    # themselves (NOTE [outputs let go]): what tanh saves of them is the graph's, not theirs.
    assert live_activations_peak(evaluate=False, num_microbatches=8) == 3


@pytest.mark.parametrize("entry", CONFORMANCE, ids=str)
def test_the_forward_program_keeps_each_rows_forwards_in_order(entry: Conformance) -> None:
    num_stages = some_stage_count(entry, 2)
    program = fpipe.pipeline(loss_fn, [layer] * num_stages, entry.make(num_stages, 4)).program
    forwards = forward_only(program)
    assert [[str(a) for a in row] for row in forwards.ranks] == [
        [str(a) for a in row if a.kind == "F"] for row in program.ranks
    ]
    assert sum(map(len, forwards.ranks)) == num_stages * 4


def test_a_forward_program_that_deadlocks_is_an_error() -> None:
    # Not a training program fpipe.pipeline would accept: rank 0 runs 3F0 before the 0F0 it needs.
    program = Program.from_lists([["3F0", "0F0"], ["1F0", "2F0"]])
    with pytest.raises(ScheduleError, match="deadlocks"):
        forward_only(program)


def test_a_failing_stage_says_where() -> None:
    def failing(p: torch.Tensor, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if x["h"].shape[0] == 2:  # the third microbatch of 8 in 4 is the first of size 2
            raise RuntimeError("boom")
        return layer(p, x)

    params, batch = model(2, batch_size=10)
    step = fpipe.pipeline(loss_fn, [layer, failing], OneFOneB(4))
    with pytest.raises(fpipe.PipelineError, match="1F2") as info:
        step.evaluate(params, batch)
    assert info.value.rank == 1 and info.value.microbatch == 2


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda step, params, batch: step.evaluate(params, batch, outputs=1), TypeError, "must be True or False"),
        (lambda step, params, batch: step.evaluate(params[:1], batch), ValueError, "params has 1 entry"),
        (
            lambda step, params, batch: step.evaluate(params, {k: v[:2] for k, v in batch.items()}),
            ValueError,
            "a batch of 2 cannot be split into 4 microbatches",
        ),
    ],
)
def test_bad_evaluation_inputs(call: Callable[..., Any], error: type[Exception], match: str) -> None:
    params, batch = model(2)
    step = fpipe.pipeline(loss_fn, [layer, layer], GPipe(4))
    with pytest.raises(error, match=match):
        call(step, params, batch)


def test_scalar_outputs_cannot_be_stitched() -> None:
    params, batch = model(2)
    step = fpipe.pipeline(lambda y, mb: y, [layer, lambda p, x: (x["h"] @ p).mean()], GPipe(2))
    assert step.evaluate(params, batch).shape == ()
    with pytest.raises(ValueError, match="is a scalar, so it has no batch dimension"):
        step.evaluate(params, batch, outputs=True)


# --- Distributed ---------------------------------------------------------------------------------

# name -> (ranks, schedule, stages): every entry of the conformance list at its sizes on 2 ranks
TWO_RANKS = {f"{e.name}-{p}x{S}": (p, e.make(S, M), S) for e in CONFORMANCE for p, S, M in e.ranks if p == 2}


def _own(tree: Any) -> Any:
    """``tree`` with tensors of their own (received ones may view one buffer as several dtypes,
    which torch.save, the way results come back from the ranks, refuses)."""
    return optree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree, none_is_leaf=True)


def _evaluate_ranks(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (_, schedule, num_stages) in TWO_RANKS.items():
        stages, params = mixed_model(num_stages)
        step = fpipe.pipeline(
            mixed_loss,
            stages,
            schedule,
            batch_dims=MIXED_BATCH_DIMS,
            parallel=fpipe.Parallelism(group=dist.group.WORLD, timeout=30),
        )
        mine = [p if s in step.local_stages else None for s, p in enumerate(params)]
        has = rank == step.program.placement()[0]
        evaluated = step.evaluate(mine, mixed_batch(5) if has else None, outputs=True)
        trained, _ = step(mine, mixed_batch(5) if has else None)
        out[name] = (_own(evaluated), trained, step.evaluate(mine, mixed_batch(7) if has else None))
    stages, params = mixed_model(2)
    step = fpipe.pipeline(
        mixed_loss,
        stages,
        GPipe(4),
        batch_dims=MIXED_BATCH_DIMS,
        parallel=fpipe.Parallelism(group=dist.group.WORLD, timeout=20),
    )
    mine = [p if s in step.local_stages else None for s, p in enumerate(params)]
    with pytest.raises(ValueError) as info:  # 3 examples cannot make 4 microbatches
        step.evaluate(mine, mixed_batch(5, size=3) if rank == 0 else None)
    out["bad batch"] = str(info.value)

    def broken(p: Any, x: Any) -> Any:
        if x["pos"].shape[0] == 2:  # microbatch 2 of 10 examples in 4: 3, 3, 2, 2
            raise RuntimeError("boom")
        return mixed_block(p, x)

    failing = fpipe.pipeline(
        mixed_loss,
        [mixed_first, broken],
        GPipe(4),
        batch_dims=MIXED_BATCH_DIMS,
        parallel=fpipe.Parallelism(group=dist.group.WORLD, timeout=20),
    )
    with pytest.raises(fpipe.PipelineError) as failed:
        failing.evaluate(mine, mixed_batch(5) if rank == 0 else None)
    out["stage raised"] = (str(failed.value), failed.value.rank)
    return out


def test_distributed_evaluate_equals_local_bitwise_on_every_rank() -> None:
    results = run_ranks(2, _evaluate_ranks, timeout=150)
    for name, (_, schedule, num_stages) in TWO_RANKS.items():
        stages, params = mixed_model(num_stages)
        step = fpipe.pipeline(mixed_loss, stages, schedule, batch_dims=MIXED_BATCH_DIMS)
        loss, outputs = step.evaluate(params, mixed_batch(5), outputs=True)
        for out in results:
            (d_loss, d_outputs), trained, longer = out[name]
            assert_bitwise((d_loss, trained), (loss, loss), name)
            assert_bitwise(d_outputs, outputs, name)
            assert d_outputs["tag"] == ("batch",) * schedule.num_microbatches
            assert_bitwise(longer, step.evaluate(params, mixed_batch(7)), name)
    first, second = results
    assert "a batch of 3 cannot be split into 4 microbatches" in first["bad batch"]
    assert "rank(s) [0] rejected" in second["bad batch"]
    for message, rank in (first["stage raised"], second["stage raised"]):
        assert "1F2" in message and rank == 1


def _mesh_evaluate(rank: int, world: int, shard_params: bool) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    stages, params = mixed_model(2)
    step = fpipe.pipeline(
        mixed_loss,
        stages,
        OneFOneB(3),
        batch_dims=MIXED_BATCH_DIMS,
        parallel=fpipe.Parallelism(mesh=mesh, shard_params=shard_params, timeout=30),
    )
    params = [p if s in step.local_stages else None for s, p in enumerate(params)]
    if shard_params:  # each rank holds its shards; evaluate gathers each stage for its forwards
        params = step.shard(params)
    replica = mesh.get_coordinate()[0]
    return replica, _own(
        step.evaluate(params, mixed_batch(6, seed=10 + replica) if step.rank == 0 else None, outputs=True)
    )


@pytest.mark.parametrize("shard_params", [False, True])
def test_data_parallel_evaluate_averages_the_loss_and_keeps_each_replicas_outputs(shard_params: bool) -> None:
    stages, params = mixed_model(2)
    step = fpipe.pipeline(mixed_loss, stages, OneFOneB(3), batch_dims=MIXED_BATCH_DIMS)
    local = [step.evaluate(params, mixed_batch(6, seed=10 + r), outputs=True) for r in range(2)]
    for replica, (loss, outputs) in run_ranks(4, _mesh_evaluate, shard_params):
        assert_bitwise(loss, (local[0][0] + local[1][0]) / 2)
        assert_bitwise(outputs["z"], local[replica][1]["z"])


def test_a_recorded_evaluation_times_the_forwards_alone() -> None:
    params, batch = model(2)
    step = fpipe.pipeline(loss_fn, [layer, layer], OneFOneB(4))
    with fpipe.record() as recording:
        step.evaluate(params, batch)
    assert [len(row) for row in recording.timeline.starts] == [4, 4]

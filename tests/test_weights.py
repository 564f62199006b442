"""Token-weighted losses (``weight_fn``) and explicit microbatches (``fpipe.Microbatches``).

The oracle is the unsplit model in float64: the per-token mean over every valid token of the
batch (and of every data-parallel replica), and for explicit microbatches the example-weighted
mean of their losses.
"""

from __future__ import annotations

from typing import Any

import optree
import pytest
import torch
import torch.distributed as dist

import fpipe
from fpipe.schedules import GPipe, OneFOneB
from tests._multiprocess import run_ranks
from tests.conformance import CONFORMANCE, Conformance
from tests.helpers import assert_bitwise, assert_close, some_stage_count

pytestmark = pytest.mark.timeout(180)

D = 3
LENGTHS = [0, 0, 1, 9, 2, 9, 9, 9]  # valid tokens per sequence: microbatch 0 of 4 has none


def block(p: torch.Tensor, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"h": torch.tanh(x["h"] @ p)}


def token_sum(y: dict[str, torch.Tensor], microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The sum of per-token squared errors over the valid tokens (what ``weight_fn`` asks for)."""
    return (((y["h"] - microbatch["target"]) ** 2).sum(-1) * microbatch["mask"]).sum()


def token_mean(y: dict[str, torch.Tensor], microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
    return token_sum(y, microbatch) / microbatch["mask"].sum()


def count(microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
    return microbatch["mask"].sum()


def padded(lengths: list[int], seed: int = 0, width: int = 9) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(width) < torch.tensor(lengths).unsqueeze(1)
    return {
        "h": torch.randn(len(lengths), width, D, generator=g, dtype=torch.float64),
        "target": torch.randn(len(lengths), width, D, generator=g, dtype=torch.float64),
        "mask": mask,
    }


def weights(num_stages: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(D, D, generator=g, dtype=torch.float64) / 2 for _ in range(num_stages)]


def unsplit(params: list[torch.Tensor], batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    x = batch
    for p in params:
        x = block(p, x)
    return x


def per_token_reference(params: list[torch.Tensor], batches: list[dict[str, torch.Tensor]]) -> Any:
    """``(loss, grads)``: the mean over every valid token of ``batches`` (the replicas' batches)."""

    def loss(ps: list[torch.Tensor]) -> torch.Tensor:
        total = sum(token_sum(unsplit(ps, b), b) for b in batches)
        return total / sum(int(b["mask"].sum()) for b in batches)

    grads, value = torch.func.grad_and_value(loss)(params)
    return value, grads


@pytest.mark.parametrize("entry", CONFORMANCE, ids=str)
def test_weight_fn_gives_the_per_token_mean(entry: Conformance) -> None:
    num_stages = some_stage_count(entry, 2)
    params, batch = weights(num_stages), padded(LENGTHS)
    step = fpipe.pipeline(token_sum, [block] * num_stages, entry.make(num_stages, 4), weight_fn=count)
    loss, grads = step(params, batch)
    expected_loss, expected_grads = per_token_reference(params, [batch])
    assert_close(loss, expected_loss)
    assert_close(grads, expected_grads)
    assert_bitwise(step.evaluate(params, batch), loss)
    # Weighting by examples would not give it: the sequences' lengths differ a lot.
    by_examples, _ = fpipe.pipeline(token_mean, [block] * num_stages, GPipe(4))(params, padded(LENGTHS[2:]))
    assert not torch.allclose(by_examples, per_token_reference(params, [padded(LENGTHS[2:])])[0])


def explicit_microbatches(seed: int = 0) -> fpipe.Microbatches:
    """Four microbatches of different sizes and sequence lengths (packed, bucketed)."""
    return fpipe.Microbatches(
        [
            padded(lengths, seed + i, width)
            for i, (lengths, width) in enumerate([([3, 2], 3), ([7], 7), ([1, 1, 1], 1), ([5, 2], 6)])
        ]
    )


def test_microbatches_must_be_a_nonempty_list() -> None:
    with pytest.raises(TypeError, match="give a non-empty list of microbatch pytrees"):
        fpipe.Microbatches([])


@pytest.mark.parametrize("entry", CONFORMANCE, ids=str)
def test_explicit_microbatches_weigh_by_examples(entry: Conformance) -> None:
    num_stages = some_stage_count(entry, 2)
    params, batch = weights(num_stages), explicit_microbatches()
    step = fpipe.pipeline(token_mean, [block] * num_stages, entry.make(num_stages, 4))
    loss, grads = step(params, batch)
    sizes = [mb["h"].shape[0] for mb in batch.microbatches]

    def reference(ps: list[torch.Tensor]) -> torch.Tensor:
        return sum(n / sum(sizes) * token_mean(unsplit(ps, mb), mb) for n, mb in zip(sizes, batch.microbatches))

    expected_grads, expected_loss = torch.func.grad_and_value(reference)(params)
    assert_close(loss, expected_loss)
    assert_close(grads, expected_grads)
    evaluated, outputs = step.evaluate(params, batch, outputs=True)
    assert_bitwise(evaluated, loss)
    assert isinstance(outputs, list) and len(outputs) == 4
    for y, mb in zip(outputs, batch.microbatches):
        assert_close(y, unsplit(params, mb))


def test_a_split_function_is_explicit_microbatches() -> None:
    """pipeline(..., split=fn) cuts each batch with fn, as fpipe.Microbatches(fn(batch, m)) would,
    for training and evaluation; fn gets the schedule's microbatch count."""
    params, explicit = weights(2), explicit_microbatches()
    seen = []

    def split(batch: Any, num_microbatches: int) -> list[Any]:
        seen.append(num_microbatches)
        return list(batch)  # the "batch" here is already the list of microbatches

    step = fpipe.pipeline(token_mean, [block] * 2, OneFOneB(4), split=split)
    reference = fpipe.pipeline(token_mean, [block] * 2, OneFOneB(4))
    loss, grads = step(params, list(explicit.microbatches))
    expected_loss, expected_grads = reference(params, explicit)
    assert_bitwise((loss, grads), (expected_loss, expected_grads))
    assert_bitwise(step.evaluate(params, list(explicit.microbatches)), expected_loss)
    assert seen == [4, 4]
    with pytest.raises(TypeError, match=r"split must be callable, split\(batch, num_microbatches\)"):
        fpipe.pipeline(token_mean, [block] * 2, OneFOneB(4), split=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="the batch has 3 microbatches but the schedule runs 4"):
        fpipe.pipeline(token_mean, [block] * 2, OneFOneB(4), split=lambda b, m: b[:3])(
            params, list(explicit.microbatches)
        )


def test_explicit_microbatches_with_weight_fn_give_the_per_token_mean() -> None:
    params, batch = weights(2), explicit_microbatches()
    loss, grads = fpipe.pipeline(token_sum, [block, block], OneFOneB(4), weight_fn=count)(params, batch)
    expected_loss, expected_grads = per_token_reference(params, list(batch.microbatches))
    assert_close(loss, expected_loss)
    assert_close(grads, expected_grads)


@pytest.mark.parametrize(
    ("options", "batch", "error", "match"),
    [
        ({"weight_fn": count}, padded([0] * 8), ValueError, r"weight_fn counts 0 in every microbatch"),
        ({"weight_fn": lambda mb: -1}, padded(LENGTHS), ValueError, "returned -1 for microbatch 0"),
        ({"weight_fn": lambda mb: 0.5}, padded(LENGTHS), ValueError, "must return a count"),
        ({"weight_fn": lambda mb: mb["nope"]}, padded(LENGTHS), ValueError, "weight_fn raised on microbatch 0"),
        ({}, fpipe.Microbatches([padded([1])] * 3), ValueError, "the batch has 3 microbatches but the schedule runs 4"),
    ],
)
def test_bad_weights_and_microbatches(options: dict[str, Any], batch: Any, error: type[Exception], match: str) -> None:
    step = fpipe.pipeline(token_sum, [block, block], GPipe(4), **options)
    with pytest.raises(error, match=match):
        step(weights(2), batch)
    with pytest.raises(error, match=match):
        step.evaluate(weights(2), batch)


def test_a_meta_tensor_in_explicit_microbatches_is_an_error() -> None:
    batch = fpipe.Microbatches([padded([1]), {**padded([1]), "h": torch.empty(1, 9, D, device="meta")}])
    with pytest.raises(ValueError, match=r"batch leaf \[1\]\['h'\] is on the meta device"):
        fpipe.pipeline(token_mean, [block, block], GPipe(2))(weights(2), batch)


def test_weight_fn_must_be_callable() -> None:
    with pytest.raises(TypeError, match="weight_fn must be callable"):
        fpipe.pipeline(token_sum, [block], GPipe(1), weight_fn=3)


# --- Distributed ---------------------------------------------------------------------------------

TWO_RANKS = {f"{e.name}-{S}": (e.make(S, M), S) for e in CONFORMANCE for p, S, M in e.ranks if p == 2 and M >= 4}


def _own(tree: Any) -> Any:
    return optree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree, none_is_leaf=True)


def _two_ranks(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (schedule, num_stages) in TWO_RANKS.items():
        m = schedule.num_microbatches
        params = weights(num_stages)
        weighted = fpipe.pipeline(
            token_sum,
            [block] * num_stages,
            schedule,
            weight_fn=count,
            parallel=fpipe.Parallelism(group=dist.group.WORLD),
        )
        plain = fpipe.pipeline(
            token_mean, [block] * num_stages, schedule, parallel=fpipe.Parallelism(group=dist.group.WORLD)
        )
        mine = [p if s in weighted.local_stages else None for s, p in enumerate(params)]
        has = rank == weighted.program.placement()[0]
        microbatches = fpipe.Microbatches([padded([1 + i % 3] * (1 + i % 2), i, 2 + i) for i in range(m)])
        out[name] = _own(
            (
                weighted(mine, padded(LENGTHS[: 2 * m] if m <= 4 else LENGTHS * 2) if has else None),
                plain(mine, microbatches if has else None),
                plain.evaluate(mine, microbatches if has else None, outputs=True),
            )
        )
    step = fpipe.pipeline(
        token_sum,
        [block, block],
        GPipe(4),
        weight_fn=count,
        parallel=fpipe.Parallelism(group=dist.group.WORLD, timeout=20),
    )
    mine = [p if s in step.local_stages else None for s, p in enumerate(weights(2))]
    for case, batch in {"no tokens": padded([0] * 8), "too few": fpipe.Microbatches([padded([1])] * 3)}.items():
        with pytest.raises(ValueError) as info:
            step(mine, batch if rank == 0 else None)
        out[case] = str(info.value)
    return out


def test_distributed_weights_and_microbatches_equal_local_bitwise() -> None:
    results = run_ranks(2, _two_ranks, timeout=150)
    for name, (schedule, num_stages) in TWO_RANKS.items():
        m = schedule.num_microbatches
        params = weights(num_stages)
        weighted = fpipe.pipeline(token_sum, [block] * num_stages, schedule, weight_fn=count)
        plain = fpipe.pipeline(token_mean, [block] * num_stages, schedule)
        microbatches = fpipe.Microbatches([padded([1 + i % 3] * (1 + i % 2), i, 2 + i) for i in range(m)])
        loss, grads = weighted(params, padded(LENGTHS[: 2 * m] if m <= 4 else LENGTHS * 2))
        p_loss, p_grads = plain(params, microbatches)
        e_loss, outputs = plain.evaluate(params, microbatches, outputs=True)
        for out in results:
            (d_loss, d_grads), (dp_loss, dp_grads), (de_loss, d_outputs) = out[name]
            assert_bitwise((d_loss, dp_loss, de_loss), (loss, p_loss, e_loss), name)
            for got, expected in [(d_grads, grads), (dp_grads, p_grads)]:
                for s, (g, e) in enumerate(zip(got, expected, strict=True)):
                    if g is not None:  # a stage this rank holds
                        assert_bitwise(g, e, f"{name}, stage {s}")
            assert_bitwise(d_outputs, outputs, name)
    first, second = results
    assert "weight_fn counts 0 in every microbatch" in first["no tokens"] and first["no tokens"] == second["no tokens"]
    assert "the batch has 3 microbatches but the schedule runs 4" in first["too few"]
    assert "rank(s) [0] rejected" in second["too few"]


REPLICA_LENGTHS = ([9, 9, 8, 9, 7, 9], [1, 0, 0, 2, 0, 1])  # replica 1 has far fewer tokens


def _mesh(rank: int, world: int, shard_params: bool) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica = mesh.get_coordinate()[0]
    step = fpipe.pipeline(
        token_sum,
        [block, block],
        OneFOneB(3),
        weight_fn=count,
        parallel=fpipe.Parallelism(mesh=mesh, shard_params=shard_params, timeout=30),
    )
    params = [p if s in step.local_stages else None for s, p in enumerate(weights(2))]
    if shard_params:
        params = step.shard(params)
    loss, grads = step(params, padded(REPLICA_LENGTHS[replica], seed=replica) if step.rank == 0 else None)
    if shard_params:  # the summed shards, gathered whole to compare
        grads = step.gather(grads)
    with pytest.raises(ValueError) as info:
        step(params, padded([0] * 6, seed=replica) if step.rank == 0 else None)
    return loss, grads, str(info.value)


@pytest.mark.parametrize("shard_params", [False, True])
def test_data_parallel_replicas_weigh_by_their_tokens(shard_params: bool) -> None:
    params = weights(2)
    expected_loss, expected_grads = per_token_reference(
        params, [padded(lengths, seed=r) for r, lengths in enumerate(REPLICA_LENGTHS)]
    )
    for loss, grads, message in run_ranks(4, _mesh, shard_params):
        assert_close(loss, expected_loss)
        for s, g in enumerate(grads):
            if g is not None:
                assert_close(g, expected_grads[s])
        assert "weight_fn counts 0 in every microbatch (and every data-parallel replica)" in message

"""fpipe.Precision: float32 sums of low-precision gradients, master weights, float16 loss scaling.

The accuracy claim is measured against a float64 reference; every other result is compared bitwise:
across schedules, with a hand-written loop (cast, per-microbatch autograd, sum in float32 in
microbatch order), with the run without a policy, and on two gloo ranks against one process.
Loss scaling with tensor parallelism (pp 2 x tp 2, dp 2 x tp 2) skips a step on every rank when one
tensor-parallel rank's piece of a gradient overflows (the model: tests/_tensor_parallel_llama.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fpipe
from fpipe.schedules import GPipe, OneFOneB, ZeroBubbleH1
from tests import _tensor_parallel_llama as llama
from tests._multiprocess import run_ranks
from tests.conformance import CONFORMANCE
from tests.helpers import assert_bitwise, bitwise_equal

BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
WIDTH = 8


def _first(p: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.tanh(batch["x"] @ p["w"] + p["b"])


def _middle(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ p["w"] + p["b"])


def _loss(y: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A per-example mean in the targets' dtype (float32 for low-precision activations)."""
    return ((y.to(batch["y"].dtype) - batch["y"]) ** 2).mean()


def _stages(num_stages: int) -> list[Any]:
    return [_first] + [_middle] * (num_stages - 1)


def _params(num_stages: int, dtype: torch.dtype, width: int = WIDTH, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "w": (torch.randn(width, width, generator=g, dtype=F64) / width**0.5).to(dtype),
            "b": torch.randn(width, generator=g, dtype=F64).to(dtype),
        }
        for _ in range(num_stages)
    ]


def _batch(size: int, dtype: torch.dtype, width: int = WIDTH, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, width, generator=g, dtype=F64)
    return {"x": x.to(dtype), "y": torch.randn(size, width, generator=g, dtype=F64).to(F64 if dtype == F64 else F32)}


# --- accuracy ------------------------------------------------------------------------------------


def _relative_error(grads: list[dict[str, torch.Tensor]], reference: list[dict[str, torch.Tensor]]) -> float:
    diff = sum(float((g[k].double() - r[k]).square().sum()) for g, r in zip(grads, reference) for k in r)
    norm = sum(float(r[k].square().sum()) for r in reference for k in r)
    return (diff / norm) ** 0.5


@pytest.mark.parametrize("num_microbatches", [16, 32])
def test_float32_accumulation_is_closer_to_float64(num_microbatches: int) -> None:
    """bfloat16 parameters: their gradients summed in float32 are closer to the float64 gradient
    of the same (bfloat16-valued) model than summed in bfloat16 (notes/precision.md has the numbers)."""
    width, size = 64, 512
    params, batch = _params(2, BF16, width), _batch(size, BF16, width)
    reference = [{k: v.double() for k, v in p.items()} for p in params]
    batch64 = {"x": batch["x"].double(), "y": batch["y"].double()}

    def full_loss(ps: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        return _loss(_middle(ps[1], _first(ps[0], batch64)), batch64)

    exact = torch.func.grad(full_loss)(reference)
    errors = {}
    for name, precision in [("bfloat16", None), ("float32", fpipe.Precision(grads=F32))]:
        step = fpipe.pipeline(_loss, _stages(2), OneFOneB(num_microbatches), precision=precision)
        _, grads = step(params, batch)
        errors[name] = _relative_error(grads, exact)
    print(f"{num_microbatches} microbatches, relative error vs float64: {errors}")
    assert errors["float32"] < 0.8 * errors["bfloat16"], errors


# --- bitwise -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, precision",
    [(BF16, fpipe.Precision()), (F32, fpipe.Precision(compute=BF16)), (F16, fpipe.Precision(grads=F32))],
    ids=["bf16-params", "f32-master-bf16", "f16-params"],
)
def test_every_schedule_agrees_bitwise(dtype: torch.dtype, precision: fpipe.Precision) -> None:
    """Every schedule of the conformance list adds the same numbers in the same order."""
    num_stages, num_microbatches = 6, 8
    params, batch = _params(num_stages, dtype), _batch(29, precision.compute or dtype)
    results = {}
    for entry in CONFORMANCE:
        step = fpipe.pipeline(_loss, _stages(num_stages), entry.make(num_stages, num_microbatches), precision=precision)
        results[entry.name] = step(params, batch)
    loss, grads = results.pop("GPipe")
    expected = precision.grads or dtype
    assert all(g.dtype == expected for p in grads for g in p.values())
    for name, (other_loss, other_grads) in results.items():
        assert_bitwise((other_loss, other_grads), (loss, grads), name)


def test_recompute_is_bitwise_unchanged() -> None:
    params, batch = _params(3, F32), _batch(13, BF16)
    precision = fpipe.Precision(compute=BF16)
    plain = fpipe.pipeline(_loss, _stages(3), ZeroBubbleH1(4), precision=precision)(params, batch)
    again = fpipe.pipeline(_loss, _stages(3), ZeroBubbleH1(4), precision=precision, recompute=True)(params, batch)
    assert_bitwise(again, plain)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_a_policy_that_changes_nothing_is_bitwise_the_default(dtype: torch.dtype) -> None:
    """float32 and float64 parameters are already summed in float32 or wider: the policy is a no-op."""
    params, batch = _params(3, dtype), _batch(11, dtype)
    plain = fpipe.pipeline(_loss, _stages(3), OneFOneB(4))(params, batch)
    policy = fpipe.pipeline(_loss, _stages(3), OneFOneB(4), precision=fpipe.Precision())(params, batch)
    assert_bitwise(policy, plain)


def _reference_loop(
    params: list[dict[str, torch.Tensor]], batch: dict[str, torch.Tensor], num_microbatches: int, compute: torch.dtype
) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """Master weights by hand: cast once, per microbatch autograd of the unsplit model seeded with
    the microbatch's weight n_i / N, gradients summed in float32 in microbatch order, the loss one
    ``torch.sum`` of the weighted losses (NOTE [the step's loss] in fpipe/_run.py)."""
    cast = [{k: v.to(compute).requires_grad_() for k, v in p.items()} for p in params]
    pieces = [torch.tensor_split(batch[k], num_microbatches) for k in ("x", "y")]
    total_size = batch["x"].shape[0]
    sums: list[dict[str, torch.Tensor]] = [{} for _ in params]
    terms = []
    for x, y in zip(*pieces):
        mb = {"x": x, "y": y}
        h = _first(cast[0], mb)
        for p in cast[1:]:
            h = _middle(p, h)
        loss = _loss(h, mb)
        weight = x.shape[0] / total_size
        leaves = [v for p in cast for v in p.values()]
        grads = torch.autograd.grad(loss, leaves, torch.full((), weight, dtype=loss.dtype))
        for (s, k), g in zip([(s, k) for s, p in enumerate(cast) for k in p], grads):
            sums[s][k] = g.float() if k not in sums[s] else sums[s][k] + g.float()
        terms.append(loss.detach() * weight)
    return torch.stack(terms).sum(), sums


@pytest.mark.parametrize("compute", [BF16, F16])
def test_master_weights_equal_the_hand_written_loop(compute: torch.dtype) -> None:
    """float32 parameters, bfloat16/float16 compute: float32 gradients, bitwise those of the loop."""
    params, batch = _params(3, F32), _batch(21, F32)
    batch["x"] = batch["x"].to(compute)
    precision = fpipe.Precision(compute=compute)
    loss, grads = fpipe.pipeline(_loss, _stages(3), OneFOneB(5), precision=precision)(params, batch)
    expected_loss, expected = _reference_loop(params, batch, 5, compute)
    assert_bitwise((loss, grads), (expected_loss, expected))
    assert all(p["w"].dtype == F32 and p["w"].requires_grad is False for p in params)  # untouched


@given(
    num_stages=st.integers(1, 4),
    num_microbatches=st.integers(1, 6),
    extra_examples=st.integers(0, 9),
    entry=st.sampled_from(CONFORMANCE),
    compute=st.sampled_from([BF16, F16]),
    seed=st.integers(0, 2**16),
)
def test_master_weights_equal_the_loop_for_any_sizes(
    num_stages: int, num_microbatches: int, extra_examples: int, entry: Any, compute: torch.dtype, seed: int
) -> None:
    """Any schedule, stage count, microbatch count and uneven split: bitwise the hand-written loop."""
    num_stages = min(s for s in entry.stage_counts if s >= num_stages)
    params, batch = _params(num_stages, F32, seed=seed), _batch(num_microbatches + extra_examples, compute, seed=seed)
    schedule = entry.make(num_stages, num_microbatches)
    step = fpipe.pipeline(_loss, _stages(num_stages), schedule, precision=fpipe.Precision(compute=compute))
    assert_bitwise(step(params, batch), _reference_loop(params, batch, num_microbatches, compute))


def test_grads_dtype_is_what_the_policy_says() -> None:
    params, batch = _params(2, BF16), _batch(8, BF16)
    params[1]["step"] = torch.tensor(3)  # an integer leaf passes through, without a gradient
    _, summed = fpipe.pipeline(_loss, _stages(2), GPipe(4), precision=fpipe.Precision(grads=F32))(params, batch)
    _, rounded = fpipe.pipeline(_loss, _stages(2), GPipe(4), precision=fpipe.Precision())(params, batch)
    assert summed[0]["w"].dtype == F32 and rounded[0]["w"].dtype == BF16 and summed[1]["step"] is None
    assert torch.equal(summed[0]["w"].to(BF16), rounded[0]["w"])  # rounded once, at the end


def test_a_parameter_no_microbatch_reaches_gets_zeros_in_the_policy_dtype() -> None:
    params, batch = _params(2, BF16), _batch(8, BF16)
    params[0]["unused"] = torch.ones(3, dtype=BF16)
    _, grads = fpipe.pipeline(_loss, _stages(2), GPipe(2), precision=fpipe.Precision(grads=F32))(params, batch)
    assert torch.equal(grads[0]["unused"], torch.zeros(3, dtype=F32))


# --- autocast ------------------------------------------------------------------------------------


def _autocast_stage(p: dict[str, torch.Tensor], x: Any) -> torch.Tensor:
    x = x["x"] if isinstance(x, dict) else x
    with torch.autocast("cpu", dtype=BF16):
        h = x @ p["w"]
    assert h.dtype == BF16  # the matmul ran in bfloat16
    return torch.tanh(h + p["b"])


def test_autocast_inside_a_stage() -> None:
    """float32 parameters, a bfloat16 autocast region in every stage: the same as autograd of the
    unsplit model with the same regions, per microbatch, and bitwise the same across schedules
    and with recomputation (the replay re-enters the region)."""
    params, batch = _params(3, F32), _batch(12, F32)
    results = [
        fpipe.pipeline(_loss, [_autocast_stage] * 3, schedule, recompute=recompute)(params, batch)
        for schedule, recompute in [(GPipe(4), False), (OneFOneB(4), True), (ZeroBubbleH1(4), False)]
    ]
    for other in results[1:]:
        assert_bitwise(other, results[0])

    def full_loss(ps: list[dict[str, torch.Tensor]], mb: dict[str, torch.Tensor]) -> torch.Tensor:
        h = mb
        for p in ps:
            h = _autocast_stage(p, h)
        return _loss(h, mb)

    loss, grads = results[0]
    for x, y in zip(torch.tensor_split(batch["x"], 4), torch.tensor_split(batch["y"], 4)):
        g, value = torch.func.grad_and_value(full_loss)(params, {"x": x, "y": y})
        loss = loss - value * 3 / 12
        grads = [{k: gs[k] - 3 / 12 * rs[k] for k in gs} for gs, rs in zip(grads, g)]
    torch.testing.assert_close(loss, torch.zeros_like(loss), atol=1e-6, rtol=0)
    for gs in grads:
        for v in gs.values():
            torch.testing.assert_close(v, torch.zeros_like(v), atol=1e-5, rtol=0)


# --- loss scaling --------------------------------------------------------------------------------


def _poisoned(p: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``_first``, plus a term whose value is 0 and whose gradient (d sqrt(z) at z = 0, times 0) is nan
    when ``z`` is 0: an inf/nan in this stage's gradients only."""
    return _first(p, batch) + (torch.sqrt(p["z"]) * 0).sum()


def test_loss_scaling_is_exact_and_its_state_moves() -> None:
    params, batch = _params(2, F16), _batch(16, F16)
    scaling = fpipe.LossScale(init=2.0**10, growth=2.0, backoff=0.5, interval=2)
    step = fpipe.pipeline(_loss, _stages(2), OneFOneB(4), precision=fpipe.Precision(loss_scale=scaling))
    plain = fpipe.pipeline(_loss, _stages(2), OneFOneB(4), precision=fpipe.Precision())(params, batch)
    assert step.loss_scale == fpipe.LossScaleState(1024.0, 0) and not step.last_skipped
    scaled = step(params, batch)
    assert_bitwise(scaled, plain)  # a power of two scales and unscales exactly
    assert step.loss_scale == fpipe.LossScaleState(1024.0, 1) and not step.last_skipped
    step(params, batch)
    assert step.loss_scale == fpipe.LossScaleState(2048.0, 0)

    poisoned = fpipe.pipeline(_loss, [_poisoned, _middle], OneFOneB(4), precision=fpipe.Precision(loss_scale=scaling))
    params[0]["z"] = torch.zeros((), dtype=F16)
    _, grads = poisoned(params, batch)
    assert poisoned.last_skipped and poisoned.loss_scale == fpipe.LossScaleState(512.0, 0)
    assert not torch.isfinite(grads[0]["z"]).all()  # returned as found: an update that ignores the flag shows
    poisoned.loss_scale = fpipe.LossScaleState(4.0, 1)  # restored, e.g. from a save
    params[0]["z"] = torch.ones((), dtype=F16)
    poisoned(params, batch)
    assert not poisoned.last_skipped and poisoned.loss_scale == fpipe.LossScaleState(8.0, 0)


def _loss16(y: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A per-example mean in float16 (the seed is made in the loss's dtype)."""
    return ((y - batch["x"]) ** 2).mean()


def _sum16(y: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A sum over the microbatch in float16, for ``weight_fn``."""
    return ((y - batch["x"]) ** 2).sum()


def test_the_loss_scale_state_is_returned_not_kept() -> None:
    """``unscale`` returns the next state and whether the step is skipped, as the agreement says."""
    from fpipe._precision import unscale

    policy = fpipe.Precision(compute=torch.float16, loss_scale=fpipe.LossScale(init=4.0, interval=1))
    params = [{"w": torch.ones(2, dtype=torch.float16)}]
    state = policy.loss_scale.start() if policy.loss_scale is not None else None
    grads = [{"w": torch.full((2,), 8.0)}]
    out, after, skipped = unscale(policy, params, grads, [0], state, lambda found: found)
    assert torch.equal(out[0]["w"], torch.full((2,), 2.0, dtype=torch.float16)) and not skipped
    assert after == fpipe.LossScaleState(8.0, 0) and state == fpipe.LossScaleState(4.0, 0)
    _, after, skipped = unscale(policy, params, grads, [0], state, lambda found: True)  # another rank's inf
    assert skipped and after == fpipe.LossScaleState(2.0, 0)


def test_an_overflowing_scale_backs_off_until_it_fits() -> None:
    """float16 tops out at 65504: a float16 loss seeded with 2**16 (one microbatch, weight 1)
    overflows, and the scale halves."""
    params, batch = _params(2, F16), _batch(8, F16)
    step = fpipe.pipeline(_loss16, _stages(2), GPipe(1), precision=fpipe.Precision(loss_scale=fpipe.LossScale()))
    step(params, batch)
    assert step.last_skipped and step.loss_scale == fpipe.LossScaleState(2.0**15, 0)
    step(params, batch)
    assert not step.last_skipped


def _count(microbatch: dict[str, torch.Tensor]) -> int:
    return microbatch["x"].shape[0]


@pytest.mark.parametrize(
    ("batch_size", "init", "options"),
    [
        (8, 2.0**18, {}),  # 4 equal weights 1/4: every seed is 2**16
        (10, 2.0**18, {}),  # weights 3/10, 3/10, 2/10, 2/10: seeds 78643.2, 78643.2, 52428.8, 52428.8
        (8, 2.0**20, {"weight_fn": _count}),  # 4 equal weights 1/8: every seed is 2**17
    ],
    ids=["equal-weights", "unequal-weights", "weight_fn"],
)
def test_a_seed_too_large_for_float16_skips_the_step(batch_size: int, init: float, options: dict[str, Any]) -> None:
    """A seed over 65504 is an inf (as a cast to float16 makes it), with any weights: the step is
    skipped and the scale halves; nothing raises (NOTE [seeds] in fpipe/_executor.py)."""
    loss_fn = _sum16 if "weight_fn" in options else _loss16
    policy = fpipe.Precision(loss_scale=fpipe.LossScale(init=init))
    step = fpipe.pipeline(loss_fn, _stages(2), GPipe(4), precision=policy, **options)
    loss, grads = step(_params(2, F16), _batch(batch_size, F16))
    assert torch.isfinite(loss)  # the loss is never scaled
    assert step.last_skipped and step.loss_scale == fpipe.LossScaleState(init / 2, 0)
    assert not all(torch.isfinite(g).all() for g in grads[1].values())


def test_loss_scaling_with_float32_master_weights() -> None:
    params, batch = _params(2, F32), _batch(8, F16)
    policy = fpipe.Precision(compute=F16, loss_scale=fpipe.LossScale(init=8.0))
    _, grads = fpipe.pipeline(_loss, _stages(2), GPipe(2), precision=policy)(params, batch)
    _, plain = fpipe.pipeline(_loss, _stages(2), GPipe(2), precision=fpipe.Precision(compute=F16))(params, batch)
    # Not bitwise: unscaled, the smallest float16 gradients round to subnormals; scaled, they do not.
    torch.testing.assert_close(grads, plain, atol=1e-4, rtol=1e-3)
    assert grads[0]["w"].dtype == F32


# --- two processes --------------------------------------------------------------------------------


_TWO_RANK_CASES = [("master", fpipe.Precision(compute=BF16), F32), ("bf16", fpipe.Precision(grads=F32), BF16)]


def _two_ranks(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    out: dict[str, Any] = {}
    group = dist.group.WORLD
    for name, policy, dtype in _TWO_RANK_CASES:
        step = fpipe.pipeline(_loss, _stages(4), OneFOneB(6), precision=policy, parallel=fpipe.Parallelism(group=group))
        params: list[Any] = _params(4, dtype)
        params = [p if s in step.local_stages else None for s, p in enumerate(params)]
        out[name] = step(params, _batch(23, BF16) if rank == 0 else None)
    scaling = fpipe.LossScale(init=2.0**8, interval=2)
    step = fpipe.pipeline(
        _loss,
        [_poisoned, _middle],
        GPipe(4),
        precision=fpipe.Precision(loss_scale=scaling),
        parallel=fpipe.Parallelism(group=group),
    )
    params = _params(2, F16)
    params[0]["z"] = torch.zeros((), dtype=F16)  # stage 0, on rank 0 only, gets nan gradients
    params = [p if s in step.local_stages else None for s, p in enumerate(params)]
    step(params, _batch(8, F16) if rank == 0 else None)
    out["scaled"] = (step.last_skipped, step.loss_scale)
    overflowing = fpipe.pipeline(
        _loss16,
        _stages(2),
        GPipe(4),
        precision=fpipe.Precision(loss_scale=fpipe.LossScale(init=2.0**18)),
        parallel=fpipe.Parallelism(group=group),
    )  # seeds of 2**16, on rank 1 only: rank 0 gets inf/nan cotangents
    local = [p if s in overflowing.local_stages else None for s, p in enumerate(_params(2, F16))]
    overflowing(local, _batch(8, F16) if rank == 0 else None)
    out["overflowed"] = (overflowing.last_skipped, overflowing.loss_scale)
    bad = _params(2, F32)  # not float16: every rank fails, not only the one holding it
    bad = [p if s in step.local_stages else None for s, p in enumerate(bad)]
    try:
        step(bad if rank == 1 else params, _batch(8, F16) if rank == 0 else None)
    except ValueError as error:
        out["error"] = str(error)
    return out


def test_two_processes_agree_with_one_bitwise_and_skip_together() -> None:
    ranks = run_ranks(2, _two_ranks, timeout=90)
    for name, policy, dtype in _TWO_RANK_CASES:
        loss, grads = fpipe.pipeline(_loss, _stages(4), OneFOneB(6), precision=policy)(
            _params(4, dtype), _batch(23, BF16)
        )
        for r, result in enumerate(ranks):
            other_loss, other_grads = result[name]
            assert_bitwise(other_loss, loss, f"{name}, rank {r}")
            for s in range(4):
                if other_grads[s] is not None:  # stage s on rank s % 2
                    assert_bitwise(other_grads[s], grads[s], f"{name}, rank {r}, stage {s}")
    for result in ranks:
        assert result["scaled"] == (True, fpipe.LossScaleState(128.0, 0))
        assert result["overflowed"] == (True, fpipe.LossScaleState(2.0**17, 0))
    assert "stage 1's parameter ['b'] is computed in torch.float32" in ranks[1]["error"]
    assert "rank(s) [1] rejected their inputs" in ranks[0]["error"]


def _replicas(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "pp"))
    policy = fpipe.Precision(grads=F32)
    params, batch = _params(2, BF16), _batch(10, BF16, seed=rank)
    out: dict[str, Any] = {
        "replicated": fpipe.pipeline(
            _loss, _stages(2), OneFOneB(3), parallel=fpipe.Parallelism(mesh=mesh), precision=policy
        )(params, batch)
    }
    sharded = fpipe.pipeline(
        _loss, _stages(2), OneFOneB(3), parallel=fpipe.Parallelism(mesh=mesh, shard_params=True), precision=policy
    )
    _, shards = sharded(sharded.shard(params), batch)
    out["shard dtypes"] = [g.dtype for p in shards for g in p.values()]
    out["sharded"] = sharded.gather(shards)
    # The scalar z lives in replica 0's shard; replica 1 holds its padding and sees no nan itself.
    scaled = fpipe.pipeline(
        _loss,
        [_poisoned, _middle],
        GPipe(2),
        parallel=fpipe.Parallelism(mesh=mesh, shard_params=True),
        precision=fpipe.Precision(loss_scale=fpipe.LossScale(init=4.0)),
    )
    poisoned = _params(2, F16)
    poisoned[0]["z"] = torch.zeros((), dtype=F16)
    scaled(scaled.shard(poisoned), _batch(4, F16, seed=rank))
    out["scaled"] = (scaled.last_skipped, scaled.loss_scale)
    return out


def test_replicas_sum_in_float32_sharded_or_not() -> None:
    """Data parallel: the replicas' float32 sums are averaged in float32, by the all-reduce or
    the reduce-scatter, bitwise the average of the one-process results; a nan in one replica's
    shard skips the step on both."""
    ranks = run_ranks(2, _replicas, timeout=90)
    policy = fpipe.Precision(grads=F32)
    step = fpipe.pipeline(_loss, _stages(2), OneFOneB(3), precision=policy)
    alone = [step(_params(2, BF16), _batch(10, BF16, seed=r))[1] for r in range(2)]
    expected = [{k: (a[k] + b[k]) / 2 for k in a} for a, b in zip(*alone)]
    for result in ranks:
        assert_bitwise(result["replicated"][1], expected)
        assert_bitwise(result["sharded"], expected)
        assert result["shard dtypes"] == [F32] * 4
        assert result["scaled"] == (True, fpipe.LossScaleState(2.0, 0))


# --- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        ({"compute": torch.int8}, ValueError, "compute must be a real floating dtype"),
        ({"accumulate": torch.int32}, ValueError, "accumulate must be a real floating dtype"),
        ({"grads": torch.complex64}, ValueError, "grads must be a real floating dtype"),
        ({"compute": "bfloat16"}, TypeError, "compute must be a torch.dtype"),
        ({"accumulate": torch.float8_e4m3fn}, ValueError, "accumulate cannot be a float8 dtype"),
        ({"compute": torch.float8_e4m3fn, "accumulate": BF16}, ValueError, "float8 compute needs gradients summed"),
        ({"compute": BF16, "loss_scale": fpipe.LossScale()}, ValueError, "loss scaling is for float16 compute"),
        ({"loss_scale": 2.0**16}, TypeError, "loss_scale must be an fpipe.LossScale"),
    ],
)
def test_bad_policies(kwargs: dict[str, Any], error: type[Exception], fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        fpipe.Precision(**kwargs)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"init": 0.0}, "init must be a positive finite number"),
        ({"growth": 1.0}, "growth must be a number > 1"),
        ({"backoff": 1.0}, r"backoff must be a number in \(0, 1\)"),
        ({"interval": 0}, "interval must be an int >= 1"),
    ],
)
def test_bad_loss_scales(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        fpipe.LossScale(**kwargs)
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        fpipe.LossScaleState(float("inf"))
    with pytest.raises(ValueError, match="good_steps must be an int >= 0"):
        fpipe.LossScaleState(1.0, -1)


def test_bad_precision_argument_and_state() -> None:
    with pytest.raises(TypeError, match=r"precision must be an fpipe\.Precision"):
        fpipe.pipeline(_loss, _stages(2), GPipe(2), precision=BF16)  # type: ignore[arg-type]
    step = fpipe.pipeline(_loss, _stages(2), GPipe(2), precision=fpipe.Precision())
    with pytest.raises(ValueError, match="this step does not scale its loss"):
        step.loss_scale = fpipe.LossScaleState(1.0)
    scaled = fpipe.pipeline(_loss, _stages(2), GPipe(2), precision=fpipe.Precision(loss_scale=fpipe.LossScale()))
    with pytest.raises(TypeError, match=r"expected an fpipe\.LossScaleState"):
        scaled.loss_scale = 2.0  # type: ignore[assignment]


def test_loss_scaling_needs_float16_parameters() -> None:
    step = fpipe.pipeline(_loss, _stages(2), GPipe(2), precision=fpipe.Precision(loss_scale=fpipe.LossScale()))
    params = _params(2, F16)
    params[1]["b"] = params[1]["b"].to(BF16)
    with pytest.raises(ValueError, match=r"stage 1's parameter \['b'\] is computed in torch.bfloat16"):
        step(params, _batch(4, F16))


def test_float8_parameters_need_float32_sums() -> None:
    step = fpipe.pipeline(_loss, _stages(2), GPipe(2), precision=fpipe.Precision(accumulate=BF16))
    params: list[dict[str, torch.Tensor]] = _params(2, BF16)
    params[0]["w"] = params[0]["w"].to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"stage 0's parameter \['w'\] is torch.float8_e4m3fn, whose gradients must"):
        step(params, _batch(4, BF16))


def test_float8_parameters_compute_in_bfloat16_with_float32_sums() -> None:
    """float8 parameters (storage only) run in bfloat16, their gradients summed in float32: bitwise
    the step of their exact bfloat16 values (every float8_e4m3fn value is a bfloat16 value)."""
    params, batch = _params(2, BF16), _batch(8, BF16)
    float8 = [{k: v.to(torch.float8_e4m3fn) for k, v in p.items()} for p in params]
    widened = [{k: v.to(BF16) for k, v in p.items()} for p in float8]
    policy = fpipe.Precision(compute=BF16, grads=F32)
    loss8, grads8 = fpipe.pipeline(_loss, _stages(2), OneFOneB(4), precision=policy)(float8, batch)
    loss16, grads16 = fpipe.pipeline(_loss, _stages(2), OneFOneB(4), precision=fpipe.Precision(grads=F32))(
        widened, batch
    )
    assert grads8[0]["w"].dtype == F32
    assert_bitwise((loss8, grads8), (loss16, grads16))


# -- Loss scaling with tensor parallelism (the model: tests/_tensor_parallel_llama.py) --


def _loss_scaled(rank, world, schedules):
    """pp 2 x tp 2 under ``llama.SCALED``: 4 steps per schedule, the third with an ``inf`` in the gradient
    of stage 0's ``w1`` on tp rank 1 only (global rank 2); per schedule and step the loss, full grads,
    ``step.loss_scale``, ``step.last_skipped`` and whether this rank's local pieces were finite."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "pp"))
    overflow = [False]

    def first(p, mb):
        if overflow[0] and mesh.get_local_rank("tp") == 1:
            p = {**p, "w1": llama.infinite_grad(p["w1"])}
        return llama.llama_first(p, mb)

    out = []
    for schedule in schedules:
        step = fpipe.pipeline(
            llama.llama_loss,
            [first, llama.llama_last],
            schedule,
            parallel=fpipe.Parallelism(mesh=mesh, timeout=60),
            precision=llama.SCALED,
        )
        params = [
            llama.distribute_llama(p, mesh["tp"]) if s in step.local_stages else None
            for s, p in enumerate(llama.as_float32(llama.llama_params(2)))
        ]
        steps = []
        for i in range(4):
            overflow[0] = i == llama.OVERFLOW_STEP
            loss, grads = step(params, llama.llama_batch(10) if step.rank == 0 else None)
            full = [llama.full_tensors(grads[s]) if s in step.local_stages else None for s in range(2)]
            finite = all(
                bool(torch.isfinite(llama.local_piece(g)).all()) for s in step.local_stages for g in grads[s].values()
            )
            steps.append((step.local_stages, loss, full, step.loss_scale, step.last_skipped, finite))
        out.append(steps)
    return out


@pytest.mark.timeout(240)
def test_float16_loss_scaling_with_tensor_parallel():
    """pp 2 x tp 2, GPipe and 1F1B under ``llama.SCALED``: the float16 step equals the reference to float16
    rounding, bitwise across schedules and tp ranks; the scale moves alike on every rank, and an
    ``inf`` in one tensor-parallel rank's piece of a gradient makes all 4 ranks skip the step."""
    results = run_ranks(4, _loss_scaled, [GPipe(3), OneFOneB(3)], timeout=120)
    first_steps = [[(*steps[0][:3], None) for steps in r] for r in results]
    llama.check_mixed(first_steps, 2, torch.float16, (llama.SCALED_LOSS_RTOL, llama.SCALED_GRADS_RTOL))
    S = llama.SCALING.init
    states = [(S, 1), (2 * S, 0), (S, 0), (S, 1)]  # after each step; the third is skipped
    for rank, r in enumerate(results):
        for steps in r:
            assert [(st.scale, st.good_steps) for _, _, _, st, _, _ in steps] == states, rank
            assert [skipped for *_, skipped, _ in steps] == [i == llama.OVERFLOW_STEP for i in range(4)], rank
            # only global rank 2 (tp 1, pp 0) saw an inf in its own pieces
            assert [finite for *_, finite in steps] == [i != llama.OVERFLOW_STEP or rank != 2 for i in range(4)], rank
            _, loss0, grads0, _, _, _ = steps[0]
            for i, (local_stages, loss, grads, _, _, _) in enumerate(steps):
                assert_bitwise(loss, loss0, f"rank {rank}, step {i}")  # the loss is never scaled
                finite = [all(torch.isfinite(g).all() for g, _, _ in grads[s].values()) for s in local_stages]
                if i == llama.OVERFLOW_STEP:  # stage 0's full w1: inf in tp rank 1's half
                    assert finite == [s != 0 for s in local_stages], (rank, i)
                else:  # the same grads at scale 2**10 or 2**11 (a power of two, no underflow)
                    for s in local_stages:
                        assert_bitwise(grads[s], grads0[s], f"rank {rank}, step {i}, stage {s}")


def _loss_scaled_data_parallel(rank, world):
    """dp 2 x pp 1 x tp 2 under ``llama.SCALED``, replicated then with ``shard_params=True``: 4 steps each,
    the third with an ``inf`` in the first element of the gradient of stage 0's ``w1`` on dp replica 1's
    tp rank 1 only (global rank 3); per mode and step the loss, full grads (``step.gather``-ed), ``step.loss_scale``,
    ``step.last_skipped``, whether this rank's own grads (pieces or shards) were finite, and (sharded)
    whether they were the shards of the replicated run's, bitwise."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp", "pp", "tp"))
    replica = mesh.get_local_rank("dp")
    overflow = [False]

    def first(p, mb):
        if overflow[0] and replica == 1 and mesh.get_local_rank("tp") == 1:
            p = {**p, "w1": llama.infinite_grad(p["w1"], first_only=True)}
        return llama.llama_first(p, mb)

    params = [llama.distribute_llama(p, mesh["tp"]) for p in llama.as_float32(llama.llama_params(2))]
    batch = llama.llama_batch(10 + replica)
    out, plain_grads = {}, []
    for shard_params in (False, True):
        step = fpipe.pipeline(
            llama.llama_loss,
            [first, llama.llama_last],
            OneFOneB(3),
            parallel=fpipe.Parallelism(mesh=mesh, shard_params=shard_params, timeout=60),
            precision=llama.SCALED,
        )
        inputs = step.shard(params) if shard_params else params
        steps = []
        for i in range(4):
            overflow[0] = i == llama.OVERFLOW_STEP
            loss, grads = step(inputs, batch)
            finite = all(bool(torch.isfinite(llama.local_piece(g)).all()) for tree in grads for g in tree.values())
            if shard_params:
                bitwise = bitwise_equal(grads, [fpipe.shard(tree, mesh) for tree in plain_grads[i]])
                grads = step.gather(grads)
            else:
                bitwise = None
                plain_grads.append(grads)
            full = [{k: g for k, (g, _, _) in llama.full_tensors(tree).items()} for tree in grads]
            steps.append((loss, full, step.loss_scale, step.last_skipped, finite, bitwise))
        out[shard_params] = steps
    return out


@pytest.mark.timeout(240)
def test_float16_loss_scaling_with_data_parallel_times_tensor_parallel():
    """dp 2 x pp 1 x tp 2 under ``llama.SCALED``, replicated and with ``shard_params=True``: an ``inf`` in one
    replica's one tensor-parallel rank's piece of a gradient makes all 4 ranks skip that step and only
    that one, the scale moves alike on every rank, and the good steps equal the float64 reference
    averaged over the replicas to float16 rounding (sharded: the replicated run's grads' shards)."""
    results = run_ranks(4, _loss_scaled_data_parallel, timeout=120)
    refs = [llama.llama_reference(2, llama.llama_batch(10 + r)) for r in range(2)]
    ref_loss = float(refs[0][0] + refs[1][0]) / 2  # the step's loss is the replicas' mean
    ref = torch.cat([((refs[0][1][s][k] + refs[1][1][s][k]) / 2).reshape(-1) for s in range(2) for k in refs[0][1][s]])
    S = llama.SCALING.init
    states = [(S, 1), (2 * S, 0), (S, 0), (S, 1)]  # after each step; the third is skipped
    for rank, r in enumerate(results):  # global rank = 2 * dp + tp
        for shard_params, steps in r.items():
            where = (rank, shard_params)
            assert [(st.scale, st.good_steps) for _, _, st, _, _, _ in steps] == states, where
            assert [skipped for _, _, _, skipped, _, _ in steps] == [i == llama.OVERFLOW_STEP for i in range(4)], where
            # the inf reached the tp-1 ranks of both replicas (summed over dp), never the tp-0 ranks; sharded,
            # only the shard holding the piece's first element (dp 0's): rank 1 alone saw it
            saw = rank == 1 if shard_params else rank % 2 == 1
            assert [finite for *_, finite, _ in steps] == [i != llama.OVERFLOW_STEP or not saw for i in range(4)], where
            if shard_params:
                assert all(bitwise for *_, bitwise in steps), where
            loss0, grads0 = steps[0][:2]
            assert loss0.dtype == torch.float16
            assert abs(float(loss0) - ref_loss) <= llama.SCALED_LOSS_RTOL * ref_loss, where
            d_all = torch.cat([grads0[s][k].double().reshape(-1) for s in range(2) for k in refs[0][1][s]])
            assert all(g.dtype == torch.float32 for tree in grads0 for g in tree.values()), where
            error = float((d_all - ref).norm() / ref.norm())
            assert error <= llama.SCALED_GRADS_RTOL, (where, error)
            for i, (loss, grads, _, _, _, _) in enumerate(steps):
                assert_bitwise(loss, loss0, f"{where}, step {i}")  # the loss is never scaled
                if i == llama.OVERFLOW_STEP:  # stage 0's full w1 (16 x 8): inf at the first element of tp rank 1's half
                    assert (~torch.isfinite(grads[0]["w1"])).nonzero().tolist() == [[llama.HIDDEN // 2, 0]], where
                else:  # the same grads at scale 2**10 or 2**11 (a power of two, no underflow)
                    assert_bitwise(grads, grads0, f"{where}, step {i}")
        for i in range(4):  # the replicated and the sharded runs' full grads, bitwise
            assert_bitwise(r[False][i][1], r[True][i][1], f"rank {rank}, step {i}")

"""Randomness inside stages is data (NOTE [randomness as data] in fpipe/_random.py): dropout is
a function of the step's key, the stage, the microbatch and the replica, bitwise the same
whatever the schedule, the process count or recomputation, and across a resume."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fpipe
from fpipe._random import CountedDraws
from fpipe.schedules import GPipe, OneFOneB, ZeroBubbleV
from tests._multiprocess import run_ranks
from tests.conformance import CONFORMANCE, Conformance
from tests.helpers import assert_bitwise, some_stage_count

M = 4  # microbatches
WIDTH = 6


def _dropout_stage(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return F.dropout(torch.tanh(x @ p["w"]), p=0.5, training=True)


def _loss(y: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
    return (y**2).mean()


def _model(num_stages: int, seed: int = 0) -> tuple[list[Any], list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    params = [{"w": torch.randn(WIDTH, WIDTH, generator=g, dtype=torch.float64)} for _ in range(num_stages)]
    return [_dropout_stage] * num_stages, params


def _batch(seed: int = 1, size: int = 10) -> torch.Tensor:
    return torch.randn(size, WIDTH, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _run(schedule: Any, num_stages: int, *, key: int | None = 7, recompute: bool = False) -> Any:
    stages, params = _model(num_stages)
    step = fpipe.pipeline(_loss, stages, schedule, recompute=recompute)
    return step(params, _batch(), key=key)


@pytest.mark.parametrize("entry", CONFORMANCE, ids=str)
def test_dropout_is_bitwise_the_same_under_every_schedule_and_recompute(entry: Conformance) -> None:
    num_stages = some_stage_count(entry, 4)
    expected = _run(GPipe(M), num_stages)
    assert_bitwise(_run(entry.make(num_stages, M), num_stages), expected, entry.name)
    assert_bitwise(_run(entry.make(num_stages, M), num_stages, recompute=True), expected, f"{entry.name}, recompute")


def test_dropout_equals_the_unsplit_model_seeded_per_stage_and_microbatch() -> None:
    """The reference: each (stage, microbatch) call with the default generator seeded as
    ``stage_info().seed`` says, the loss weighted by the microbatch's share."""
    num_stages, batch = 3, _batch()
    _, params = _model(num_stages)
    seeds: dict[tuple[int, int], int] = {}

    def recording(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        info = fpipe.stage_info()
        seeds[info.stage, info.microbatch] = info.seed
        return _dropout_stage(p, x)

    step = fpipe.pipeline(_loss, [recording] * num_stages, OneFOneB(M))
    loss, grads = step(params, batch, key=3)

    def full(params: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64)
        for i, mb in enumerate(torch.tensor_split(batch, M)):
            h = mb
            for s in range(num_stages):
                torch.manual_seed(seeds[s, i])
                h = _dropout_stage(params[s], h)
            total = total + _loss(h, mb) * (len(mb) / len(batch))
        return total

    ref_grads, ref_loss = torch.func.grad_and_value(full)(params)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    for s in range(num_stages):
        torch.testing.assert_close(grads[s]["w"], ref_grads[s]["w"], rtol=1e-12, atol=1e-15)
    assert len(set(seeds.values())) == num_stages * M  # no two calls share a seed


def _noise_loss(y: torch.Tensor, mb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    noise = torch.rand(8, dtype=torch.float64)
    return (y**2).mean() + 0 * noise.sum(), noise


def test_microbatches_and_steps_never_share_a_mask_and_a_key_repeats_them() -> None:
    stages, params = _model(2)
    step = fpipe.pipeline(_noise_loss, stages, OneFOneB(M), has_aux=True)
    torch.manual_seed(0)
    (_, first), _ = step(params, _batch())
    (_, second), _ = step(params, _batch())
    assert len({tuple(row.tolist()) for row in torch.cat([first, second])}) == 2 * M
    torch.manual_seed(0)  # the same generator: the same keys, the same draws
    (_, again), _ = step(params, _batch())
    assert_bitwise(again, first)
    (_, keyed), _ = step(params, _batch(), key=11)
    (_, rekeyed), _ = step(params, _batch(), key=11)
    assert_bitwise(keyed, rekeyed)
    assert not torch.equal(keyed, first)


def test_a_step_moves_the_callers_generator_by_one_draw_whatever_the_stages_draw() -> None:
    stages, params = _model(3)
    step = fpipe.pipeline(_loss, stages, GPipe(M))
    torch.manual_seed(5)
    step(params, _batch())
    after_step = torch.rand(4)
    torch.manual_seed(5)
    torch.randint(0, 2**53, (), dtype=torch.int64)  # the key's draw
    assert torch.equal(torch.rand(4), after_step)
    torch.manual_seed(5)
    step(params, _batch(), key=1)  # a given key draws nothing
    assert torch.equal(torch.rand(4), (torch.manual_seed(5), torch.rand(4))[1])


def test_evaluate_draws_what_the_training_forward_draws() -> None:
    stages, params = _model(4)
    step = fpipe.pipeline(_loss, stages, ZeroBubbleV(M))
    loss, _ = step(params, _batch(), key=21)
    assert_bitwise(step.evaluate(params, _batch(), key=21), loss)
    assert not torch.equal(step.evaluate(params, _batch(), key=22), loss)


def test_stage_info_says_where_and_fails_outside_a_stage() -> None:
    seen: list[fpipe.StageInfo] = []

    def stage(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        seen.append(fpipe.stage_info())
        return x @ p["w"]

    _, params = _model(2)
    step = fpipe.pipeline(_loss, [stage, stage], OneFOneB(2))
    step(params, _batch(), key=9)
    assert sorted((i.stage, i.microbatch) for i in seen) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(i.key == 9 and i.replica == 0 and i.training for i in seen)
    seen.clear()
    step.evaluate(params, _batch(), key=9)
    assert seen and not any(i.training for i in seen)
    with pytest.raises(RuntimeError, match="no stage is running"):
        fpipe.stage_info()


@pytest.mark.parametrize(
    ("key", "error", "fragment"),
    [
        (-1, ValueError, r"\[0, 2\*\*53\)"),
        (2**53, ValueError, "2\\*\\*53"),
        (1.5, TypeError, "must be an int"),
        (True, TypeError, "must be an int"),
    ],
)
def test_a_bad_key_is_refused(key: Any, error: type[Exception], fragment: str) -> None:
    stages, params = _model(2)
    step = fpipe.pipeline(_loss, stages, GPipe(2))
    with pytest.raises(error, match=fragment):
        step(params, _batch(), key=key)


def test_dropout_resumes_exactly(tmp_path: Any) -> None:
    """The keys come from the default generator, which save_state saves: a resumed run draws
    the masks the uninterrupted one drew."""
    _, model_params = _model(2)
    params = [{f"w{s}": p["w"]} for s, p in enumerate(model_params)]  # saved names are global

    def stage(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return _dropout_stage({"w": next(iter(p.values()))}, x)

    step = fpipe.pipeline(_loss, [stage, stage], OneFOneB(M))
    torch.manual_seed(0)
    losses = []
    for n in range(3):
        if n == 1:
            fpipe.save_state(tmp_path, fpipe.TrainState(params, step=n))
        losses.append(step(params, _batch(n))[0])
    torch.manual_seed(123)  # another process's state: load_state puts the saved one back
    fpipe.load_state(tmp_path, params)
    resumed = [step(params, _batch(n))[0] for n in (1, 2)]
    assert_bitwise(resumed, losses[1:])


# --- Many processes ----------------------------------------------------------------------------

SCHEDULES = {"gpipe": (GPipe(M), 2), "1f1b": (OneFOneB(M), 2), "zbv": (ZeroBubbleV(M), 4)}


def _distributed(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (schedule, num_stages) in SCHEDULES.items():
        stages, params = _model(num_stages)
        step = fpipe.pipeline(_loss, stages, schedule, parallel=fpipe.Parallelism(group=dist.group.WORLD, timeout=30))
        mine = [p if s in step.local_stages else None for s, p in enumerate(params)]
        torch.manual_seed(100 if rank == 0 else 999)  # the ranks' generators differ: rank 0's key is used
        out[name] = step(mine, _batch() if rank == 0 else None), step.local_stages
    return out


def test_dropout_on_two_processes_equals_one_process_bitwise() -> None:
    results = run_ranks(2, _distributed, timeout=90)
    for name, (schedule, num_stages) in SCHEDULES.items():
        torch.manual_seed(100)  # rank 0's generator, whose key every rank uses
        stages, params = _model(num_stages)
        loss, grads = fpipe.pipeline(_loss, stages, schedule)(params, _batch())
        for (d_loss, d_grads), local_stages in (r[name] for r in results):
            assert_bitwise(d_loss, loss, name)
            for s in local_stages:
                assert_bitwise(d_grads[s], grads[s], f"{name}, stage {s}")


def _replicas_and_tensor_parallel(rank: int, world: int) -> dict[str, Any]:
    """Two meshes on the same 2 processes: dp 2 x pp 1, then pp 1 x tp 2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    out: dict[str, Any] = {}
    stages, params = _model(1)

    def keyed_noise(y: torch.Tensor, mb: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        info = fpipe.stage_info()
        loss, noise = _noise_loss(y, mb)
        return loss, {"noise": noise, "key": torch.tensor(info.key), "replica": torch.tensor(info.replica)}

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "pp"))
    step = fpipe.pipeline(
        keyed_noise, stages, GPipe(M), parallel=fpipe.Parallelism(mesh=mesh, timeout=30), has_aux=True
    )
    torch.manual_seed(100 if rank == 0 else 999)  # replica 0's key is every replica's
    out["dp"] = step(params, _batch())[0][1]

    tp_mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "tp"))

    def replicated_dropout(p: dict[str, Any], x: torch.Tensor) -> Any:
        h = distribute_tensor(x, p["w"].device_mesh, [Replicate()]) @ p["w"]  # a replicated DTensor
        return F.dropout(torch.tanh(h), p=0.5, training=True).to_local()

    tp_params = [{"w": distribute_tensor(params[0]["w"], tp_mesh["tp"], [Replicate()])}]
    step = fpipe.pipeline(
        _loss, [replicated_dropout], OneFOneB(M), parallel=fpipe.Parallelism(mesh=tp_mesh, timeout=30)
    )
    torch.manual_seed(100 if rank == 0 else 999)
    loss, grads = step(tp_params, _batch())
    out["tp"] = loss, grads[0]["w"].to_local()
    return out


def test_replicas_draw_their_own_masks_of_one_agreed_key_and_tensor_parallel_ranks_the_same() -> None:
    results = run_ranks(2, _replicas_and_tensor_parallel, timeout=90)
    stages, params = _model(1)
    torch.manual_seed(100)
    (_, expected), _ = fpipe.pipeline(_noise_loss, stages, GPipe(M), has_aux=True)(params, _batch())
    replica_0, replica_1 = (r["dp"] for r in results)
    assert torch.equal(replica_0["key"], replica_1["key"])  # agreed, though the generators differ
    assert replica_0["replica"].tolist() == [0] * M and replica_1["replica"].tolist() == [1] * M
    assert_bitwise(replica_0["noise"], expected)  # replica 0 draws what one process draws
    assert not torch.equal(replica_1["noise"], expected)  # replica 1 its own
    # tensor parallel: every tp rank draws one mask for the replicated activation, the one-process one
    torch.manual_seed(100)
    loss, grads = fpipe.pipeline(_loss, stages, OneFOneB(M))(params, _batch())
    for tp_loss, tp_grad in (r["tp"] for r in results):
        assert_bitwise(tp_loss, loss)
        torch.testing.assert_close(tp_grad, grads[0]["w"], rtol=1e-12, atol=1e-15)


# Counted draws (NOTE [counted draws]): a traced stage call's random numbers.

CPU = torch.device("cpu")


def _counted(seed: int, draw: Any, backends: tuple[str, ...] = ("aot_eager",)) -> Any:
    """``draw()`` under ``CountedDraws`` seeded ``seed``, eagerly and compiled with each backend."""

    def run(s: torch.Tensor) -> Any:
        with CountedDraws(s):
            return draw()

    s = torch.tensor(seed)
    outs = [run(s)]
    for backend in backends:
        torch._dynamo.reset()
        outs.append(torch.compile(run, backend=backend, fullgraph=True)(s))
    return outs


@pytest.mark.parametrize("backends", [("aot_eager",), pytest.param(("inductor",), marks=pytest.mark.slow)], ids=str)
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # Inductor's import
def test_counted_draws_are_the_same_bits_eager_and_under_each_backend(backends: tuple[str, ...]) -> None:
    """Integer hashing and exact conversions: the bits do not depend on the backend (a normal's
    logarithm and cosine within 1e-6 relative: the backend's)."""
    x = torch.ones(3, 5, dtype=torch.float64)

    def draws() -> Any:
        return (
            F.dropout(x, 0.3), torch.rand(2, 3), torch.rand((4,), dtype=torch.bfloat16), torch.randint(3, 9, (5,)),
            torch.randperm(6), torch.bernoulli(torch.full((4,), 0.5)), x.clone().uniform_(-1, 1),
            torch.dropout(x, 0.5, True), torch.randn(4, 2),
        )  # fmt: skip

    first, *compiled = _counted(11, draws, backends)
    for out in compiled:
        assert_bitwise(out[:-1], first[:-1])
        torch.testing.assert_close(out[-1], first[-1], rtol=1e-6, atol=0)


def test_counted_uniforms_fill_zero_to_one_in_each_dtype_and_look_uniform() -> None:
    mode = CountedDraws(torch.tensor(3))
    for dtype, step in ((torch.float64, 2.0**-53), (torch.float32, 2.0**-24), (torch.bfloat16, 2.0**-8)):
        u = mode.uniform((20000,), dtype, CPU)
        assert u.dtype == dtype and float(u.min()) >= 0 and float(u.max()) < 1
        assert torch.equal(torch.remainder(u.double(), step), torch.zeros(20000, dtype=torch.float64))
    u = mode.uniform((100000,), torch.float64, CPU)
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    z = mode.normal((100000,), torch.float64, CPU)
    assert abs(float(z.mean())) < 0.01 and abs(float(z.std()) - 1) < 0.01
    bits = mode.words63(50000, CPU)
    assert int(bits.min()) >= 0 and int(bits.max()) < 2**63 and bits.unique().numel() == 50000


def test_counted_draws_differ_by_seed_and_by_draw_and_repeat_for_both() -> None:
    def two() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.rand(1000), torch.rand(1000)

    a = _counted(1, two)[0]
    b = _counted(2, two)[0]
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], b[0])
    assert_bitwise(_counted(1, two)[0], a)


def test_counted_dropout_keeps_its_semantics() -> None:
    x = torch.arange(1.0, 2001.0, dtype=torch.float64)
    with CountedDraws(torch.tensor(5)):
        assert F.dropout(x, 0.0) is x and F.dropout(x, 0.5, training=False) is x
        assert torch.equal(F.dropout(x, 1.0), torch.zeros_like(x))
        y = F.dropout(x, 0.25)
        kept = y != 0
        torch.testing.assert_close(y[kept], x[kept] / 0.75)
        assert abs(float(kept.double().mean()) - 0.75) < 0.03
        z = x.clone()
        assert F.dropout(z, 0.25, inplace=True) is z and not torch.equal(z, x)
        assert torch.equal(torch.randperm(50).sort().values, torch.arange(50))
        r = torch.randint(10, (1000,))
        assert int(r.min()) == 0 and int(r.max()) == 9 and r.dtype == torch.int64


def test_a_draw_from_the_callers_own_generator_is_not_counted() -> None:
    """``generator=`` (or ``out=``): the caller's numbers, as torch draws them."""
    with CountedDraws(torch.tensor(5)):
        mine = torch.rand(4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(mine, torch.rand(4, generator=torch.Generator().manual_seed(1)))

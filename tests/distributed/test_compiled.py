"""Compiled rows (``fpipe._distributed._compiled``): on 2 gloo ranks, each rank's row one graph
with its messages inside it, bitwise the eager step; ranks that cannot all compile run eagerly
together; a rank killed or frozen in its graph fails the other, naming it (NOTE [compiled rows])."""

from __future__ import annotations

import collections
import os
import signal
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

import fpipe
from fpipe._compile import CompiledRun, compile_option
from fpipe.schedules import DualPipe, Interleaved1F1B, OneFOneB
from tests._multiprocess import run_ranks
from tests.conformance import CONFORMANCE
from tests.distributed._faults import SLACK
from tests.helpers import (
    MIXED_BATCH_DIMS,
    assert_bitwise,
    expert_batch,
    expert_layer,
    expert_loss,
    expert_params,
    mixed_batch,
    mixed_loss,
    mixed_model,
)

pytestmark = pytest.mark.timeout(300)

# Every 2-rank size of the conformance list (DualPipe's stages each on both ranks).
TWO_RANKS = {f"{e.name}-{S}x{M}": (e.make(S, M), S) for e in CONFORMANCE for p, S, M in e.ranks if p == 2}
QUICK = ("OneFOneB-2x5", "ZeroBubbleV-4x4", "DualPipe-2x4")  # (ZB-V: split backwards; the rest @slow)
# (sequence length, batch also on the last rank): the first call of each signature runs eagerly
# and learns the layouts, the next ones are compiled; a new length is no new graph, the batch on
# the last rank is (other messages) unless that rank holds the first stage too; the last call
# comes back to the first signature.
CALLS = [(5, False), (5, False), (7, False), (7, False), (9, True), (9, True), (5, False)]


def _steps(rank, world, names):
    """For each schedule, the eager and the compiled step's results at each call, with the
    warnings and the graphs compiled."""
    torch.set_default_dtype(torch.float64)
    out = {}
    for name in names:
        schedule, num_stages = TWO_RANKS[name]
        stages, params = mixed_model(num_stages)
        parallel = fpipe.Parallelism(group=dist.group.WORLD, timeout=60)
        counter = CompileCounter()
        kwargs = {"batch_dims": MIXED_BATCH_DIMS, "parallel": parallel}
        compiled = fpipe.pipeline(mixed_loss, stages, schedule, compile=counter, **kwargs)
        eager = fpipe.pipeline(mixed_loss, stages, schedule, **kwargs)
        params = [p if s in eager.local_stages else None for s, p in enumerate(params)]
        placement = eager.program.placement()
        calls = []
        for length, batch_on_last in CALLS:
            has = rank == placement[0] or (batch_on_last and rank == placement[-1])
            batch = mixed_batch(length) if has else None
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = compiled(params, batch)
            calls.append((result, eager(params, batch), [str(w.message) for w in caught], counter.frame_count))
        # (a new graph when the batch moves to the last stage's rank, unless it holds the first stage)
        out[name] = calls, 1 if placement[-1] == placement[0] else 2
    return out


def _check(names):
    for rank, results in enumerate(run_ranks(2, _steps, names, timeout=280)):
        for name in names:
            calls, more = results[name]
            for call, (compiled, eager, caught, _) in enumerate(calls):
                assert_bitwise(compiled, eager, f"{name}, rank {rank}, call {call}")
                assert caught == [], (name, rank, call, caught)
            frames = [frames for *_, frames in calls]
            assert frames == [0, 1, 1, 1, 1, more, more], (name, rank, frames)


def test_compiled_rows_are_bitwise_the_eager_step():
    """Complex and integer activations, a string leaf (not sent), the sequence length changing,
    the last rank given the batch or not: bitwise the eager step, one graph for every length."""
    _check(list(QUICK))


@pytest.mark.slow
def test_every_schedule_s_compiled_rows_are_bitwise_the_eager_step():
    _check([name for name in TWO_RANKS if name not in QUICK])


def _item_stage(p, x):
    """A stage whose Python branches on a tensor's value: it cannot be traced into one graph."""
    y = torch.tanh(x @ p["w"])
    return y * 2 if y.sum().item() > 0 else y


def _first(p, x):
    return torch.tanh(x["x"].to(p["w"].dtype) @ p["w"])


def _square(y, mb):
    return ((y - mb["t"]) ** 2).mean()


def _three_calls(rank, stages):
    """Three calls of a compiled 1F1B step on ``stages`` and of its eager twin, with the compiled
    call's warnings."""
    torch.set_default_dtype(torch.float64)
    g = torch.Generator().manual_seed(0)
    params = [{"w": torch.randn(4, 4, generator=g)} for _ in range(2)]
    batch = {"x": torch.randn(6, 4, generator=g), "t": torch.randn(6, 4, generator=g)}
    parallel = fpipe.Parallelism(group=dist.group.WORLD, timeout=60)
    compiled = fpipe.pipeline(_square, stages, OneFOneB(3), parallel=parallel, compile="aot_eager")
    eager = fpipe.pipeline(_square, stages, OneFOneB(3), parallel=parallel)
    params = [p if s in eager.local_stages else None for s, p in enumerate(params)]
    out = []
    for _ in range(3):
        mine = batch if rank == 0 else None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = compiled(params, mine)
        out.append((result, eager(params, mine), [str(w.message) for w in caught]))
    return out


def _check_eager_together(results, own, other):
    """Every call bitwise the eager step; from the second, one warning on each rank: rank 1's
    ``own``, rank 0's ``other`` (the first call learns the layouts, eagerly, as documented)."""
    for rank, calls in enumerate(results):
        for call, (compiled, eager, caught) in enumerate(calls):
            assert_bitwise(compiled, eager, f"rank {rank}, call {call}")
            if call == 0:
                assert caught == [], caught
                continue
            assert len(caught) == 1 and caught[0].endswith("this step runs eagerly."), caught
            assert (own if rank == 1 else other) in caught[0], caught


def _refusing(rank, world):
    """Stage 1 (rank 1) cannot be traced: both ranks warn and run eagerly, every call."""
    return _three_calls(rank, [_first, _item_stage])


def test_a_rank_that_cannot_compile_its_row_has_every_rank_run_eagerly():
    own = "action 1F0 (stage 1, microbatch 0) cannot be traced"
    _check_eager_together(run_ranks(2, _refusing, timeout=200), own, "another pipeline rank could not compile its row")


def _fault(rank, world, fault, timeout):
    """1F1B on 2 ranks, compiled; in the third call rank 0 ``fault``s after the handshake, as its
    graph starts: rank 1 waits in its graph for rank 0's activation. The survivor's seconds,
    error type and message."""
    torch.set_default_dtype(torch.float64)
    g = torch.Generator().manual_seed(0)
    params = [{"w": torch.randn(4, 4, generator=g)} for _ in range(2)]
    batch = {"x": torch.randn(6, 4, generator=g), "t": torch.randn(6, 4, generator=g)}
    parallel = fpipe.Parallelism(group=dist.group.WORLD, timeout=timeout)
    step = fpipe.pipeline(
        _square, [_first, lambda p, x: torch.tanh(x @ p["w"])], OneFOneB(3), parallel=parallel, compile="aot_eager"
    )
    params = [p if s in step.local_stages else None for s, p in enumerate(params)]
    mine = batch if rank == 0 else None
    step(params, mine)  # learns the layouts
    step(params, mine)  # compiles
    if rank == 0:
        attempt = CompiledRun.attempt

        def faulty(self, *args, **kwargs):
            os.kill(os.getpid(), fault)
            return attempt(self, *args, **kwargs)

        CompiledRun.attempt = faulty  # (this process only)
    start = time.monotonic()
    try:
        step(params, mine)
        return "no error", "", time.monotonic() - start
    except fpipe.PipelineError as error:
        return type(error).__name__, str(error), time.monotonic() - start


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("fault", "timeout", "kind", "because"),
    [
        (signal.SIGKILL, 60, "PipelineError", "because rank 0 died"),
        (signal.SIGSTOP, 4, "PipelineTimeoutError", "because rank 0 stopped answering"),
    ],
    ids=["killed", "frozen"],
)
def test_a_rank_killed_or_frozen_in_its_graph_fails_the_other_naming_it(fault, timeout, kind, because):
    """Rank 1's graph waits on a receive that no fpipe wait bounds: the closed connection or, for
    a frozen peer, the timer at the pipeline's timeout ends it, and rank 1 raises as an eager
    step would, naming rank 0."""
    kind_, message, seconds = run_ranks(2, _fault, fault, timeout, timeout=100, may_die=frozenset({0}))[1]
    assert kind_ == kind and because in message, (kind_, message)
    assert seconds < timeout + SLACK, seconds


def test_compile_names_what_a_distributed_step_cannot_compile_yet():
    parts = ["regathered sharded parameters", "tensor parallelism"]
    with pytest.raises(NotImplementedError, match="not yet a step with regathered sharded parameters or tensor"):
        compile_option(True, parts)
    assert compile_option("aot_eager", ["nothing"]) is not None and compile_option(False, ["x"]) is None


def _aux_loss(y, mb):
    loss = ((y - mb["t"]) ** 2).sum()
    return loss, {"sum": loss.detach(), "first": y[0].detach()}


def _tokens(mb):
    return (mb["t"][..., 0] > 0).sum()


def _composed(rank, world):
    """``has_aux`` with ``weight_fn``, ``recompute`` and a bfloat16 precision policy, compiled and
    eager, on rows learned then compiled."""
    torch.set_default_dtype(torch.float64)
    g = torch.Generator().manual_seed(0)
    params = [{"w": torch.randn(4, 4, generator=g)} for _ in range(2)]
    parallel = fpipe.Parallelism(group=dist.group.WORLD, timeout=60)
    stages = [_first, lambda p, x: torch.tanh(x @ p["w"])]
    out = []
    for options in (
        {"has_aux": True, "weight_fn": _tokens, "recompute": {0, 1}},
        {"precision": fpipe.Precision(compute=torch.bfloat16, accumulate=torch.float32)},
    ):
        loss_fn = _aux_loss if options.get("has_aux") else _square
        compiled = fpipe.pipeline(loss_fn, stages, OneFOneB(3), parallel=parallel, compile="aot_eager", **options)
        eager = fpipe.pipeline(loss_fn, stages, OneFOneB(3), parallel=parallel, **options)
        mine = [p if s in eager.local_stages else None for s, p in enumerate(params)]
        for seed in (1, 2):
            h = torch.Generator().manual_seed(seed)
            batch = {"x": torch.randn(6, 4, generator=h), "t": torch.randn(6, 4, generator=h)}
            batch = batch if rank == 0 else None
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = compiled(mine, batch)
            out.append((result, eager(mine, batch), [str(w.message) for w in caught]))
        with fpipe.record() as recording, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = compiled(mine, batch)  # recorded: every rank runs its row eagerly
        out.append((result, eager(mine, batch), [str(w.message) for w in caught] + [len(recording.timelines)]))
    # Dropout, recomputed on the last stage: the draws are counted (NOTE [counted draws]) in the
    # row that learns the layouts as in the graph, and are the one-process compiled step's.
    stages = [_first, lambda p, x: torch.nn.functional.dropout(torch.tanh(x @ p["w"]), 0.3)]
    options = {"recompute": {1}, "compile": "aot_eager"}
    compiled = fpipe.pipeline(_square, stages, OneFOneB(3), parallel=parallel, **options)
    alone = fpipe.pipeline(_square, stages, OneFOneB(3), **options)
    for key in (4, 5):
        h = torch.Generator().manual_seed(key)
        batch = {"x": torch.randn(6, 4, generator=h), "t": torch.randn(6, 4, generator=h)}
        loss, grads = alone(params, batch, key=key)
        expected = (loss, [g if s in compiled.local_stages else None for s, g in enumerate(grads)])
        out.append((compiled(mine, batch if rank == 0 else None, key=key), expected, []))
    # A stage that branches on its microbatch's size: rank 1's graph does not fit a larger batch
    # (a guard fails), so that call runs rank 1's row without a graph, with a warning, while
    # rank 0 runs its graph: the messages are the same (NOTE [compiled rows], point 1).
    stages = [_first, _sized_stage([1])]
    compiled = fpipe.pipeline(_square, stages, OneFOneB(3), parallel=parallel, compile="aot_eager")
    eager = fpipe.pipeline(_square, stages, OneFOneB(3), parallel=parallel)
    for size in (6, 6, 12, 12):
        h = torch.Generator().manual_seed(size)
        batch = {"x": torch.randn(size, 4, generator=h), "t": torch.randn(size, 4, generator=h)}
        batch = batch if rank == 0 else None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = compiled(mine, batch)
        out.append((result, eager(mine, batch), [str(w.message) for w in caught]))
    return out


def _sized_stage(layers):
    """A stage over the parameters named by ``layers`` (ints in an f-string, as models name
    theirs: constants in the graph, not dynamic ints) that branches on its microbatch's size."""

    def sized(p, x):
        y = x
        for layer in layers:
            y = torch.tanh(y @ p[f"w{layer}"[:1]])
        return y * 2 if y.shape[0] > 2 else y

    return sized


def test_compiled_rows_compose_with_aux_token_weights_recompute_precision_and_draws():
    """Then a call under ``fpipe.record()``: its actions run (and are timed), with a warning."""
    for rank, calls in enumerate(run_ranks(2, _composed, timeout=200)):
        for call, (compiled, eager, caught) in enumerate(calls):
            assert_bitwise(compiled, eager, f"rank {rank}, call {call}")
            if call == 11 and rank == 1:
                assert len(caught) == 1 and "this pipeline rank's graph does not fit this step's shapes" in caught[0]
            elif call in (2, 5):
                assert len(caught) == 2 and "fpipe.record() times each action" in caught[0], caught
                assert caught[1] == 1, caught  # the timeline of the step recorded
            else:
                assert caught == [], caught


def _replicas(rank, world):
    """dp 2 x pp 1, two stages on each replica's one pipeline rank: replica 1's sequence length
    changes at the second call, so that one replica runs compiled while the other learns its
    layouts eagerly: sharded parameters (gathered before the graph, reduce-scattered after it,
    averaged), and replicated ones with ``weight_fn`` (summed; averaged in the slow mesh test)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_default_dtype(torch.float64)
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "pp"))
    parallel = fpipe.Parallelism(mesh=mesh, timeout=60)
    stages, params = mixed_model(2)
    sharded = fpipe.Parallelism(mesh=mesh, shard_params=True, timeout=60)
    out = []
    for weight_fn, how in (
        (None, sharded),  # shards gathered before the graph, the gradients reduce-scattered after it
        (lambda mb: (mb["tokens"] % 2).sum(), parallel),
    ):
        options = {"batch_dims": MIXED_BATCH_DIMS, "parallel": how, "weight_fn": weight_fn}
        compiled = fpipe.pipeline(mixed_loss, stages, OneFOneB(2), compile="aot_eager", **options)
        eager = fpipe.pipeline(mixed_loss, stages, OneFOneB(2), **options)
        mine = compiled.shard(params) if how.shard_params else params
        assert_bitwise(eager.shard(params) if how.shard_params else params, mine)
        for length in (5, 5, 5) if rank == 0 else (5, 7, 7):
            batch = mixed_batch(length, seed=rank + 1)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = compiled(mine, batch)
            out.append((result, eager(mine, batch), [str(w.message) for w in caught]))
    return out


def test_replicas_reduce_compiled_rows_as_the_eager_step_does_replicated_or_sharded():
    for rank, calls in enumerate(run_ranks(2, _replicas, timeout=200)):
        for call, (compiled, eager, caught) in enumerate(calls):
            assert_bitwise(compiled, eager, f"rank {rank}, call {call}")
            assert caught == [], caught


def _tensor_parallel(rank, world):
    """pp 1 x tp 2: column- then row-parallel weights and a replicated bias (its gradient a
    ``Partial`` sum until the step's epilogue), compiled and eager, with the DTensor code inside
    the graph; a stage that makes its DTensor with ``distribute_tensor`` cannot be traced (dynamo:
    a pybind11 constructor) and warns."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    torch.set_default_dtype(torch.float64)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "tp"))
    g = torch.Generator().manual_seed(0)
    full = {"w1": torch.randn(8, 8, generator=g), "w2": torch.randn(8, 8, generator=g)}
    full["b"] = torch.randn(8, generator=g)
    placements = {"w1": [Shard(1)], "w2": [Shard(0)], "b": [Replicate()]}
    params = [{k: distribute_tensor(v, mesh["tp"], placements[k]) for k, v in full.items()}]

    def stage(p, x, make=DTensor.from_local):
        h = make(x["x"], p["w1"].device_mesh, [Replicate()])
        y = torch.tanh(h @ p["w1"]) @ p["w2"] + p["b"]
        return y.redistribute(placements=[Replicate()]).to_local()

    def made(p, x):
        return stage(p, x, make=distribute_tensor)

    parallel = fpipe.Parallelism(mesh=mesh, timeout=60)
    out = []
    for fn in (stage, made):
        compiled = fpipe.pipeline(_square, [fn], OneFOneB(2), parallel=parallel, compile="aot_eager")
        eager = fpipe.pipeline(_square, [fn], OneFOneB(2), parallel=parallel)
        for seed in (1, 2, 3):
            h = torch.Generator().manual_seed(seed)
            batch = {"x": torch.randn(4, 8, generator=h), "t": torch.randn(4, 8, generator=h)}
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = compiled(params, batch)
            out.append((result, eager(params, batch), [str(w.message) for w in caught]))
    return out


def test_tensor_parallel_stages_compile_where_dynamo_traces_their_dtensors():
    for rank, calls in enumerate(run_ranks(2, _tensor_parallel, timeout=200)):
        for call, (compiled, eager, caught) in enumerate(calls):
            assert_bitwise(compiled, eager, f"rank {rank}, call {call}")
            if call < 3:
                assert caught == [], caught
            elif call > 3:  # (the first call learns the layouts, eagerly; dynamo warns too)
                ours = [w for w in caught if w.startswith("fpipe")]
                assert len(ours) == 1 and "action 0F0 (stage 0, microbatch 0) cannot be traced" in ours[0], caught


def _experts(rank, world):
    """pp 1 x ep 2: ``fpipe.moe``'s expert layers, their all-to-alls (counts first, then rows)
    inside the graph; each call's frames counted."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_default_dtype(torch.float64)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "ep"))

    def run(p, x):
        h = x["x"]
        for layer in p:
            h = expert_layer(layer, h)
        return h

    params = [[{"dense": p["dense"], "w": distribute_tensor(p["w"], mesh["ep"], [Shard(0)])} for p in expert_params(2)]]
    parallel = fpipe.Parallelism(mesh=mesh, timeout=60)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = fpipe.pipeline(expert_loss, [run], OneFOneB(2), parallel=parallel, compile=counter)
    eager = fpipe.pipeline(expert_loss, [run], OneFOneB(2), parallel=parallel)
    out = []
    for seed in (0, 1, 2):
        batch = expert_batch(2 * seed + rank, 2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = compiled(params, batch)
        out.append((result, eager(params, batch), [str(w.message) for w in caught], counter.frame_count))
    return out


def test_expert_parallel_stages_compile_their_all_to_alls_into_the_graph():
    for rank, calls in enumerate(run_ranks(2, _experts, timeout=200)):
        for call, (compiled, eager, caught, frames) in enumerate(calls):
            assert_bitwise(compiled, eager, f"rank {rank}, call {call}")
            assert caught == [], caught
            assert frames == (0 if call == 0 else 1), frames  # (the first call learns the layouts)


def _wide(rank, world):
    """pp 2 x tp 2 and pp 2 x ep 2: tensor- and expert-parallel stages on both pipeline ranks,
    compiled and eager, the first call learning the layouts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    torch.set_default_dtype(torch.float64)
    out = []
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    g = torch.Generator().manual_seed(0)
    placements = {"w1": [Shard(1)], "w2": [Shard(0)], "b": [Replicate()]}
    shapes = {"w1": (8, 8), "w2": (8, 8), "b": (8,)}
    full = [{k: torch.randn(*shape, generator=g) for k, shape in shapes.items()} for _ in "ab"]

    def parallel_mlp(p, x):
        h = DTensor.from_local(x["x"] if isinstance(x, dict) else x, p["w1"].device_mesh, [Replicate()])
        return (torch.tanh(h @ p["w1"]) @ p["w2"] + p["b"]).redistribute(placements=[Replicate()]).to_local()

    parallel = fpipe.Parallelism(mesh=mesh, timeout=60)
    compiled = fpipe.pipeline(_square, [parallel_mlp] * 2, OneFOneB(2), parallel=parallel, compile="aot_eager")
    eager = fpipe.pipeline(_square, [parallel_mlp] * 2, OneFOneB(2), parallel=parallel)
    params = [
        {k: distribute_tensor(v, mesh["tp"], placements[k]) for k, v in p.items()} if s in eager.local_stages else None
        for s, p in enumerate(full)
    ]
    for seed in (1, 2):
        h = torch.Generator().manual_seed(seed)
        batch = {"x": torch.randn(4, 8, generator=h), "t": torch.randn(4, 8, generator=h)}
        out.append((compiled(params, batch if 0 in eager.local_stages else None), eager(params, batch)))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))

    def experts(p, x):
        h = x["x"] if isinstance(x, dict) else x
        for layer in p:
            h = expert_layer(layer, h)
        return h

    parallel = fpipe.Parallelism(mesh=mesh, timeout=60)
    compiled = fpipe.pipeline(expert_loss, [experts] * 2, OneFOneB(2), parallel=parallel, compile="aot_eager")
    eager = fpipe.pipeline(expert_loss, [experts] * 2, OneFOneB(2), parallel=parallel)
    layers = expert_params(4)
    held = [{"dense": p["dense"], "w": distribute_tensor(p["w"], mesh["ep"], [Shard(0)])} for p in layers]
    params = [held[2 * s : 2 * s + 2] if s in eager.local_stages else None for s in range(2)]
    for seed in (0, 1):
        batch = expert_batch(2 * seed + mesh.get_coordinate()[1], 2) if 0 in eager.local_stages else None
        out.append((compiled(params, batch), eager(params, batch)))
    return out


@pytest.mark.slow
def test_tensor_and_expert_parallel_stages_compile_on_two_pipeline_ranks():
    for rank, calls in enumerate(run_ranks(4, _wide, timeout=280)):
        for call, (compiled, eager) in enumerate(calls):
            assert_bitwise(compiled, eager, f"rank {rank}, call {call}")


def _subgroup(rank, world):
    """A pipeline over global ranks 1 and 2 (pipeline ranks 0 and 1): the graphs' sends and
    receives name pipeline ranks, not global ones; rank 0 only joins the group's creation."""
    torch.set_default_dtype(torch.float64)
    group = dist.new_group([1, 2])
    if rank == 0:
        return None
    stages, params = mixed_model(2)
    parallel = fpipe.Parallelism(group=group, timeout=60)
    options = {"batch_dims": MIXED_BATCH_DIMS, "parallel": parallel}
    compiled = fpipe.pipeline(mixed_loss, stages, OneFOneB(2), compile="aot_eager", **options)
    eager = fpipe.pipeline(mixed_loss, stages, OneFOneB(2), **options)
    params = [p if s in eager.local_stages else None for s, p in enumerate(params)]
    batch = mixed_batch(5) if rank == 1 else None
    return [(compiled(params, batch), eager(params, batch)) for _ in range(2)]


def test_compiled_rows_on_a_subgroup_address_pipeline_ranks():
    for rank, calls in enumerate(run_ranks(3, _subgroup, timeout=200)[1:], start=1):
        for call, (compiled, eager) in enumerate(calls):
            assert_bitwise(compiled, eager, f"rank {rank}, call {call}")


def _mesh(rank, world):
    """dp 2 x pp 2: each replica's pipeline group a subgroup, replicas reducing after the graph:
    interleaved 1F1B, and DualPipe (its stages on both pipeline ranks, their sums added before
    the replicas' reduction) with replicated and with sharded parameters."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_default_dtype(torch.float64)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    out = []
    setups = ((Interleaved1F1B(4), 4, False), (DualPipe(4), 2, False), (DualPipe(4), 2, True))
    for schedule, num_stages, shard in setups:
        stages, params = mixed_model(num_stages)
        parallel = fpipe.Parallelism(mesh=mesh, timeout=60, shard_params=shard)
        options = {"batch_dims": MIXED_BATCH_DIMS, "parallel": parallel}
        compiled = fpipe.pipeline(mixed_loss, stages, schedule, compile="aot_eager", **options)
        eager = fpipe.pipeline(mixed_loss, stages, schedule, **options)
        params = [p if s in eager.local_stages else None for s, p in enumerate(params)]
        if shard:
            params, _ = compiled.shard(params), eager.shard(params)
        batch = mixed_batch(5, seed=rank // 2 + 1) if 0 in eager.local_stages else None
        out += [(compiled(params, batch), eager(params, batch)) for _ in range(2)]
    return out


@pytest.mark.slow
def test_compiled_rows_on_a_data_parallel_pipeline_mesh():
    for rank, calls in enumerate(run_ranks(4, _mesh, timeout=280)):
        for call, (compiled, eager) in enumerate(calls):
            assert_bitwise(compiled, eager, f"rank {rank}, call {call}")


def _ordered_first(p, x):
    return collections.OrderedDict(h=torch.tanh(x["x"] @ p["w"]))


def _ordered_second(p, x):
    return torch.tanh(x["h"] @ p["w"])


def _unbuildable(rank, world):
    """Stage 0 hands stage 1 an OrderedDict, which the eager wire carries and a graph cannot rebuild:
    rank 1 learns it in the first call; from the second, both ranks warn and run eagerly."""
    return _three_calls(rank, [_ordered_first, _ordered_second])


def test_a_message_a_graph_cannot_rebuild_has_every_rank_run_eagerly():
    own = "the activation of stage 0 for microbatch 0 carries a node of type OrderedDict"
    _check_eager_together(run_ranks(2, _unbuildable, timeout=200), own, "another pipeline rank cannot compile its row")


def _inductor(rank, world):
    torch.set_default_dtype(torch.float64)
    g = torch.Generator().manual_seed(0)
    params = [{"w": torch.randn(16, 16, generator=g) / 4} for _ in range(2)]
    batch = {"x": torch.randn(8, 5, 16, generator=g), "t": torch.randn(8, 5, 16, generator=g)}
    parallel = fpipe.Parallelism(group=dist.group.WORLD, timeout=600)
    stages = [_first, lambda p, x: torch.tanh(x @ p["w"])]
    compiled = fpipe.pipeline(_square, stages, OneFOneB(4), parallel=parallel, compile=True)
    eager = fpipe.pipeline(_square, stages, OneFOneB(4), parallel=parallel)
    params = [p if s in eager.local_stages else None for s, p in enumerate(params)]
    mine = batch if rank == 0 else None
    compiled(params, mine)  # learns the layouts
    return [compiled(params, mine) for _ in range(2)], eager(params, mine)


@pytest.mark.slow
def test_inductor_rows_are_close_to_eager_and_repeat_themselves():
    """Float64, 1F1B on 2 ranks under Inductor: within 1e-12 of the eager step (relative to each
    gradient's largest entry), and two compiled calls bitwise equal."""
    for rank, ((first, second), eager) in enumerate(run_ranks(2, _inductor, timeout=600)):
        assert_bitwise(first, second, f"rank {rank}")
        torch.testing.assert_close(first[0], eager[0], rtol=1e-12, atol=0)
        for got, want in zip(first[1], eager[1]):
            if want is not None:
                scale = max(w.abs().max() for w in want.values())
                torch.testing.assert_close(got, want, rtol=0, atol=1e-12 * float(scale))


def _with_ids(p, x):
    return {"h": torch.tanh(x["x"] @ p["w"]), "ids": x["ids"]}


def _embedded(p, x):
    return x["h"] * p["emb"][x["ids"]]


def _own_error(rank, world):
    """In the third call rank 1's compiled graph indexes past its table (its own error, at run
    time): it raises that; rank 0, waiting in its graph, raises naming rank 1."""
    torch.set_default_dtype(torch.float64)
    g = torch.Generator().manual_seed(0)
    params = [{"w": torch.randn(4, 4, generator=g)}, {"emb": torch.randn(5, 4, generator=g)}]
    parallel = fpipe.Parallelism(group=dist.group.WORLD, timeout=60)
    step = fpipe.pipeline(_square, [_with_ids, _embedded], OneFOneB(3), parallel=parallel, compile="aot_eager")
    params = [p if s in step.local_stages else None for s, p in enumerate(params)]
    batch = {"x": torch.randn(6, 4, generator=g), "t": torch.randn(6, 4, generator=g), "ids": torch.arange(6) % 5}
    step(params, batch if rank == 0 else None)  # learns the layouts
    step(params, batch if rank == 0 else None)  # compiles
    batch["ids"] = batch["ids"] + 3  # (past the table's 5 rows)
    start = time.monotonic()
    try:
        step(params, batch if rank == 0 else None)
        return "no error", "", time.monotonic() - start
    except Exception as error:
        return type(error).__name__, str(error), time.monotonic() - start


def test_a_stage_s_own_error_in_a_compiled_row_fails_the_others_naming_its_rank():
    (kind0, message0, seconds0), (kind1, message1, _) = run_ranks(2, _own_error, timeout=150)
    assert kind1 == "IndexError", (kind1, message1)
    assert kind0 == "PipelineError" and "rank 1 failed in its compiled row (IndexError)" in message0, message0
    assert seconds0 < SLACK, seconds0  # (told by the board, not after the timeout)

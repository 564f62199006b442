"""The distributed runtime equals the single-process executor, bitwise, and fails loudly.

Each test spawns 2 or 4 gloo ranks on 127.0.0.1 (tests/_multiprocess.py), runs several steps
there, and compares with the same pipeline run in this process.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import fpipe
from fpipe.schedules import GPipe, OneFOneB, Program, ZeroBubbleV
from tests._multiprocess import run_ranks
from tests.conformance import CONFORMANCE
from tests.helpers import (
    MIXED_BATCH_DIMS,
    assert_bitwise,
    mixed_batch,
    mixed_block,
    mixed_first,
    mixed_loss,
    mixed_model,
)

pytestmark = pytest.mark.timeout(180)

# name -> (ranks, schedule, stages): every distributed size of every entry of the conformance list
RUNS = {f"{e.name}-{p}x{S}": (p, e.make(S, M), S) for e in CONFORMANCE for p, S, M in e.ranks}
SCHEDULES = {name: (schedule, S) for name, (_, schedule, S) in RUNS.items()}


def _local(schedule, num_stages, batch):
    stages, params = mixed_model(num_stages)
    step = fpipe.pipeline(mixed_loss, stages, schedule, batch_dims=MIXED_BATCH_DIMS)
    return step(params, batch)


CALLS = [(5, False), (7, False), (7, True)]  # (sequence length, batch also on the last rank)


def _train(rank, world, name):
    schedule, num_stages = SCHEDULES[name]
    stages, params = mixed_model(num_stages)
    step = fpipe.pipeline(
        mixed_loss,
        stages,
        schedule,
        batch_dims=MIXED_BATCH_DIMS,
        parallel=fpipe.Parallelism(group=dist.group.WORLD, timeout=30),
    )
    params = [p if s in step.local_stages else None for s, p in enumerate(params)]
    placement = step.program.placement()
    out = []
    with fpipe.record() as recording:
        for length, batch_on_last in CALLS:  # the sequence length changes between calls
            has = rank == placement[0] or (batch_on_last and rank == placement[-1])
            loss, grads = step(params, mixed_batch(length) if has else None)
            out.append((loss, grads, step.global_norm(grads)))
    timeline = recording.timeline
    return step.local_stages, out, (timeline.starts, timeline.ends, timeline.bubble_fractions)


@pytest.mark.parametrize(("world", "name"), [(p, name) for name, (p, _, _) in RUNS.items()])
def test_distributed_equals_local_bitwise(world, name):
    schedule, num_stages = SCHEDULES[name]
    results = run_ranks(world, _train, name)
    for call, (length, _) in enumerate(CALLS):
        loss, grads = _local(schedule, num_stages, mixed_batch(length))
        norm = torch.cat([g.reshape(-1) for tree in grads for g in tree.values()]).norm()
        for local_stages, out, _ in results:
            d_loss, d_grads, d_norm = out[call]
            mine = [g if s in local_stages else None for s, g in enumerate(grads)]
            assert_bitwise((d_loss, d_grads), (loss, mine), f"{name}, call {call}")
            torch.testing.assert_close(d_norm, norm, rtol=1e-12, atol=0)
    # fpipe.record gathers every rank's measured row to every rank
    starts, ends, bubbles = results[0][2]
    assert all(r[2][0] == starts for r in results)
    program = schedule if isinstance(schedule, Program) else schedule.program(num_stages, world)
    assert [len(row) for row in starts] == [len(row) for row in program.ranks]
    assert all(s <= e for srow, erow in zip(starts, ends) for s, e in zip(srow, erow))
    assert len(bubbles) == world and all(0 <= b < 1 for b in bubbles)


LARGE_LENGTHS = (410, 450, 450)  # a microbatch's activation (5 x 410 x 2 complex128) is >= 64 KiB


def _train_large(rank, world):
    stages, params = mixed_model(2)
    step = fpipe.pipeline(
        mixed_loss,
        stages,
        GPipe(2),
        batch_dims=MIXED_BATCH_DIMS,
        parallel=fpipe.Parallelism(group=dist.group.WORLD, timeout=30),
    )
    params = [p if s in step.local_stages else None for s, p in enumerate(params)]
    return [step(params, mixed_batch(length) if rank == 0 else None) for length in LARGE_LENGTHS]


def test_large_leaves_travel_on_their_own_and_equal_local():
    """Activations, cotangents and the last stage's targets of 64 KiB or more travel as messages of
    their own (fpipe/_distributed/_wire.py), beside small inline leaves, across a change of sequence length."""
    from fpipe._distributed._wire import INLINE_LIMIT

    assert 5 * LARGE_LENGTHS[0] * 2 * 16 >= INLINE_LIMIT
    results = run_ranks(2, _train_large)
    for call, length in enumerate(LARGE_LENGTHS):
        loss, grads = _local(GPipe(2), 2, mixed_batch(length))
        for rank, out in enumerate(results):
            d_loss, d_grads = out[call]
            assert_bitwise((d_loss, d_grads[rank]), (loss, grads[rank]), f"call {call}, rank {rank}")


def _transposing(p, mb):  # a non-contiguous activation: the transpose of a product
    return (mb["x"].T @ p).T


def _reducing(p, x):  # a reduction, whose order of additions follows the input's layout
    return (x.T * p).sum(1)


def _layout_loss(y, mb):  # the targets are split along dim 1: non-contiguous pieces
    return (y - mb["y"].sum(0)).square().mean()


def _layout_params_and_batch():
    g, f32 = torch.Generator().manual_seed(3), torch.float32  # explicit: the tests' default dtype is float64
    params = [torch.randn(64, 64, generator=g, dtype=f32), torch.randn(64, generator=g, dtype=f32)]
    return params, {"x": torch.randn(64, 32, generator=g, dtype=f32), "y": torch.randn(16, 32, generator=g, dtype=f32)}


def _train_layouts(rank, world):
    params, batch = _layout_params_and_batch()
    step = fpipe.pipeline(
        _layout_loss,
        [_transposing, _reducing],
        GPipe(2),
        batch_dims=1,
        parallel=fpipe.Parallelism(group=dist.group.WORLD),
    )
    params = [p if s in step.local_stages else None for s, p in enumerate(params)]
    return step(params, batch if rank == 0 else None)


def test_layouts_cross_boundaries_as_over_the_wire():
    """NOTE [boundary layout]: a transposed activation and targets split along dim 1 reach the next
    stage and loss_fn contiguous in one process too, so one process and two agree bitwise."""
    params, batch = _layout_params_and_batch()
    loss, grads = fpipe.pipeline(_layout_loss, [_transposing, _reducing], GPipe(2), batch_dims=1)(params, batch)
    for rank, (d_loss, d_grads) in enumerate(run_ranks(2, _train_layouts)):
        assert_bitwise((d_loss, d_grads[rank]), (loss, grads[rank]), f"rank {rank}")


def _mesh_train(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    stages, params = mixed_model(2)
    step = fpipe.pipeline(
        mixed_loss, stages, OneFOneB(3), batch_dims=MIXED_BATCH_DIMS, parallel=fpipe.Parallelism(mesh=mesh, timeout=30)
    )
    params = [p if s in step.local_stages else None for s, p in enumerate(params)]
    replica = mesh.get_coordinate()[0]
    loss, grads = step(params, mixed_batch(6, seed=10 + replica) if step.rank == 0 else None)
    return step.local_stages, loss, grads, step.global_norm(grads)


def test_data_parallel_times_pipeline_mesh():
    results = run_ranks(4, _mesh_train)
    per_replica = [_local(OneFOneB(3), 2, mixed_batch(6, seed=10 + r)) for r in range(2)]
    loss = (per_replica[0][0] + per_replica[1][0]) / 2
    grads = [
        {k: (per_replica[0][1][s][k] + per_replica[1][1][s][k]) / 2 for k in per_replica[0][1][s]} for s in range(2)
    ]
    for local_stages, d_loss, d_grads, _ in results:
        assert_bitwise(d_loss, loss)
        for s in local_stages:
            assert_bitwise(d_grads[s], grads[s], f"stage {s}")
    norm = torch.cat([g.reshape(-1) for tree in grads for g in tree.values()]).norm()
    for *_, d_norm in results:
        torch.testing.assert_close(d_norm, norm, rtol=1e-12, atol=0)


def _bad_inputs(rank, world):
    stages, params = mixed_model(2)
    messages = {}
    step = fpipe.pipeline(
        mixed_loss,
        stages,
        GPipe(2),
        batch_dims=MIXED_BATCH_DIMS,
        parallel=fpipe.Parallelism(group=dist.group.WORLD, timeout=20),
    )
    mine = [p if s in step.local_stages else None for s, p in enumerate(params)]
    for case, (ps, batch) in {
        "params for a stage held elsewhere": (params, mixed_batch(3)),
        "missing params": ([None, None], mixed_batch(3)),
        "batch on no rank": (mine, None),
    }.items():
        with pytest.raises(ValueError) as info:
            step(ps, batch if rank == 0 else None)
        messages[case] = str(info.value)
    other = fpipe.pipeline(
        mixed_loss,
        stages,
        GPipe(2) if rank == 0 else OneFOneB(2),
        batch_dims=MIXED_BATCH_DIMS,
        parallel=fpipe.Parallelism(group=dist.group.WORLD),
    )
    with pytest.raises(fpipe.schedules.ScheduleError) as info:
        other(mine, mixed_batch(3) if rank == 0 else None)
    messages["mismatched schedules"] = str(info.value)
    # NOTE [a handshake of fixed size]: each case below used to abort a rank in gloo or leave one waiting.
    for case, counts in {"microbatch counts": (8, 4), "counts past the inline sizes": (20, 24)}.items():
        other = fpipe.pipeline(
            mixed_loss,
            stages,
            OneFOneB(counts[rank]),
            batch_dims=MIXED_BATCH_DIMS,
            parallel=fpipe.Parallelism(group=dist.group.WORLD, timeout=20),
        )
        with pytest.raises(fpipe.schedules.ScheduleError) as info:
            other(mine, mixed_batch(3, size=20) if rank == 0 else None)
        messages[case] = str(info.value)
    many = fpipe.pipeline(
        mixed_loss,
        stages,
        OneFOneB(20),
        batch_dims=MIXED_BATCH_DIMS,
        parallel=fpipe.Parallelism(group=dist.group.WORLD, timeout=20),
    )
    messages["20 microbatches"] = many(mine, mixed_batch(3, size=20) if rank == 0 else None)[0]
    for case, count in {
        "a meta count": lambda mb: torch.ones((), dtype=torch.int64, device="meta"),
        "counts past int64": lambda mb: 2**62,
    }.items():
        weighted = fpipe.pipeline(
            mixed_loss,
            stages,
            GPipe(2),
            batch_dims=MIXED_BATCH_DIMS,
            parallel=fpipe.Parallelism(group=dist.group.WORLD, timeout=20),
            weight_fn=count,
        )
        with pytest.raises(ValueError) as info:
            weighted(mine, mixed_batch(3) if rank == 0 else None)
        messages[case] = str(info.value)
    weighted = fpipe.pipeline(
        mixed_loss,
        stages,
        GPipe(2),
        batch_dims=MIXED_BATCH_DIMS,
        parallel=fpipe.Parallelism(group=dist.group.WORLD, timeout=20),
        weight_fn=(lambda mb: 1) if rank == 0 else None,
    )
    with pytest.raises(ValueError) as info:
        weighted(mine, mixed_batch(3) if rank == 0 else None)
    messages["weight_fn on one rank"] = str(info.value)
    with pytest.raises((TypeError, ValueError)) as info:  # fails on rank 1 before the handshake
        step(mine if rank == 0 else mine[:1], None if rank == 1 else mixed_batch(3))
    messages["params of one rank"] = str(info.value)
    with pytest.raises((TypeError, ValueError)) as info:  # so does an evaluate with outputs="yes" on rank 1
        step.evaluate(mine, mixed_batch(3) if rank == 0 else None, outputs=True if rank == 0 else "yes")
    messages["outputs of one rank"] = str(info.value)
    with pytest.raises(fpipe.schedules.ScheduleError) as info:
        fpipe.pipeline(mixed_loss, [*stages, mixed_block], GPipe(2), parallel=fpipe.Parallelism(group=dist.group.WORLD))
    messages["stages do not fit"] = str(info.value)
    # the group still works after input errors
    loss, _ = step(mine, mixed_batch(3) if rank == 0 else None)
    messages["after"] = float(loss)

    def broken(p, x):
        if broken.calls == 2:  # stage 1, on rank 1, in its third forward (microbatch 2)
            raise ValueError("boom")
        broken.calls += 1
        return mixed_block(p, x)

    broken.calls = 0
    failing = fpipe.pipeline(
        mixed_loss,
        [mixed_first, broken],
        OneFOneB(3),
        batch_dims=MIXED_BATCH_DIMS,
        parallel=fpipe.Parallelism(group=dist.group.WORLD, timeout=20),
    )
    with pytest.raises(fpipe.PipelineError) as info:
        failing(mine, mixed_batch(3) if rank == 0 else None)
    messages["stage raised"] = (str(info.value), info.value.rank, str(info.value.action), repr(info.value.__cause__))
    with pytest.raises(fpipe.PipelineError) as info:  # the failed step's messages may still be in flight
        step(mine, mixed_batch(3) if rank == 0 else None)
    messages["after a failure"] = str(info.value)
    return messages


def test_bad_inputs_fail_on_every_rank():
    first, second = run_ranks(2, _bad_inputs)
    assert "stage 1 lives on rank 1" in first["params for a stage held elsewhere"]
    assert "stage 0 lives on rank 0" in second["params for a stage held elsewhere"]
    assert "params[0] is None" in first["missing params"]
    assert "was given batch=None" in first["batch on no rank"]
    assert "rank(s) [0] rejected" in second["batch on no rank"]
    assert "weight_fn returned a tensor on the meta device for microbatch 0" in first["a meta count"]
    assert "rank(s) [0] rejected" in second["a meta count"]
    assert "sum past 2**63 - 1" in first["counts past int64"] and "rank(s) [0] rejected" in second["counts past int64"]
    assert "params has 1 entry" in second["params of one rank"]
    assert "rank(s) [1] rejected" in first["params of one rank"]
    assert "outputs must be True or False (outputs: 'yes')" in second["outputs of one rank"]
    assert "rank(s) [1] rejected" in first["outputs of one rank"]
    local, _ = _local(OneFOneB(20), 2, mixed_batch(3, size=20))
    for m in (first, second):
        assert "different programs" in m["mismatched schedules"]
        assert "microbatches by rank: [8, 4]" in m["microbatch counts"]
        assert "weight_fn by rank: [True, False]" in m["weight_fn on one rank"]
        assert "microbatches by rank: [20, 24]" in m["counts past the inline sizes"]
        assert_bitwise(m["20 microbatches"], local)
        assert "3 stages cannot be laid out on 2 ranks" in m["stages do not fit"]
        assert m["after"] > 0
    text, rank, action, cause = second["stage raised"]
    assert "forward of stage 1 on microbatch 2 (1F2) failed on rank 1" in text and "boom" in cause
    text, rank, action, cause = first["stage raised"]
    assert "rank 0 stopped because rank 1 failed in forward of stage 1 on microbatch 2 (1F2)" in text
    assert (rank, action, cause) == (1, "1F2", "None")
    for m in (first, second):
        assert "an earlier step failed on this process group" in m["after a failure"]


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        return h.clone()

    @staticmethod
    def backward(ctx, g):
        raise ValueError("boom in backward")


def _backward_fails(rank, world):
    """Stage 1 (rank 1 of 3) raises in its first backward, after it has sent every activation to
    rank 2: rank 2 expects no more messages from it, yet must fail too, naming it."""
    stages, params = mixed_model(3)
    stages[1] = lambda p, x: {**mixed_block(p, x), "z": _FailingBackward.apply(mixed_block(p, x)["z"])}
    step = fpipe.pipeline(
        mixed_loss,
        stages,
        GPipe(2),
        batch_dims=MIXED_BATCH_DIMS,
        parallel=fpipe.Parallelism(group=dist.group.WORLD, timeout=10),
    )
    mine = [p if s in step.local_stages else None for s, p in enumerate(params)]
    # A failed step leaves its group broken (``mark_broken``; a send to the failed rank may still
    # be waited for by the step's sends thread): the ranks meet on a group of their own instead.
    others = dist.new_group(backend="gloo")
    with pytest.raises(fpipe.PipelineError) as info:
        step(mine, mixed_batch(3) if rank == 0 else None)
    dist.barrier(group=others)  # every rank stays alive (a lost connection would tell rank 2 something is wrong)
    return str(info.value), info.value.rank, str(info.value.action)


def test_a_failure_reaches_ranks_that_expect_no_message_from_the_failing_rank():
    results = run_ranks(3, _backward_fails)
    for rank, (text, failing, action) in enumerate(results):
        assert (failing, action) == (1, "1B0"), (rank, text)
        if rank != 1:  # (told at once, or while waiting at the step's end: either way naming rank 1's action)
            assert f"rank {rank} stopped " in text, (rank, text)
            assert "because rank 1 failed in backward of stage 1 on microbatch 0 (1B0)" in text, (rank, text)


def _weight_grad_fails(rank, world):
    """ZB-V: stage 0 (rank 0, which also holds the last stage) raises in its first weight-grad
    backward; rank 1 learns of it from an error meta and forwards it to rank 0, which is no longer
    reading."""
    stages, params = mixed_model(4)
    stages[0] = lambda p, mb: mixed_first({**p, "w": _FailingBackward.apply(p["w"])}, mb)
    step = fpipe.pipeline(
        mixed_loss,
        stages,
        ZeroBubbleV(4),
        batch_dims=MIXED_BATCH_DIMS,
        parallel=fpipe.Parallelism(group=dist.group.WORLD, timeout=30),
    )
    mine = [p if s in step.local_stages else None for s, p in enumerate(params)]
    start = time.monotonic()
    with pytest.raises(fpipe.PipelineError) as info:
        step(mine, mixed_batch(3, size=8) if rank == 0 else None)
    elapsed = time.monotonic() - start
    dist.barrier()
    return info.value.rank, str(info.value.action), elapsed


def test_a_failure_fails_every_rank_at_once():
    """No rank waits for a send to a rank that has stopped reading (the failed one)."""
    for failing, action, elapsed in run_ranks(2, _weight_grad_fails):
        assert (failing, action) == (0, "0W0")
        assert elapsed < 15, elapsed  # not the 30 s timeout, with room for a loaded machine


def _dies(rank, world):
    _, params = mixed_model(2)

    def dying(p, x):
        if rank == 1:
            os._exit(3)
        return mixed_block(p, x)

    step = fpipe.pipeline(
        mixed_loss,
        [mixed_first, dying],
        GPipe(2),
        batch_dims=MIXED_BATCH_DIMS,
        parallel=fpipe.Parallelism(group=dist.group.WORLD, timeout=15),
    )
    mine = [p if s in step.local_stages else None for s, p in enumerate(params)]
    with pytest.raises(fpipe.PipelineError) as info:
        step(mine, mixed_batch(3) if rank == 0 else None)
    return str(info.value)


def test_a_dead_rank_fails_the_others():
    message, _ = run_ranks(2, _dies, may_die=frozenset({1}), timeout=60)
    assert "rank 0 stopped while waiting for" in message and "because rank 1 died" in message


def _replicas(rank, world):
    """On a 2 x 2 mesh: one replica rejects its batch, then both go on; float32 params' loss."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica = mesh.get_coordinate()[0]
    stages, params = mixed_model(2)
    step = fpipe.pipeline(
        mixed_loss, stages, OneFOneB(4), batch_dims=MIXED_BATCH_DIMS, parallel=fpipe.Parallelism(mesh=mesh, timeout=20)
    )
    mine = [p if s in step.local_stages else None for s, p in enumerate(params)]
    outcomes = []
    for call in range(2):  # replica 1's first batch is too small for 4 microbatches
        batch = mixed_batch(5, seed=call, size=2 if (replica, call) == (1, 0) else 8)
        try:
            loss, grads = step(mine, batch if step.rank == 0 else None)
            outcomes.append(("ok", loss, grads))
        except ValueError as error:
            outcomes.append(("ValueError", str(error), None))
    low = [{k: v.to(torch.float32) for k, v in p.items()} if p is not None else None for p in mine]
    loss, _ = step(low, _float32_batch(10 + replica) if step.rank == 0 else None)
    # replicas built with different microbatch counts: each pipeline agrees within itself
    other = fpipe.pipeline(
        mixed_loss,
        stages,
        OneFOneB(4 - 2 * replica),
        batch_dims=MIXED_BATCH_DIMS,
        parallel=fpipe.Parallelism(mesh=mesh, timeout=20),
    )
    with pytest.raises(fpipe.schedules.ScheduleError) as info:
        other(mine, mixed_batch(5, size=8) if other.rank == 0 else None)
    return replica, step.local_stages, outcomes, loss, str(info.value)


def _float32_batch(seed):
    """float32 activations (complex64 RoPE) against float64 targets: a float64 loss."""
    batch = mixed_batch(5, seed=seed)
    return {**batch, "freqs": batch["freqs"].to(torch.complex64)}


def test_replicas_fail_together_and_keep_the_loss_precision():
    """A replica that rejects its inputs fails the others (never averaging two different steps);
    the replica-averaged loss keeps its own precision (float64 here) when the grads are float32;
    replicas built with different programs all raise a ScheduleError."""
    results = run_ranks(4, _replicas)
    stages, params = mixed_model(2)
    local = fpipe.pipeline(mixed_loss, stages, OneFOneB(4), batch_dims=MIXED_BATCH_DIMS)
    expected_loss, expected_grads = local(params, mixed_batch(5, seed=1, size=8))
    low = [{k: v.to(torch.float32) for k, v in p.items()} for p in params]
    low_losses = [local(low, _float32_batch(10 + r))[0] for r in range(2)]
    for replica, local_stages, outcomes, low_loss, mismatch in results:
        assert "the data-parallel replicas run different programs" in mismatch
        kind, message, _ = outcomes[0]
        assert kind == "ValueError", outcomes[0]
        if replica == 0:
            assert "another data-parallel replica rejected its inputs" in message
        kind, loss, grads = outcomes[1]
        assert kind == "ok"
        assert_bitwise(loss, expected_loss)
        for s in local_stages:
            assert_bitwise(grads[s], expected_grads[s], f"stage {s}")
        assert low_loss.dtype == low_losses[0].dtype == torch.float64
        torch.testing.assert_close(low_loss, (low_losses[0] + low_losses[1]) / 2, rtol=1e-15, atol=0)

"""Tensor-parallel stages (DTensor) on a pipeline x tensor (and data) mesh equal the unsplit model.

A Llama-style block (RMSNorm, causal attention with its heads split column-wise and its output
projection row-wise, a SwiGLU MLP split the same way) is written once over tensors: with plain
weights it is the single-process float64 reference; with DTensor weights on the mesh's ``"tp"``
sub-mesh each tensor-parallel rank computes its heads and hidden units, and the row-wise
products are summed by DTensor (``Partial`` -> ``Replicate``). The sums over heads and hidden
units are split in two, so results equal the reference to float64 rounding, not bitwise; across
schedules on the same mesh, fused or split backward, they are bitwise equal (fixed accumulation
order, one all-reduce of a replicated weight's partial gradients per step).
"""

from __future__ import annotations

import optree
import pytest
import torch
import torch.nn.functional as F

import fpipe
from fpipe.schedules import GPipe, OneFOneB, ZeroBubbleH1, ZeroBubbleV
from tests._multiprocess import run_ranks

pytestmark = pytest.mark.timeout(240)

DIM, HEAD_DIM, HIDDEN, VOCAB = 8, 2, 16, 13  # 4 heads
TP = ("wq", "wk", "wv", "wo", "w1", "w3", "w2", "n1", "n2")  # the DTensor weights of a block


def _dtensor_api():
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    return DTensor, Partial, Replicate, Shard


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _column_input(h):
    """``h`` for a column-parallel product: a replicated DTensor's local copy, whose gradient is a
    partial sum (each rank's heads contribute their part)."""
    DTensor, Partial, _, _ = _dtensor_api()
    return h.to_local(grad_placements=[Partial()]) if isinstance(h, DTensor) else h


def _row_output(y, like):
    """The sum over tensor-parallel ranks of a row-parallel product ``y`` (as a ``Partial`` DTensor)."""
    DTensor, Partial, _, _ = _dtensor_api()
    return DTensor.from_local(y, like.device_mesh, [Partial()]) if isinstance(like, DTensor) else y


def _local(w):
    DTensor, _, _, _ = _dtensor_api()
    return w.to_local() if isinstance(w, DTensor) else w


def _replicated(x):
    DTensor, _, Replicate, _ = _dtensor_api()
    return x.redistribute(x.device_mesh, [Replicate()]) if isinstance(x, DTensor) else x


def _block(p, x):
    """One decoder block; ``x`` replicated. Returns the residual stream and the MLP's output,
    the latter still a partial sum when tensor-parallel (it travels so, and is summed by the next
    stage)."""
    b, t, _ = x.shape
    h = _column_input(_rms(x, p["n1"]))
    wq, wk, wv = _local(p["wq"]), _local(p["wk"]), _local(p["wv"])
    heads = wq.shape[0] // HEAD_DIM  # this rank's heads
    q, k, v = (F.linear(h, w).view(b, t, heads, HEAD_DIM).transpose(1, 2) for w in (wq, wk, wv))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
    x = x + _replicated(_row_output(F.linear(a, _local(p["wo"])), p["wo"]))
    h = _column_input(_rms(x, p["n2"]))
    mlp = F.linear(F.silu(F.linear(h, _local(p["w1"]))) * F.linear(h, _local(p["w3"])), _local(p["w2"]))
    return {"x": x, "mlp": _row_output(mlp, p["w2"])}


def _first(p, mb):
    x = F.embedding(mb["tokens"], p["embed"])
    DTensor, _, Replicate, _ = _dtensor_api()
    if isinstance(p["wq"], DTensor):
        x = DTensor.from_local(x, p["wq"].device_mesh, [Replicate()])
    return _block(p, x)


def _middle(p, y):
    return _block(p, _replicated(y["x"] + y["mlp"]))


def _last(p, y):
    y = _block(p, _replicated(y["x"] + y["mlp"]))
    x = _local(_replicated(y["x"] + y["mlp"]))
    return F.linear(_rms(x, p["norm"]), p["head"])


def _loss(logits, mb):
    return F.cross_entropy(logits.reshape(-1, VOCAB), mb["targets"].reshape(-1))


def _stages(num_stages):
    return [_first, *[_middle] * (num_stages - 2), _last]


def _params(num_stages, seed=0):
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=0.3):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    params = []
    for s in range(num_stages):
        p = {n: w(DIM, DIM) for n in ("wq", "wk", "wv", "wo")}
        p.update(w1=w(HIDDEN, DIM), w3=w(HIDDEN, DIM), w2=w(DIM, HIDDEN), n1=1 + w(DIM), n2=1 + w(DIM))
        if s == 0:
            p["embed"] = w(VOCAB, DIM, scale=1.0)
        if s == num_stages - 1:
            p.update(norm=1 + w(DIM), head=w(VOCAB, DIM))
        params.append(p)
    return params


def _batch(seed, size=6, length=5):
    g = torch.Generator().manual_seed(seed)
    return {
        "tokens": torch.randint(VOCAB, (size, length), generator=g),
        "targets": torch.randint(VOCAB, (size, length), generator=g),
    }


def _reference(num_stages, batch, params=None):
    stages = _stages(num_stages)

    def full_loss(params):
        y = batch
        for stage, p in zip(stages, params, strict=True):
            y = stage(p, y)
        return _loss(y, batch)

    grads, loss = torch.func.grad_and_value(full_loss)(_params(num_stages) if params is None else params)
    return loss, grads


def _distribute(params, tensor_mesh):
    """Column-wise (``Shard(0)``) q, k, v, w1, w3; row-wise (``Shard(1)``) wo, w2; replicated norms."""
    _, _, Replicate, Shard = _dtensor_api()
    from torch.distributed.tensor import distribute_tensor

    placement = {"wo": Shard(1), "w2": Shard(1), "n1": Replicate(), "n2": Replicate()}
    return {
        k: distribute_tensor(v, tensor_mesh, [placement.get(k, Shard(0))]) if k in TP else v for k, v in params.items()
    }


def _full(tree):
    DTensor, _, _, _ = _dtensor_api()
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v, type(v).__name__, str(getattr(v, "placements", "")))
        for k, v in tree.items()
    }


def _train(rank, world, dims, shape, schedules, num_stages, precision=None):
    """Steps on a ``dims`` mesh, one per schedule; per schedule the loss, full grads and norm.
    With a ``precision`` policy the parameters are float32 master weights."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
    replica = mesh.get_coordinate()[dims.index("dp")] if "dp" in dims else 0
    out = []
    for schedule in schedules:
        step = fpipe.pipeline(_loss, _stages(num_stages), schedule, mesh=mesh, timeout=60, precision=precision)
        full_params = _params(num_stages) if precision is None else _float32(_params(num_stages))
        params = [_distribute(p, mesh["tp"]) if s in step.local_stages else None for s, p in enumerate(full_params)]
        loss, grads = step(params, _batch(10 + replica) if step.rank == 0 else None)
        for s in step.local_stages:  # the grads' placements and dtypes are their params'
            for k, g in grads[s].items():
                assert type(g) is type(params[s][k]), (s, k)
                assert getattr(g, "placements", None) == getattr(params[s][k], "placements", None), (s, k)
                assert g.dtype == params[s][k].dtype, (s, k, g.dtype)
        full = [_full(grads[s]) if s in step.local_stages else None for s in range(num_stages)]
        out.append((step.local_stages, loss, full, step.global_norm(grads)))
    return out


def _check(results, num_stages, replicas=1):
    """Each rank's results (one per schedule) against the float64 reference, averaged over
    ``replicas``, and bitwise equal across schedules (split backward or fused)."""
    refs = [_reference(num_stages, _batch(10 + r)) for r in range(replicas)]
    loss = sum(r[0] for r in refs) / replicas
    grads = [{k: sum(r[1][s][k] for r in refs) / replicas for k in refs[0][1][s]} for s in range(num_stages)]
    norm = torch.cat([g.reshape(-1) for tree in grads for g in tree.values()]).norm()
    first = {}  # (stage, name) -> the gradient of the first schedule, from the rank that held it
    for local_stages, _, d_grads, _ in (per_rank[0] for per_rank in results):
        first.update({(s, k): g for s in local_stages for k, (g, _, _) in d_grads[s].items()})
    for per_rank in results:
        for j, (local_stages, d_loss, d_grads, d_norm) in enumerate(per_rank):
            torch.testing.assert_close(d_loss, loss, rtol=1e-13, atol=0)
            torch.testing.assert_close(d_norm, norm, rtol=1e-13, atol=0)
            for s in local_stages:
                assert d_grads[s].keys() == grads[s].keys()
                for k, (g, kind, placements) in d_grads[s].items():
                    assert kind == ("DTensor" if k in TP else "Tensor"), (s, k, kind)
                    torch.testing.assert_close(g, grads[s][k], rtol=1e-12, atol=1e-14)
                    assert torch.equal(g, first[s, k]), (j, s, k, placements)  # bitwise across schedules
            assert torch.equal(d_loss, results[0][0][1])


# bfloat16 compute, float32 master weights and sums (notes/precision.md)
MIXED = fpipe.Precision(compute=torch.bfloat16, accumulate=torch.float32)
# Relative errors against float64, from the bfloat16 forward and backward of each microbatch; measured
# (1F1B, 3 microbatches): loss 4.1e-4, all grads 1.9e-2 (one process under MIXED: 4.1e-4, 1.6e-2).
MIXED_LOSS_RTOL, MIXED_GRADS_RTOL = 1e-2, 5e-2


def _float32(params):
    return [{k: v.float() for k, v in p.items()} for p in params]


def _plain_and_mixed(rank, world, dims, shape, schedules, num_stages):
    """``_train`` in float64, then the first two schedules again under ``MIXED``."""
    return _train(rank, world, dims, shape, schedules, num_stages), _train(
        rank, world, dims, shape, schedules[:2], num_stages, precision=MIXED
    )


def _check_mixed(results, num_stages, compute=torch.bfloat16, rtols=(MIXED_LOSS_RTOL, MIXED_GRADS_RTOL)):
    """``compute`` (bfloat16) on float32 master weights: bitwise equal across schedules, float32
    grads, and the float64 reference to ``compute`` rounding (relative error of the loss and of
    all grads, within ``rtols``)."""
    loss, grads = _reference(num_stages, _batch(10))
    first = {
        (s, k): g
        for local_stages, _, d_grads, _ in (r[0] for r in results)
        for s in local_stages
        for k, (g, _, _) in d_grads[s].items()
    }
    assert len(first) == sum(len(tree) for tree in grads)
    for per_rank in results:
        for local_stages, d_loss, d_grads, _ in per_rank:
            assert d_loss.dtype == compute
            assert torch.equal(d_loss, results[0][0][1])  # bitwise across schedules and ranks
            for s in local_stages:
                for k, (g, kind, _) in d_grads[s].items():
                    assert kind == ("DTensor" if k in TP else "Tensor") and g.dtype == torch.float32, (s, k, kind)
                    assert torch.equal(g, first[s, k]), (s, k)
    loss_rtol, grads_rtol = rtols
    assert abs(float(results[0][0][1]) - float(loss)) <= loss_rtol * float(loss)
    d_all = torch.cat([first[s, k].double().reshape(-1) for s in range(num_stages) for k in grads[s]])
    ref_all = torch.cat([grads[s][k].reshape(-1) for s in range(num_stages) for k in grads[s]])
    assert (d_all - ref_all).norm() <= grads_rtol * ref_all.norm(), float((d_all - ref_all).norm() / ref_all.norm())


def test_pipeline_times_tensor_parallel_equals_the_unsplit_model():
    """pp 2 x tp 2 (mesh declared tp-first); GPipe, 1F1B and ZB-H1 (split backward), 2 stages; then
    GPipe and 1F1B with bfloat16 compute on float32 master weights, float32 sums (``MIXED``)."""
    schedules = [GPipe(3), OneFOneB(3), ZeroBubbleH1(3)]
    results = run_ranks(4, _plain_and_mixed, ("tp", "pp"), (2, 2), schedules, 2, timeout=180)
    _check([r[0] for r in results], 2)
    _check_mixed([r[1] for r in results], 2)


# float16 compute with dynamic loss scaling on float32 master weights (notes/precision.md): the scale
# grows after 2 good steps and halves after a skipped one
SCALING = fpipe.LossScale(init=2.0**10, interval=2)
SCALED = fpipe.Precision(compute=torch.float16, loss_scale=SCALING)
# Relative errors against float64, from the float16 forward and backward of each microbatch; measured
# (GPipe and 1F1B, 3 microbatches): loss 4.1e-4, all grads 2.2e-3.
SCALED_LOSS_RTOL, SCALED_GRADS_RTOL = 2e-3, 1e-2
OVERFLOW_STEP = 2  # of steps 0 to 3, the one whose gradient overflows on one tensor-parallel rank


def _infinite_grad(w, first_only=False):
    """``w`` (a DTensor), whose gradient's local piece on this rank is ``inf`` (the other ranks'
    pieces are untouched: nothing sums a sharded weight's gradient over tensor-parallel ranks);
    with ``first_only``, only the piece's first element (in one data-parallel shard of it)."""
    DTensor, _, _, _ = _dtensor_api()

    def infinite(g):
        if not first_only:
            return torch.full_like(g, torch.inf)
        g = g.clone()
        g.view(-1)[0] = torch.inf
        return g

    local = w.to_local()
    local.register_hook(infinite)
    return DTensor.from_local(local, w.device_mesh, w.placements)


def _loss_scaled(rank, world, schedules):
    """pp 2 x tp 2 under ``SCALED``: 4 steps per schedule, the third with an ``inf`` in the gradient
    of stage 0's ``w1`` on tp rank 1 only (global rank 2); per schedule and step the loss, full grads,
    ``step.loss_scale``, ``step.last_skipped`` and whether this rank's local pieces were finite."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "pp"))
    overflow = [False]

    def first(p, mb):
        if overflow[0] and mesh.get_local_rank("tp") == 1:
            p = {**p, "w1": _infinite_grad(p["w1"])}
        return _first(p, mb)

    out = []
    for schedule in schedules:
        step = fpipe.pipeline(_loss, [first, _last], schedule, mesh=mesh, timeout=60, precision=SCALED)
        params = [
            _distribute(p, mesh["tp"]) if s in step.local_stages else None for s, p in enumerate(_float32(_params(2)))
        ]
        steps = []
        for i in range(4):
            overflow[0] = i == OVERFLOW_STEP
            loss, grads = step(params, _batch(10) if step.rank == 0 else None)
            full = [_full(grads[s]) if s in step.local_stages else None for s in range(2)]
            finite = all(bool(torch.isfinite(_local(g)).all()) for s in step.local_stages for g in grads[s].values())
            steps.append((step.local_stages, loss, full, step.loss_scale, step.last_skipped, finite))
        out.append(steps)
    return out


def test_float16_loss_scaling_with_tensor_parallel():
    """pp 2 x tp 2, GPipe and 1F1B under ``SCALED``: the float16 step equals the reference to float16
    rounding, bitwise across schedules and tp ranks; the scale moves alike on every rank, and an
    ``inf`` in one tensor-parallel rank's piece of a gradient makes all 4 ranks skip the step."""
    results = run_ranks(4, _loss_scaled, [GPipe(3), OneFOneB(3)], timeout=120)
    first_steps = [[(*steps[0][:3], None) for steps in r] for r in results]
    _check_mixed(first_steps, 2, torch.float16, (SCALED_LOSS_RTOL, SCALED_GRADS_RTOL))
    S = SCALING.init
    states = [(S, 1), (2 * S, 0), (S, 0), (S, 1)]  # after each step; the third is skipped
    for rank, r in enumerate(results):
        for steps in r:
            assert [(st.scale, st.good_steps) for _, _, _, st, _, _ in steps] == states, rank
            assert [skipped for *_, skipped, _ in steps] == [i == OVERFLOW_STEP for i in range(4)], rank
            # only global rank 2 (tp 1, pp 0) saw an inf in its own pieces
            assert [finite for *_, finite in steps] == [i != OVERFLOW_STEP or rank != 2 for i in range(4)], rank
            _, loss0, grads0, _, _, _ = steps[0]
            for i, (local_stages, loss, grads, _, _, _) in enumerate(steps):
                assert torch.equal(loss, loss0), (rank, i)  # the loss is never scaled
                finite = [all(torch.isfinite(g).all() for g, _, _ in grads[s].values()) for s in local_stages]
                if i == OVERFLOW_STEP:  # stage 0's full w1: inf in tp rank 1's half
                    assert finite == [s != 0 for s in local_stages], (rank, i)
                else:  # the same grads at scale 2**10 or 2**11 (a power of two, no underflow)
                    assert all(
                        torch.equal(g, grads0[s][k][0]) for s in local_stages for k, (g, _, _) in grads[s].items()
                    ), (rank, i)


def test_two_stages_per_rank_with_tensor_parallel():
    """pp 2 x tp 2, 4 stages: looped (interleaved 1F1B) and in a V (ZB-V, split backward)."""
    results = run_ranks(4, _train, ("pp", "tp"), (2, 2), [OneFOneB(4), ZeroBubbleV(4)], 4, timeout=180)
    _check(results, 4)


# -- shard_params=True: each rank's DTensor params sharded over its dp group by their local pieces --

MAX_NORM, LR = 0.5, 1e-2  # the norm is about 1.5: clipping scales


def _same(a, b):
    """Bitwise equal pytrees, DTensors compared by type, placements and local piece."""
    leaves_a, leaves_b = optree.tree_leaves(a, none_is_leaf=True), optree.tree_leaves(b, none_is_leaf=True)
    return len(leaves_a) == len(leaves_b) and all(
        type(x) is type(y)
        and (x is None or torch.equal(_local(x), _local(y)))
        and getattr(x, "placements", None) == getattr(y, "placements", None)
        for x, y in zip(leaves_a, leaves_b)
    )


def _sharded(rank, world, dims, shape, schedule, num_stages):
    """The same step with ``shard_params=True`` (and ``regather=True``) next to the replicated one on a
    mesh with dp, pp and tp; then a clipped AdamW update of the shards and a second step."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
    replica = mesh.get_coordinate()[dims.index("dp")]
    plain, sharded = (
        fpipe.pipeline(_loss, _stages(num_stages), schedule, mesh=mesh, timeout=60, **options)
        for options in ({}, {"shard_params": True})
    )
    # regather=True: inside a stage, the other stages' gathered local pieces are freed
    seen, freed = {}, []

    def watching(s, stage):
        def run(p, x):
            freed.extend(all(t.untyped_storage().size() == 0 for t in ts) for other, ts in seen.items() if other != s)
            seen[s] = [_local(t) for t in p.values()]
            return stage(p, x)

        return run

    stages = [watching(s, f) for s, f in enumerate(_stages(num_stages))]
    regathered = fpipe.pipeline(_loss, stages, schedule, mesh=mesh, timeout=60, shard_params=True, regather=True)
    held = plain.local_stages
    params = [_distribute(p, mesh["tp"]) if s in held else None for s, p in enumerate(_params(num_stages))]
    shards, r_shards = sharded.shard(params), regathered.shard(params)
    batch = _batch(10 + replica) if plain.rank == 0 else None
    loss, grads = sharded(shards, batch)
    p_loss, p_grads = plain(params, batch)
    r_loss, r_grads = regathered(r_shards, batch)
    gathered = sharded.unshard(grads)
    checks = {
        "shards are plain 1-D tensors": all(
            type(x) is torch.Tensor and x.dim() == 1 for s in held for x in [*shards[s].values(), *grads[s].values()]
        ),
        "loss bitwise": torch.equal(loss, p_loss) and torch.equal(r_loss, loss),
        # dp 2: each element is g_0 + g_1 in the reduce-scatter and in the all-reduce alike
        "grads: the shards of the replicated run's, bitwise": all(
            _same(grads[s], fpipe.shard(p_grads[s], mesh)) for s in held
        ),
        "regather bitwise": _same(r_grads, grads),
        "unshard: the replicated run's grads, DTensors with their placements, bitwise": all(
            _same(gathered[s], p_grads[s]) for s in held
        ),
        "fpipe.gather(step.shard(params)) == params": all(
            _same(fpipe.gather(shards[s], params[s], sharded), params[s]) for s in held
        ),
        "evaluate bitwise": torch.equal(sharded.evaluate(shards, batch), plain.evaluate(params, batch)),
        "regather frees the other stages' pieces": all(freed) and (len(freed) > 0 or len(held) == 1),
        **_uneven(mesh),
        **_sharded_mixed(mesh, schedule, num_stages, batch),
    }
    norm, p_norm = sharded.global_norm(grads), plain.global_norm(p_grads)
    opt = fpipe.optim.adamw(LR)
    state = opt.init(shards)
    clipped = fpipe.optim.clip_by_global_norm(grads, norm, max_norm=MAX_NORM)
    shards, state = opt.update(shards, clipped, state)
    loss2 = sharded(shards, batch)[0]
    updated = sharded.unshard(shards)
    return {
        "checks": checks,
        "local_stages": held,
        "loss": loss,
        "norm": norm,
        "plain_norm": p_norm,
        "grads": [_full(gathered[s]) if s in held else None for s in range(num_stages)],
        "updated": [_full(updated[s]) if s in held else None for s in range(num_stages)],
        "loss2": loss2,
    }


def _sharded_mixed(mesh, schedule, num_stages, batch):
    """Under ``MIXED`` (float32 master weights): ``shard_params=True`` gives float32 shards of the
    replicated run's grads, bitwise, and ``unshard`` float32 DTensors with the params' placements."""
    plain, sharded = (
        fpipe.pipeline(_loss, _stages(num_stages), schedule, mesh=mesh, timeout=60, precision=MIXED, **options)
        for options in ({}, {"shard_params": True})
    )
    held = plain.local_stages
    params = [_distribute(p, mesh["tp"]) if s in held else None for s, p in enumerate(_float32(_params(num_stages)))]
    loss, grads = sharded(sharded.shard(params), batch)
    p_loss, p_grads = plain(params, batch)
    return {
        "mixed: loss bitwise": loss.dtype == torch.bfloat16 and torch.equal(loss, p_loss),
        "mixed: float32 grads": all(
            g.dtype == torch.float32 for s in held for g in [*grads[s].values(), *p_grads[s].values()]
        ),
        "mixed: grads the shards of the replicated run's, bitwise": all(
            _same(grads[s], fpipe.shard(p_grads[s], mesh)) for s in held
        ),
        "mixed: unshard the replicated run's grads, bitwise": all(
            _same(sharded.unshard(grads)[s], p_grads[s]) for s in held
        ),
    }


def _uneven(mesh):
    """A DTensor of 5 x 3 split by rows over tp 2 (local pieces of 9 and 6 elements), cut over
    dp 2 by fpipe.shard and gathered back by fpipe.gather."""
    _, _, _, Shard = _dtensor_api()
    from torch.distributed.tensor import distribute_tensor

    tree = {"w": distribute_tensor(torch.arange(15.0, dtype=torch.float64).view(5, 3), mesh["tp"], [Shard(0)])}
    shards = fpipe.shard(tree, mesh)
    tp = mesh.get_local_rank("tp")
    return {
        "uneven: shard sizes by tp rank": tuple(shards["w"].shape) == ((5,), (3,))[tp],
        "uneven: gather(shard) == tree": _same(fpipe.gather(shards, tree, mesh), tree),
    }


def _check_sharded(results, num_stages, replicas):
    """Against the float64 reference averaged over ``replicas``, clipped AdamW by torch.optim."""
    batches = [_batch(10 + r) for r in range(replicas)]
    refs = [_reference(num_stages, b) for b in batches]
    loss = sum(r[0] for r in refs) / replicas
    grads = [{k: sum(r[1][s][k] for r in refs) / replicas for k in refs[0][1][s]} for s in range(num_stages)]
    norm = torch.cat([g.reshape(-1) for tree in grads for g in tree.values()]).norm()
    params = _params(num_stages)
    flat = [p for tree in params for p in tree.values()]
    for p, g in zip(flat, [g for tree in grads for g in tree.values()]):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(flat, MAX_NORM)
    torch.optim.AdamW(flat, lr=LR).step()
    updated = [{k: p.detach() for k, p in tree.items()} for tree in params]
    loss2 = sum(_reference(num_stages, b, updated)[0] for b in batches) / replicas
    for rank, r in enumerate(results):
        assert all(r["checks"].values()), (rank, [name for name, ok in r["checks"].items() if not ok])
        torch.testing.assert_close(r["loss"], loss, rtol=1e-13, atol=0)
        torch.testing.assert_close(r["norm"], norm, rtol=1e-13, atol=0)
        torch.testing.assert_close(r["norm"], r["plain_norm"], rtol=1e-14, atol=0)  # summed in another order
        torch.testing.assert_close(r["loss2"], loss2, rtol=1e-12, atol=0)
        for s in r["local_stages"]:
            for k, (g, kind, _) in r["grads"][s].items():
                assert kind == ("DTensor" if k in TP else "Tensor"), (s, k, kind)
                torch.testing.assert_close(g, grads[s][k], rtol=1e-12, atol=1e-14)
                p, p_kind, _ = r["updated"][s][k]
                assert p_kind == kind
                torch.testing.assert_close(p, updated[s][k], rtol=1e-12, atol=1e-14)


def test_sharded_data_parallel_times_tensor_parallel():
    """dp 2 x pp 1 x tp 2 (both stages on the one pipeline rank, interleaved): shard_params=True
    gives the shards of the replicated run's grads bitwise, and the reference to rounding."""
    results = run_ranks(4, _sharded, ("dp", "pp", "tp"), (2, 1, 2), OneFOneB(3), 2, timeout=180)
    _check_sharded(results, 2, replicas=2)


def _loss_scaled_data_parallel(rank, world):
    """dp 2 x pp 1 x tp 2 under ``SCALED``, replicated then with ``shard_params=True``: 4 steps each,
    the third with an ``inf`` in the first element of the gradient of stage 0's ``w1`` on dp replica 1's
    tp rank 1 only (global rank 3); per mode and step the loss, full grads (``unshard``-ed), ``step.loss_scale``,
    ``step.last_skipped``, whether this rank's own grads (pieces or shards) were finite, and (sharded)
    whether they were the shards of the replicated run's, bitwise."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp", "pp", "tp"))
    replica = mesh.get_local_rank("dp")
    overflow = [False]

    def first(p, mb):
        if overflow[0] and replica == 1 and mesh.get_local_rank("tp") == 1:
            p = {**p, "w1": _infinite_grad(p["w1"], first_only=True)}
        return _first(p, mb)

    params = [_distribute(p, mesh["tp"]) for p in _float32(_params(2))]
    batch = _batch(10 + replica)
    out, plain_grads = {}, []
    for shard_params in (False, True):
        step = fpipe.pipeline(
            _loss, [first, _last], OneFOneB(3), mesh=mesh, timeout=60, precision=SCALED, shard_params=shard_params
        )
        inputs = step.shard(params) if shard_params else params
        steps = []
        for i in range(4):
            overflow[0] = i == OVERFLOW_STEP
            loss, grads = step(inputs, batch)
            finite = all(bool(torch.isfinite(_local(g)).all()) for tree in grads for g in tree.values())
            if shard_params:
                bitwise = _same(grads, [fpipe.shard(tree, mesh) for tree in plain_grads[i]])
                grads = step.unshard(grads)
            else:
                bitwise = None
                plain_grads.append(grads)
            full = [{k: g for k, (g, _, _) in _full(tree).items()} for tree in grads]
            steps.append((loss, full, step.loss_scale, step.last_skipped, finite, bitwise))
        out[shard_params] = steps
    return out


def test_float16_loss_scaling_with_data_parallel_times_tensor_parallel():
    """dp 2 x pp 1 x tp 2 under ``SCALED``, replicated and with ``shard_params=True``: an ``inf`` in one
    replica's one tensor-parallel rank's piece of a gradient makes all 4 ranks skip that step and only
    that one, the scale moves alike on every rank, and the good steps equal the float64 reference
    averaged over the replicas to float16 rounding (sharded: the replicated run's grads' shards)."""
    results = run_ranks(4, _loss_scaled_data_parallel, timeout=120)
    refs = [_reference(2, _batch(10 + r)) for r in range(2)]
    ref_loss = float(refs[0][0] + refs[1][0]) / 2  # the step's loss is the replicas' mean
    ref = torch.cat([((refs[0][1][s][k] + refs[1][1][s][k]) / 2).reshape(-1) for s in range(2) for k in refs[0][1][s]])
    S = SCALING.init
    states = [(S, 1), (2 * S, 0), (S, 0), (S, 1)]  # after each step; the third is skipped
    for rank, r in enumerate(results):  # global rank = 2 * dp + tp
        for shard_params, steps in r.items():
            where = (rank, shard_params)
            assert [(st.scale, st.good_steps) for _, _, st, _, _, _ in steps] == states, where
            assert [skipped for _, _, _, skipped, _, _ in steps] == [i == OVERFLOW_STEP for i in range(4)], where
            # the inf reached the tp-1 ranks of both replicas (summed over dp), never the tp-0 ranks; sharded,
            # only the shard holding the piece's first element (dp 0's): rank 1 alone saw it
            saw = rank == 1 if shard_params else rank % 2 == 1
            assert [finite for *_, finite, _ in steps] == [i != OVERFLOW_STEP or not saw for i in range(4)], where
            if shard_params:
                assert all(bitwise for *_, bitwise in steps), where
            loss0, grads0 = steps[0][:2]
            assert loss0.dtype == torch.float16
            assert abs(float(loss0) - ref_loss) <= SCALED_LOSS_RTOL * ref_loss, where
            d_all = torch.cat([grads0[s][k].double().reshape(-1) for s in range(2) for k in refs[0][1][s]])
            assert all(g.dtype == torch.float32 for tree in grads0 for g in tree.values()), where
            error = float((d_all - ref).norm() / ref.norm())
            assert error <= SCALED_GRADS_RTOL, (where, error)
            for i, (loss, grads, _, _, _, _) in enumerate(steps):
                assert torch.equal(loss, loss0), (where, i)  # the loss is never scaled
                if i == OVERFLOW_STEP:  # stage 0's full w1 (16 x 8): inf at the first element of tp rank 1's half
                    assert (~torch.isfinite(grads[0]["w1"])).nonzero().tolist() == [[HIDDEN // 2, 0]], where
                else:  # the same grads at scale 2**10 or 2**11 (a power of two, no underflow)
                    assert _same(grads, grads0), (where, i)
        for i in range(4):  # the replicated and the sharded runs' full grads, bitwise
            assert _same(r[False][i][1], r[True][i][1]), (rank, i)


def _sharded_bad_inputs(rank, world):
    """On dp 2 x pp 1 x tp 2 with shard_params=True: DTensors on the wrong mesh or on a mesh without
    tp, full DTensor params given to the step on one rank, then a good step, then grads of the
    wrong structure to global_norm; what each rank raised."""
    from torch.distributed.device_mesh import init_device_mesh

    DTensor, _, Replicate, _ = _dtensor_api()
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp", "pp", "tp"))
    step = fpipe.pipeline(_loss, _stages(2), OneFOneB(2), mesh=mesh, shard_params=True, timeout=30)
    params = [_distribute(p, mesh["tp"]) for p in _params(2)]
    messages = {}
    wrong = [dict(p) for p in params]
    wrong[0]["wq"] = DTensor.from_local(wrong[0]["wq"].to_local(), mesh["dp"], [Replicate()])
    for name, call in {
        "shard, wrong mesh": lambda: step.shard(wrong),
        "gather, wrong mesh": lambda: fpipe.gather(fpipe.shard(params[0], mesh), wrong[0], mesh),
        "shard, no tp": lambda: fpipe.shard(params[0], mesh["dp", "pp"]),
    }.items():
        with pytest.raises(ValueError) as info:
            call()
        messages[name] = str(info.value)
    shards = step.shard(params)
    batch = _batch(1) if step.rank == 0 else None
    with pytest.raises(ValueError) as info:
        # on one rank, a full DTensor where its shard belongs
        step([{**shards[0], "wq": params[0]["wq"]}, shards[1]] if rank == 3 else shards, batch)
    messages["full params"] = str(info.value)
    loss, grads = step(shards, batch)  # input errors leave the mesh usable
    messages["after"] = float(loss)
    with pytest.raises(ValueError) as info:
        step.global_norm([{"wq": g["wq"]} for g in grads])
    messages["norm, wrong structure"] = str(info.value)
    unsharded = fpipe.pipeline(_loss, _stages(2), OneFOneB(2), mesh=mesh, shard_params=True, timeout=30)
    with pytest.raises(ValueError) as info:
        unsharded.global_norm(grads)  # no step.shard yet: no layouts to read the placements from
    messages["norm, no layout"] = str(info.value)
    return messages


def test_sharded_tensor_parallel_bad_inputs_fail_on_every_rank():
    results = run_ranks(4, _sharded_bad_inputs, timeout=120)
    for rank, m in enumerate(results):  # global rank = 2 * dp + tp
        tp_ranks = [rank - rank % 2, rank - rank % 2 + 1]
        assert "fpipe.step.shard: params[0]['wq'] is a DTensor on the wrong mesh" in m["shard, wrong mesh"]
        assert f"this rank's tensor-parallel sub-mesh has ranks {tp_ranks}" in m["shard, wrong mesh"]
        assert "fpipe.gather: like['wq'] is a DTensor on the wrong mesh" in m["gather, wrong mesh"]
        assert "fpipe.shard: tree['n1'] is a DTensor but the pipeline's mesh has no tensor-par" in m["shard, no tp"]
        assert "grads[0] has 1 leaf but stage 0's parameters have 10" in m["norm, wrong structure"]
        assert "fpipe.step.global_norm: the step has no layout for stage 0" in m["norm, no layout"]
    full = "params[0]['wq'] should be this rank's shard of the local piece (shape (4, 8)) of a torch.float64 DTensor"
    assert full + " of shape (8, 8), a 1-D torch.float64 tensor of 16 elements" in results[3]["full params"]
    assert "another data-parallel replica rejected its inputs" in results[1]["full params"]
    assert "another tensor-parallel rank rejected its inputs" in results[0]["full params"]
    assert "another tensor-parallel rank rejected its inputs" in results[2]["full params"]
    assert len({r["after"] for r in results}) == 1


def _both(rank, world, dims, shape, schedule, num_stages):
    return _train(rank, world, dims, shape, [schedule], num_stages), _sharded(
        rank, world, dims, shape, schedule, num_stages
    )


@pytest.mark.slow
def test_data_times_pipeline_times_tensor_parallel():
    """dp 2 x pp 2 x tp 2 on 8 processes: equal to the average of the replicas' references,
    replicated and with shard_params=True."""
    results = run_ranks(8, _both, ("dp", "pp", "tp"), (2, 2, 2), OneFOneB(2), 2, timeout=400)
    _check([r[0] for r in results], 2, replicas=2)
    _check_sharded([r[1] for r in results], 2, replicas=2)


def _bad_inputs(rank, world):
    """On pp 2 x tp 2: DTensor params on the wrong mesh on one rank, then a good step, then a
    stage returning DTensors on another sub-mesh; what every rank raised."""
    from torch.distributed.device_mesh import init_device_mesh

    DTensor, _, Replicate, _ = _dtensor_api()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp, tp = mesh.get_coordinate()
    step = fpipe.pipeline(_loss, _stages(2), OneFOneB(2), mesh=mesh, timeout=30)
    params = [_distribute(p, mesh["tp"]) if s == pp else None for s, p in enumerate(_params(2))]
    batch = _batch(1) if pp == 0 else None
    messages = {}
    wrong = [dict(p) if p is not None else None for p in params]
    if (pp, tp) == (1, 1):  # one rank: its tp partner and its pipeline peer must hear of it too
        wrong[1]["wq"] = DTensor.from_local(wrong[1]["wq"].to_local(), mesh["pp"], [Replicate()])
    with pytest.raises(ValueError) as info:
        step(wrong, batch)
    messages["wrong mesh"] = str(info.value)
    messages["after"] = float(step(params, batch)[0])  # input errors leave the mesh usable

    def elsewhere(p, mb):  # returns a DTensor on the pipeline sub-mesh
        y = _first(p, mb)
        return {"x": DTensor.from_local(y["x"].to_local(), mesh["pp"], [Replicate()]), "mlp": y["mlp"]}

    failing = fpipe.pipeline(_loss, [elsewhere, _last], OneFOneB(2), mesh=mesh, timeout=30)
    with pytest.raises(fpipe.PipelineError) as info:
        failing(params, batch)
    messages["output elsewhere"] = (str(info.value), repr(info.value.__cause__))
    return messages


def test_bad_dtensor_inputs_fail_on_every_rank():
    results = run_ranks(4, _bad_inputs, timeout=120)
    wrong = [r["wrong mesh"] for r in results]  # global rank = 2 * pp + tp
    assert "params[1] leaf ['wq'] (stage 1, rank 1) is a DTensor on the wrong mesh" in wrong[3]
    assert "this rank's tensor-parallel sub-mesh has ranks [2, 3]" in wrong[3]
    assert "another tensor-parallel rank rejected its inputs" in wrong[2]
    assert "rank(s) [1] rejected their inputs" in wrong[1]
    assert "another tensor-parallel rank rejected its inputs" in wrong[0]
    assert len({r["after"] for r in results}) == 1
    for rank, r in enumerate(results):
        message, cause = r["output elsewhere"]
        assert "forward of stage 0 on microbatch 0 (0F0)" in message, (rank, message)
        if rank < 2:  # the senders: their own error says which leaf and why
            assert "the leaf ['x'] is a DTensor on the wrong mesh" in cause


def _uneven_heads(rank, world):
    """3 heads on 2 tensor-parallel ranks: the stage cannot split them, on every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp = mesh.get_coordinate()[0]
    step = fpipe.pipeline(_loss, _stages(2), OneFOneB(2), mesh=mesh, timeout=30)
    full = _params(2)
    for p in full:  # 3 heads of HEAD_DIM: 6 rows of q, k, v, 3 on each rank
        p.update({n: p[n][: 3 * HEAD_DIM] for n in ("wq", "wk", "wv")}, wo=p["wo"][:, : 3 * HEAD_DIM])
    params = [_distribute(p, mesh["tp"]) if s == pp else None for s, p in enumerate(full)]
    with pytest.raises(fpipe.PipelineError) as info:
        step(params, _batch(1) if pp == 0 else None)
    return str(info.value), repr(info.value.__cause__)


def test_a_tensor_parallel_size_that_does_not_divide_the_heads_fails_every_rank():
    results = run_ranks(4, _uneven_heads, timeout=120)
    for rank, (message, cause) in enumerate(results):
        assert "forward of stage 0 on microbatch 0 (0F0)" in message, (rank, message)
        if rank < 2:
            assert "is invalid for input of size" in cause, cause


def _one_tp_rank_fails(rank, world):
    """On pp 2 x tp 2, stage 0 raises on tp rank 1 only, while its partner waits in the stage's
    all-reduce: every rank raises, in seconds, not at the process group's timeout."""
    import time

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp, tp = mesh.get_coordinate()

    def first(p, mb):
        if tp == 1:
            raise ValueError("boom on tp rank 1")
        return _first(p, mb)

    step = fpipe.pipeline(_loss, [first, _last], OneFOneB(2), mesh=mesh, timeout=30)
    params = [_distribute(p, mesh["tp"]) if s == pp else None for s, p in enumerate(_params(2))]
    start = time.monotonic()
    with pytest.raises(fpipe.PipelineError) as info:
        step(params, _batch(1) if pp == 0 else None)
    return time.monotonic() - start, str(info.value), repr(info.value.__cause__)


def test_a_failure_on_one_tensor_parallel_rank_fails_its_partners_in_their_collectives():
    results = run_ranks(4, _one_tp_rank_fails, timeout=120)
    for rank, (seconds, message, _) in enumerate(results):
        assert seconds < 15, (rank, seconds)  # not the 30 s timeout, with room for a loaded machine
        assert "forward of stage 0 on microbatch 0 (0F0)" in message, (rank, message)
    assert "boom on tp rank 1" in results[1][2]
    # its partner, in the stage's all-reduce, named by its mesh coordinates (also when rank 1's
    # connection closed before the board aborted that all-reduce); the next pipeline rank, in
    # fpipe's own waits or by the error meta of rank 0 (which of them comes first is a race)
    partner = "rank 0 (pp 0, tp 0) stopped while waiting for a collective inside its stage because rank 1 (pp 0, tp 1)"
    assert partner in results[0][1]
    assert results[2][1].startswith("fpipe: rank 2 (pp 1, tp 0) stopped "), results[2][1]
    assert "because rank 1 (pp 0, tp 1) failed in forward of stage 0" in results[2][1]

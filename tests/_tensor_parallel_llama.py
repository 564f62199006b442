"""A tensor-parallel Llama-style pipeline, its float64 reference and the checks of its runs, shared by
the tests of tensor parallelism (the end-to-end ones: tests/tensor_parallel/test_end_to_end.py; loss
scaling: tests/test_precision.py; ``shard_params=True``: tests/sharding/test_stages.py and
test_public.py; bad inputs and failures on every rank: tests/distributed/test_rank_step.py).

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

import torch
import torch.nn.functional as F

import fpipe
from tests.helpers import assert_bitwise, bitwise_equal

DIM, HEAD_DIM, HIDDEN, VOCAB = 8, 2, 16, 13  # 4 heads
TP = ("wq", "wk", "wv", "wo", "w1", "w3", "w2", "n1", "n2")  # the DTensor weights of a block


def dtensor_api():
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    return DTensor, Partial, Replicate, Shard


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _column_input(h):
    """``h`` for a column-parallel product: a replicated DTensor's local copy, whose gradient is a
    partial sum (each rank's heads contribute their part)."""
    DTensor, Partial, _, _ = dtensor_api()
    return h.to_local(grad_placements=[Partial()]) if isinstance(h, DTensor) else h


def _row_output(y, like):
    """The sum over tensor-parallel ranks of a row-parallel product ``y`` (as a ``Partial`` DTensor)."""
    DTensor, Partial, _, _ = dtensor_api()
    return DTensor.from_local(y, like.device_mesh, [Partial()]) if isinstance(like, DTensor) else y


def local_piece(w):
    DTensor, _, _, _ = dtensor_api()
    return w.to_local() if isinstance(w, DTensor) else w


def _replicated(x):
    DTensor, _, Replicate, _ = dtensor_api()
    return x.redistribute(x.device_mesh, [Replicate()]) if isinstance(x, DTensor) else x


def _block(p, x):
    """One decoder block; ``x`` replicated. Returns the residual stream and the MLP's output,
    the latter still a partial sum when tensor-parallel (it travels so, and is summed by the next
    stage)."""
    b, t, _ = x.shape
    h = _column_input(_rms(x, p["n1"]))
    wq, wk, wv = local_piece(p["wq"]), local_piece(p["wk"]), local_piece(p["wv"])
    heads = wq.shape[0] // HEAD_DIM  # this rank's heads
    q, k, v = (F.linear(h, w).view(b, t, heads, HEAD_DIM).transpose(1, 2) for w in (wq, wk, wv))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
    x = x + _replicated(_row_output(F.linear(a, local_piece(p["wo"])), p["wo"]))
    h = _column_input(_rms(x, p["n2"]))
    mlp = F.linear(F.silu(F.linear(h, local_piece(p["w1"]))) * F.linear(h, local_piece(p["w3"])), local_piece(p["w2"]))
    return {"x": x, "mlp": _row_output(mlp, p["w2"])}


def llama_first(p, mb):
    x = F.embedding(mb["tokens"], p["embed"])
    DTensor, _, Replicate, _ = dtensor_api()
    if isinstance(p["wq"], DTensor):
        x = DTensor.from_local(x, p["wq"].device_mesh, [Replicate()])
    return _block(p, x)


def _middle(p, y):
    return _block(p, _replicated(y["x"] + y["mlp"]))


def llama_last(p, y):
    y = _block(p, _replicated(y["x"] + y["mlp"]))
    x = local_piece(_replicated(y["x"] + y["mlp"]))
    return F.linear(_rms(x, p["norm"]), p["head"])


def llama_loss(logits, mb):
    return F.cross_entropy(logits.reshape(-1, VOCAB), mb["targets"].reshape(-1))


def llama_stages(num_stages):
    return [llama_first, *[_middle] * (num_stages - 2), llama_last]


def llama_params(num_stages, seed=0):
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


def llama_batch(seed, size=6, length=5):
    g = torch.Generator().manual_seed(seed)
    return {
        "tokens": torch.randint(VOCAB, (size, length), generator=g),
        "targets": torch.randint(VOCAB, (size, length), generator=g),
    }


def llama_reference(num_stages, batch, params=None):
    stages = llama_stages(num_stages)

    def full_loss(params):
        y = batch
        for stage, p in zip(stages, params, strict=True):
            y = stage(p, y)
        return llama_loss(y, batch)

    grads, loss = torch.func.grad_and_value(full_loss)(llama_params(num_stages) if params is None else params)
    return loss, grads


def distribute_llama(params, tensor_mesh):
    """Column-wise (``Shard(0)``) q, k, v, w1, w3; row-wise (``Shard(1)``) wo, w2; replicated norms."""
    _, _, Replicate, Shard = dtensor_api()
    from torch.distributed.tensor import distribute_tensor

    placement = {"wo": Shard(1), "w2": Shard(1), "n1": Replicate(), "n2": Replicate()}
    return {
        k: distribute_tensor(v, tensor_mesh, [placement.get(k, Shard(0))]) if k in TP else v for k, v in params.items()
    }


def full_tensors(tree):
    DTensor, _, _, _ = dtensor_api()
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v, type(v).__name__, str(getattr(v, "placements", "")))
        for k, v in tree.items()
    }


def train_ranks(rank, world, dims, shape, schedules, num_stages, precision=None):
    """Steps on a ``dims`` mesh, one per schedule; per schedule the loss, full grads and norm.
    With a ``precision`` policy the parameters are float32 master weights."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
    replica = mesh.get_coordinate()[dims.index("dp")] if "dp" in dims else 0
    out = []
    for schedule in schedules:
        step = fpipe.pipeline(
            llama_loss,
            llama_stages(num_stages),
            schedule,
            parallel=fpipe.Parallelism(mesh=mesh, timeout=60),
            precision=precision,
        )
        full_params = llama_params(num_stages) if precision is None else as_float32(llama_params(num_stages))
        params = [
            distribute_llama(p, mesh["tp"]) if s in step.local_stages else None for s, p in enumerate(full_params)
        ]
        loss, grads = step(params, llama_batch(10 + replica) if step.rank == 0 else None)
        for s in step.local_stages:  # the grads' placements and dtypes are their params'
            for k, g in grads[s].items():
                assert type(g) is type(params[s][k]), (s, k)
                assert getattr(g, "placements", None) == getattr(params[s][k], "placements", None), (s, k)
                assert g.dtype == params[s][k].dtype, (s, k, g.dtype)
        full = [full_tensors(grads[s]) if s in step.local_stages else None for s in range(num_stages)]
        out.append((step.local_stages, loss, full, step.global_norm(grads)))
    return out


def check_trained(results, num_stages, replicas=1):
    """Each rank's results (one per schedule) against the float64 reference, averaged over
    ``replicas``, and bitwise equal across schedules (split backward or fused)."""
    refs = [llama_reference(num_stages, llama_batch(10 + r)) for r in range(replicas)]
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
                    assert_bitwise(g, first[s, k], f"schedule {j}, stage {s}, {k} {placements}")  # across schedules
            assert_bitwise(d_loss, results[0][0][1])


# bfloat16 compute, float32 master weights and sums (notes/precision.md)
MIXED = fpipe.Precision(compute=torch.bfloat16, accumulate=torch.float32)
# Relative errors against float64, from the bfloat16 forward and backward of each microbatch; measured
# (1F1B, 3 microbatches): loss 4.1e-4, all grads 1.9e-2 (one process under MIXED: 4.1e-4, 1.6e-2).
MIXED_LOSS_RTOL, MIXED_GRADS_RTOL = 1e-2, 5e-2


def as_float32(params):
    return [{k: v.float() for k, v in p.items()} for p in params]


def check_mixed(results, num_stages, compute=torch.bfloat16, rtols=(MIXED_LOSS_RTOL, MIXED_GRADS_RTOL)):
    """``compute`` (bfloat16) on float32 master weights: bitwise equal across schedules, float32
    grads, and the float64 reference to ``compute`` rounding (relative error of the loss and of
    all grads, within ``rtols``)."""
    loss, grads = llama_reference(num_stages, llama_batch(10))
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
            assert_bitwise(d_loss, results[0][0][1])  # across schedules and ranks
            for s in local_stages:
                for k, (g, kind, _) in d_grads[s].items():
                    assert kind == ("DTensor" if k in TP else "Tensor") and g.dtype == torch.float32, (s, k, kind)
                    assert_bitwise(g, first[s, k], f"stage {s}, {k}")
    loss_rtol, grads_rtol = rtols
    assert abs(float(results[0][0][1]) - float(loss)) <= loss_rtol * float(loss)
    d_all = torch.cat([first[s, k].double().reshape(-1) for s in range(num_stages) for k in grads[s]])
    ref_all = torch.cat([grads[s][k].reshape(-1) for s in range(num_stages) for k in grads[s]])
    assert (d_all - ref_all).norm() <= grads_rtol * ref_all.norm(), float((d_all - ref_all).norm() / ref_all.norm())


# float16 compute with dynamic loss scaling on float32 master weights (notes/precision.md): the scale
# grows after 2 good steps and halves after a skipped one
SCALING = fpipe.LossScale(init=2.0**10, interval=2)
SCALED = fpipe.Precision(compute=torch.float16, loss_scale=SCALING)
# Relative errors against float64, from the float16 forward and backward of each microbatch; measured
# (GPipe and 1F1B, 3 microbatches): loss 4.1e-4, all grads 2.2e-3.
SCALED_LOSS_RTOL, SCALED_GRADS_RTOL = 2e-3, 1e-2
OVERFLOW_STEP = 2  # of steps 0 to 3, the one whose gradient overflows on one tensor-parallel rank


def infinite_grad(w, first_only=False):
    """``w`` (a DTensor), whose gradient's local piece on this rank is ``inf`` (the other ranks'
    pieces are untouched: nothing sums a sharded weight's gradient over tensor-parallel ranks);
    with ``first_only``, only the piece's first element (in one data-parallel shard of it)."""
    DTensor, _, _, _ = dtensor_api()

    def infinite(g):
        if not first_only:
            return torch.full_like(g, torch.inf)
        g = g.clone()
        g.view(-1)[0] = torch.inf
        return g

    local = w.to_local()
    local.register_hook(infinite)
    return DTensor.from_local(local, w.device_mesh, w.placements)


# -- shard_params=True: each rank's DTensor params sharded over its dp group by their local pieces --

MAX_NORM, LR = 0.5, 1e-2  # the norm is about 1.5: clipping scales


def sharded_ranks(rank, world, dims, shape, schedule, num_stages):
    """The same step with ``shard_params=True`` (and ``regather=True``) next to the replicated one on a
    mesh with dp, pp and tp; then a clipped AdamW update of the shards and a second step."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
    replica = mesh.get_coordinate()[dims.index("dp")]
    plain, sharded = (
        fpipe.pipeline(
            llama_loss, llama_stages(num_stages), schedule, parallel=fpipe.Parallelism(mesh=mesh, timeout=60, **options)
        )
        for options in ({}, {"shard_params": True})
    )
    # regather=True: inside a stage, the other stages' gathered local pieces are freed
    seen, freed = {}, []

    def watching(s, stage):
        def run(p, x):
            freed.extend(all(t.untyped_storage().size() == 0 for t in ts) for other, ts in seen.items() if other != s)
            seen[s] = [local_piece(t) for t in p.values()]
            return stage(p, x)

        return run

    stages = [watching(s, f) for s, f in enumerate(llama_stages(num_stages))]
    regathered = fpipe.pipeline(
        llama_loss,
        stages,
        schedule,
        parallel=fpipe.Parallelism(mesh=mesh, shard_params=True, regather=True, timeout=60),
    )
    held = plain.local_stages
    params = [distribute_llama(p, mesh["tp"]) if s in held else None for s, p in enumerate(llama_params(num_stages))]
    shards, r_shards = sharded.shard(params), regathered.shard(params)
    batch = llama_batch(10 + replica) if plain.rank == 0 else None
    loss, grads = sharded(shards, batch)
    p_loss, p_grads = plain(params, batch)
    r_loss, r_grads = regathered(r_shards, batch)
    gathered = sharded.gather(grads)
    checks = {
        "shards are plain 1-D tensors": all(
            type(x) is torch.Tensor and x.dim() == 1 for s in held for x in [*shards[s].values(), *grads[s].values()]
        ),
        "loss bitwise": bitwise_equal((loss, r_loss), (p_loss, loss)),
        # dp 2: each element is g_0 + g_1 in the reduce-scatter and in the all-reduce alike
        "grads: the shards of the replicated run's, bitwise": all(
            bitwise_equal(grads[s], fpipe.shard(p_grads[s], mesh)) for s in held
        ),
        "regather bitwise": bitwise_equal(r_grads, grads),
        "gather: the replicated run's grads, DTensors with their placements, bitwise": all(
            bitwise_equal(gathered[s], p_grads[s]) for s in held
        ),
        "fpipe.gather(step.shard(params)) == params": all(
            bitwise_equal(fpipe.gather(shards[s], params[s], sharded), params[s]) for s in held
        ),
        "evaluate bitwise": bitwise_equal(sharded.evaluate(shards, batch), plain.evaluate(params, batch)),
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
    updated = sharded.gather(shards)
    return {
        "checks": checks,
        "local_stages": held,
        "loss": loss,
        "norm": norm,
        "plain_norm": p_norm,
        "grads": [full_tensors(gathered[s]) if s in held else None for s in range(num_stages)],
        "updated": [full_tensors(updated[s]) if s in held else None for s in range(num_stages)],
        "loss2": loss2,
    }


def _sharded_mixed(mesh, schedule, num_stages, batch):
    """Under ``MIXED`` (float32 master weights): ``shard_params=True`` gives float32 shards of the
    replicated run's grads, bitwise, and ``step.gather`` float32 DTensors with the params' placements."""
    plain, sharded = (
        fpipe.pipeline(
            llama_loss,
            llama_stages(num_stages),
            schedule,
            parallel=fpipe.Parallelism(mesh=mesh, timeout=60, **options),
            precision=MIXED,
        )
        for options in ({}, {"shard_params": True})
    )
    held = plain.local_stages
    params = [
        distribute_llama(p, mesh["tp"]) if s in held else None
        for s, p in enumerate(as_float32(llama_params(num_stages)))
    ]
    loss, grads = sharded(sharded.shard(params), batch)
    p_loss, p_grads = plain(params, batch)
    return {
        "mixed: loss bitwise": loss.dtype == torch.bfloat16 and bitwise_equal(loss, p_loss),
        "mixed: float32 grads": all(
            g.dtype == torch.float32 for s in held for g in [*grads[s].values(), *p_grads[s].values()]
        ),
        "mixed: grads the shards of the replicated run's, bitwise": all(
            bitwise_equal(grads[s], fpipe.shard(p_grads[s], mesh)) for s in held
        ),
        "mixed: gather the replicated run's grads, bitwise": all(
            bitwise_equal(sharded.gather(grads)[s], p_grads[s]) for s in held
        ),
    }


def _uneven(mesh):
    """A DTensor of 5 x 3 split by rows over tp 2 (local pieces of 9 and 6 elements), cut over
    dp 2 by fpipe.shard and gathered back by fpipe.gather."""
    _, _, _, Shard = dtensor_api()
    from torch.distributed.tensor import distribute_tensor

    tree = {"w": distribute_tensor(torch.arange(15.0, dtype=torch.float64).view(5, 3), mesh["tp"], [Shard(0)])}
    shards = fpipe.shard(tree, mesh)
    tp = mesh.get_local_rank("tp")
    return {
        "uneven: shard sizes by tp rank": tuple(shards["w"].shape) == ((5,), (3,))[tp],
        "uneven: gather(shard) == tree": bitwise_equal(fpipe.gather(shards, tree, mesh), tree),
    }


def check_sharded(results, num_stages, replicas):
    """Against the float64 reference averaged over ``replicas``, clipped AdamW by torch.optim."""
    batches = [llama_batch(10 + r) for r in range(replicas)]
    refs = [llama_reference(num_stages, b) for b in batches]
    loss = sum(r[0] for r in refs) / replicas
    grads = [{k: sum(r[1][s][k] for r in refs) / replicas for k in refs[0][1][s]} for s in range(num_stages)]
    norm = torch.cat([g.reshape(-1) for tree in grads for g in tree.values()]).norm()
    params = llama_params(num_stages)
    flat = [p for tree in params for p in tree.values()]
    for p, g in zip(flat, [g for tree in grads for g in tree.values()]):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(flat, MAX_NORM)
    torch.optim.AdamW(flat, lr=LR).step()
    updated = [{k: p.detach() for k, p in tree.items()} for tree in params]
    loss2 = sum(llama_reference(num_stages, b, updated)[0] for b in batches) / replicas
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

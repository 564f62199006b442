"""Sharded data parallel under the pipeline equals the unsharded run and the per-replica average.

One spawn of 4 gloo ranks runs everything distributed (tests/_multiprocess.py): a 2 x 2 (dp x pp)
mesh with 4 stages (interleaved 1F1B: two stages per rank, so a second stage's all-gather is in
flight while the first one computes), then a 4 x 1 mesh (4 shards), the error cases and a
failing replica. Parameters have leaves that do not divide by the data-parallel size, a scalar
(fewer elements than shards), an empty tensor, a complex, a float32, an int64 and a string leaf.
Another spawn shards the DTensor parameters of tensor-parallel stages (dp 2 x pp 1 x tp 2, the model
of tests/_tensor_parallel_llama.py) by their local pieces.
"""

from __future__ import annotations

from datetime import timedelta

import optree
import pytest
import torch
import torch.distributed as dist

import fpipe
from fpipe._run import segments
from fpipe._sharding._layout import LeafLayout, StageLayout, cut, layout_of
from fpipe.schedules import Interleaved1F1B, OneFOneB
from tests._multiprocess import run_ranks
from tests._tensor_parallel_llama import check_sharded, sharded_ranks
from tests.helpers import assert_bitwise, bitwise_equal

pytestmark = pytest.mark.timeout(180)

D, N, LR, F64 = 5, 6, 0.1, torch.float64  # dtypes explicit: spawned ranks keep torch's default, float32
MESHES = {"2x2": ((2, 2), 4, Interleaved1F1B(4, stages_per_rank=2)), "4x1": ((4, 1), 2, OneFOneB(3))}


def _stage(p, x):
    x = x["x"] if isinstance(x, dict) else x
    h = getattr(torch, p["act"])(x @ p["w"] + p["b"]) * p["gain"] * p["gain32"]
    h = torch.roll(h, shifts=int(p["shift"]), dims=-1) + p["empty"].sum()
    return h + 0.1 * (torch.polar(torch.ones_like(h), h) * p["phase"]).real


def _loss(y, mb):
    return ((y - mb["y"]) ** 2).mean()


def _params(num_stages):
    g = torch.Generator().manual_seed(0)
    return [
        {
            "w": torch.randn(D, D, generator=g, dtype=F64) / 2,  # 25 elements: padded on every mesh here
            "b": torch.randn(D, generator=g, dtype=F64),
            "gain": torch.tensor(1.0 + s / 10, dtype=F64),  # one element: most ranks hold only padding
            "gain32": torch.tensor(0.9, dtype=torch.float32),  # a second dtype, a second all-gather
            "phase": torch.randn(D, generator=g, dtype=torch.complex128),
            "shift": torch.tensor(s % 2),  # int64: gathered, never differentiated
            "act": "tanh",  # a non-tensor leaf: kept whole in every shard tree
            "empty": torch.zeros(0, dtype=F64),
        }
        for s in range(num_stages)
    ]


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(N, D, generator=g, dtype=F64), "y": torch.randn(N, D, generator=g, dtype=F64)}


def _sgd(params, grads):
    return [
        None if p is None else optree.tree_map(lambda x, dx: x if dx is None else x - LR * dx, p, g, none_is_leaf=True)
        for p, g in zip(params, grads)
    ]


CALLS = 2  # two steps with an SGD update of the shards in between


def _train(mesh, schedule, num_stages):
    replica = mesh.get_coordinate()[0]
    params = _params(num_stages)
    sharded = fpipe.pipeline(
        _loss, [_stage] * num_stages, schedule, parallel=fpipe.Parallelism(mesh=mesh, shard_params=True, timeout=30)
    )
    plain = fpipe.pipeline(_loss, [_stage] * num_stages, schedule, parallel=fpipe.Parallelism(mesh=mesh, timeout=30))
    shards = sharded.shard(params)  # every stage given: those held elsewhere are ignored
    full = [p if s in plain.local_stages else None for s, p in enumerate(params)]
    s0 = sharded.local_stages[0]
    checks = {
        "fpipe.shard == step.shard": bitwise_equal(fpipe.shard(params[s0], mesh), shards[s0]),
        "gather(shard) == params": bitwise_equal(fpipe.gather(shards[s0], params[s0], sharded), params[s0]),
        "shard sizes": {k: tuple(v.shape) for k, v in shards[s0].items() if isinstance(v, torch.Tensor)},
    }
    # regather=True: a stage's full parameters live only while one of its actions runs
    seen: dict[int, list[torch.Tensor]] = {}

    def watching(s):
        def stage(p, x):
            for other, tensors in seen.items():
                assert other == s or all(t.untyped_storage().size() == 0 for t in tensors), (s, other)
            seen[s] = [t for t in p.values() if isinstance(t, torch.Tensor)]
            return _stage(p, x)

        return stage

    regathered = fpipe.pipeline(
        _loss,
        [watching(s) for s in range(num_stages)],
        schedule,
        parallel=fpipe.Parallelism(mesh=mesh, shard_params=True, regather=True),
    )
    regathered_shards = regathered.shard(params)
    out = []
    for call in range(CALLS):
        batch = _batch(10 * call + replica) if sharded.rank == 0 else None
        loss, grads = sharded(shards, batch)
        r_loss, r_grads = regathered(regathered_shards, batch)
        checks[f"regather bitwise, call {call}"] = bitwise_equal((r_loss, r_grads), (loss, grads))
        regathered_shards = _sgd(regathered_shards, r_grads)
        plain_loss, plain_grads = plain(full, batch)
        out.append(
            {
                "loss": loss,
                "grads": sharded.gather(grads),
                "params": sharded.gather(shards),
                "norm": sharded.global_norm(grads),
                "plain_loss": plain_loss,
                "plain_grads": plain_grads,
                "plain_norm": plain.global_norm(plain_grads),
                "grad_shapes": {k: None if v is None else tuple(v.shape) for k, v in grads[s0].items()},
            }
        )
        shards, full = _sgd(shards, grads), _sgd(full, plain_grads)
    return {"local_stages": sharded.local_stages, "checks": checks, "calls": out}


def _errors(mesh):
    params = _params(4)
    stages = [_stage] * 4
    messages = {}
    step = fpipe.pipeline(
        _loss, stages, Interleaved1F1B(4, stages_per_rank=2), parallel=fpipe.Parallelism(mesh=mesh, shard_params=True)
    )
    batch = _batch(0) if step.rank == 0 else None
    full = [p if s in step.local_stages else None for s, p in enumerate(params)]
    with pytest.raises(ValueError) as info:
        step(full, batch)
    messages["no layout"] = str(info.value)
    shards = step.shard(params)
    with pytest.raises(ValueError) as info:
        step(full, batch)  # full parameters where shards are expected: rejected on every rank
    messages["full params"] = str(info.value)
    s0 = step.local_stages[0]
    wrong = [dict(p, extra=torch.zeros(1)) if s == s0 else p for s, p in enumerate(shards)]
    with pytest.raises(ValueError) as info:
        step(wrong, batch)
    messages["structure"] = str(info.value)
    pp_group = mesh.get_group("pp")
    with pytest.raises(ValueError) as info:
        fpipe.pipeline(_loss, stages, OneFOneB(4), parallel=fpipe.Parallelism(group=pp_group, shard_params=True))
    messages["no data dimension"] = str(info.value)
    with pytest.raises(TypeError) as info:
        fpipe.pipeline(_loss, stages, OneFOneB(4), parallel=fpipe.Parallelism(mesh=mesh, shard_params="yes"))
    messages["not a bool"] = str(info.value)
    plain = fpipe.pipeline(_loss, stages, OneFOneB(4), parallel=fpipe.Parallelism(mesh=mesh))
    with pytest.raises(ValueError) as info:
        plain.shard(params)
    messages["step does not shard"] = str(info.value)
    with pytest.raises(ValueError) as info:
        fpipe.shard(params[0], pp_group)
    messages["shard over no mesh"] = str(info.value)
    loss, _ = step(shards, batch)  # the groups still work after rejected inputs
    messages["after"] = float(loss)
    return messages


def _failing_replica(mesh):
    replica = mesh.get_coordinate()[0]

    def broken(p, x):
        if replica == 0:
            raise ValueError("boom")
        return _stage(p, x)

    stages = [_stage, broken, _stage, _stage]
    step = fpipe.pipeline(
        _loss,
        stages,
        Interleaved1F1B(4, stages_per_rank=2),
        parallel=fpipe.Parallelism(mesh=mesh, shard_params=True, timeout=30),
    )
    shards = step.shard(_params(4))
    with pytest.raises(fpipe.PipelineError) as info:
        step(shards, _batch(0) if step.rank == 0 else None)
    return str(info.value)


def _ranks(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {name: init_device_mesh("cpu", shape, mesh_dim_names=("dp", "pp")) for name, (shape, *_) in MESHES.items()}
    out = {name: _train(meshes[name], schedule, num_stages) for name, (_, num_stages, schedule) in MESHES.items()}
    out["errors"] = _errors(meshes["2x2"])
    dist.barrier()
    return out


def _failing(rank, world):
    """The failing-replica case in processes of its own: a failure aborts the mesh's groups."""
    from torch.distributed.device_mesh import init_device_mesh

    failure = _failing_replica(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp")))
    # The failure aborted the mesh's groups only (none of them is the default group): every rank
    # is out of the failed step within a second and the default group's barrier completes.
    dist.barrier(async_op=True).wait(timeout=timedelta(seconds=10))
    return failure


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(4, _ranks, timeout=150)


def _reference(name):
    """Per call: the loss and grads of the single-process pipeline, averaged over replicas."""
    (dp, _), num_stages, schedule = MESHES[name]
    step = fpipe.pipeline(_loss, [_stage] * num_stages, schedule)
    params, out = _params(num_stages), []
    for call in range(CALLS):
        runs = [step(params, _batch(10 * call + r)) for r in range(dp)]
        loss = runs[0][0]
        for other, _ in runs[1:]:
            loss = loss + other
        grads = [
            optree.tree_map(lambda *gs: None if gs[0] is None else sum(gs[1:], gs[0]) / dp, *trees, none_is_leaf=True)
            for trees in zip(*(g for _, g in runs))
        ]
        out.append((loss / dp, grads, params))
        params = _sgd(params, grads)
    return out


def _norm(leaves):
    return sum(g.abs().double().square().sum() for g in leaves).sqrt()


def _assert_trees(actual, expected, rtol):
    """Bitwise equal with ``rtol=0``; else close, float32 leaves to a few of their ulps."""
    if rtol == 0:
        assert_bitwise(actual, expected)
        return
    assert optree.tree_structure(actual, none_is_leaf=True) == optree.tree_structure(expected, none_is_leaf=True)
    for a, e in zip(optree.tree_leaves(actual, none_is_leaf=True), optree.tree_leaves(expected, none_is_leaf=True)):
        if not isinstance(e, torch.Tensor):
            assert a == e
        elif e.dtype in (torch.float64, torch.complex128):
            torch.testing.assert_close(a, e, rtol=rtol, atol=rtol * 1e-2)
        else:
            torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", list(MESHES))
def test_sharded_equals_unsharded_and_replica_average(ranks, name):
    """With 2 replicas every sum has 2 terms, and a + b == b + a: bitwise. With 4, gloo's
    reduce-scatter and all-reduce (whose chunks depend on the buffer's length, so even the loss,
    all-reduced alone when sharded and with the grads when not) and a left-to-right sum add in
    different orders: equal to float64 rounding."""
    exact = MESHES[name][0][0] == 2
    reference = _reference(name)
    for result in ranks:
        mine = result[name]
        for call, (loss, grads, params) in enumerate(reference):
            got = mine["calls"][call]
            # with 4 replicas, the float32 leaf's last-ulp difference flows into every value
            # after the first update: float32 tolerance from then on
            rtol = 0.0 if exact else 1e-13 if call == 0 else 1e-6
            _assert_trees(got["loss"], got["plain_loss"], rtol)
            _assert_trees(got["loss"], loss, rtol)
            for s in range(len(grads)):
                if s in mine["local_stages"]:
                    _assert_trees(got["grads"][s], got["plain_grads"][s], rtol)
                    _assert_trees(got["grads"][s], grads[s], rtol)
                    _assert_trees(got["params"][s], params[s], rtol)
                else:
                    assert got["grads"][s] is None and got["plain_grads"][s] is None
            # the norm of the sharded grads is the norm of the gathered ones, up to summation order
            gathered = [g for s in mine["local_stages"] for g in optree.tree_leaves(got["grads"][s])]
            if len(mine["local_stages"]) == len(grads):
                torch.testing.assert_close(got["norm"], _norm(gathered), rtol=1e-13, atol=0)
            # ... and of the reference: a float32 leaf averaged over 4 replicas differs by an ulp
            rtol = 1e-13 if exact else 1e-6
            torch.testing.assert_close(got["norm"], _norm(optree.tree_leaves(grads)), rtol=rtol, atol=0)
            torch.testing.assert_close(got["plain_norm"], _norm(optree.tree_leaves(grads)), rtol=rtol, atol=0)


@pytest.mark.parametrize("name", list(MESHES))
def test_shards_are_flat_padded_slices(ranks, name):
    dp = MESHES[name][0][0]
    size = {"w": -(-D * D // dp), "b": -(-D // dp), "gain": 1, "gain32": 1, "phase": -(-D // dp), "shift": 1}
    for result in ranks:
        mine = result[name]
        assert mine["checks"]["fpipe.shard == step.shard"] and mine["checks"]["gather(shard) == params"]
        assert mine["checks"]["shard sizes"] == {**{k: (n,) for k, n in size.items()}, "empty": (0,)}
        grad_shapes = mine["calls"][0]["grad_shapes"]
        assert grad_shapes == {**{k: (n,) for k, n in size.items()}, "shift": None, "act": None, "empty": (0,)}


def test_errors(ranks):
    for result in ranks:
        m = result["errors"]
        assert "has no layout for stage" in m["no layout"] and "step.shard(params)" in m["no layout"]
        assert "['b'] should be this rank's shard of a torch.float64 tensor of shape (5,)" in m["full params"]
        assert "does not have the structure step.shard recorded" in m["structure"]
        assert "shard_params=True cuts parameters over the data-parallel ranks" in m["no data dimension"]
        assert "shard_params must be True or False" in m["not a bool"]
        assert "this step does not shard" in m["step does not shard"]
        assert "fpipe.shard" in m["shard over no mesh"]
        assert m["after"] > 0


def test_a_failing_replica_fails_the_other():
    failures = run_ranks(4, _failing, timeout=120)
    # mesh coordinates: global rank 2 * replica + pipeline rank
    assert "failed on rank 1" in failures[1] and "boom" in failures[1]
    # Every other rank names the failed one, its replica and its action (the failure board).
    for r in (0, 2, 3):
        expected = f"rank {r} (dp {r // 2}, pp {r % 2}) stopped"
        assert expected in failures[r], failures[r]
        assert "because rank 1 (dp 0, pp 1) failed in forward of stage 1" in failures[r]


def _mixed_precision(rank, world):
    """Optimizer state kept in float32 for bfloat16 and float64 parameters, cut and gathered back."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "pp"))
    step = fpipe.pipeline(_loss, [_stage], OneFOneB(2), parallel=fpipe.Parallelism(mesh=mesh, shard_params=True))
    g = torch.Generator().manual_seed(0)
    params = [
        {
            "bf": torch.randn(5, generator=g).bfloat16(),
            "a": torch.randn(3, generator=g, dtype=F64),
            "b": torch.ones(2, dtype=F64),
        }
    ]
    state = [{"bf": params[0]["bf"].float() / 3, "a": params[0]["a"].float() / 3, "b": params[0]["b"] / 3}]
    step.shard(params)  # records the layouts step.gather gathers with
    state_shards = [fpipe.shard(state[0], mesh)]
    return step.gather(state_shards), fpipe.gather(state_shards[0], params[0], step), state


def test_step_gather_keeps_the_dtypes_of_the_shards():
    """Gathers used to take the parameters' dtypes: float32 state of bfloat16 parameters failed
    inside gloo, and of float64 ones next to a float64 leaf came back silently cast to float64."""
    for unsharded, gathered, state in run_ranks(2, _mixed_precision, timeout=60):
        for tree in (unsharded[0], gathered):
            assert {k: v.dtype for k, v in tree.items()} == {k: v.dtype for k, v in state[0].items()}
            assert_bitwise(tree, state[0])


# --- no processes: the layout and the segments ----------------------------------------------------


def test_cut_pads_and_never_drops():
    tree = {"a": torch.arange(5.0, dtype=torch.float32), "b": torch.arange(4.0).reshape(2, 2), "n": 3}
    layout = layout_of(tree, 2)
    assert layout.leaves[0] == LeafLayout((5,), torch.float32, 3)
    pieces = [cut(tree, layout, r) for r in range(2)]
    assert pieces[0]["a"].tolist() == [0, 1, 2] and pieces[1]["a"].tolist() == [3, 4, 0]  # the picture
    assert pieces[0]["b"].tolist() == [0, 1] and pieces[1]["b"].tolist() == [2, 3]
    assert pieces[1]["n"] == 3
    three = layout_of(tree, 3)  # 5 elements in 3 shards of 2: the last holds one and a pad
    assert [cut(tree, three, r)["a"].tolist() for r in range(3)] == [[0, 1], [2, 3], [4, 0]]
    assert isinstance(three, StageLayout) and three.num_shards == 3


def test_segments_end_at_each_stages_last_action():
    program = Interleaved1F1B(2, stages_per_rank=2).program(4, 2)
    order = [(0, a) for a in program.ranks[0]]
    pieces = segments(order)
    assert [a for actions, _ in pieces for a in actions] == order
    assert [done for _, done in pieces] == [[2], [0]]
    assert str(pieces[0][0][-1][1]) == "2B1" and str(pieces[1][0][-1][1]) == "0B1"


def test_sharding_needs_a_data_dimension():
    with pytest.raises(ValueError, match="shard_params=True cuts parameters over the data-parallel ranks"):
        fpipe.pipeline(_loss, [_stage], OneFOneB(2), parallel=fpipe.Parallelism(shard_params=True))


# --- the example --------------------------------------------------------------------------------


def test_train_sharded_example_equals_the_replica_average():
    """``torchrun --nproc-per-node 4 examples/train_sharded.py`` (2 x 2, sharded, fpipe.optim's AdamW
    on shards) takes the same steps as one process running both replicas, ``clip_grad_norm_`` and
    ``torch.optim.AdamW`` on full parameters."""
    import importlib.util
    import re
    import subprocess
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "train_sharded.py"
    spec = importlib.util.spec_from_file_location("fpipe_example_train_sharded", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    argv = ["--steps", "4", "--dim", "16", "--hidden", "24", "--batch-size", "6", "--quiet"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(path)]
    run = subprocess.run([*command, *argv], capture_output=True, text=True, timeout=150, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    first, last = map(float, re.search(r"loss (\S+) -> (\S+),", run.stdout).groups())

    torch.set_default_dtype(torch.float32)  # as in the example's processes (the fixture restores it)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        args = example.parse_args(argv)
        params = example.init_params(args.dim, args.hidden, torch.Generator().manual_seed(args.seed))
        named = [(s, k, t) for s, p in enumerate(params) for k, t in p.items()]
        groups = [
            {"params": [t for _, _, t in named if t.dim() >= 2], "weight_decay": 0.1},  # matrices only
            {"params": [t for _, _, t in named if t.dim() < 2], "weight_decay": 0.0},
        ]
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
        teacher = example.teacher(torch.Generator().manual_seed(1234))
        data = [torch.Generator().manual_seed(args.seed + 1 + r) for r in range(2)]
        step = fpipe.pipeline(example.loss_fn, example.STAGES, OneFOneB(args.microbatches))
        losses = []
        for _ in range(args.steps):
            (loss_a, grads_a), (loss_b, grads_b) = (
                step(params, example.get_batch(teacher, args.batch_size, g)) for g in data
            )
            for s, k, t in named:  # the replicas' average, as the mesh's reduce-scatter gives it
                t.grad = (grads_a[s][k] + grads_b[s][k]) / 2
            torch.nn.utils.clip_grad_norm_([t for _, _, t in named], args.max_norm)
            opt.step()  # in place: params holds the updated tensors
            losses.append(((loss_a + loss_b) / 2).item())
    finally:
        torch.set_num_threads(threads)
    # the global norm sums in another order, so the clipping scale may differ in its last bits
    assert first == pytest.approx(losses[0], rel=1e-5) and last == pytest.approx(losses[-1], rel=1e-5)


@pytest.mark.parametrize("name", list(MESHES))
def test_regather_is_bitwise_and_frees_between_actions(ranks, name):
    """regather=True: the stage functions saw other stages' gathered parameters freed (asserted
    inside the ranks), and the results equal the keep-for-the-step ones bit for bit."""
    for result in ranks:
        checks = result[name]["checks"]
        assert all(checks[f"regather bitwise, call {call}"] for call in range(CALLS)), checks


def test_regather_needs_sharding():
    with pytest.raises(ValueError, match="regather=True re-gathers sharded parameters"):
        fpipe.pipeline(_loss, [_stage], OneFOneB(2), parallel=fpipe.Parallelism(regather=True))


@pytest.mark.timeout(240)
def test_sharded_data_parallel_times_tensor_parallel():
    """dp 2 x pp 1 x tp 2 (both stages on the one pipeline rank, interleaved): shard_params=True
    gives the shards of the replicated run's grads bitwise, and the reference to rounding."""
    results = run_ranks(4, sharded_ranks, ("dp", "pp", "tp"), (2, 1, 2), OneFOneB(3), 2, timeout=180)
    check_sharded(results, 2, replicas=2)

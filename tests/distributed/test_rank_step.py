"""One step as one rank of many (fpipe/_distributed/_rank_step.py), the parts a test can call in one
process: which stages' parameters a rank must hold (whole distributed steps:
tests/test_distributed.py, tests/distributed/test_faults.py; a recorded timeline made of every
rank's own row: tests/distributed/test_transport.py).

With tensor parallelism (the Llama-style stages of tests/_tensor_parallel_llama.py on pp 2 x tp 2 gloo
ranks, one spawn per test): bad DTensor inputs on one rank, heads that do not divide over the
tensor-parallel ranks, and a stage failing on one tensor-parallel rank while its partner waits in
the stage's all-reduce make every rank raise, each naming its rank, stage and action."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import fpipe
from fpipe._distributed import _rank_step
from fpipe.schedules import OneFOneB
from tests._multiprocess import run_ranks
from tests._tensor_parallel_llama import (
    HEAD_DIM,
    distribute_llama,
    dtensor_api,
    llama_batch,
    llama_first,
    llama_last,
    llama_loss,
    llama_params,
    llama_stages,
)


def test_a_rank_holds_exactly_its_stages_parameters() -> None:
    spec: Any = SimpleNamespace(num_stages=3, local_stages=(1,), rank=1)
    _rank_step._check_held(spec, [None, {"w": torch.ones(1)}, None], (0, 1, 2))
    with pytest.raises(ValueError, match=r"rank 1 holds stage 1 but params\[1\] is None"):
        _rank_step._check_held(spec, [None, None, None], (0, 1, 2))
    with pytest.raises(ValueError, match=r"params\[2\] is given on rank 1, but stage 2 lives on rank 2"):
        _rank_step._check_held(spec, [None, {"w": torch.ones(1)}, {"w": torch.ones(1)}], (0, 1, 2))


# -- Tensor-parallel steps on 4 gloo ranks (the model: tests/_tensor_parallel_llama.py) --


def _bad_inputs(rank, world):
    """On pp 2 x tp 2: DTensor params on the wrong mesh on one rank, then a good step, then a
    stage returning DTensors on another sub-mesh; what every rank raised."""
    from torch.distributed.device_mesh import init_device_mesh

    DTensor, _, Replicate, _ = dtensor_api()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp, tp = mesh.get_coordinate()
    step = fpipe.pipeline(llama_loss, llama_stages(2), OneFOneB(2), parallel=fpipe.Parallelism(mesh=mesh, timeout=30))
    params = [distribute_llama(p, mesh["tp"]) if s == pp else None for s, p in enumerate(llama_params(2))]
    batch = llama_batch(1) if pp == 0 else None
    messages = {}
    wrong = [dict(p) if p is not None else None for p in params]
    if (pp, tp) == (1, 1):  # one rank: its tp partner and its pipeline peer must hear of it too
        wrong[1]["wq"] = DTensor.from_local(wrong[1]["wq"].to_local(), mesh["pp"], [Replicate()])
    with pytest.raises(ValueError) as info:
        step(wrong, batch)
    messages["wrong mesh"] = str(info.value)
    messages["after"] = float(step(params, batch)[0])  # input errors leave the mesh usable

    def elsewhere(p, mb):  # returns a DTensor on the pipeline sub-mesh
        y = llama_first(p, mb)
        return {"x": DTensor.from_local(y["x"].to_local(), mesh["pp"], [Replicate()]), "mlp": y["mlp"]}

    failing = fpipe.pipeline(
        llama_loss, [elsewhere, llama_last], OneFOneB(2), parallel=fpipe.Parallelism(mesh=mesh, timeout=30)
    )
    with pytest.raises(fpipe.PipelineError) as info:
        failing(params, batch)
    messages["output elsewhere"] = (str(info.value), repr(info.value.__cause__))
    return messages


@pytest.mark.timeout(240)
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
    step = fpipe.pipeline(llama_loss, llama_stages(2), OneFOneB(2), parallel=fpipe.Parallelism(mesh=mesh, timeout=30))
    full = llama_params(2)
    for p in full:  # 3 heads of HEAD_DIM: 6 rows of q, k, v, 3 on each rank
        p.update({n: p[n][: 3 * HEAD_DIM] for n in ("wq", "wk", "wv")}, wo=p["wo"][:, : 3 * HEAD_DIM])
    params = [distribute_llama(p, mesh["tp"]) if s == pp else None for s, p in enumerate(full)]
    with pytest.raises(fpipe.PipelineError) as info:
        step(params, llama_batch(1) if pp == 0 else None)
    return str(info.value), repr(info.value.__cause__)


@pytest.mark.timeout(240)
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
        return llama_first(p, mb)

    step = fpipe.pipeline(
        llama_loss, [first, llama_last], OneFOneB(2), parallel=fpipe.Parallelism(mesh=mesh, timeout=30)
    )
    params = [distribute_llama(p, mesh["tp"]) if s == pp else None for s, p in enumerate(llama_params(2))]
    start = time.monotonic()
    with pytest.raises(fpipe.PipelineError) as info:
        step(params, llama_batch(1) if pp == 0 else None)
    return time.monotonic() - start, str(info.value), repr(info.value.__cause__)


@pytest.mark.timeout(240)
def test_a_failure_on_one_tensor_parallel_rank_fails_its_partners_in_their_collectives():
    results = run_ranks(4, _one_tp_rank_fails, timeout=120)
    for rank, (seconds, message, _) in enumerate(results):
        assert seconds < 15, (rank, seconds)  # not the 30 s timeout, with room for a loaded machine
        assert "forward of stage 0 on microbatch 0 (0F0)" in message, (rank, message)
    assert "boom on tp rank 1" in results[1][2]
    # its partner, in the stage's all-reduce, names rank 1 by its mesh coordinates (also when
    # rank 1's connection closed before the board aborted that all-reduce). Where it stops is a
    # race on a loaded machine: usually in that all-reduce ("a collective inside its stage"), but
    # an aborted all-reduce can also surface at its next wait (its send to stage 1); either way
    # it stops in this step, at once, for rank 1's failure.
    assert results[0][1].startswith("fpipe: rank 0 (pp 0, tp 0) stopped "), results[0][1]
    assert "because rank 1 (pp 0, tp 1)" in results[0][1], results[0][1]
    assert results[2][1].startswith("fpipe: rank 2 (pp 1, tp 0) stopped "), results[2][1]
    assert "because rank 1 (pp 0, tp 1) failed in forward of stage 0" in results[2][1]

"""No host synchronization of fpipe's own making between a step's first and last action.

On a device backend a step reads a value on the host only to receive a message (its meta and,
when a layout changes, its header): tests/_syncs.py records every other ``.item()``-like call,
data-dependent shape or host-to-device copy fpipe makes, for every schedule of the conformance
list, in one process and over gloo (pipeline, and a dp x pp mesh, replicated and sharded).
What remains outside the actions is listed in notes/wire.md ("Host synchronization").
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import fpipe
from tests._multiprocess import run_ranks
from tests._syncs import Sync, host_syncs
from tests.conformance import CONFORMANCE
from tests.helpers import mse_loss, tanh_batch, tanh_layer, tanh_params


def _avoidable(found: list[Sync]) -> list[Sync]:
    """The syncs between the first and last action that do not read a received message."""
    return [s for s in found if s.in_step and not s.receive]


@pytest.mark.parametrize("entry", CONFORMANCE, ids=str)
def test_one_process_step_does_not_synchronize(entry: Any) -> None:
    num_stages = next(S for S in entry.stage_counts if S >= 2)
    step = fpipe.pipeline(mse_loss, [tanh_layer] * num_stages, entry.make(num_stages, 4))
    params = tanh_params(num_stages)
    step(params, tanh_batch(12))  # a first step, as training runs them
    with host_syncs() as found:
        step(params, tanh_batch(12))
    assert [s for s in found if s.in_step] == []


def test_the_checker_sees_a_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    from fpipe._distributed._wire import META_BYTES, meta_of
    from fpipe._stage import StageRun

    real = StageRun.forward

    def syncing(self: Any, x: Any, **kwargs: Any) -> Any:
        meta_of(torch.zeros(META_BYTES, dtype=torch.uint8))  # fpipe reading a tensor on the host
        return real(self, x, **kwargs)

    monkeypatch.setattr(StageRun, "forward", syncing)
    step = fpipe.pipeline(mse_loss, [tanh_layer] * 2, fpipe.schedules.GPipe(2))
    with host_syncs() as found:
        step(tanh_params(2), tanh_batch(12))
    # stage 0's forwards, on 2 microbatches
    assert found == [Sync("tolist", "_distributed/_wire.py:meta_of", in_step=True, receive=False)] * 2
    with host_syncs() as found:
        torch.tensor([1.0]).item()  # not fpipe's
    assert found == []


def _distributed(rank: int, world: int, cases: list[tuple[str, int, int, dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, num_stages, microbatches, options in cases:
        schedule = next(e for e in CONFORMANCE if e.name == name).make(num_stages, microbatches)
        if "dp" in options:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (options["dp"], world // options["dp"]), mesh_dim_names=("dp", "pp"))
            step = fpipe.pipeline(
                mse_loss,
                [tanh_layer] * num_stages,
                schedule,
                parallel=fpipe.Parallelism(mesh=mesh, shard_params=options.get("shard", False)),
            )
        else:
            step = fpipe.pipeline(
                mse_loss, [tanh_layer] * num_stages, schedule, parallel=fpipe.Parallelism(group=dist.group.WORLD)
            )
        full = tanh_params(num_stages)
        params: list[Any] = [p if s in step.local_stages else None for s, p in enumerate(full)]
        if options.get("shard"):
            params = step.shard(params)
        batch = tanh_batch(12) if 0 in step.local_stages else None
        step(params, batch)
        with host_syncs() as found:
            step(params, batch)
        out[f"{name}-{options}"] = [(s.call, s.where, s.in_step, s.receive) for s in found]
    return out


def _check(results: list[dict[str, Any]]) -> None:
    for rank, per_case in enumerate(results):
        for case, found in per_case.items():
            syncs = [Sync(*s) for s in found]
            assert _avoidable(syncs) == [], (rank, case)
            # what reads a message is the wire's meta, and a new layout's header (uneven microbatches)
            reads = {"_distributed/_wire.py:meta_of", "_distributed/_wire.py:large_leaves"}
            assert {s.where for s in syncs if s.in_step} <= reads, (rank, case)


def test_two_pipeline_ranks_do_not_synchronize() -> None:
    cases = [(e.name, S, M, {}) for e in CONFORMANCE for p, S, M in e.ranks if p == 2]
    _check(run_ranks(2, _distributed, cases, timeout=240))


def test_a_mesh_does_not_synchronize() -> None:
    cases = [
        ("OneFOneB", 4, 4, {}),
        ("OneFOneB", 2, 4, {"dp": 2}),
        ("OneFOneB", 2, 4, {"dp": 2, "shard": True}),
    ]
    _check(run_ranks(4, _distributed, cases, timeout=240))

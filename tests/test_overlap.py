"""Each stage's data-parallel gradient reduction is posted at the stage's last action and waited
for when the step returns (NOTE [reduction overlap] in fpipe/_distributed/_rank_step.py); the
results are bitwise the replicas' average computed in one process."""

from __future__ import annotations

from typing import Any

import torch

import fpipe
from fpipe.schedules import Interleaved1F1B
from tests._multiprocess import run_ranks

NUM_STAGES = 4


def _stage(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ p["w"]) + p["b"]


def _loss(y: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return (y - batch).square().mean()


def _params() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    f64 = torch.float64  # explicit: the ranks' processes keep torch's default dtype
    return [
        {"w": torch.randn(6, 6, generator=g, dtype=f64), "b": torch.randn(6, generator=g, dtype=f64)}
        for _ in range(NUM_STAGES)
    ]


def _batch(replica: int) -> torch.Tensor:
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(10 + replica), dtype=torch.float64)


def _schedule() -> Interleaved1F1B:
    return Interleaved1F1B(num_microbatches=4, stages_per_rank=2)


def _train(rank: int, world: int) -> tuple[Any, ...]:
    from torch.distributed.device_mesh import init_device_mesh

    from fpipe._distributed import _rank_step
    from fpipe._stage import StageRun

    log: list[tuple[str, int]] = []
    posted, backward = _rank_step.all_reduce_sum_async, StageRun.backward

    def post(topology: Any, group: Any, leaves: Any, timeout: float, what: str) -> Any:
        log.append(("reduce", int(what.split("stage ")[1].split("'")[0])))
        return posted(topology, group, leaves, timeout, what)

    def backward_logged(self: Any, *args: Any) -> Any:
        log.append(("B", self.index))
        return backward(self, *args)

    _rank_step.all_reduce_sum_async = post  # type: ignore[assignment]
    StageRun.backward = backward_logged  # type: ignore[method-assign]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    step = fpipe.pipeline(_loss, [_stage] * NUM_STAGES, _schedule(), parallel=fpipe.Parallelism(mesh=mesh, timeout=30))
    params: list[Any] = [p if s in step.local_stages else None for s, p in enumerate(_params())]
    replica = mesh.get_coordinate()[0]
    loss, grads = step(params, _batch(replica) if 0 in step.local_stages or step.rank == 1 else None)
    return step.local_stages, loss, grads, log


def test_reductions_are_posted_at_each_stages_last_action_and_bitwise_the_average() -> None:
    step = fpipe.pipeline(_loss, [_stage] * NUM_STAGES, _schedule())
    per_replica = [step(_params(), _batch(r)) for r in range(2)]
    loss = (per_replica[0][0] + per_replica[1][0]) / 2
    grads = [{k: (per_replica[0][1][s][k] + per_replica[1][1][s][k]) / 2 for k in ("w", "b")} for s in range(4)]
    for local_stages, d_loss, d_grads, log in run_ranks(4, _train, timeout=120):
        assert torch.equal(d_loss, loss)
        for s in local_stages:
            for k in ("w", "b"):
                assert torch.equal(d_grads[s][k], grads[s][k])
        # each stage's reduction right after its last backward, the later stage first
        later, earlier = sorted(local_stages, reverse=True)
        backwards = [k for k, entry in enumerate(log) if entry[0] == "B"]
        assert log.index(("reduce", later)) == 1 + max(k for k in backwards if log[k] == ("B", later))
        assert log.index(("reduce", later)) < max(k for k in backwards if log[k] == ("B", earlier))
        assert log[-1] == ("reduce", earlier)

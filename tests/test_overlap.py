"""Each stage's data-parallel gradient reduction is posted at the stage's last action and waited
for when the step returns (NOTE [reduction overlap] in fpipe/_distributed/_rank_step.py); the
results are bitwise the replicas' average computed in one process."""

from __future__ import annotations

from typing import Any

import fpipe
from fpipe.schedules import Interleaved1F1B
from tests._multiprocess import run_ranks
from tests.helpers import assert_bitwise, mse_loss, tanh_batch, tanh_layer, tanh_params

NUM_STAGES, WIDTH = 4, 6


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
    step = fpipe.pipeline(
        mse_loss, [tanh_layer] * NUM_STAGES, _schedule(), parallel=fpipe.Parallelism(mesh=mesh, timeout=30)
    )
    params: list[Any] = [p if s in step.local_stages else None for s, p in enumerate(tanh_params(NUM_STAGES, WIDTH))]
    replica = mesh.get_coordinate()[0]
    batch = tanh_batch(8, WIDTH, seed=10 + replica)
    loss, grads = step(params, batch if 0 in step.local_stages or step.rank == 1 else None)
    return step.local_stages, loss, grads, log


def test_reductions_are_posted_at_each_stages_last_action_and_bitwise_the_average() -> None:
    step = fpipe.pipeline(mse_loss, [tanh_layer] * NUM_STAGES, _schedule())
    per_replica = [step(tanh_params(NUM_STAGES, WIDTH), tanh_batch(8, WIDTH, seed=10 + r)) for r in range(2)]
    loss = (per_replica[0][0] + per_replica[1][0]) / 2
    grads = [{k: (per_replica[0][1][s][k] + per_replica[1][1][s][k]) / 2 for k in ("w", "b")} for s in range(4)]
    for local_stages, d_loss, d_grads, log in run_ranks(4, _train, timeout=120):
        assert_bitwise(d_loss, loss)
        for s in local_stages:
            assert_bitwise(d_grads[s], grads[s], f"stage {s}")
        # each stage's reduction right after its last backward, the later stage first
        later, earlier = sorted(local_stages, reverse=True)
        backwards = [k for k, entry in enumerate(log) if entry[0] == "B"]
        assert log.index(("reduce", later)) == 1 + max(k for k in backwards if log[k] == ("B", later))
        assert log.index(("reduce", later)) < max(k for k in backwards if log[k] == ("B", earlier))
        assert log[-1] == ("reduce", earlier)

"""fpipe.moe's reference layer: in one process against a dense loop over experts with masks
(outputs and every gradient, 1e-12), and with its experts split over 2 and 4 ranks (one spawn
each) against the unsplit layer on every rank's tokens.

The gradient factor under expert parallelism: rank ``r``'s loss ``L_r`` is the mean over its
tokens, and the total loss is ``L = (1/R) sum_r L_r``. Each rank back-propagates its own ``L_r``.
The combine's backward carries every rank's cotangents to the rank holding the expert, so the
local piece of an expert's gradient on its rank is ``sum_r dL_r/dW_e = R dL/dW_e``: divided by
``R`` it is the unsplit gradient's block. The router and the shared expert see only this rank's
tokens, ``dL_r/dtheta``; their mean over the ranks is ``dL/dtheta`` (a data-parallel average).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fpipe.moe._dispatch as dispatch_module
from fpipe.moe import distribute_experts, init_moe, moe, route, token_counts
from tests._multiprocess import run_ranks
from tests.helpers import assert_bitwise, assert_close

D, H, K = 4, 6, 2  # width, expert hidden size, experts per token
BALANCE = 0.01  # the balance loss's coefficient in the test losses


def dense_moe(params: dict[str, Any], x: torch.Tensor, top_k: int, score: str, bias: Any) -> torch.Tensor:
    """The layer as a loop over all experts, each on every token, masked by its gate weights."""
    routing = route(x @ params["router"], top_k, score=score, bias=bias)  # type: ignore[arg-type]
    y = torch.zeros_like(x)
    for e in range(params["w1"].shape[0]):
        gate = (routing.weights * (routing.experts == e)).sum(dim=1)
        h = torch.nn.functional.silu(x @ params["w1"][e]) * (x @ params["w3"][e])
        y = y + gate[:, None] * (h @ params["w2"][e])
    if "shared" in params:
        s = params["shared"]
        y = y + (torch.nn.functional.silu(x @ s["w1"]) * (x @ s["w3"])) @ s["w2"]
    return y


def loss_of(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((y - target) ** 2).mean()


@pytest.mark.parametrize(
    ("num_experts", "top_k", "score", "shared_hidden", "with_bias"),
    [
        (4, 2, "softmax", None, False),
        (6, 3, "sigmoid", 5, True),
        (3, 1, "softmax", 0, False),
        (5, 5, "sigmoid", 2, False),
    ],
)
def test_the_layer_equals_a_dense_loop_with_every_gradient(
    num_experts: int, top_k: int, score: str, shared_hidden: int | None, with_bias: bool
) -> None:
    params = init_moe(D, H, num_experts, shared_hidden=shared_hidden, generator=torch.Generator().manual_seed(1))
    x, target = torch.randn(2, 6, D), torch.randn(2, 6, D)
    bias = torch.randn(num_experts) / 10 if with_bias else None

    def layer(params: dict[str, Any]) -> torch.Tensor:
        y, stats = moe(params, x, top_k=top_k, score=score, bias=bias, sequence_length=6)  # type: ignore[arg-type]
        return loss_of(y, target) + BALANCE * stats.balance_loss

    def dense(params: dict[str, Any]) -> torch.Tensor:
        flat = x.reshape(-1, D)
        routing = route(flat @ params["router"], top_k, score=score, bias=bias)  # type: ignore[arg-type]
        balance = sum(
            num_experts
            / (top_k * 6)
            * float((routing.experts[s : s + 6] == i).sum())
            * (routing.scores[s : s + 6, i] / routing.scores[s : s + 6].sum(-1)).mean()
            for s in (0, 6)
            for i in range(num_experts)
        )
        y = dense_moe(params, flat, top_k, score, bias).reshape(x.shape)
        return loss_of(y, target) + BALANCE * balance / 2

    y, stats = moe(params, x, top_k=top_k, score=score, bias=bias)  # type: ignore[arg-type]
    assert_close(y, dense_moe(params, x.reshape(-1, D), top_k, score, bias).reshape(x.shape), 1e-12)
    assert (
        stats.counts.tolist()
        == token_counts(route(x.reshape(-1, D) @ params["router"], top_k, score=score, bias=bias), num_experts).tolist()
    )  # type: ignore[arg-type]
    got = torch.func.grad_and_value(layer)(params)
    assert_close(got, torch.func.grad_and_value(dense)(params), 1e-12)
    assert_bitwise(torch.func.grad_and_value(layer)(params), got)  # deterministic


def capacity_mask(experts: torch.Tensor, capacity: int) -> torch.Tensor:
    """1 for the (token, slot) pairs a capacity keeps: each expert's first ``capacity``, token by token."""
    seen: dict[int, int] = {}
    mask = torch.zeros(experts.shape)
    for t in range(experts.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            mask[t, j] = float(seen.get(e, 0) < capacity)
            seen[e] = seen.get(e, 0) + 1
    return mask


@pytest.mark.parametrize("capacity", [1, 3, 12])
def test_the_layer_with_a_capacity_equals_a_dense_loop_that_drops(capacity: int) -> None:
    params = init_moe(D, H, 4, generator=torch.Generator().manual_seed(2))
    x, target = torch.randn(12, D), torch.randn(12, D)
    mask = capacity_mask(route(x @ params["router"], 2).experts, capacity)

    def layer(params: dict[str, Any]) -> torch.Tensor:
        return loss_of(moe(params, x, top_k=2, capacity=capacity)[0], target)

    def dense(params: dict[str, Any]) -> torch.Tensor:
        routing = route(x @ params["router"], 2)
        y = (torch.nn.functional.silu(x @ params["shared"]["w1"]) * (x @ params["shared"]["w3"])) @ params["shared"][
            "w2"
        ]
        for e in range(4):
            gate = (routing.weights * mask * (routing.experts == e)).sum(dim=1)
            h = torch.nn.functional.silu(x @ params["w1"][e]) * (x @ params["w3"][e])
            y = y + gate[:, None] * (h @ params["w2"][e])
        return loss_of(y, target)

    assert (mask.sum() < 24) == (capacity < 12)
    assert_close(torch.func.grad_and_value(layer)(params), torch.func.grad_and_value(dense)(params), 1e-12)


def test_bad_params_fail() -> None:
    params = init_moe(D, H, 4)
    with pytest.raises(ValueError, match=r"x's last dimension must be the router's input size, 4 \(x: shape \(3, 5\)"):
        moe(params, torch.randn(3, 5), top_k=1)
    with pytest.raises(ValueError, match=r"params\['w3'\] must be \[num_experts, ., .\] with the router's 4 experts"):
        moe({**params, "w3": params["w3"][:3]}, torch.randn(3, D), top_k=1)


# --- Expert parallelism: one spawn of 2 ranks, one of 4 --------------------------------------


def _tokens(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens and targets: a different number of tokens on each rank."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(3 + 2 * rank, D, generator=g), torch.randn(3 + 2 * rank, D, generator=g)


def _rank_loss(
    params: dict[str, Any], rank: int, capacity: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s mean loss (with the balance loss), its token counts and its output."""
    x, target = _tokens(rank)
    y, stats = moe(params, x, top_k=K, score="sigmoid", capacity=capacity)
    return loss_of(y, target) + BALANCE * stats.balance_loss, stats.counts, y


def _split_run(params: dict[str, Any], rank: int, capacity: int | None = None) -> dict[str, Any]:
    """One forward and backward on this rank's tokens with the experts split: output, loss, grads."""
    leaves = {k: v for k, v in params.items() if k != "shared"}
    leaves = {k: v.detach().requires_grad_() for k, v in leaves.items()}
    shared = {k: v.detach().requires_grad_() for k, v in params["shared"].items()}
    tree = {**leaves, "shared": shared}
    loss, counts, y = _rank_loss(tree, rank, capacity)
    loss.backward()
    grads = {k: v.grad for k, v in leaves.items()} | {"shared": {k: v.grad for k, v in shared.items()}}
    return {"y": y.detach(), "loss": loss.detach(), "counts": counts, "grads": grads}


def _expert_parallel_checks(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    torch.set_default_dtype(torch.float64)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    num_experts = 2 * world_size
    params = init_moe(D, H, num_experts, generator=torch.Generator().manual_seed(0))
    split = distribute_experts(params, mesh["ep"])
    block = slice(rank * 2, rank * 2 + 2)

    # The unsplit model: every expert here, every rank's tokens, L = mean of the ranks' losses.
    def total(params: dict[str, Any], capacity: int | None = None) -> torch.Tensor:
        return torch.stack([_rank_loss(params, r, capacity)[0] for r in range(world_size)]).mean()

    full_grads, full_loss = torch.func.grad_and_value(total)(params)
    full_counts = sum(_rank_loss(params, r)[1] for r in range(world_size))

    run = _split_run(split, rank)
    # 1. This rank's output is the one-process layer's on its tokens with all experts.
    x, _ = _tokens(rank)
    assert_close(run["y"], moe(params, x, top_k=K, score="sigmoid")[0], 1e-12)
    # 2. Expert gradients: Shard(0) DTensors whose local piece / R is the unsplit block.
    for name in ("w1", "w3", "w2"):
        grad = run["grads"][name]
        assert isinstance(grad, DTensor) and grad.placements == split[name].placements, name
        assert_close(grad.to_local() / world_size, full_grads[name][block], 1e-12, context=name)
    # 3. Router and shared gradients, and the loss: averaged over the ranks, the unsplit ones.
    replicated = [t.clone() for t in (run["grads"]["router"], *run["grads"]["shared"].values(), run["loss"])]
    for t in replicated:
        dist.all_reduce(t)
    expected = [full_grads["router"], *full_grads["shared"].values(), full_loss]
    assert_close([t / world_size for t in replicated], expected, 1e-12)
    # 4. Counts summed over the ranks: the unsplit counts over every rank's tokens.
    counts = run["counts"].clone()
    dist.all_reduce(counts)
    assert torch.equal(counts, full_counts)
    # 5. Deterministic: a second run gives the same bits.
    assert_bitwise(_split_run(split, rank), run)
    # 6. A rank with no tokens still takes part: the others' outputs and its gradients are right.
    x = _tokens(rank)[0][: 0 if rank == 0 else None]
    w2 = split["w2"].detach().requires_grad_()
    y, stats = moe({**split, "w2": w2}, x, top_k=K)
    y.sum().backward()
    assert_close(y, moe(params, x, top_k=K)[0], 1e-12)
    assert stats.balance_loss.item() == 0.0 if rank == 0 else stats.balance_loss.item() > 0.0
    assert isinstance(w2.grad, DTensor)
    pieces = [torch.empty_like(w2.grad.to_local()) for _ in range(world_size)]
    dist.all_gather(pieces, w2.grad.to_local())

    def summed(w2: torch.Tensor) -> torch.Tensor:
        xs = [_tokens(r)[0][: 0 if r == 0 else None] for r in range(world_size)]
        return sum(moe({**params, "w2": w2}, x, top_k=K)[0].sum() for x in xs)  # type: ignore[return-value]

    assert_close(torch.cat(pieces), torch.func.grad(summed)(params["w2"]), 1e-12)

    # 7. With a capacity, which drops per (source rank, expert): the same checks of the output
    # and the expert gradients against the one-process layer with the same capacity.
    run = _split_run(split, rank, capacity=1)
    x, _ = _tokens(rank)
    assert_close(run["y"], moe(params, x, top_k=K, score="sigmoid", capacity=1)[0], 1e-12)
    full_grads = torch.func.grad(total)(params, 1)
    for name in ("w1", "w3", "w2"):
        assert_close(run["grads"][name].to_local() / world_size, full_grads[name][block], 1e-12, context=name)

    # 8. Disagreements raise on every rank, naming the rank, before any row moves (no hang).
    x, _ = _tokens(rank)
    routing = route(x @ params["router"], K)
    wrong = num_experts * 2 if rank == world_size - 1 else num_experts
    last = world_size - 1
    disagree = rf"rank 0 has \({num_experts}, {D}\), rank {last} has \({2 * num_experts}, {D}\)"
    with pytest.raises(ValueError, match=rf"disagree on \(num_experts, features\): {disagree}"):
        dispatch_module.dispatch(x, routing, wrong, mesh.get_group())
    if rank == 1:
        counting = dispatch_module.token_counts
        dispatch_module.token_counts = lambda routing, n: counting(routing, n) + 1  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"rank 1 of the expert-parallel group counted \d+ routed pairs but has"):
        dispatch_module.dispatch(x, routing, num_experts, mesh.get_group())
    if rank == 1:
        dispatch_module.token_counts = counting
    with pytest.raises(
        ValueError,
        match=rf"num_experts must be a multiple of the expert-parallel group's size, {world_size} \(num_experts: 3\)",
    ):
        dispatch_module.dispatch(x, route(x @ params["router"][:, :3], 1), 3, mesh.get_group())
    # 9. The layer's and distribute_experts' checks of the expert weights.
    replicate = DTensor.from_local(params["w3"], mesh["ep"], [Replicate()], run_check=False)
    with pytest.raises(ValueError, match=r"\(params\['w3'\]: placements \(Replicate\(\),\) on a 1-D mesh\)"):
        moe({**split, "w3": replicate}, x, top_k=K)
    with pytest.raises(ValueError, match=r"must be all DTensors or all plain tensors \(plain: params\['w2'\]\)"):
        moe({**split, "w2": params["w2"]}, x, top_k=K)
    square = DeviceMesh("cpu", torch.arange(world_size).reshape(1, world_size), mesh_dim_names=("dp", "ep"))
    with pytest.raises(ValueError, match=r"ep_mesh must be 1-D \(ep_mesh: 2-D, dimensions \('dp', 'ep'\)\)"):
        distribute_experts(params, square)
    with pytest.raises(ValueError, match=rf"a multiple of the mesh's size, {world_size} \(params\['w1'\]: 3 experts\)"):
        distribute_experts(init_moe(D, H, 3), mesh["ep"])
    return {"counts": run["counts"], "y": run["y"]}


@pytest.mark.parametrize("world_size", [2, 4])
def test_experts_split_over_ranks_equal_the_unsplit_layer(world_size: int) -> None:
    results = run_ranks(world_size, _expert_parallel_checks, timeout=60)
    assert [tuple(r["y"].shape) for r in results] == [(3 + 2 * rank, D) for rank in range(world_size)]
    assert all(int(r["counts"].sum()) == K * (3 + 2 * rank) for rank, r in enumerate(results))

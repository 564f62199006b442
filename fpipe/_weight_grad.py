"""Split backward: input gradients now, weight gradients later, without recomputing anything.

NOTE [split backward]
Zero-bubble schedules run a stage's backward as two actions: ``I`` computes the cotangents of
the stage's inputs (the previous stage waits for them), ``W`` the parameter gradients (nobody
waits; it fills bubbles). ``I`` is ``autograd.grad(outputs, inputs)``, which runs only the
graph nodes on paths from the outputs to the inputs. Parameter gradients hang off that path:
each parameter's gradient flows from the first nodes that are both downstream of the inputs
and upstream of the parameter (its "intermediates"). During ``I`` a pre-hook on each
intermediate saves the gradient arriving there; ``W`` then pulls those saved gradients back
from the intermediates to the parameters, ``autograd.grad(GradientEdges, params)``, which
touches only the small parameter side of the graph. Together they run each node once, as the
fused backward does. Parameters whose contributions never meet the inputs' paths (or a stage
whose inputs are not differentiable, like stage 0) are done in ``W`` straight from the outputs.
A parameter can have both kinds of paths (``{"h": x @ p, "u": p.sum()}``): outputs that the
inputs do not reach get no gradient during ``I``, so ``W`` seeds those it reaches with their
cotangents too, beside the saved gradients of its intermediates.
A ``torch.compile``'d stage is one opaque graph node whose backward yields every gradient at
once and cannot run twice: there ``I`` runs the whole backward and ``W`` only hands over the
parameter gradients (correct, but no bubble is filled).
The same idea is in ``torch.distributed.pipelining._backward``.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

# Where a backward starts: the gradient edge of an output, which autograd takes as a root exactly
# as it takes the tensor, without keeping the tensor's data (NOTE [outputs let go] in fpipe/_stage.py).
Root = GradientEdge


def _consumers(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """For every node reachable backwards from ``roots``, the nodes that consume its output."""
    consumers: dict[Node, list[Node]] = collections.defaultdict(list)
    queue = collections.deque(dict.fromkeys(roots))
    seen = set(queue)
    while queue:
        node = queue.popleft()
        for nxt, _ in node.next_functions:
            if nxt is not None:
                consumers[nxt].append(node)
                if nxt not in seen:
                    seen.add(nxt)
                    queue.append(nxt)
    return consumers


def _downstream(
    starts: Sequence[Node], consumers: dict[Node, list[Node]], stop: set[Node]
) -> tuple[set[Node], set[Node]]:
    """Nodes reached forward from ``starts`` (not entering ``stop``), and the ``stop`` nodes hit."""
    reached, hit = set(starts), set()
    queue = collections.deque(starts)
    while queue:
        for consumer in consumers.get(queue.popleft(), ()):
            if consumer in stop:
                hit.add(consumer)
            elif consumer not in reached:
                reached.add(consumer)
                queue.append(consumer)
    return reached, hit


@dataclass(eq=False)
class _Group:
    """Parameters whose gradients flow in through the same intermediates."""

    params: list[int] = field(default_factory=list)
    intermediates: list[Node] = field(default_factory=list)
    grads: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)
    outputs: list[int] = field(default_factory=list)  # outputs the inputs do not reach, that these params do


@dataclass(eq=False)
class DeferredWeightGrad:
    """What ``W`` needs after ``I`` ran: saved intermediate gradients, or the outputs themselves
    (``rest``: the parameters done from the outputs; ``done``: the gradients, already computed)."""

    groups: list[_Group]
    rest: list[int]
    outputs: list[Root]
    grad_outputs: list[torch.Tensor]
    params: Sequence[torch.Tensor]
    done: list[torch.Tensor | None] | None = None

    def run(self) -> list[torch.Tensor | None]:
        """The parameter gradients, one per parameter (``None`` where none flows)."""
        if self.done is not None:
            return self.done
        grads: list[torch.Tensor | None] = [None] * len(self.params)
        for group in self.groups:
            seeded = [
                (GradientEdge(node, k), g)
                for node in group.intermediates
                for k, g in enumerate(group.grads.get(node, ()))
                if g is not None
            ]
            seeded += [(self.outputs[j], self.grad_outputs[j]) for j in group.outputs]
            if not seeded:
                continue
            edges, seeds = zip(*seeded)
            # An intermediate downstream of another would get the gradient twice (saved, and
            # again through the other): pin each to what it saw during I.
            handles = [
                node.register_prehook(lambda _, saved=group.grads[node]: saved)
                for node in group.intermediates
                if node in group.grads and len(group.intermediates) > 1
            ]
            try:
                found = torch.autograd.grad(
                    list(edges),
                    [get_gradient_edge(self.params[k]) for k in group.params],
                    list(seeds),
                    retain_graph=True,
                    allow_unused=True,
                )
            finally:
                for handle in handles:
                    handle.remove()
            for k, g in zip(group.params, found):
                grads[k] = g
        if self.rest and self.outputs:
            found = torch.autograd.grad(
                self.outputs, [self.params[k] for k in self.rest], self.grad_outputs, allow_unused=True
            )
            for k, g in zip(self.rest, found):
                grads[k] = g
        return grads


def input_grad(
    outputs: list[Root],
    grad_outputs: list[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[Sequence[torch.Tensor | None], DeferredWeightGrad]:
    """The input half of a backward (NOTE [split backward]) and what the weight half needs."""
    if not outputs or not inputs:
        return [None] * len(inputs), DeferredWeightGrad([], list(range(len(params))), outputs, grad_outputs, params)
    roots = [o.node for o in outputs]
    consumers = _consumers(roots)
    if any(node.name().startswith("CompiledFunction") for node in [*roots, *consumers]):
        # A torch.compile'd region is one opaque node whose backward computes every gradient at
        # once (and may not be re-run): do the whole backward now, W only hands the result over.
        found = torch.autograd.grad(outputs, [*inputs, *params], grad_outputs, allow_unused=True)
        return found[: len(inputs)], DeferredWeightGrad([], [], [], [], params, done=list(found[len(inputs) :]))
    after_inputs, _ = _downstream([get_gradient_edge(x).node for x in inputs], consumers, set())
    unreached: dict[Node, list[int]] = collections.defaultdict(list)  # outputs I gives no gradient
    for j, node in enumerate(roots):
        if node not in after_inputs:
            unreached[node].append(j)
    by_node: dict[Node, _Group] = {}
    groups: list[_Group] = []
    rest: list[int] = []
    for k, p in enumerate(params):
        reached, hit = _downstream([get_gradient_edge(p).node], consumers, after_inputs)
        if not hit:
            rest.append(k)
            continue
        merged = list(dict.fromkeys(by_node[n] for n in hit if n in by_node))  # each group once
        group = merged[0] if merged else _Group()
        if not merged:
            groups.append(group)
        for other in merged[1:]:
            group.params += other.params
            group.intermediates += [n for n in other.intermediates if n not in group.intermediates]
            group.outputs += [j for j in other.outputs if j not in group.outputs]
            for n in other.intermediates:
                by_node[n] = group
            groups.remove(other)
        group.params.append(k)
        group.outputs += [j for n in reached if n in unreached for j in unreached[n] if j not in group.outputs]
        for n in hit:
            if n not in by_node:
                by_node[n] = group
                group.intermediates.append(n)

    # A pre-hook per intermediate saves the gradient arriving there: group.grads[node] = grad_outputs.
    handles = [
        node.register_prehook(functools.partial(group.grads.__setitem__, node))
        for group in groups
        for node in group.intermediates
    ]
    try:
        found = torch.autograd.grad(outputs, list(inputs), grad_outputs, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    for group in groups:
        group.params.sort()
        group.outputs.sort()
    return found, DeferredWeightGrad(groups, rest, outputs, grad_outputs, params)

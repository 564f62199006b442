"""A stage's parameter gradients summed over microbatches in microbatch order, whatever the schedule.

NOTE [fixed accumulation order]
A stage's parameter gradients are summed over microbatches in microbatch order 0, 1, 2, ...
whatever order the schedule runs the backwards in: a contribution that arrives early waits in
``OrderedSum`` until its predecessors are in. So every schedule, and one process or many, add
the same numbers in the same order and give bitwise-identical results.
The sum lives in the ``.grad`` of the stage's own parameter leaves (detached copies made for
the step, never the user's tensors). A fused backward whose microbatch is next in order lets
the autograd engine accumulate into them as it goes, as ``loss.backward()`` would: each
parameter's gradient is added while it is fresh in cache and freed at once, so a backward
never holds a second full set of the stage's gradients. Any other contribution (a backward
that runs early, a split backward's ``W``) is computed apart and added in order later; the
additions are the same either way (the engine's first one keeps the tensor, the next ones add
in place).

NOTE [gradients the engine keeps]
When the engine accumulates into a ``.grad`` that is not set yet, it may keep the gradient tensor
it was handed instead of copying it (``AccumulateGrad`` "steals" a tensor nothing else holds).
That tensor may be a view of one that other tensors share: in ``p.view(()) + q.view(())`` both
parameters get views of the one cotangent, so ``p.grad`` and ``q.grad`` share storage and the
next microbatch's in-place accumulation into one adds into the other too (plain
``loss.backward()`` in a loop has this bug: three such backwards give 5, not 3). Shared with
the seed, a received cotangent or an input leaf's ``.grad`` (the cotangent that goes back to
the previous stage), the next in-place addition would change those too. So after each engine
accumulation that set a ``.grad``, ``OrderedSum.own`` copies any such ``.grad`` whose storage
another tensor shares (its storage's use count, ``shares_storage``), before anything adds into
it; once every ``.grad`` is known to be the sum's own, nothing is checked. (A sum added by
``_flush`` is a copy from the start.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._tensor_parallel import clone, shares_storage

Grads = list[torch.Tensor | None]


class OrderedSum:
    """Sums per-microbatch gradients into ``leaves``' ``.grad`` in microbatch order.

    NOTE [fixed accumulation order]: ``engine_accumulates`` says whether the engine may accumulate
    a microbatch's backward straight into ``.grad`` (then ``accumulated`` records it); ``add``
    takes a contribution computed apart and adds it once its predecessors are in. ``order``: the
    microbatches summed, in order (default ``0, 1, 2, ...``): a holder's own, for a stage on
    several ranks (NOTE [a stage on several ranks] in fpipe/schedules/_program.py).
    """

    def __init__(
        self,
        leaves: list[torch.Tensor],
        dtypes: Sequence[torch.dtype] | None = None,
        order: Sequence[int] | None = None,
    ) -> None:
        self._leaves = leaves
        self._order = order  # (``None``: microbatch ``k`` is the ``k``-th)
        self._next = 0  # the position in ``order`` of the next microbatch to add
        self._pending: dict[int, Grads] = {}
        # With a precision policy whose sums are wider than the leaves (NOTE [precision of a leaf]),
        # the sums live here in their own dtypes, every contribution is added by ``_flush``.
        self._dtypes = dtypes
        self._sums: Grads = [None] * len(leaves)
        # Which ``.grad``s are known to be this sum's own (NOTE [gradients the engine keeps]).
        self._own = [False] * len(leaves)
        self.all_own = not leaves

    def engine_accumulates(self, microbatch: int) -> bool:
        """Whether the engine may add ``microbatch``'s gradients straight into ``.grad``: every
        earlier microbatch's contribution is in, and the sums have the leaves' dtypes (``.grad``
        has the leaf's dtype)."""
        return microbatch == self._expected() and self._dtypes is None

    def _expected(self) -> int:
        """The microbatch to add next (past the end: -1)."""
        order, k = self._order, self._next
        return k if order is None else order[k] if k < len(order) else -1

    def accumulated(self, microbatch: int) -> None:
        """The engine has added ``microbatch``'s gradients to ``.grad`` (each one this sum's own: ``own``)."""
        assert microbatch == self._expected(), "fpipe: accumulated out of microbatch order"
        self._next += 1
        if self._pending:
            self._flush()

    def own(self) -> None:
        """After the engine has added into ``.grad``: copy each ``.grad`` it has just set that
        shares its storage, before anything adds into it (NOTE [gradients the engine keeps])."""
        for k, leaf in enumerate(self._leaves):
            if not self._own[k] and leaf.grad is not None:
                if shares_storage(leaf.grad):
                    leaf.grad = clone(leaf.grad)
                self._own[k] = True
        self.all_own = all(self._own)

    def add(self, microbatch: int, grads: Sequence[torch.Tensor | None]) -> None:
        """Add ``grads`` (one per leaf, ``None`` for none) once earlier microbatches are in."""
        self._pending[microbatch] = list(grads)
        self._flush()

    def _flush(self) -> None:
        while self._expected() in self._pending:
            if self._dtypes is not None:
                self._add_wide(self._pending.pop(self._expected()), self._dtypes)
                self._next += 1
                continue
            for leaf, g in zip(self._leaves, self._pending.pop(self._expected())):
                if g is None:
                    continue
                if leaf.grad is None:
                    # A copy: autograd may hand back the cotangent itself (``x + p``) or an
                    # expanded view of it (``p.sum()``), and later sums add in place. A
                    # ``Partial`` DTensor stays one (``clone``), summed once in ``grads``.
                    leaf.grad = clone(g)
                else:
                    leaf.grad.add_(g)
            self._next += 1

    def _add_wide(self, grads: Grads, dtypes: Sequence[torch.dtype]) -> None:
        for k, (g, dtype) in enumerate(zip(grads, dtypes)):
            if g is None:
                continue
            total = self._sums[k]
            if total is None:
                self._sums[k] = g.to(dtype, copy=True)  # a copy, as in _flush
            else:
                total.add_(g)  # the narrow gradient is widened exactly, then added in ``dtype``

    @property
    def total(self) -> Grads:
        """The sum so far, one per leaf (``None`` where nothing was added)."""
        if self._dtypes is not None:
            return list(self._sums)
        return [leaf.grad for leaf in self._leaves]

    def replace(self, k: int, g: torch.Tensor) -> None:
        """Keep ``g`` as leaf ``k``'s sum: the same sum, redistributed (a wide sum cannot be a ``.grad``)."""
        if self._dtypes is not None:
            self._sums[k] = g
        else:
            self._leaves[k].grad = g


class HoldersSum:
    """A stage's gradients in one process when the program runs it on several ranks (NOTE [a stage
    on several ranks] in fpipe/schedules/_program.py): one ``OrderedSum`` per holder, over that
    holder's microbatches (``orders``, in holder order), the first in ``.grad``, the others apart
    in the leaves' dtypes (or the policy's); ``total`` adds the others to the first in holder
    order, once, as the holders' exchange does on many ranks. ``OrderedSum``'s interface."""

    def __init__(
        self, leaves: list[torch.Tensor], dtypes: Sequence[torch.dtype] | None, orders: Sequence[Sequence[int]]
    ) -> None:
        apart = list(dtypes) if dtypes is not None else [leaf.dtype for leaf in leaves]
        self._sums = [OrderedSum(leaves, dtypes, orders[0])] + [
            OrderedSum(leaves, apart, order) for order in orders[1:]
        ]
        self._holder = {i: k for k, order in enumerate(orders) for i in order}
        self._added = False

    @property
    def all_own(self) -> bool:
        return self._sums[0].all_own

    def engine_accumulates(self, microbatch: int) -> bool:
        return self._holder[microbatch] == 0 and self._sums[0].engine_accumulates(microbatch)

    def accumulated(self, microbatch: int) -> None:
        self._sums[0].accumulated(microbatch)

    def own(self) -> None:
        self._sums[0].own()

    def add(self, microbatch: int, grads: Sequence[torch.Tensor | None]) -> None:
        self._sums[self._holder[microbatch]].add(microbatch, grads)

    @property
    def total(self) -> Grads:
        first = self._sums[0]
        if not self._added:
            self._added = True
            for other in self._sums[1:]:
                for k, g in enumerate(other.total):
                    total = first.total[k]
                    if g is None:
                        continue
                    if total is None:
                        first.replace(k, clone(g))
                    else:
                        total.add_(g)
        return first.total

    def replace(self, k: int, g: torch.Tensor) -> None:
        self._sums[0].replace(k, g)

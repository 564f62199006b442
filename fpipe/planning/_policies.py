"""The list-scheduling policies ``search`` tries, the likeliest winners first."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace

from ._list_schedule import Policy
from ._problem import Problem

LOCAL_ACTIONS = 200  # the largest programs local improvement is tried on (and the unreserved grid run twice)


def policies(problem: Problem) -> Iterator[Policy]:
    """The list-scheduling policies to try, the likeliest winners first: over a grid of 972 cost
    cases (notes/search.md's costs, ``p`` 4 and 8, every placement), the order of how often each
    laid out the fastest program; fused backwards win only where ``B`` costs less than ``I + W``.
    With several stages per rank and a memory limit, memory is held as used (``reserve=False``,
    NOTE [unreserved memory] in ``_list_schedule.py``): over notes/search.md's small cases and
    its ``p = 4, m = 8`` grid with two stages per rank, each policy so was among the fastest
    passes 2.5 to 6 times as often as when reserving (with one stage per rank, or no limit, the
    two are the same)."""
    several = problem.num_stages > problem.num_ranks
    unreserved = several and any(math.isfinite(limit) for limit in problem.limits)
    for policy in _grid(several):
        yield replace(policy, reserve=not unreserved)
    if unreserved and problem.num_stages * problem.num_microbatches * 3 <= LOCAL_ACTIONS:
        yield from _grid(several)  # cheap there, and local improvement starts from their best too


def _grid(several: bool) -> Iterator[Policy]:
    yield Policy(split=True, extra=None)
    yield Policy(split=True, backward_first=False, extra=None)
    yield Policy(split=True, extra=4)
    yield Policy(split=True, extra=None, patient=True)
    for extra in (2, 1, 0):
        yield Policy(split=True, extra=extra, patient=True)
        yield Policy(split=True, extra=extra)
    yield Policy(split=True, backward_first=False, extra=0)
    if several:
        yield Policy(split=True, deep_first=False, extra=None)
    yield Policy(split=True, extra=-1)
    yield Policy(split=False, backward_first=False, extra=None)
    yield Policy(split=False, extra=0)
    yield Policy(split=False, extra=None)

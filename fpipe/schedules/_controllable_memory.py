"""V-Half and V-Min: V schedules at about 1/2 and 1/3 of 1F1B's activation memory (Qi et al.,
"Pipeline Parallelism with Controllable Memory", NeurIPS 2024, arXiv 2405.15362), in the order that
sail-sg/zero-bubble-pipeline-parallelism builds them
(``megatron/core/pipeline_parallel/zerobubble/scheduler/zbv_greedy.py``).

NOTE [controllable-memory building blocks]
    The paper builds a schedule from one *building block* per rank: where, inside a repeating
    interval, the rank runs its four passes of a microbatch (``F`` and ``I`` of chunk 0, ``F``
    and ``I`` of chunk 1). Repeated every interval, the block sets the peak activations of a rank
    by its *lifespan*, how long a microbatch's activations stay alive: with an interval of 6 unit
    slots (an ``F``, ``I`` and ``W`` per chunk), V-Min's block keeps a chunk's activations about
    ``4p`` slots (``2p/3`` chunks alive, a third of 1F1B's ``p`` stages), V-Half's about ``6p``
    (``p`` chunks, a half). The repository's ``schedule_from_pattern`` then turns the repeated
    blocks into an order, greedily; ``_greedy_v`` transliterates it step by step::

        slot[r][pass][i] = block(p, r)[pass] + 6i          # pass: f0, f1, i1, i0
        put W: each W in the first free slot after its I   # one queue for both chunks
        squeeze(slots, warm_up=True)
        drop the W; squeeze(slots, warm_up=False)
        put W, chunk 1's queue first; each rank runs its actions in slot order

    ``squeeze`` visits the actions in slot order and moves each to the earliest free slot after
    its inputs' and its previous microbatch's slots where the rank's peak (chunk activations
    alive from ``F`` to ``W``; a free slot runs a pending ``W`` when no ``W`` is placed) stays
    at most the peak before the pass; the steady state (from rank 0's first chunk-0 ``I`` to
    the first last-microbatch ``F``) stays as it is, and so does the warm-up unless
    ``warm_up``. It then retimes every action as soon as possible at unit cost. The tests hold
    the result against literal grids and the repository's output.

    The repository recounts a rank's peak over all its actions for every slot it tries, which
    at ``p = 32``, ``m = 256`` took seconds; ``_Walk`` keeps the count after each action and
    recounts only the stretch a move changes, with the same result.

NOTE [distinct slots]
    No two actions of a rank ever share a slot here: a rank's four block starts differ modulo 6
    (V-Half's pairwise differences are not multiples of 3 but ``b - f = 3p + gap``, an odd one;
    V-Min's are odd but ``B - F = b - f = 2p + gap``, not a multiple of 3), ``put_w`` fills free
    slots only, ``squeeze`` moves an action only to a free slot (every slot before the one
    visited holds an action already visited, marked occupied, or none), and the unit-cost
    retiming runs one action per slot on a rank. The repository's walks also say what a shared
    slot does (its ``mem_of_stage`` stops counting there, its ``put_w`` stops taking the rank's
    actions); fpipe's never meet one.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass

from ._action import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action
from ._placement import BuiltinSchedule, v_ranks
from ._program import Program

# The passes of one microbatch on rank r, as the repository numbers them ("FfBbWw"): F and f are
# the forwards of chunk 0 (stage r) and chunk 1 (stage 2p-1-r), B and b the input gradients of
# chunk 1 and chunk 0 (the backward comes up the V first), W and w their weight gradients.
_F, _f, _B, _b = 0, 1, 2, 3

Times = list[list[int]]  # one rank's slot per pass type, per microbatch


@dataclass(frozen=True)
class _ControllableV(BuiltinSchedule):
    """What V-Half and V-Min share: the V placement, and the repository's greedy passes over the
    class's building block (``_BLOCKS``)."""

    def program(self, num_stages: int, num_ranks: int | None = None) -> Program:
        """The program for ``num_stages`` stages on ``num_stages // 2`` ranks.

        Raises:
            ScheduleError: if ``num_stages`` is odd or below 2, or ``num_ranks`` is given and is not
                ``num_stages // 2``.
        """
        name = type(self).__name__
        return _greedy_v(v_ranks(name, num_stages, num_ranks), self.num_microbatches, _BLOCKS[name])


@dataclass(frozen=True)
class VHalf(_ControllableV):
    """V-Half (Qi et al., 2024): a V schedule at half of 1F1B's activation memory.

    ``ZeroBubbleV``'s placement (rank ``r`` holds stage ``r`` and stage ``2p - 1 - r``), its
    backward split into ``I`` and ``W``, and the paper's V-shape building block that keeps about
    half of 1F1B's activations: rank ``r`` of ``p`` starts its passes of microbatch ``i`` at
    these slots (``f0``/``f1`` the forwards of chunks 0 and 1, ``i1``/``i0`` their input
    gradients, 6 slots per microbatch), as ``stable_pattern_v_half`` of the repository's
    ``zbv_greedy.py`` writes it::

        gap = 3 if p % 2 == 0 else 0
        f0(i) = 2r + 6i
        f1(i) = 3p - r - 2 + 6i
        i1(i) = 3p + gap + 2r - 1 + 6i
        i0(i) = 6p + gap - r - 2 + 6i

    and the repository's greedy passes turn those slots into each rank's order (NOTE
    [controllable-memory building blocks]). The result holds at most ``(p + 2) // 2``
    microbatches' activations on a rank (``min(m, (p + 2) // 2)`` on the busiest; NOTE
    [activation units]; 1F1B: ``p``) whatever the costs. When ``T_F = T_I = T_W``, the costs the
    order is built for, and ``m >= 2p``, its bubble is at most 0.6 of 1F1B's (``p`` 2..8; the
    paper says half): notes/schedules.md states the exact figures. It takes any number of
    microbatches.
    """


@dataclass(frozen=True)
class VMin(_ControllableV):
    """V-Min (Qi et al., 2024): a V schedule at a third of 1F1B's activation memory.

    As ``VHalf`` with the paper's smallest V-shape building block, which keeps about a third of
    1F1B's activations: rank ``r`` of ``p`` starts microbatch ``i``'s passes at (same notation;
    ``stable_pattern_v_min`` of the repository's ``zbv_greedy.py``)::

        gap = 2 if p % 3 == 0 else 0
        f0(i) = r + 6i
        f1(i) = 2p - r - 1 + 6i
        i1(i) = 2p + gap + r + 6i
        i0(i) = 4p + gap - r - 1 + 6i

    then the same greedy passes (NOTE [controllable-memory building blocks]). The result holds
    at most ``(p + 4) // 3`` microbatches' activations on a rank (``min(m, (p + 4) // 3)`` on the
    busiest; NOTE [activation units]; 1F1B: ``p``) whatever the costs. Its block leaves slots
    that only a ``W`` of the same cost fills: at ``T_F = T_I = T_W`` and ``m >= 2p`` its bubble is
    at most 0.75 of 1F1B's (``p`` 2..8; the paper says two thirds), with ``T_I = 2 T_F`` well
    above it (``p = 8``, ``m = 32``: 0.39 against 0.18; the repository's README warns that V-Min
    suffers from unequal costs).
    It takes any number of microbatches.
    """


def _half_block(p: int, r: int) -> list[int]:
    """V-Half's slots of microbatch 0's ``F, f, B, b`` on rank ``r`` (``stable_pattern_v_half``)."""
    gap = 3 if p % 2 == 0 else 0
    return [2 * r, 3 * p - r - 2, 3 * p + gap + 2 * r - 1, 6 * p + gap - r - 2]


def _min_block(p: int, r: int) -> list[int]:
    """V-Min's slots of microbatch 0's ``F, f, B, b`` on rank ``r`` (``stable_pattern_v_min``)."""
    gap = 2 if p % 3 == 0 else 0
    return [r, 2 * p - r - 1, 2 * p + gap + r, 4 * p + gap - r - 1]


_BLOCKS: dict[str, Callable[[int, int], list[int]]] = {"VHalf": _half_block, "VMin": _min_block}


def _greedy_v(p: int, m: int, block: Callable[[int, int], list[int]]) -> Program:
    """The repository's ``schedule_from_pattern``: blocks repeated every 6 slots, squeezed twice, ``W`` placed."""
    slots = [[[start + 6 * i for i in range(m)] for start in block(p, r)] for r in range(p)]
    # First with the W of both chunks in one queue, then again without (re-placed after).
    slots = [rank[:4] for rank in _squeeze(slots, with_w=True)]
    slots = [rank[:4] for rank in _squeeze(slots, with_w=False)]
    slots = [_put_w(rank, split=True) for rank in slots]
    ranks = []
    for r, rank in enumerate(slots):
        stages = (r, 2 * p - 1 - r, 2 * p - 1 - r, r, 2 * p - 1 - r, r)  # F f B b W w
        kinds = (FORWARD, FORWARD, BACKWARD_INPUT, BACKWARD_INPUT, BACKWARD_WEIGHT, BACKWARD_WEIGHT)
        timed = sorted((slot, t, i) for t, times in enumerate(rank) for i, slot in enumerate(times))
        ranks.append(tuple(Action(stages[t], kinds[t], i) for _, t, i in timed))
    return Program(tuple(ranks), 2 * p, m)


def _put_w(rank: Times, *, split: bool) -> Times:
    """``put_w``: each ``W`` in the first free slot after its ``B``/``b``; one queue, or one per chunk (``split``).

    The repository walks the slots one by one; a free slot runs one ``W`` from the first queue
    that has one pending. Between two of the rank's actions that is the stretch of free slots
    between them, filled queue by queue (NOTE [distinct slots]: no two actions share a slot).
    """
    w_slots: Times = [[], []] if split else [[]]
    pending = [0, 0]
    free = 0  # the first slot after the last action walked
    for time, t in sorted((time, t) for t, times in enumerate(rank[:4]) for time in times):
        for w, queue in enumerate(w_slots):
            run = min(pending[w], time - free)
            if run > 0:
                queue.extend(range(free, free + run))
                pending[w] -= run
                free += run
        if t in (_B, _b):
            pending[t - _B if split else 0] += 1
        free = time + 1
    for w, queue in enumerate(w_slots):  # the rest after the last action, queue by queue
        queue.extend(range(free, free + pending[w]))
        free += pending[w]
    return [*rank, *w_slots]


_CHANGE = (1, 1, 0, 0, -1)  # chunk activations alive: an F or f adds one, a W frees one


class _Walk:
    """``mem_of_stage`` of one rank, kept up to date while its actions move one at a time.

    The repository counts the rank's peak activations in chunk units by walking its actions in
    slot order: an ``F``/``f`` adds one, a ``W`` frees one and, when the rank has no ``W`` slots
    (``drain``), each free slot runs one pending ``W`` (one per ``B``/``b`` walked). It recounts
    the whole rank for every slot it tries; a move changes the walk only from the new slot on,
    and once the walk is past the old slot in the state it had before the move, the rest is as
    before. So ``move`` walks from the new slot until the states meet again (``W`` slots: just past
    the old slot), and since the rank's peak is within the limit before the move, the move keeps
    it there if that stretch does (NOTE [distinct slots]: no two actions share a slot).

    Attributes:
        events: the rank's ``(slot, type)`` in slot order.
        states: ``(pending W, alive)`` after each of ``events`` (pending stays 0 with ``W`` slots).
        drain: whether free slots run pending ``W``s (the rank has no ``W`` slots).
    """

    def __init__(self, rank: Times) -> None:
        self.drain = len(rank) == 4
        self.events = sorted((time, t) for t, times in enumerate(rank) for time in times)
        self.states: list[tuple[int, int]] = []
        walked = self._walk(0, 0, -1, None, len(self.events))
        assert walked is not None  # never more alive than actions
        self.states = walked

    def peak(self) -> int:
        """The most chunk activations alive at once."""
        return max((alive for _, alive in self.states), default=0)

    def move(self, time: int, t: int, to: int, limit: int) -> bool:
        """Move the action of type ``t`` at slot ``time`` to the free slot ``to < time`` when the
        peak stays at most ``limit`` (it is before the move); say whether it moved."""
        old = bisect_left(self.events, (time, t))
        new = bisect_left(self.events, (to, t))
        walked = self._walk(new, old, to, t, limit)
        if walked is None:
            return False
        del self.events[old]
        self.events.insert(new, (to, t))
        self.states[new : new + len(walked)] = walked  # past them, the indices are the old ones
        return True

    def _walk(self, new: int, old: int, to: int, t: int | None, limit: int) -> list[tuple[int, int]] | None:
        """The states from index ``new`` on with the action at index ``old`` moved to ``(to, t)``
        at index ``new`` (``t`` None: nothing moved, ``new = old``: from the start), up to where
        they meet the current ones; None as soon as more than ``limit`` are alive."""
        events, states = self.events, self.states
        previous, (pending, alive) = (events[new - 1][0], states[new - 1]) if new else (-1, (0, 0))
        walked = []
        for k in range(new, len(events)):
            if t is not None and k <= old:
                time, kind = (to, t) if k == new else events[k - 1]
            else:
                time, kind = events[k]
            if self.drain:
                drained = min(pending, time - previous - 1)
                pending, alive = pending - drained, alive - drained
                pending += kind in (_B, _b)
            alive += _CHANGE[kind]
            if alive > limit:
                return None
            walked.append((pending, alive))
            if t is not None and k > old and states[k] == (pending, alive):
                break
            previous = time
        return walked


def _in_slot_order(slots: list[Times]) -> list[tuple[int, int, int, int]]:
    """``(slot, rank, type, microbatch)`` of every action, in the order the repository visits them.

    NOTE [slot order]
        The repository's passes pick, again and again, the earliest of the next actions of each
        (rank, type) queue, ties to the lower rank, then type. Each queue's slots increase with
        the microbatch (an action never moves before the previous microbatch's), and an action
        moves only when visited, so that is the sorted order of the slots as they were before the
        pass.
    """
    return sorted(
        (slot, r, t, i) for r, rank in enumerate(slots) for t, times in enumerate(rank) for i, slot in enumerate(times)
    )


def _squeeze(slots: list[Times], *, with_w: bool) -> list[Times]:
    """``reorder``: visit the actions in slot order and move each to the earliest free slot after its
    dependencies that keeps the rank's peak (the warm-up only ``with_w``, never the steady state
    between rank 0's first ``b`` and the first last ``F``); return the as-soon-as-possible start
    times of the result at unit cost."""
    slots = [_put_w(rank, split=False) if with_w else rank for rank in slots]
    slots = [[list(times) for times in rank] for rank in slots]  # moved in place below
    p = len(slots)
    walks = [_Walk(rank) for rank in slots]
    limit = max(walk.peak() for walk in walks)
    occupied = [[False] * (rank[-1][-1] + 1) for rank in slots]
    phase = 0  # 0: warm-up, 1: steady state, 2: cool-down
    for time, r, t, i in _in_slot_order(slots):
        if phase == 0 and (r, t) == (0, _b):
            phase = 1
        if phase == 1 or (phase == 0 and not with_w):
            if phase == 1 and t == _F and i == len(slots[0][_F]) - 1:
                phase = 2
            occupied[r][slots[r][t][i]] = True
            continue
        after = -1  # the latest slot this action waits for
        if t in (_F, _B) and r > 0:
            after = max(after, slots[r - 1][t][i])
        if t in (_f, _b) and r + 1 < p:
            after = max(after, slots[r + 1][t][i])
        if 0 < t < 4:
            after = max(after, slots[r][t - 1][i])
        if t == 4:
            after = max(after, sorted(slots[r][_B] + slots[r][_b])[i])
        if i > 0:
            after = max(after, slots[r][t][i - 1])
        for earlier in range(after + 1, time):
            if not occupied[r][earlier] and walks[r].move(time, t, earlier, limit):
                slots[r][t][i] = earlier
                break
        occupied[r][slots[r][t][i]] = True
    if not with_w:
        slots = [_put_w(rank, split=False) for rank in slots]
    return _unit_starts(slots)


def _unit_starts(slots: list[Times]) -> list[Times]:
    """``eager_execution_time`` at unit cost and free messages: visit the actions in slot order and
    start each when its rank is free and its inputs exist."""
    p = len(slots)
    start: list[Times] = [[[-1] * len(times) for times in rank] for rank in slots]
    free = [0] * p  # when each rank is next free
    for _, r, t, i in _in_slot_order(slots):
        ready = free[r]
        if t in (_F, _B) and r > 0:
            ready = max(ready, start[r - 1][t][i] + 1)
        if t in (_f, _b) and r + 1 < p:
            ready = max(ready, start[r + 1][t][i] + 1)
        if 0 < t < 4:
            ready = max(ready, start[r][t - 1][i] + 1)
        if i > 0:
            ready = max(ready, start[r][t][i - 1] + 1)
        start[r][t][i] = ready
        free[r] = ready + 1
    return start

"""Programs: per-rank action lists, their validation, and their rank x time grid.

A program is plain data. ``validate`` checks that it can run; ``ticks_of`` replays it with unit
cost per action (each rank runs its next action as soon as that action's inputs exist), which
gives both the picture (``render``) and the order in which a single process interprets it.

Dependencies between actions (``s`` stage, ``i`` microbatch, ``S`` stages)::

    F(s, i)      needs F(s-1, i)                     (the activation)
    B/I(s, i)    needs F(s, i) and B/I(s+1, i)       (the cotangent; the last stage needs only F)
    W(s, i)      needs I(s, i)

A program may also pair two adjacent actions of a rank (``Program.pairs``): an overlapped pair,
run interleaved at the stages' communication points (NOTE [overlapped pairs] in
fpipe/_pairs.py). A pair is one unit of the replay: it starts once both halves' dependencies
have ended, and both halves' results exist when it ends, so a program whose pairs would wait on
each other's messages deadlocks in the replay, and ``validate`` says so.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from .._plural import brief, listing, plural
from ._action import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, KINDS, Action


class ScheduleError(ValueError):
    """A program that cannot run, or schedule parameters that cannot work."""


@dataclass(frozen=True)
class Program:
    """Per-rank ordered action lists for ``num_stages`` stages and ``num_microbatches`` microbatches.

    ``ranks[r]`` is what rank ``r`` executes, in order. Which rank holds a stage (the placement)
    is read off the actions: a stage lives on the rank whose list mentions it, or on several,
    each running it on its own microbatches (NOTE [a stage on several ranks]).
    """

    ranks: tuple[tuple[Action, ...], ...]
    num_stages: int
    num_microbatches: int
    pairs: frozenset[tuple[Action, Action]] = frozenset()  # overlapped pairs: (first, second), adjacent

    @classmethod
    def from_lists(
        cls,
        ranks: Sequence[Sequence[Action | str]],
        *,
        num_stages: int | None = None,
        num_microbatches: int | None = None,
    ) -> Program:
        """Build a program from per-rank lists of actions or strings such as ``"2F0"``.

        ``num_stages`` and ``num_microbatches`` default to one more than the largest index used.
        Two actions joined by ``&`` (``"1F3&1B1"``) are an overlapped pair (``Program.pairs``),
        in that order. The result is not validated; call ``validate`` (``fpipe.pipeline`` does).
        """
        if isinstance(ranks, (str, bytes)) or not all(
            isinstance(row, Sequence) and not isinstance(row, str) for row in ranks
        ):
            raise ScheduleError(
                "fpipe.schedules: a program is a list with one list of actions per rank, "
                f"e.g. [['0F0', '0B0'], ['1F0', '1B0']] (got: {ranks!r})."
            )
        pairs: set[tuple[Action, Action]] = set()
        rows_: list[tuple[Action, ...]] = []
        for row in ranks:
            out: list[Action] = []
            for a in row:
                if isinstance(a, str) and "&" in a:
                    first, second = (Action.parse(half) for half in a.split("&", 1))
                    out += [first, second]
                    pairs.add((first, second))
                else:
                    out.append(a if isinstance(a, Action) else Action.parse(a))
            rows_.append(tuple(out))
        rows = tuple(rows_)
        every = [a for row in rows for a in row]
        if num_stages is None:
            num_stages = max((a.stage for a in every), default=-1) + 1
        if num_microbatches is None:
            num_microbatches = max((a.microbatch for a in every), default=-1) + 1
        return cls(rows, num_stages, num_microbatches, frozenset(pairs))

    @property
    def num_ranks(self) -> int:
        """The number of (possibly virtual) ranks."""
        return len(self.ranks)

    def placement(self) -> tuple[int, ...]:
        """``placement()[s]`` is the rank that holds stage ``s``, the first of its holders for a
        stage on several ranks (``holders``; validated programs only)."""
        return tuple(holders[0] for holders in _holders(self))

    def holders(self, stage: int) -> tuple[int, ...]:
        """The ranks that hold ``stage``, ordered by the first microbatch each runs it on: one,
        or several (NOTE [a stage on several ranks]; validated programs only)."""
        return _holders(self)[stage]

    def rank_of(self, stage: int, microbatch: int) -> int:
        """The rank that runs ``stage`` on ``microbatch`` (validated programs only)."""
        return _ranks_of(self)[stage][microbatch]

    def placement_by_microbatch(self) -> tuple[tuple[int, ...], ...]:
        """``placement_by_microbatch()[s][i]`` is ``rank_of(s, i)``: the table, for callers that
        ask per message (one lookup of the program, which hashes it, instead of one per call)."""
        return _ranks_of(self)

    def microbatches_on(self, stage: int, rank: int) -> tuple[int, ...]:
        """The microbatches ``rank`` runs ``stage`` on, in order (validated programs only)."""
        return tuple(i for i, r in enumerate(_ranks_of(self)[stage]) if r == rank)

    def shared(self) -> bool:
        """Whether some stage lives on several ranks (NOTE [a stage on several ranks])."""
        return any(len(holders) > 1 for holders in _holders(self))

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages that ``rank`` holds, in increasing order."""
        return tuple(sorted({a.stage for a in self.ranks[rank]}))

    def __str__(self) -> str:
        return render(self)


# NOTE [a stage on several ranks]
# A program may run a stage on several ranks, each on its own microbatches: DualPipe's rank r
# holds stage r for the first half of the microbatches and stage p-1-r for the second. Every
# holder holds the stage's parameters. A (stage, microbatch)'s actions all run on one rank, which
# receives its activation and cotangent and sends them on; each holder sums its microbatches'
# gradients in microbatch order, and the holders' sums are added in holder order (by the first
# microbatch each runs): ``(g_0 + ... + g_{h-1}) + (g_h + ... + g_{m-1})`` for two halves, in one
# process and many; replicas then reduce (or reduce-scatter) that sum as any stage's gradients. Such a program is
# bitwise equal to itself across runtimes and within float rounding of the other schedules,
# which add ``g_h`` to the running sum: keeping their order would need every per-microbatch
# gradient of one holder sent to the other, or held until the other's sum arrives (the memory
# DualPipe saves).


@functools.lru_cache(maxsize=64)
def _ranks_of(program: Program) -> tuple[tuple[int, ...], ...]:
    """``_ranks_of(p)[s][i]``: the rank whose row runs stage ``s`` on microbatch ``i``."""
    where = [[-1] * program.num_microbatches for _ in range(program.num_stages)]
    for r, row in enumerate(program.ranks):
        for a in row:  # (one rank per stage and microbatch in a valid program: ``validate_actions``)
            if where[a.stage][a.microbatch] < 0:
                where[a.stage][a.microbatch] = r
    return tuple(map(tuple, where))


@functools.lru_cache(maxsize=64)
def _holders(program: Program) -> tuple[tuple[int, ...], ...]:
    """Per stage, its ranks ordered by the first microbatch each runs it on (``Program.holders``)."""
    return tuple(tuple(dict.fromkeys(ranks)) for ranks in _ranks_of(program))


class Schedule(Protocol):
    """What ``fpipe.pipeline`` accepts as a schedule: a value that builds a program.

    ``program(num_stages, num_ranks)`` lays ``num_stages`` stages on ``num_ranks`` ranks (the
    pipeline group's size when distributed); ``num_ranks=None`` asks for the schedule's own
    default, which is what one process uses (its ranks are virtual).
    """

    @property
    def num_microbatches(self) -> int: ...

    def program(self, num_stages: int, num_ranks: int | None = None) -> Program:
        """The per-rank action lists for ``num_stages`` stages on ``num_ranks`` ranks (``None``:
        the schedule's default); raises ``ScheduleError`` for sizes it cannot lay out."""
        ...


def dependencies(action: Action, num_stages: int, split: frozenset[tuple[int, int]]) -> list[Action]:
    """The actions that must finish before ``action`` can start (see the module docstring).

    ``split`` holds the ``(stage, microbatch)`` pairs whose backward is split into ``I`` and ``W``.
    """
    s, i = action.stage, action.microbatch
    if action.kind == FORWARD:
        return [Action(s - 1, FORWARD, i)] if s > 0 else []
    if action.kind == BACKWARD_WEIGHT:
        return [Action(s, BACKWARD_INPUT, i)]
    deps = [Action(s, FORWARD, i)]
    if s + 1 < num_stages:
        deps.append(Action(s + 1, BACKWARD_INPUT if (s + 1, i) in split else BACKWARD, i))
    return deps


def split_backwards(program: Program) -> frozenset[tuple[int, int]]:
    """The ``(stage, microbatch)`` pairs whose backward the program runs as ``I`` then ``W``."""
    return frozenset((a.stage, a.microbatch) for row in program.ranks for a in row if a.kind == BACKWARD_INPUT)


def validate(program: Program) -> None:
    """Check that ``program`` can run, or raise ``ScheduleError`` saying why.

    Checks, in order: indices in range; each stage and microbatch on one rank; every forward and
    backward present exactly once (a backward is either ``B`` or the pair ``I`` + ``W``); on each
    rank a backward after its forward and ``W`` after its ``I``; and, replaying the program, no
    dependency cycle across ranks (a deadlock), reported with the grid and the stuck actions.
    """
    validate_actions(program)
    validate_pairs(program)
    ticks_of(program)


def validate_pairs(program: Program) -> None:
    """Raise ``ScheduleError`` unless each of ``program.pairs`` is a forward and a backward (``B``
    or ``I``) of one rank, adjacent in its row, each action in one pair at most, and the second
    not needing the first (it would wait for it inside the pair). Whether pairs wait on each
    other's messages across ranks is the replay's to find (``ticks_of``)."""
    where = {a: (r, k) for r, row in enumerate(program.ranks) for k, a in enumerate(row)}
    seen: set[Action] = set()
    split = split_backwards(program)
    for first, second in sorted(program.pairs):
        name = f"{first}&{second}"
        if first not in where or second not in where:
            raise ScheduleError(f"fpipe.schedules: the pair {name} names an action the program does not run.")
        (r1, k1), (r2, k2) = where[first], where[second]
        if r1 != r2:
            raise ScheduleError(
                f"fpipe.schedules: the pair {name} has its halves on two ranks ({first} on rank {r1}, {second} on "
                f"rank {r2}). A pair runs two actions of one rank together: pair actions of one rank."
            )
        if k2 != k1 + 1:
            raise ScheduleError(
                f"fpipe.schedules: the pair {name} is not adjacent on rank {r1} (positions {k1} and {k2}). "
                "Put the second half right after the first."
            )
        kinds = {first.kind, second.kind}
        if FORWARD not in kinds or not kinds & {BACKWARD, BACKWARD_INPUT}:
            raise ScheduleError(
                f"fpipe.schedules: the pair {name} must be a forward and a backward (B or I) "
                f"(kinds: {first.kind}, {second.kind})."
            )
        if second.kind == FORWARD and second.stage == 0:
            raise ScheduleError(
                f"fpipe.schedules: the pair {name} has stage 0's forward second; it reads the microbatch (and may send "
                "it on to the last stage's rank) as it starts, which must come before its pair's sends: put it first."
            )
        if seen & {first, second}:
            raise ScheduleError(f"fpipe.schedules: an action of the pair {name} is in another pair too.")
        seen |= {first, second}
        if first in dependencies(second, program.num_stages, split):
            raise ScheduleError(
                f"fpipe.schedules: the pair {name} would deadlock: {second} needs {first}, which ends only with "
                "the pair. Pair actions of different microbatches (or stages) that do not need each other."
            )


def validate_actions(program: Program) -> None:
    """``validate``'s checks but the replay: what a replay with costs (``simulate``) needs before it
    runs. Whether the program deadlocks depends only on its order, so such a replay stops short on
    a rank exactly when ``ticks_of`` does, and then calls it for the error."""
    S, M = program.num_stages, program.num_microbatches
    if S < 1 or M < 1 or not program.ranks:
        raise ScheduleError(
            f"fpipe.schedules: a program needs at least one rank, stage and microbatch "
            f"(ranks: {program.num_ranks}, stages: {S}, microbatches: {M})."
        )
    seen: dict[Action, tuple[int, int]] = {}
    owner: dict[tuple[int, int], int] = {}
    for r, row in enumerate(program.ranks):
        for pos, a in enumerate(row):
            if a.kind not in KINDS or not (0 <= a.stage < S) or not (0 <= a.microbatch < M):
                raise ScheduleError(
                    f"fpipe.schedules: action {a} (rank {r}, position {pos}) is out of range: "
                    f"stages are 0..{S - 1}, microbatches 0..{M - 1}, kinds {'/'.join(KINDS)}."
                )
            if a in seen:
                r0, p0 = seen[a]
                raise ScheduleError(
                    f"fpipe.schedules: action {a} appears twice (rank {r0} position {p0}, "
                    f"rank {r} position {pos}). Each action must run exactly once.\n"
                    + _positional(program, {(r0, p0), (r, pos)})
                )
            seen[a] = (r, pos)
            if owner.setdefault((a.stage, a.microbatch), r) != r:
                raise ScheduleError(
                    f"fpipe.schedules: stage {a.stage} runs microbatch {a.microbatch} on rank "
                    f"{owner[a.stage, a.microbatch]} and on rank {r} (action {a}). A stage's actions on one "
                    "microbatch (F, B, I, W) must run on one rank.\n" + _positional(program, {(r, pos)})
                )
    missing: list[str] = []
    for s in range(S):
        for i in range(M):
            fused, inp, wgt = (Action(s, k, i) in seen for k in (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT))
            if Action(s, FORWARD, i) not in seen:
                missing.append(str(Action(s, FORWARD, i)))
            if fused and (inp or wgt):
                raise ScheduleError(
                    f"fpipe.schedules: stage {s} microbatch {i} has both a fused backward "
                    f"({Action(s, BACKWARD, i)}) and a split one (I/W). Use one or the other."
                )
            if not fused and not inp:
                missing.append(str(Action(s, BACKWARD if not wgt else BACKWARD_INPUT, i)))
            if inp and not wgt:
                missing.append(str(Action(s, BACKWARD_WEIGHT, i)))
    if missing:
        raise ScheduleError(
            f"fpipe.schedules: the program is missing actions: {listing(missing, limit=12)}. Every stage needs a "
            "forward and a backward (B, or I and W) for every microbatch.\n" + _positional(program, set())
        )
    for a, (r, pos) in seen.items():  # in program order
        before = {BACKWARD: FORWARD, BACKWARD_INPUT: FORWARD, BACKWARD_WEIGHT: BACKWARD_INPUT}.get(a.kind)
        if before is not None and seen[Action(a.stage, before, a.microbatch)][1] > pos:
            raise ScheduleError(
                f"fpipe.schedules: on rank {r}, {a} (position {pos}) comes before "
                f"{Action(a.stage, before, a.microbatch)} that it needs. Move it later.\n"
                + _positional(program, {(r, pos)})
            )


def forward_only(program: Program) -> Program:
    """``program`` with each rank's row kept to its forwards, in order: what an evaluation runs.

    A forward depends only on the same microbatch's forward one stage earlier, which a training
    program that replays (``validate``) runs earlier in the same rows; the filtered rows are
    replayed again all the same (``ticks_of``), so a forward-only program never deadlocks.
    """
    rows = tuple(tuple(a for a in row if a.kind == FORWARD) for row in program.ranks)
    forwards = Program(rows, program.num_stages, program.num_microbatches)  # no backward: no pairs
    ticks_of(forwards)
    return forwards


def _positional(program: Program, marks: set[tuple[int, int]]) -> str:
    """The grid of a program that cannot be replayed: each rank's actions in order, ``marks`` drawn."""
    return render(program, marks=marks, ticks=[list(range(len(row))) for row in program.ranks])


def ticks_of(program: Program) -> list[list[int]]:
    """Replay a program with unit cost per action: ``ticks_of(p)[r][k]`` is the tick of ``p.ranks[r][k]``.

    At each tick every rank runs its next action if everything it depends on finished at an
    earlier tick (``as_soon_as_possible`` with unit durations). Raises ``ScheduleError`` (with
    the grid so far and the stuck actions marked) if at some tick no rank can move: the program
    deadlocks.
    """
    starts, _ = as_soon_as_possible(program, lambda r, k, a: 1.0, lambda d: 0.0)
    ticks = [[int(t) for t in row] for row in starts]
    stuck = {(r, len(ticks[r])) for r, row in enumerate(program.ranks) if len(ticks[r]) < len(row)}
    if stuck:
        done, split = {a for row, t in zip(program.ranks, ticks) for a in row[: len(t)]}, split_backwards(program)
        waits = "; ".join(
            f"rank {r} waits at {program.ranks[r][k]} for "
            + ", ".join(str(d) for d in dependencies(program.ranks[r][k], program.num_stages, split) if d not in done)
            for r, k in sorted(stuck)
        )
        t = max((row[-1] + 1 for row in ticks if row), default=0)
        raise ScheduleError(
            f"fpipe.schedules: the program deadlocks after {plural(t, 'tick')}: {waits}. "
            "Reorder the actions so that every dependency can run first.\n" + render(program, marks=stuck, ticks=ticks)
        )
    return ticks


Times = tuple[tuple[float, ...], ...]


def as_soon_as_possible(
    program: Program,
    duration: Callable[[int, int, Action], float],
    send: Callable[[Action], float],
    paired: Callable[[int, int, Action, Action, float, float], float] | None = None,
) -> tuple[Times, Times]:
    """Starts and ends per rank of ``program`` replayed as soon as possible.

    Each rank runs its actions in program order; action ``k`` of rank ``r`` starts when the rank
    is free and every action it depends on has ended (plus ``send(d)`` for a dependency ``d`` on
    another rank), and lasts ``duration(r, k, action)``. An overlapped pair (``program.pairs``)
    is one unit: it starts when both halves' dependencies have ended and lasts
    ``paired(r, k, first, second, first's duration, second's)`` (default ``in_sequence``: the
    sum). A deadlocked program's rows stop at the first action that can never start
    (``ticks_of`` reports it; ``validate`` rules it out).
    """
    paired = in_sequence if paired is None else paired
    split = split_backwards(program)
    rank_of = {(a.stage, a.microbatch): r for r, row in enumerate(program.ranks) for a in row}
    partner = dict(program.pairs)
    ends: dict[Action, float] = {}
    starts_of: list[list[float]] = [[] for _ in program.ranks]
    ends_of: list[list[float]] = [[] for _ in program.ranks]
    moved = True
    while moved:
        moved = False
        for r, row in enumerate(program.ranks):
            while len(ends_of[r]) < len(row):
                k = len(ends_of[r])
                second = partner.get(row[k]) if k + 1 < len(row) and partner.get(row[k]) == row[k + 1] else None
                unit = [row[k]] if second is None else [row[k], second]  # a pair is one unit (module docstring)
                deps = [d for a in unit for d in dependencies(a, program.num_stages, split) if d not in unit]
                if any(d not in ends for d in deps):
                    break
                ready = max(
                    (ends[d] + (send(d) if rank_of[d.stage, d.microbatch] != r else 0.0) for d in deps), default=0.0
                )
                start = max(ends_of[r][-1] if k else 0.0, ready)
                if second is None:
                    ends[row[k]] = start + duration(r, k, row[k])
                    starts_of[r].append(start)
                    ends_of[r].append(ends[row[k]])
                else:  # drawn as two halves of the pair's time; both results exist at its end
                    first_time, second_time = duration(r, k, row[k]), duration(r, k + 1, second)
                    end = start + paired(r, k, row[k], second, first_time, second_time)
                    middle = start + (end - start) * first_time / ((first_time + second_time) or 1.0)
                    ends[row[k]] = ends[second] = end
                    starts_of[r] += [start, middle]
                    ends_of[r] += [middle, end]
                moved = True
    return tuple(map(tuple, starts_of)), tuple(map(tuple, ends_of))


def in_sequence(rank: int, k: int, first: Action, second: Action, first_time: float, second_time: float) -> float:
    """A pair's duration when nothing of it overlaps: its halves' durations, summed."""
    return first_time + second_time


def execution_order(program: Program) -> tuple[tuple[int, Action], ...]:
    """``(rank, action)`` pairs in the order one process interprets them: by tick, then rank."""
    ticks = ticks_of(program)
    pairs = [(t, r, a) for r, row in enumerate(program.ranks) for t, a in zip(ticks[r], row)]
    return tuple((r, a) for _, r, a in sorted(pairs, key=lambda p: (p[0], p[1])))


def render(
    program: Program,
    *,
    marks: set[tuple[int, int]] | None = None,
    ticks: list[list[int]] | None = None,
) -> str:
    """The program as a rank x time grid, one row per rank, ``.`` where a rank idles.

    Example (GPipe, 2 stages, 2 microbatches)::

        rank 0 | 0F0 0F1  .   .  0B0 0B1
        rank 1 |  .  1F0 1F1 1B0 1B1  .

    Column ``t`` is what each rank does at unit time ``t``. ``marks`` holds ``(rank, position)``
    pairs drawn as ``>2B0<``, in place when the action has a time, else after the row (an
    action stuck in a deadlock); ``ticks`` the times to draw (default: ``ticks_of(program)``).
    """
    if ticks is None:
        ticks = ticks_of(program)
    marks = marks or set()
    in_place = any(k < len(ticks[r]) for r, k in marks)
    width = max((len(str(a)) for row in program.ranks for a in row), default=1) + (2 if in_place else 0)
    end = max((row[-1] + 1 for row in ticks if row), default=0)
    lines = []
    for r, row in enumerate(program.ranks):
        cells = [".".center(width)] * end
        for k, t in enumerate(ticks[r]):
            cells[t] = (f">{row[k]}<" if (r, k) in marks else str(row[k])).center(width)
        stuck = [f">{row[k]}<" for (mr, k) in sorted(marks) if mr == r and len(ticks[r]) <= k < len(row)]
        lines.append(f"rank {r} | " + " ".join(cells + stuck).rstrip())
    if program.pairs:
        lines.append("pairs  | " + " ".join(f"{a}&{b}" for a, b in sorted(program.pairs)))
    return "\n".join(lines)


def checked_program(function: str, program: object) -> Program:
    """``program`` if it is a ``Program``, else a ``TypeError`` naming ``function``, the value's type
    and what to pass: a schedule's ``.program(num_stages)``, a search result's ``.program``."""
    if isinstance(program, Program):
        return program
    if isinstance(program, type):
        fix = f"Build one: {program.__name__}(num_microbatches=8).program(num_stages)"
    elif isinstance(getattr(program, "program", None), Program):  # a Searched, a Tuned
        fix = "Pass its program, e.g. found.program"
    elif callable(getattr(program, "program", None)):  # a schedule value
        fix = "Pass schedule.program(num_stages), e.g. OneFOneB(8).program(4)"
    else:
        fix = "Pass a Program: schedule.program(num_stages), Program.from_lists(...) or found.program"
    raise TypeError(f"fpipe.schedules.{function}: program must be a Program (program: {brief(program)}). {fix}.")


def checked_schedule(function: str, schedule: object) -> Schedule:
    """``schedule`` if it builds programs, else a ``TypeError`` naming ``function`` and the fix (a
    class to instantiate, a name or a program where a schedule value goes)."""
    if callable(getattr(schedule, "program", None)) and not isinstance(schedule, type):
        return schedule  # type: ignore[return-value]
    fix = (
        f"Call it with the number of microbatches, e.g. {schedule.__name__}(num_microbatches=8)"
        if isinstance(schedule, type)
        else "Pass a schedule value such as OneFOneB(num_microbatches=8)"
    )
    raise TypeError(
        f"fpipe.schedules.{function}: schedule must be a schedule value (schedule: {brief(schedule)}). {fix}."
    )


def placement(schedule: Schedule, num_stages: int, num_ranks: int | None = None) -> tuple[int, ...]:
    """Where ``schedule`` puts each of ``num_stages`` stages: ``placement(...)[s]`` is stage ``s``'s rank.

    The placement is read off the (validated) program, so it is the one ``fpipe.pipeline``
    runs. For a ``Program`` in hand use ``program.placement()`` and ``program.stages_of(rank)``.

    Examples:
        >>> from fpipe.schedules import Interleaved1F1B, ZeroBubbleV, placement
        >>> placement(Interleaved1F1B(8, stages_per_rank=2), 6)  # looped: stage s on rank s % 3
        (0, 1, 2, 0, 1, 2)
        >>> placement(ZeroBubbleV(8), 6)  # V: rank r holds stages r and 5 - r
        (0, 1, 2, 2, 1, 0)

    Raises:
        ScheduleError: if the schedule cannot build a valid program for these sizes.
        TypeError: if ``schedule`` is not a schedule value (a class such as ``OneFOneB``, a name).
    """
    program = checked_schedule("placement", schedule).program(num_stages, num_ranks)
    validate(program)
    return program.placement()


def checksum(program: Program) -> int:
    """A checksum of ``program``, equal on every rank that built the same one."""
    text = f"{program.num_stages}/{program.num_microbatches}/" + "|".join(
        ",".join(map(str, row)) for row in program.ranks
    )
    if program.pairs:
        text += "/" + ",".join(f"{a}&{b}" for a, b in sorted(program.pairs))
    return zlib.crc32(text.encode())

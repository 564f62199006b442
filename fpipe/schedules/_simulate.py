"""Simulation: when each action of a program runs, given what each kind of action costs.

``ticks_of`` replays a program with unit cost; ``simulate`` replays it with a cost per kind of
action and a latency per message between ranks, and measures the two figures that tell
schedules apart: the bubble (the fraction of the step a rank idles) and the peak activations a
rank holds, in microbatches of the rank's layers (NOTE [activation units]).

NOTE [activation units]
    One unit is the activations one microbatch leaves in all the layers a rank holds: a stage of
    a one-stage-per-rank pipeline. A rank holding ``v`` stages counts each of its
    ``(stage, microbatch)`` activations as ``1/v``, so schedules with different stages per rank
    compare directly (1F1B's rank 0 peaks at ``p``, ZB-V's at ``p`` too, from ``2p`` half-size
    chunks). A stage on several ranks counts as one over its holders (``stages_held``): DualPipe's
    rank holds two whole stages, each for half of the microbatches, and peaks at ``p + 1`` of
    them, DeepSeek's figure. The CLI, the Chrome trace's counters and the README's table use this unit.

The replay is "as soon as possible": each rank runs its actions in program order, and an action
starts when the rank is free and every action it depends on (see ``fpipe.schedules._program``)
has finished, plus the sender's ``send`` if that action ran on another rank::

    start(a) = max(end(previous action on the rank),
                   max(end(d) + (costs[stage(d)].send if rank(d) != rank(a) else 0) for d in dependencies(a)))
               + costs[stage(a)].overhead + (costs[stage(a)].receive if a takes a message else 0)
    end(a)   = start(a) + costs[stage(a)].of(kind(a))

The costs are one ``Costs`` for every stage, or one per stage (a first stage with the embedding
and a last one with the head and the loss cost more than the others). This is how a rank with
blocking receives behaves, and it is the model under which the papers' bubble formulas are
derived, e.g. GPipe's and 1F1B's ``(p-1)/(m+p-1)`` with ``T_B = 2 T_F``.

``replay`` reruns a timeline with its own action durations: with free messages, its makespan is
the step's critical path (what no runtime running those actions in that order can beat). Going
the other way, from a measured timeline to the costs that ``simulate`` reproduces it with, is
``fpipe.planning.fit_costs``.

NOTE [per-action overhead]
    A runtime spends time on each action beyond its compute: the interpreter's dispatch and
    posting the previous action's sends (every action), and taking a message from another rank
    even when it has already arrived (an action that takes one: an ``F`` whose previous stage,
    or a ``B`` or ``I`` whose next stage, is on another rank). A recorded action starts once its
    inputs are there and ends when its compute returns, so that time shows as a gap before each
    action even when no message is awaited. ``Costs.overhead`` and ``Costs.receive`` model it:
    each action of the stage occupies its rank for ``overhead``, plus ``receive`` if it takes a
    message, before it starts, after the rank is free and its inputs have arrived (the formula
    above). So a program with more actions (split backwards: an ``I`` and a ``W`` where a ``B``
    would do) or more messages (a looped placement crosses ranks at every stage boundary, a V
    not at its turn) pays accordingly, and ``simulate`` ends every action exactly where ``simulate`` without them ends
    it when each duration grows by what comes before it (``charged``); only the starts differ,
    and the bubble counts that time as time the rank does not compute, as a measured timeline
    does. ``fpipe.planning.fit_costs`` reads both back off a measured timeline (NOTE [fitting the
    overhead] in ``fpipe/planning/_fit.py``).

NOTE [overlapped time]
    An overlapped pair (``Program.pairs``, NOTE [overlapped pairs] in fpipe/_pairs.py) lasts what
    the runtime's baton gives when each half of duration ``d`` (charged: NOTE [per-action
    overhead]) is ``n = Costs.communication_points`` rounds of compute ``(d - c) / n`` (1) then
    a collective ``c / n`` (2), ``c = Costs.communication``; the side switches at each point, and
    resumes once its collective has ended (3); collectives run one at a time (one network)::

        compute    | F (1) | B (1)          | F (1) | B (1)          |.....|
        network    |       | F (2) |        | B (2)      | F (2) |   | B (2) |
                   0 first compute, hidden by nothing      the last collective, hidden by nothing

    So a pair lasts at least its longer resource, compute ``sum(d - c)`` or network ``sum(c)``,
    plus what cannot hide: the first side's first compute, before any collective is in flight,
    and the last collective, after every compute (more where one side's collective outlasts
    the other's compute: ``overlapped`` replays it exactly). As the points grow it tends to
    ``max(sum(d - c), sum(c))``: DualPipe's claim (arXiv:2412.19437, section 3.2.1) that at a
    1:1 ratio all-to-alls hide fully, which its hand-placed chunks (layer boundaries not aligned,
    SMs split between compute and communication) approach and this model does not assume: no
    compute slows down while a collective runs. Halves without communication last their sum.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from .._plural import brief
from ._action import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action
from ._program import (
    Program,
    ScheduleError,
    as_soon_as_possible,
    checked_program,
    ticks_of,
    validate_actions,
)


@dataclass(frozen=True)
class Costs:
    """How long each kind of action takes, and how long a message between ranks travels.

    Any time unit will do; only ratios matter for the bubble. The defaults are the zero-bubble
    paper's ``T_F = T_B = T_W = 1`` (its ``B`` is our ``I``), with a fused backward costing the
    sum of its two parts. For the classic ``T_B = 2 T_F`` use ``Costs(backward=2)``.

    Attributes:
        forward: one stage's forward on one microbatch (``F``).
        backward_input: the input-gradient part of its backward (``I``).
        backward_weight: the weight-gradient part (``W``).
        backward: the fused backward (``B``); ``None`` means ``backward_input + backward_weight``.
        send: latency of an activation or cotangent sent to another rank (``0`` on the same rank).
        overhead: what each action of the stage costs its rank before it starts, beyond its own
            duration: the runtime's dispatch and message posting (NOTE [per-action overhead]).
            ``of`` does not include it.
        receive: what an action of the stage that takes a message from another rank costs its
            rank on top of ``overhead``, once the message is there (NOTE [per-action overhead]).
        communication: the part of each ``F``'s and each ``B``'s or ``I``'s duration spent in
            the stage's own collectives (the expert all-to-alls; ``W`` has none): what an
            overlapped pair can hide behind its other half's compute (NOTE [overlapped time]).
            It changes nothing for actions that are not paired.
        communication_points: how many collectives each ``F`` and each ``B`` or ``I`` of the
            stage posts and waits for (``fpipe.communication_point``; a MoE layer's dispatch and
            combine are 2): the rounds ``communication`` is split into.
    """

    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    backward: float | None = None
    send: float = 0.0
    overhead: float = 0.0
    receive: float = 0.0
    communication: float = 0.0
    communication_points: int = 1

    def __post_init__(self) -> None:
        for name in (
            "forward",
            "backward_input",
            "backward_weight",
            "backward",
            "send",
            "overhead",
            "receive",
            "communication",
        ):
            value = getattr(self, name)
            if value is None and name == "backward":
                continue
            positive = name not in ("send", "overhead", "receive", "communication")
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not number or value < 0 or (positive and value == 0):
                raise ScheduleError(
                    f"fpipe.schedules.Costs: {name} must be a finite {'positive' if positive else 'non-negative'} "
                    f"number ({name}: {value!r})."
                )
        points = self.communication_points
        if not isinstance(points, int) or isinstance(points, bool) or points < 1:
            raise ScheduleError(
                f"fpipe.schedules.Costs: communication_points must be an int of at least 1 "
                f"(communication_points: {points!r})."
            )
        for name, duration in (
            ("forward", self.forward),
            ("backward_input", self.backward_input),
            ("backward", self.of(BACKWARD)),
        ):
            if self.communication > duration:
                raise ScheduleError(
                    f"fpipe.schedules.Costs: communication is the part of each F and each B or I spent in "
                    f"collectives, so it cannot exceed {name} (communication: {self.communication!r}, {name}: "
                    f"{duration!r}). Lower communication, or give {name} its collectives' time too."
                )

    def of(self, kind: str) -> float:
        """The duration of an action of ``kind`` (``"F"``, ``"B"``, ``"I"`` or ``"W"``)."""
        if kind == BACKWARD:
            return self.backward_input + self.backward_weight if self.backward is None else self.backward
        durations = {FORWARD: self.forward, BACKWARD_INPUT: self.backward_input, BACKWARD_WEIGHT: self.backward_weight}
        if kind in durations:
            return durations[kind]
        raise ScheduleError(f"fpipe.schedules.Costs: unknown action kind {kind!r}. Kinds are F, B, I, W.")


def charged(costs: Costs, receives: tuple[bool, bool] = (False, False)) -> Costs:
    """``costs`` with what comes before each action added to its duration, and ``overhead`` and
    ``receive`` set to 0: the same makespan and action ends under ``simulate`` (NOTE [per-action
    overhead]), for the search's schedulers, which know durations only. ``receives`` says
    whether the stage's ``F`` and its ``B`` or ``I`` take a message (``receiving_kinds``).
    ``costs`` itself when it has neither overhead nor receive cost."""
    if costs.overhead == 0 and costs.receive == 0:
        return costs
    forward, backward = (costs.overhead + (costs.receive if r else 0.0) for r in receives)
    return Costs(
        forward=costs.forward + forward,
        backward_input=costs.backward_input + backward,
        backward_weight=costs.backward_weight + costs.overhead,
        backward=costs.of(BACKWARD) + backward,
        send=costs.send,
        communication=costs.communication,
        communication_points=costs.communication_points,
    )


def overlapped(first: tuple[float, float, int], second: tuple[float, float, int]) -> float:
    """How long an overlapped pair lasts whose halves are ``(duration, communication, points)``,
    the first half starting (NOTE [overlapped time]): their sum without communication."""
    if first[1] == 0 and second[1] == 0:
        return first[0] + second[0]
    halves = (first, second)
    compute = [(d - c) / n for d, c, n in halves]
    collective = [c / n for _, c, n in halves]
    left = [n for _, _, n in halves]
    ready = [0.0, 0.0]  # when each side's posted collective ends
    clock = network = 0.0
    side, done = 0, [False, False]
    while not all(done):
        clock = max(clock, ready[side])  # (3)
        if not left[side]:
            done[side], side = True, 1 - side
            continue
        clock += compute[side]  # (1)
        network = max(network, clock) + collective[side]  # (2)
        ready[side], left[side] = network, left[side] - 1
        side = side if done[1 - side] else 1 - side
    return clock


def receiving_kinds(placement: Sequence[int]) -> tuple[tuple[bool, bool], ...]:
    """Per stage, whether its ``F`` and whether its ``B`` or ``I`` take a message from another
    rank, for stages placed on ranks ``placement[s]`` (an ``F`` from the previous stage, a
    backward from the next)."""
    last = len(placement) - 1
    return tuple(
        (s > 0 and placement[s - 1] != rank, s < last and placement[s + 1] != rank) for s, rank in enumerate(placement)
    )


def _receiving(program: Program) -> dict[tuple[int, int], tuple[bool, bool]]:
    """``receiving_kinds`` per stage and microbatch: where a stage lives on several ranks, whether
    a message crosses ranks depends on the microbatch (NOTE [a stage on several ranks])."""
    m, placement = program.num_microbatches, program.placement()
    if not program.shared():
        return {(s, i): r for s, r in enumerate(receiving_kinds(placement)) for i in range(m)}
    out = {}
    for i in range(m):
        for s, kinds in enumerate(receiving_kinds([program.rank_of(t, i) for t in range(program.num_stages)])):
            out[s, i] = kinds
    return out


def before(costs: Costs, receives: tuple[bool, bool], kind: str) -> float:
    """What an action of ``kind`` costs its rank before it starts (NOTE [per-action overhead])."""
    takes = receives[0] if kind == FORWARD else receives[1] if kind in (BACKWARD, BACKWARD_INPUT) else False
    return costs.overhead + (costs.receive if takes else 0.0)


@dataclass(frozen=True)
class Simulation:
    """A program replayed with costs: when each action starts and ends, and what that gives.

    ``starts[r][k]`` and ``ends[r][k]`` are the times of ``program.ranks[r][k]``; time 0 is when
    the first action starts (when its overhead starts, for costs with one: NOTE [per-action
    overhead]).

    A timeline measured by ``fpipe.record()`` has this type too, with ``costs=None`` and times
    in seconds.

    Attributes:
        program: the simulated program.
        costs: the costs it was simulated with, one ``Costs`` or a tuple of one per stage
            (``None`` for a measured timeline).
        starts: start time of each action, per rank, in program order.
        ends: end time of each action, per rank, in program order.
    """

    program: Program
    costs: Costs | tuple[Costs, ...] | None
    starts: tuple[tuple[float, ...], ...]
    ends: tuple[tuple[float, ...], ...]

    @property
    def makespan(self) -> float:
        """The length of the step: when the last action on any rank ends."""
        return max((row[-1] for row in self.ends if row), default=0.0)

    @property
    def busy(self) -> tuple[float, ...]:
        """Per rank, the total time spent running actions."""
        return tuple(sum(e - s for s, e in zip(starts, ends)) for starts, ends in zip(self.starts, self.ends))

    @property
    def bubble_fractions(self) -> tuple[float, ...]:
        """Per rank, the fraction of the makespan the rank idles (leading and trailing idle included)."""
        span = self.makespan
        return tuple((span - b) / span for b in self.busy)

    @property
    def bubble_fraction(self) -> float:
        """The idle fraction of the whole pipeline: the mean of ``bubble_fractions``."""
        fractions = self.bubble_fractions
        return sum(fractions) / len(fractions)

    @property
    def peak_activations(self) -> tuple[float, ...]:
        """Per rank, the most activations alive at once, in microbatches of the rank's layers.

        An activation is alive from the start of its forward ``F`` to the end of its ``B`` (or of
        its ``W``, which still needs it). Ranks run actions one at a time, so this depends only on
        the program's order, not on the costs. A rank holding ``v`` stages counts each
        ``(stage, microbatch)`` activation as ``1/v`` (NOTE [activation units]).
        """
        return tuple(
            max((alive for _, alive in activations_alive(row)), default=0) / stages_held(self.program, r)
            for r, row in enumerate(self.program.ranks)
        )

    def intervals(self) -> list[tuple[int, Action, float, float]]:
        """Every action as ``(rank, action, start, end)``, sorted by start time, then rank."""
        rows = [
            (r, a, s, e)
            for r, (row, starts, ends) in enumerate(zip(self.program.ranks, self.starts, self.ends))
            for a, s, e in zip(row, starts, ends)
        ]
        return sorted(rows, key=lambda x: (x[2], x[0]))

    def summary(self) -> str:
        """Makespan, bubble and peak activations per rank, one line each, for printing under a grid."""
        lines = [f"makespan {self.makespan:g}, bubble {self.bubble_fraction:.1%} (mean over ranks)"]
        for r, (bubble, peak) in enumerate(zip(self.bubble_fractions, self.peak_activations)):
            lines.append(f"rank {r}: bubble {bubble:.1%}, peak activations {peak:g}")
        return "\n".join(lines)


def stages_held(program: Program, rank: int) -> float:
    """How many stages of the model ``rank`` holds, a stage on several ranks counting as its share
    on each (DualPipe's two halves of a rank make one: NOTE [a stage on several ranks] in
    fpipe/schedules/_program.py); at least 1: the divisor of its activation counts."""
    return max(1.0, sum(1 / len(program.holders(s)) for s in program.stages_of(rank)))


def activations_alive(row: tuple[Action, ...]) -> Iterator[tuple[int, int]]:
    """``(k, alive)`` for each action ``row[k]`` that makes (``F``) or frees (``B``, ``W``) an
    activation: how many ``(stage, microbatch)`` activations are alive after it."""
    alive = 0
    for k, a in enumerate(row):
        if a.kind in (FORWARD, BACKWARD, BACKWARD_WEIGHT):
            alive += 1 if a.kind == FORWARD else -1
            yield k, alive


def simulate(program: Program, costs: Costs | Sequence[Costs] | None = None) -> Simulation:
    """Replay ``program`` with ``costs`` (default ``Costs()``) as soon as dependencies allow.

    Args:
        program: the program to replay.
        costs: one ``Costs`` for every stage, or a sequence of one per stage: an action of stage
            ``s`` lasts ``costs[s].of(kind)``, and a message that stage ``s`` sends to another
            rank (an activation from its ``F``, a cotangent from its ``B`` or ``I``) travels
            ``costs[s].send``; each action of stage ``s`` first costs its rank ``costs[s].overhead``,
            and ``costs[s].receive`` more if it takes a message (NOTE [per-action overhead]).

    Examples:
        >>> from fpipe.schedules import Costs, OneFOneB, simulate
        >>> sim = simulate(OneFOneB(num_microbatches=8).program(4), Costs(backward=2))
        >>> sim.makespan, sim.bubble_fractions[0]  # (m+p-1)(T_F+T_B) and (p-1)/(m+p-1)
        (33.0, 0.2727272727272727)
        >>> sim.peak_activations  # microbatches of a rank's layers: p - r
        (4.0, 3.0, 2.0, 1.0)
        >>> heavy_ends = [Costs(backward=2), Costs(backward=2), Costs(forward=2, backward=4)]
        >>> simulate(OneFOneB(num_microbatches=8).program(3), heavy_ends).makespan
        54.0

    Raises:
        ScheduleError: if the program does not validate, or ``costs`` is a sequence whose length
            is not ``program.num_stages``.
        TypeError: if ``program`` is not a ``Program`` (a schedule, a search result: the message
            says what to pass), or ``costs`` is neither a ``Costs`` nor a sequence of them.
    """
    costs = Costs() if costs is None else costs
    validate_actions(checked_program("simulate", program))
    per_stage = _per_stage(program, costs)
    receives = _receiving(program)
    occupied = {key: charged(per_stage[key[0]], r) for key, r in receives.items()}  # what comes before, then the action

    def paired(r: int, k: int, first: Action, second: Action, first_time: float, second_time: float) -> float:
        one, two = per_stage[first.stage], per_stage[second.stage]  # NOTE [overlapped time]
        return overlapped(
            (first_time, one.communication, one.communication_points),
            (second_time, two.communication, two.communication_points),
        )

    starts, ends = as_soon_as_possible(
        program, lambda r, k, a: occupied[a.stage, a.microbatch].of(a.kind), lambda d: per_stage[d.stage].send, paired
    )
    _complete(program, starts)
    if any(c.overhead or c.receive for c in per_stage):
        starts = tuple(  # a half of an overlapped pair may be drawn shorter than what comes before it
            tuple(
                min(t + before(per_stage[a.stage], receives[a.stage, a.microbatch], a.kind), e)
                for t, e, a in zip(*rows)
            )
            for rows in zip(starts, ends, program.ranks)
        )
    return Simulation(program, costs if isinstance(costs, Costs) else per_stage, starts, ends)


def replay(timeline: Simulation, send: float = 0.0) -> Simulation:
    """``timeline``'s actions rerun with their own durations, as soon as dependencies allow.

    Each action lasts what it lasted in ``timeline`` (``end - start``), an overlapped pair what it
    lasted as a whole, and each message between ranks takes ``send``; the replay is
    ``simulate``'s. With ``send=0`` its makespan is the step's *critical path*: how long the step
    takes if messages and whatever a runtime does between actions cost nothing, so no runtime
    can run these actions in this order faster.
    For a measured timeline (``fpipe.record()``), ``timeline.makespan / replay(timeline).makespan
    - 1`` is the share of the step spent beyond its actions' own work.

    Examples:
        >>> from fpipe.schedules import Costs, GPipe, replay, simulate
        >>> sim = simulate(GPipe(num_microbatches=4).program(2), Costs(backward=2, send=0.5))
        >>> sim.makespan, replay(sim).makespan, replay(sim, send=0.5).makespan
        (16.0, 15.0, 16.0)

    Raises:
        ScheduleError: if ``timeline``'s times do not match its program (one start and one end
            per action), or its program does not validate.
        TypeError: if ``timeline`` is not a ``Simulation``.
        ValueError: if ``send`` is negative or not finite.
    """
    (timeline,) = checked("fpipe.schedules.replay", (timeline,))
    if isinstance(send, bool) or not isinstance(send, (int, float)) or not math.isfinite(send) or send < 0:
        raise ValueError(f"fpipe.schedules.replay: send must be a finite number >= 0 (send: {send!r}).")
    validate_actions(timeline.program)

    def paired(r: int, k: int, first: Action, second: Action, first_time: float, second_time: float) -> float:
        # A pair lasts what it lasted: one span given to both halves when recorded, two halves of
        # it when simulated.
        return max(timeline.ends[r][k : k + 2]) - min(timeline.starts[r][k : k + 2])

    starts, ends = as_soon_as_possible(
        timeline.program, lambda r, k, a: timeline.ends[r][k] - timeline.starts[r][k], lambda d: float(send), paired
    )
    _complete(timeline.program, starts)
    return Simulation(timeline.program, None, starts, ends)


def _complete(program: Program, starts: tuple[tuple[float, ...], ...]) -> None:
    """Raise ``validate``'s error for a program whose replay stopped short on some rank (it deadlocks)."""
    if any(len(row) < len(actions) for row, actions in zip(starts, program.ranks)):
        ticks_of(program)


def _per_stage(program: Program, costs: Costs | Sequence[Costs]) -> tuple[Costs, ...]:
    """``costs`` as one ``Costs`` per stage of ``program``, or an error saying what is wrong."""
    if isinstance(costs, Costs):
        return (costs,) * program.num_stages
    if isinstance(costs, (str, bytes)) or not isinstance(costs, Sequence):
        raise TypeError(
            f"fpipe.schedules.simulate: costs must be a Costs or a sequence of one Costs per stage "
            f"(costs: {costs!r}). Pass e.g. Costs(backward=2), or [Costs(...)] * num_stages."
        )
    for s, c in enumerate(costs):
        if not isinstance(c, Costs):
            raise TypeError(
                f"fpipe.schedules.simulate: costs[{s}] is not a Costs (costs[{s}]: {c!r}). Pass one Costs per stage."
            )
    if len(costs) != program.num_stages:
        raise ScheduleError(
            f"fpipe.schedules.simulate: costs must hold one Costs per stage of the program "
            f"(len(costs): {len(costs)}, program.num_stages: {program.num_stages}). "
            "Pass one Costs per stage, or a single Costs for all stages."
        )
    return tuple(costs)


def checked(function: str, timeline: Simulation | Sequence[Simulation]) -> tuple[Simulation, ...]:
    """``timeline`` as a non-empty tuple of timelines of programs that place their stages alike
    (possibly different programs), each with one start and one end per action, or an error naming
    ``function`` and what is wrong."""
    fix = "Pass recording.timeline or recording.timelines from fpipe.record(), or simulate(program, costs)"
    if isinstance(timeline, Simulation):
        timelines: tuple[Simulation, ...] = (timeline,)
    elif isinstance(timeline, Iterable) and not isinstance(timeline, str):
        timelines = tuple(timeline)
    else:  # a Recording, a Program, a step: what holds timelines, or what has no times
        raise TypeError(
            f"{function}: timeline must be a Simulation or a sequence of them (timeline: {brief(timeline)}). {fix}."
        )
    for k, t in enumerate(timelines):
        if not isinstance(t, Simulation):
            raise TypeError(f"{function}: timeline {k} is not a Simulation (timeline {k}: {brief(t)}). {fix}.")
    if not timelines:
        raise ScheduleError(f"{function}: no timeline (timelines: 0). Record at least one step with fpipe.record().")

    def placed(program: Program) -> tuple[int, list[tuple[int, int]]]:
        return program.num_stages, sorted({(a.stage, r) for r, row in enumerate(program.ranks) for a in row})

    for k, t in enumerate(timelines):
        program = t.program
        if placed(program) != placed(timelines[0].program):
            raise ScheduleError(
                f"{function}: timeline {k} places its stages otherwise than timeline 0 "
                f"((stage, rank) pairs, timeline 0: {placed(timelines[0].program)}, timeline {k}: {placed(program)}). "
                "Pass the steps of programs of one placement."
            )
        shape = [len(row) for row in program.ranks]
        if [len(row) for row in t.starts] != shape or [len(row) for row in t.ends] != shape:
            raise ScheduleError(
                f"{function}: timeline {k} does not have one start and one end per action "
                f"(actions per rank: {shape}, starts per rank: {[len(row) for row in t.starts]}, ends per "
                f"rank: {[len(row) for row in t.ends]}). Pass timelines from fpipe.record() or simulate()."
            )
        for r, (row, starts, ends) in enumerate(zip(program.ranks, t.starts, t.ends)):
            for a, start, end in zip(row, starts, ends):
                if not (math.isfinite(start) and math.isfinite(end)):
                    raise ScheduleError(
                        f"{function}: timeline {k} has a time that is not finite for "
                        f"{a.describe()} on rank {r} (start: {start!r}, end: {end!r}). Pass finite times."
                    )
    return timelines

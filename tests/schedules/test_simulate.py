"""The simulator against the published bubble and memory figures of each schedule.

Notation: ``p`` ranks, ``m`` microbatches, ``v`` stages per rank. "Idle" is a rank's time not
running actions, within the makespan.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import fpipe
from fpipe.schedules import (
    Costs,
    DualPipeV,
    GPipe,
    Interleaved1F1B,
    LoopedBFS,
    OneFOneB,
    Overlapped,
    Program,
    ScheduleError,
    Simulation,
    ZeroBubbleH1,
    ZeroBubbleV,
    replay,
    simulate,
    ticks_of,
    validate,
)

CLASSIC = Costs(forward=1, backward=2)  # T_B = 2 T_F, the usual assumption behind (p-1)/(m+p-1)
SPLIT = Costs(forward=1, backward_input=1, backward_weight=1)  # the zero-bubble paper's T_F = T_B = T_W


def idle(costs: Costs, program: Program) -> list[float]:
    sim = simulate(program, costs)
    return [sim.makespan - busy for busy in sim.busy]


def test_small_timeline_literally() -> None:
    # rank 0 | 0F0 0F1 ... 0B0 0B0 0B0 0B1 0B1 0B1 ; rank 1 |  .  1F0 1B0 1B0 1F1 1B1 1B1
    sim = simulate(OneFOneB(2).program(2), CLASSIC)
    assert sim.starts == ((0, 1, 4, 7), (1, 2, 4, 5))
    assert sim.ends == ((1, 2, 6, 9), (2, 4, 5, 7))
    assert sim.makespan == 9
    assert sim.busy == (6, 6)
    assert sim.summary() == (
        "makespan 9, bubble 33.3% (mean over ranks)\n"
        "rank 0: bubble 33.3%, peak activations 2\n"
        "rank 1: bubble 33.3%, peak activations 1"
    )
    assert [(r, str(a), s, e) for r, a, s, e in sim.intervals()][:4] == [
        (0, "0F0", 0, 1), (0, "0F1", 1, 2), (1, "1F0", 1, 2), (1, "1B0", 2, 4),
    ]  # fmt: skip


@pytest.mark.parametrize(
    "program",
    [
        GPipe(5).program(3),
        OneFOneB(7).program(4),
        Interleaved1F1B(6, stages_per_rank=2).program(6),
        ZeroBubbleH1(6).program(4),
        ZeroBubbleV(5).program(6),
        LoopedBFS(3, stages_per_rank=3).program(6),
    ],
)
def test_unit_costs_reproduce_the_ticks(program: Program) -> None:
    sim = simulate(program, Costs(forward=1, backward=1, backward_input=1, backward_weight=1))
    assert [list(row) for row in sim.starts] == ticks_of(program)


@pytest.mark.parametrize("p", range(1, 9))
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(p: int) -> None:
    for m in range(1, 17):
        for schedule in (GPipe(m), OneFOneB(m)):
            sim = simulate(schedule.program(p), CLASSIC)
            assert sim.makespan == 3 * (m + p - 1)
            assert sim.bubble_fractions == pytest.approx([(p - 1) / (m + p - 1)] * p, abs=1e-12)


@pytest.mark.parametrize("p", range(1, 9))
def test_peak_activations_1f1b_p_minus_r_gpipe_m(p: int) -> None:
    for m in range(1, 17):
        assert simulate(OneFOneB(m).program(p)).peak_activations == tuple(min(p - r, m) for r in range(p))
        assert simulate(GPipe(m).program(p)).peak_activations == (m,) * p


@pytest.mark.parametrize(("p", "v"), [(2, 2), (2, 3), (3, 2), (4, 2), (4, 4)])
def test_interleaved_bubble_is_1f1b_bubble_over_v(p: int, v: int) -> None:
    # Each of the v stages of a rank costs 1/v of a 1F1B stage; the bubble time is divided by v.
    per_stage = Costs(forward=1 / v, backward=2 / v)
    for m in (p, 2 * p, 4 * p):
        one_f_one_b = idle(CLASSIC, OneFOneB(m).program(p))
        interleaved = idle(per_stage, Interleaved1F1B(m, stages_per_rank=v).program(p * v))
        assert interleaved == pytest.approx([x / v for x in one_f_one_b])
        sim = simulate(Interleaved1F1B(m, stages_per_rank=v).program(p * v), CLASSIC)
        assert sim.bubble_fraction == pytest.approx((p - 1) / v / (m + (p - 1) / v))


@pytest.mark.parametrize(("p", "v"), [(2, 2), (3, 2), (4, 2), (4, 3)])
def test_looped_bfs_bubble_is_gpipe_bubble_over_v(p: int, v: int) -> None:
    # With m >= p microbatches a rank's next stage never waits for the loop around the ranks.
    for m in (p, p + 1, 3 * p):
        sim = simulate(LoopedBFS(m, stages_per_rank=v).program(p * v), CLASSIC)
        assert sim.bubble_fraction == pytest.approx((p - 1) / v / (m + (p - 1) / v))
        assert sim.peak_activations == (m,) * p  # m * v chunks, each 1/v of the rank's layers


@pytest.mark.parametrize("p", range(2, 9))
def test_zero_bubble_h1_bubble_is_a_third_of_1f1b(p: int) -> None:
    # 1F1B idles (p-1)(T_F + T_B + T_W) per rank, ZB-H1 (p-1)(T_F + T_B - T_W): a third when all equal.
    for m in range(p, 3 * p):
        assert idle(SPLIT, OneFOneB(m).program(p)) == [3 * (p - 1)] * p
        assert idle(SPLIT, ZeroBubbleH1(m).program(p)) == [p - 1] * p
        assert simulate(ZeroBubbleH1(m).program(p)).bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))
    # At the cost of no extra memory: every rank holds at most p, 1F1B's peak on rank 0.
    assert max(simulate(ZeroBubbleH1(4 * p).program(p)).peak_activations) == p


@pytest.mark.parametrize("p", range(1, 9))
def test_zero_bubble_v_bubble_is_near_zero(p: int) -> None:
    # Once the V is full (m >= 2p - 1) each rank idles only p - 1 chunk forwards, a sixth of
    # 1F1B's 3(p - 1) when a chunk costs half a 1F1B stage.
    for m in range(2 * p - 1, 2 * p + 8):
        program = ZeroBubbleV(m).program(2 * p)
        assert idle(SPLIT, program) == [p - 1] * p
        sim = simulate(program, SPLIT)
        assert sim.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1))
        assert sim.bubble_fraction <= simulate(ZeroBubbleH1(m).program(p), SPLIT).bubble_fraction
        assert max(sim.peak_activations) <= p  # 2p half-size chunks: 1F1B's peak of p stages


def test_send_latency_adds_two_per_hop_to_gpipe() -> None:
    for p in range(1, 6):
        for m in (1, 4):
            sim = simulate(GPipe(m).program(p), Costs(backward=2, send=0.5))
            assert sim.makespan == 3 * (m + p - 1) + 2 * (p - 1) * 0.5


def test_no_send_latency_within_a_rank() -> None:
    # ZB-V's middle stages share rank p - 1: its hop costs nothing, the other 2(p - 1) hops do.
    plain = simulate(ZeroBubbleV(1).program(4), SPLIT).makespan
    assert simulate(ZeroBubbleV(1).program(4), Costs(send=1)).makespan == plain + 2 * 2


def test_rejects_invalid_program() -> None:
    with pytest.raises(ScheduleError, match="missing actions: 0B0"):
        simulate(Program.from_lists([["0F0"]]))


def test_simulate_and_replay_reject_a_deadlock_as_validate_does() -> None:
    # Each replays the program once, with its costs; a rank that stops short there gets validate's
    # error, grid included (whether a program deadlocks depends only on its order).
    stuck = Program.from_lists([["0F0", "0B0", "0F1", "0B1"], ["1F0", "1F1", "1B0", "1B1"]])
    with pytest.raises(ScheduleError, match="deadlocks after 2 ticks") as expected:
        validate(stuck)
    times = ((0.0, 1.0, 2.0, 3.0), (1.0, 2.0, 3.0, 4.0))
    for run in (lambda: simulate(stuck, Costs(send=0.5)), lambda: replay(Simulation(stuck, None, times, times))):
        with pytest.raises(ScheduleError) as info:
            run()
        assert str(info.value) == str(expected.value)


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("forward", 0, "forward must be a finite positive number"),
        ("backward_input", -1.0, "backward_input must be a finite positive number"),
        ("backward", float("inf"), "backward must be a finite positive number"),
        ("send", -0.5, "send must be a finite non-negative number"),
        ("backward_weight", "1", "backward_weight must be a finite positive number"),
        ("overhead", -0.25, "overhead must be a finite non-negative number"),
        ("overhead", math.nan, "overhead must be a finite non-negative number"),
        ("receive", -1, "receive must be a finite non-negative number"),
    ],
)
def test_costs_reject_bad_values(field: str, value: object, fragment: str) -> None:
    with pytest.raises(ScheduleError, match=fragment):
        Costs(**{field: value})  # type: ignore[arg-type]


def test_costs_of_each_kind() -> None:
    costs = Costs(forward=1, backward_input=2, backward_weight=3)
    assert [costs.of(kind) for kind in "FIWB"] == [1, 2, 3, 5]
    assert Costs(backward=4).of("B") == 4
    with pytest.raises(ScheduleError, match="unknown action kind 'X'"):
        costs.of("X")


# Per-stage costs. Every cost below is a sum of powers of two, so the replay is exact in floats.
LIGHT = Costs(forward=1, backward_input=1, backward_weight=1, backward=2, send=0.5)
HEAVY = Costs(forward=2, backward_input=2, backward_weight=2, backward=4, send=0.25)


def test_per_stage_costs_literally() -> None:
    # stage 0: F 1, B 2, its activations travel 0.5; stage 1: F 2, B 4, its cotangents travel 0.25.
    # rank 0 | 0F0 0F1 ............................. 0B0 ..... 0B1    0B0 at 9.5 + 0.25, 0B1 at 13.5 + 0.25
    # rank 1 | ... 1F0 1F1 1B0 1B1                                  1F0 at 1 + 0.5, 1F1 when 1F0 ends (3.5)
    sim = simulate(GPipe(2).program(2), [LIGHT, HEAVY])
    assert sim.starts == ((0, 1, 9.75, 13.75), (1.5, 3.5, 5.5, 9.5))
    assert sim.ends == ((1, 2, 11.75, 15.75), (3.5, 5.5, 9.5, 13.5))
    assert sim.costs == (LIGHT, HEAVY)


@pytest.mark.parametrize(
    "program",
    [
        GPipe(3).program(3),
        OneFOneB(5).program(4),
        ZeroBubbleV(5).program(6),
        Interleaved1F1B(4, stages_per_rank=2).program(4),
    ],
    ids=["gpipe", "1f1b", "zbv", "interleaved"],
)
def test_uniform_per_stage_costs_equal_one_costs(program: Program) -> None:
    costs = Costs(forward=0.7, backward_input=1.3, backward_weight=0.9, send=0.3)
    one = simulate(program, costs)
    per_stage = simulate(program, [costs] * program.num_stages)
    assert (per_stage.starts, per_stage.ends) == (one.starts, one.ends)
    assert one.costs == costs and per_stage.costs == (costs,) * program.num_stages


def test_per_stage_costs_need_one_per_stage() -> None:
    with pytest.raises(ScheduleError, match=r"len\(costs\): 3, program.num_stages: 2\). Pass one Costs per stage"):
        simulate(GPipe(2).program(2), [LIGHT] * 3)


@pytest.mark.parametrize(
    ("costs", "fragment"),
    [
        ({"forward": 1}, "costs must be a Costs or a sequence of one Costs per stage"),
        ("FB", "costs must be a Costs or a sequence of one Costs per stage"),
        ([LIGHT, 2.0], r"costs\[1\] is not a Costs \(costs\[1\]: 2.0\)"),
    ],
)
def test_per_stage_costs_reject_other_types(costs: object, fragment: str) -> None:
    with pytest.raises(TypeError, match=fragment):
        simulate(GPipe(2).program(2), costs)  # type: ignore[arg-type]


# Per-action overhead (NOTE [per-action overhead]): dyadic costs, so the sums are exact in floats.
@pytest.mark.parametrize(
    "program",
    [OneFOneB(5).program(4), ZeroBubbleH1(4).program(3), GPipe(3).program(3)],
    ids=["1f1b", "zbh1", "gpipe"],
)
def test_overhead_is_each_duration_grown_by_it(program: Program) -> None:
    # The reference: one stage per rank, no latency; each action lasts its duration plus the
    # overhead, and the overhead comes first, so only the starts move, by the overhead.
    with_overhead = simulate(program, Costs(forward=1, backward_input=1.5, backward_weight=0.5, overhead=0.25))
    grown = simulate(program, Costs(forward=1.25, backward_input=1.75, backward_weight=0.75, backward=2.25))
    assert with_overhead.ends == grown.ends
    assert with_overhead.starts == tuple(tuple(t + 0.25 for t in row) for row in grown.starts)
    assert with_overhead.makespan == grown.makespan
    assert all(b == g - 0.25 * len(row) for b, g, row in zip(with_overhead.busy, grown.busy, program.ranks))


def test_overhead_literally() -> None:
    # GPipe(2) on 2 ranks, F 1, B 2, overhead 0.5 (o) before each action, latency 0.25:
    # rank 0 | o 0F0 o 0F1 ...................... o 0B0 o 0B1     0B0 at 7.25 + 0.25 + 0.5 = 8
    # rank 1 | ......... o 1F0 o 1F1 o 1B0 o 1B1                 1F0 at 1.5 + 0.25 + 0.5 = 2.25
    sim = simulate(GPipe(2).program(2), Costs(forward=1, backward=2, send=0.25, overhead=0.5))
    assert sim.starts == ((0.5, 2, 8, 10.5), (2.25, 3.75, 5.25, 7.75))
    assert sim.ends == ((1.5, 3, 10, 12.5), (3.25, 4.75, 7.25, 9.75))
    assert sim.makespan == 12.5 and sim.busy == (6, 6)


def test_receive_is_paid_by_actions_that_take_a_message() -> None:
    # GPipe(2) on 2 ranks, F 1, B 2, receive 0.5 (r), no overhead: 1F0, 1F1 take stage 0's
    # activations, 0B0, 0B1 stage 1's cotangents; 0F0, 0F1, 1B0, 1B1 take nothing.
    # rank 0 | 0F0 0F1 ........... r 0B0 r 0B1      0B0 at 6 (1B0's end) + 0.5
    # rank 1 | ... r 1F0 r 1F1 1B0 1B1
    sim = simulate(GPipe(2).program(2), Costs(forward=1, backward=2, receive=0.5))
    assert sim.starts == ((0, 1, 6.5, 9), (1.5, 3, 4, 6))
    assert sim.ends == ((1, 2, 8.5, 11), (2.5, 4, 6, 8))


@pytest.mark.parametrize(
    "program",
    [GPipe(4).program(2), OneFOneB(6).program(3), ZeroBubbleH1(4).program(3), DualPipeV(4).program(4)],
    ids=["gpipe", "1f1b", "zbh1", "dualpipev"],
)
@pytest.mark.parametrize("send", [0.0, 0.5])
def test_replay_of_a_simulation_is_the_simulation(program: Program, send: float) -> None:
    # Dyadic costs, so that end - start gives each duration back exactly.
    costs = [
        Costs(forward=1 + s / 4, backward_input=1.5, backward_weight=0.75, backward=2.5, send=send)
        for s in range(program.num_stages)
    ]
    sim = simulate(program, costs)
    again = replay(sim, send=send)
    assert (again.starts, again.ends, again.costs) == (sim.starts, sim.ends, None)


def test_replay_removes_gaps_and_latency_literally() -> None:
    # GPipe(2) on 2 ranks (backwards in microbatch order), measured with waits between actions
    # (messages, the runtime):
    #   rank 0 | 0F0 [0,1] 0F1 [1,2]                                  0B0 [11.5,13.5] 0B1 [13.5,15.5]
    #   rank 1 |      1F0 [2,3] 1F1 [4,5] 1B0 [6,8] 1B1 [9,11]
    program = GPipe(2).program(2)
    measured = Simulation(program, None, ((0, 1, 11.5, 13.5), (2, 4, 6, 9)), ((1, 2, 13.5, 15.5), (3, 5, 8, 11)))
    critical = replay(measured)
    # Same durations, no waiting: rank 1 runs 1F0 at 1 (when 0F0 ends), 1F1 at 2, 1B0 at 3, 1B1
    # at 5; rank 0 runs 0B0 at 5 (when 1B0 ends) and 0B1 at 7.
    assert critical.starts == ((0, 1, 5, 7), (1, 2, 3, 5))
    assert critical.ends == ((1, 2, 7, 9), (2, 3, 5, 7))
    assert critical.makespan == 9 < measured.makespan == 15.5


def test_replay_errors() -> None:
    sim = simulate(GPipe(2).program(2))
    for send, fragment in [(-1.0, "-1.0"), (math.inf, "inf"), (True, "True")]:
        with pytest.raises(ValueError, match=f"replay: send must be a finite number >= 0 \\(send: {fragment}\\)"):
            replay(sim, send=send)
    with pytest.raises(ScheduleError, match=r"replay: timeline 0 does not have one start and one end per action"):
        replay(Simulation(sim.program, None, sim.starts, ((1.0,), (2.0,))))
    with pytest.raises(TypeError, match=r"replay: timeline 0 is not a Simulation \(timeline 0: .*type Program"):
        replay(sim.program)  # type: ignore[arg-type]


def test_replay_of_a_recorded_step_is_no_longer_than_the_step() -> None:
    def stage(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ p)

    step = fpipe.pipeline(lambda y, batch: y.square().mean(), [stage] * 3, OneFOneB(4))
    with fpipe.record() as recording:
        step([torch.randn(8, 8) for _ in range(3)], torch.randn(8, 8))
    measured = recording.timeline
    critical = replay(measured)
    assert critical.busy == pytest.approx(measured.busy)
    assert 0 < critical.makespan <= measured.makespan + 1e-9  # up to the rounding of end - start


# Overlapped pairs (NOTE [overlapped time]): the pair's time worked by hand, dyadic costs.
PAIRED = Program.from_lists([["0F0", "0F1&0B0", "0B1"]])  # one rank: 0F1 and 0B0 as a pair


@pytest.mark.parametrize(
    "costs, pair",
    [
        # F 2 = compute 1 + collective 1; B 6 = compute 5 + collective 1; one point each:
        #   compute | F 1 | B 5       |        the pair: 1 + 5 + B's collective 1 = 7 (in sequence 8)
        #   network |     | F 1 |     | B 1 |
        (Costs(forward=2, backward=6, communication=1), 7.0),
        # Two points each (F: 0.5 + 0.5, twice; B: 2.5 + 0.5, twice): compute never waits, only
        # B's last collective shows: 6 + 0.5.
        (Costs(forward=2, backward=6, communication=1, communication_points=2), 6.5),
        # Collectives longer than compute (F = B = 1 + 3): the network never idles after F's
        # first compute: 1 + 3 + 3.
        (Costs(forward=4, backward_input=4, backward=4, communication=3), 7.0),
        (Costs(forward=2, backward=6), 8.0),  # no communication: the sum
    ],
)
def test_overlapped_pair_literally(costs: Costs, pair: float) -> None:
    sim = simulate(PAIRED, costs)
    forward, backward = costs.forward, costs.of("B")
    middle = forward + pair * forward / (forward + backward)  # the pair drawn as two halves of its time
    assert sim.starts == ((0, forward, middle, forward + pair),)
    assert sim.ends == ((forward, middle, forward + pair, forward + pair + backward),)
    assert replay(sim).ends == sim.ends  # a replay keeps the pair as it lasted


def test_pairs_without_communication_last_their_sum_and_communication_changes_no_unpaired_action() -> None:
    costs = Costs(forward=1, backward=2.5, backward_input=1.5, send=0.25)
    paired = Overlapped(OneFOneB(6)).program(3)
    assert paired.pairs
    sim = simulate(paired, costs)
    for r, row in enumerate(paired.ranks):
        for k, action in enumerate(row[:-1]):
            if (action, row[k + 1]) in paired.pairs:
                assert sim.ends[r][k + 1] - sim.starts[r][k] == costs.of("F") + costs.of("B")
    plain = OneFOneB(6).program(3)
    talking = replace(costs, communication=0.75, communication_points=3)
    assert simulate(plain, talking).ends == simulate(plain, costs).ends
    assert simulate(paired, talking).makespan < sim.makespan


def test_replay_of_a_recorded_pair_keeps_its_span() -> None:
    # fpipe.record() gives both halves of a pair the pair's span: 0F1&0B0 ran [2, 9].
    measured = Simulation(PAIRED, None, ((0, 2, 2, 9),), ((2, 9, 9, 15),))
    again = replay(measured)
    assert again.ends == ((2, 5.5, 9, 15),) and again.makespan == 15


@pytest.mark.parametrize(
    "fields, fragment",
    [
        ({"communication": -1.0}, "communication must be a finite non-negative number"),
        ({"communication": 1.5}, r"cannot exceed forward \(communication: 1.5, forward: 1"),
        ({"forward": 2, "communication": 1.5}, r"cannot exceed backward_input \(communication: 1.5"),
        ({"communication_points": 0}, r"communication_points must be an int of at least 1 \(communication_points: 0"),
    ],
)
def test_costs_reject_bad_communication(fields: dict[str, object], fragment: str) -> None:
    with pytest.raises(ScheduleError, match=fragment):
        Costs(**fields)  # type: ignore[arg-type]

"""The plan of a step's messages between pipeline ranks (``fpipe._distributed._messages``): which
each rank sends and receives, in order, and which action of its row sends or needs each (NOTE
[small receives ahead] in fpipe/_distributed/_transport.py), with a stage on two ranks too (NOTE
[after the row]). The messages themselves are tested on gloo ranks in tests/test_distributed.py."""

from __future__ import annotations

from fpipe._distributed._messages import ahead, consumers, messages, sends
from fpipe.schedules import DualPipe, GPipe, OneFOneB
from fpipe.schedules._program import Program, Schedule


def _program(schedule: Schedule, num_stages: int) -> Program:
    return schedule.program(num_stages)


def test_each_received_message_is_needed_by_one_action_of_the_row() -> None:
    for schedule in (GPipe(4), OneFOneB(4)):
        program = _program(schedule, 2)
        for rank in (0, 1):
            needed = consumers(program, rank, send_microbatches=True)
            sent_here = [key for r in (0, 1) if r != rank for key in messages(program, r, True).get(rank, [])]
            assert sorted(needed) == sorted(sent_here)


def test_gpipe_needs_its_next_message_one_action_later_and_1f1b_two() -> None:
    """What decides whether a small receive is posted ahead: GPipe's last rank runs its forwards
    one after another, 1F1B's a backward between them."""
    gpipe = consumers(_program(GPipe(4), 2), 1, send_microbatches=False)
    assert [gpipe["act", 0, i] for i in range(4)] == [0, 1, 2, 3]
    one_f_one_b = consumers(_program(OneFOneB(4), 2), 1, send_microbatches=False)
    assert [one_f_one_b["act", 0, i] for i in range(4)] == [0, 2, 4, 6]
    assert ("result", 1, 0) not in gpipe and ("mb", 0, 0) not in gpipe
    assert consumers(_program(GPipe(4), 2), 1, send_microbatches=True)["mb", 0, 2] == 2
    first = consumers(_program(GPipe(4), 2), 0, send_microbatches=True)
    assert [first["cot", 1, i] for i in range(4)] == [4, 5, 6, 7] and first["result", 1, 0] == 8


def test_each_message_is_sent_by_one_action_of_the_senders_row() -> None:
    program = _program(GPipe(4), 2)
    first, last = sends(program, 0, send_microbatches=False), sends(program, 1, send_microbatches=False)
    assert first[1] == [(("act", 0, i), i) for i in range(4)]
    assert last[0] == [*((("cot", 1, i), 4 + i) for i in range(4)), (("result", 1, 0), 8)]
    assert {r: [key for key, _ in sent] for r, sent in first.items()} == messages(program, 0, False)


def test_a_stage_on_two_ranks_adds_gradient_and_loss_messages_after_the_row() -> None:
    """DualPipe on 2 ranks, 4 microbatches: each rank sends its sums of both stages to the other,
    rank 0 (the last stage's second holder) its losses to rank 1, which sends the result back;
    with the batch on rank 0 only, rank 0 first sends rank 1 the second half's microbatches."""
    program = DualPipe(4).program(2)
    end = [len(row) for row in program.ranks]
    assert sends(program, 0, False)[1][-3:] == [
        (("grad", 0, 0), end[0]),
        (("grad", 1, 0), end[0]),
        (("losses", 1, 0), end[0]),
    ]
    assert sends(program, 1, False)[0][-3:] == [
        (("grad", 0, 0), end[1]),
        (("grad", 1, 0), end[1]),
        (("result", 1, 0), end[1]),
    ]
    assert consumers(program, 1, False)["losses", 1, 0] == end[1] and ("losses", 1, 0) not in consumers(
        program, 0, False
    )
    assert ahead(program, 0) == [(1, 2), (1, 3)] and ahead(program, 1) == []
    fed = sends(program, 0, True)[1]
    assert fed[:2] == [(("mb", 0, 2), 0), (("mb", 0, 3), 0)]  # before the row: stage 0 of 2 and 3 on rank 1
    assert [key for key, _ in fed if key[0] == "mb"] == [("mb", 0, i) for i in (2, 3, 0, 1)]
    needed = consumers(program, 1, True)
    assert sorted(key for key in needed if key[0] == "mb") == [("mb", 0, i) for i in range(4)]


def test_an_evaluation_exchanges_no_gradients() -> None:
    from fpipe.schedules._program import forward_only

    program = forward_only(DualPipe(4).program(2))
    assert not any(key[0] == "grad" for r in (0, 1) for key in messages(program, r, False).get(1 - r, []))

"""The distributed transport's plan of a step (``fpipe._distributed._transport``): which messages
each rank receives, and which action needs each (NOTE [small receives ahead]). The messages
themselves are tested on gloo ranks in tests/test_distributed.py."""

from __future__ import annotations

from fpipe._distributed._transport import consumers, messages
from fpipe.schedules import GPipe, OneFOneB
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

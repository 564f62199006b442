"""The distributed transport's plan of a step (``fpipe._distributed._transport``): which messages
each rank receives, and which action needs each (NOTE [small receives ahead]); and a recorded
timeline gathered from every rank's own row. The messages themselves are tested on gloo ranks in
tests/test_distributed.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from fpipe._distributed import _transport
from fpipe._distributed._transport import Key, ahead_is_safe, consumers, messages, sends
from fpipe.schedules import GPipe, OneFOneB, simulate
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


def test_a_receive_goes_ahead_in_stream_order_only_if_no_send_to_its_peer_comes_first() -> None:
    """NOTE [receives ahead in stream order]: on GPipe's last rank nothing goes back to the first
    until the backwards, so every activation's receive may go ahead; on 1F1B's it sends a
    cotangent between two activations, so the next activation's receive must wait."""

    def safe(schedule: Schedule, rank: int, key: Key) -> list[bool]:
        program = _program(schedule, 2)
        sent_at = [k for _, k in sends(program, rank, send_microbatches=False)[1 - rank]]
        needed = consumers(program, rank, send_microbatches=False)
        kind, stage, _ = key
        out = []
        for i in range(1, 4):  # microbatch i's receive, posted as microbatch i - 1's is read
            now = needed[kind, stage, i - 1]  # at the start of that action, before its own sends
            out.append(ahead_is_safe(sent_at, sum(k < now for k in sent_at), needed[kind, stage, i]))
        return out

    assert safe(GPipe(4), 1, ("act", 0, 0)) == [True, True, True]
    assert safe(OneFOneB(4), 1, ("act", 0, 0)) == [False, False, False]
    assert safe(GPipe(4), 0, ("cot", 1, 0)) == [True, True, True]
    assert ahead_is_safe([3, 5], 2, 0)  # nothing left to send
    assert ahead_is_safe([3, 5], 1, 5) and not ahead_is_safe([3, 5], 1, 6)  # a send in the needing action comes after


def test_a_recorded_timeline_gathers_each_ranks_own_row(monkeypatch: pytest.MonkeyPatch) -> None:
    program = GPipe(2).program(2)
    mine = simulate(program)  # rank 1 measured its own row; rank 0's row here is not its measure
    theirs = [{"starts": [10.0, 11.0, 12.0, 13.0], "ends": [10.5, 11.5, 12.5, 13.5]}, None]
    calls = []

    def all_gather_json(topology: Any, group: Any, value: Any, timeout: float, what: str) -> list[Any]:
        calls.append((group, timeout, what))
        return [theirs[0], {"starts": list(value["starts"]), "ends": list(value["ends"])}]  # as JSON by name

    monkeypatch.setattr(_transport, "all_gather_json", all_gather_json)
    topology: Any = SimpleNamespace(rank=1, group="pp")
    timeline = _transport.gathered(mine, topology, 7.0)
    assert calls == [("pp", 7.0, "the other ranks' recorded timelines")]
    assert timeline.starts == ((10.0, 11.0, 12.0, 13.0), mine.starts[1])
    assert timeline.ends == ((10.5, 11.5, 12.5, 13.5), mine.ends[1])
    assert timeline.program is program and timeline.costs is None

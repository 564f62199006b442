"""The distributed transport (``fpipe._distributed._transport``): which receives go ahead (NOTE
[receives ahead in stream order]) and a recorded timeline gathered from every rank's own row.
The plan of a step's messages: tests/distributed/test_messages.py; sent tensors let go:
tests/distributed/test_sends.py; the messages themselves on gloo ranks: tests/test_distributed.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from fpipe._distributed import _transport
from fpipe._distributed._messages import Key, consumers, sends
from fpipe._distributed._transport import ahead_is_safe
from fpipe.schedules import GPipe, OneFOneB, simulate
from fpipe.schedules._program import Program, Schedule


def _program(schedule: Schedule, num_stages: int) -> Program:
    return schedule.program(num_stages)


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

"""The distributed transport's plan of a step (``fpipe._distributed._transport``): which messages
each rank receives, which action needs each (NOTE [small receives ahead]), and which of its own
sends a rank knows to have completed when it reads a peer's message (NOTE [sends released]); a
recorded timeline gathered from every rank's own row; and, on 2 gloo ranks, sent tensors let go
once their sends are known to have completed. The messages themselves are tested on gloo ranks
in tests/test_distributed.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

import fpipe
from fpipe._distributed import _transport
from fpipe._distributed._transport import Key, ahead_is_safe, confirmed, consumers, messages, sends
from fpipe.schedules import GPipe, OneFOneB, ZeroBubbleV, simulate
from fpipe.schedules._program import Program, Schedule
from tests._multiprocess import run_ranks


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


def _confirmed(program: Program, me: int, peer: int, send_microbatches: bool) -> list[int]:
    """``confirmed`` for ``me``'s messages to ``peer`` and ``peer``'s to ``me``, as the transport asks it."""
    needed = consumers(program, peer, send_microbatches)
    mine = messages(program, me, send_microbatches).get(peer, [])
    return confirmed([needed[key] for key in mine], [k for _, k in sends(program, peer, send_microbatches).get(me, [])])


def test_a_peers_message_confirms_the_messages_it_had_read_when_it_sent_it() -> None:
    """NOTE [sends released], 1F1B on 2 ranks: rank 1 sends the cotangent of 1B_i after 1F_i read
    activation i, so it confirms activations 0..i (the result, all 8); rank 0 sends activation
    i + 2 after 0B_i read cotangent i, so it confirms cotangents 0..i."""
    program = _program(OneFOneB(8), 2)
    assert _confirmed(program, 0, 1, False) == [1, 2, 3, 4, 5, 6, 7, 8, 8]
    assert _confirmed(program, 1, 0, False) == [0, 0, 1, 2, 3, 4, 5, 6]
    # GPipe: rank 1 sends nothing back before its backwards, by when it has read every activation.
    assert _confirmed(_program(GPipe(4), 2), 0, 1, False) == [4] * 5
    # With the microbatches sent too, they count among rank 0's messages to rank 1 (2 per forward).
    assert _confirmed(_program(OneFOneB(4), 2), 0, 1, True) == [2, 4, 6, 8, 8]


def test_a_peer_has_read_what_it_confirms_before_it_sends() -> None:
    """For every built-in schedule on 2 and 4 ranks: a peer's message confirms only messages needed
    by an action of the peer's row at or before the one that sends it, and the result confirms all."""
    for schedule, num_stages, num_ranks in [
        (GPipe(4), 4, 4), (OneFOneB(6), 4, 2), (OneFOneB(4), 4, 4), (ZeroBubbleV(4), 4, 2),
    ]:  # fmt: skip
        program = schedule.program(num_stages, num_ranks)
        for me in range(num_ranks):
            for peer in range(num_ranks):
                if peer == me:
                    continue
                mine = messages(program, me, True).get(peer, [])
                needed = consumers(program, peer, True)
                theirs = sends(program, peer, True).get(me, [])
                counts = _confirmed(program, me, peer, True)
                assert len(counts) == len(theirs)
                # Read by the time the peer sends at position k: needed at k or before, or before a later one is.
                read_by = [min(needed[key] for key in mine[j:]) for j in range(len(mine))]
                assert counts == [sum(at <= k for at in read_by) for _, k in theirs]
                if theirs and theirs[-1][0][0] == "result":
                    assert counts[-1] == len(mine)


# -- Sent tensors let go on 2 gloo ranks (NOTE [sends released]) ----------------------------------

WIDTH = 1 << 14  # float64 leaves of 128 KiB: they travel from their own storage (INLINE_LIMIT)
M = 8
_SENT: dict[int, StorageWeakRef] = {}  # microbatch -> the storage of its stage-0 output's ``big`` leaf, on rank 0
_ALIVE: dict[int, list[int]] = {}  # microbatch -> the earlier ``big`` leaves alive when its forward ran


def _first(p, mb):
    i = int(mb["id"])
    _ALIVE[i] = sorted(j for j, ref in _SENT.items() if not ref.expired())
    big = torch.full((WIDTH,), float(i + 1), dtype=torch.float64)  # no graph: the pullback does not keep it
    _SENT[i] = StorageWeakRef(big.untyped_storage())  # (the wire sends a view of it)
    return {"h": mb["x"] @ p["w"], "big": big}


def _second(p, x):
    return (x["h"] * p["v"]).sum(-1) + x["big"].mean()


def _loss(y, mb):
    return ((y - mb["t"]) ** 2).mean()


def _released(rank, world):
    """1F1B, 8 microbatches: on rank 0, which sent ``big`` leaves are still alive at each forward
    of stage 0; on rank 1, the bytes its transport holds as each cotangent is sent."""
    g = torch.Generator().manual_seed(0)
    params = [
        {"w": torch.randn(8, WIDTH, generator=g, dtype=torch.float64)},
        {"v": torch.randn(WIDTH, generator=g, dtype=torch.float64)},
    ]
    batch = {
        "x": torch.randn(M, 8, generator=g, dtype=torch.float64),
        "id": torch.arange(M),
        "t": torch.zeros(M, dtype=torch.float64),
    }
    step = fpipe.pipeline(_loss, [_first, _second], OneFOneB(M), parallel=fpipe.Parallelism(group=dist.group.WORLD))
    held: list[int] = []
    send_cotangent = _transport.DistributedTransport.send_cotangent

    def recording(self, stage, microbatch, value):
        held.append(self.held())  # before this send: what the earlier sends still hold
        send_cotangent(self, stage, microbatch, value)

    _transport.DistributedTransport.send_cotangent = recording  # (this process only: it is the rank's own)
    params = [p if s in step.local_stages else None for s, p in enumerate(params)]
    out = []
    for _ in range(2):
        _SENT.clear()
        _ALIVE.clear()
        held.clear()
        step(params, batch if rank == 0 else None)
        out.append(
            {"alive": dict(_ALIVE), "after": [j for j, ref in _SENT.items() if not ref.expired()], "held": list(held)}
        )
    return out


@pytest.mark.timeout(120)
def test_sent_tensors_are_let_go_once_the_peer_has_read_them():
    """No timing involved: at 0F_j, rank 0 has run 0B_{j-2}, whose cotangent rank 1 sent after 1F_{j-2}
    read activation j - 2, so every send of activation j - 2 or earlier has completed and nothing
    may hold its tensors (a stage output's leaf with no graph, which no pullback keeps either);
    before, the transport kept all of them until the end of the step. Likewise rank 1, as it sends
    cotangent i, has read activation i, sent after 0B_{i-2} read cotangent i - 2: it may hold
    cotangent i - 1 alone. Twice, so the second step starts with every layout known."""
    results = run_ranks(2, _released, timeout=100)
    cotangent = WIDTH * 8  # bytes of one cotangent's large leaf
    for first, second in zip(*results):
        assert first["after"] == [] and second["alive"] == {}
        for j in range(M):
            assert set(first["alive"][j]) <= {j - 1}, (j, first["alive"][j])
        assert first["held"] == [] and len(second["held"]) == M
        assert all(held < 2 * cotangent for held in second["held"]), second["held"]

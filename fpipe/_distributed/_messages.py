"""The messages of a step between pipeline ranks: which each rank sends and receives, in order,
and where in its row (``plan``, made once per program). The transport (``_transport.py``) moves
them; both sides derive the same sequences from the program, so no message names itself on the
wire (notes/wire.md)."""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Sequence
from typing import NamedTuple

from ..schedules import Action, Program
from ..schedules._action import BACKWARD, BACKWARD_INPUT, FORWARD

Key = tuple[str, int, int]  # ("act" | "cot" | "mb" | "grad" | "losses" | "result", stage, microbatch)


def messages(program: Program, sender: int, send_microbatches: bool) -> dict[int, list[Key]]:
    """Per receiving rank, the messages ``sender`` sends in one step, in the order it sends them."""
    return {r: [key for key, _ in sent] for r, sent in sends(program, sender, send_microbatches).items()}


def sends(program: Program, sender: int, send_microbatches: bool) -> dict[int, list[tuple[Key, int]]]:
    """``messages``, each with the position in ``sender``'s row of the action that sends it (those
    after the row, NOTE [after the row]: one past the last)."""
    where, last, row = program.placement_by_microbatch(), program.num_stages - 1, program.ranks[sender]
    out: dict[int, list[tuple[Key, int]]] = defaultdict(list)
    feeds = send_microbatches and sender == program.placement()[0]  # the batch's rank sends it on
    for r, i in ahead(program, sender) if feeds else []:
        out[r].append((("mb", 0, i), 0))
    for k, a in enumerate(row):
        s, i = a.stage, a.microbatch
        if a.kind == FORWARD:
            if s == 0 and feeds and where[last][i] != sender:
                out[where[last][i]].append((("mb", 0, i), k))
            if s < last and where[s + 1][i] != sender:
                out[where[s + 1][i]].append((("act", s, i), k))
        elif a.kind in (BACKWARD, BACKWARD_INPUT) and s > 0 and where[s - 1][i] != sender:
            out[where[s - 1][i]].append((("cot", s, i), k))
    end = len(row)
    for s in program.stages_of(sender) if _trains(row) else ():
        for r in program.holders(s):
            if r != sender:
                out[r].append((("grad", s, 0), end))
    holders = program.holders(last)
    if sender in holders[1:]:
        out[holders[0]].append((("losses", last, 0), end))
    if sender == holders[0]:
        for r in range(program.num_ranks):
            if r != sender:
                out[r].append((("result", last, 0), end))
    return out


def consumers(program: Program, rank: int, send_microbatches: bool) -> dict[Key, int]:
    """Each message ``rank`` receives in one step, and the position in its row of the action that
    needs it (those after the row, NOTE [after the row]: one past the last)."""
    where, last, row = program.placement_by_microbatch(), program.num_stages - 1, program.ranks[rank]
    out: dict[Key, int] = {}
    for k, a in enumerate(row):
        s, i = a.stage, a.microbatch
        if a.kind == FORWARD and s > 0 and where[s - 1][i] != rank:
            out["act", s - 1, i] = k
        if a.kind == FORWARD and s in (0, last) and send_microbatches and program.placement()[0] != rank:
            out["mb", 0, i] = k  # (on DualPipe's rank p-1 for stage 0 or the last, never both)
        if a.kind in (BACKWARD, BACKWARD_INPUT) and s < last and where[s + 1][i] != rank:
            out["cot", s + 1, i] = k
    end = len(row)
    for s in program.stages_of(rank) if _trains(row) else ():
        if len(program.holders(s)) > 1:
            out["grad", s, 0] = end  # (from each other holder: one key, one position)
    holders = program.holders(last)
    if rank == holders[0] and len(holders) > 1:
        out["losses", last, 0] = end
    if rank != holders[0]:
        out["result", last, 0] = end
    return out


def _trains(row: Sequence[Action]) -> bool:
    """Whether a row makes gradients (an evaluation's forward-only program has none to exchange)."""
    return any(a.kind != FORWARD for a in row)


def ahead(program: Program, sender: int) -> list[tuple[int, int]]:
    """``(rank, microbatch)``: the microbatches the batch's rank ``sender`` (stage 0's first holder)
    sends before its row, when the last stage's rank holds no batch: those whose stage 0 another
    rank runs (DualPipe's second half, on rank p-1), to it and to their last stage's rank."""
    where, last = program.placement_by_microbatch(), program.num_stages - 1
    if sender != program.placement()[0]:
        return []
    return [
        (r, i)
        for i in range(program.num_microbatches)
        if where[0][i] != sender
        for r in dict.fromkeys((where[0][i], where[last][i]))
        if r != sender
    ]


# NOTE [after the row]
# After its row a rank sends, in this order: for each stage it holds with other ranks (NOTE [a
# stage on several ranks] in fpipe/schedules/_program.py), by stage, its gradient sum to each
# other holder (``grad``); as a last stage's holder other than the first, its microbatches' losses
# (``losses``) to the first holder, which stacks every microbatch's in order (NOTE [the step's
# loss] in fpipe/_run.py); as that first holder, the result to every other rank. Each rank sends
# all of a kind before it reads any, and sends never block, so no order of ranks can deadlock.


class Route(NamedTuple):
    """The messages between this rank and one peer in one step (``plan``)."""

    peer: int
    incoming: list[Key]  # the peer's messages to this rank, in the order sent
    outgoing: list[Key]  # this rank's messages to the peer, in the order sent
    sent_at: list[int]  # the position in this rank's row of the action that sends each outgoing one


class Plan(NamedTuple):
    """What ``rank``'s transport derives from the program for every step (``plan``)."""

    routes: tuple[Route, ...]  # one per peer that this rank sends to or receives from
    needed: dict[Key, int]  # ``consumers``: read only


@functools.lru_cache(maxsize=16)
def plan(program: Program, rank: int, send_microbatches: bool) -> Plan:
    """``rank``'s messages with each peer in a step of ``program``: the same for every step of a
    pipeline, so made once (the program is a value: a step hashes it, about 11 us at 256 actions,
    where making the plan took 0.2 ms a peer)."""
    outgoing = sends(program, rank, send_microbatches)
    routes = []
    for r in range(program.num_ranks):
        if r != rank:
            theirs, mine = sends(program, r, send_microbatches).get(rank, []), outgoing.get(r, [])
            if theirs or mine:
                keys, sent_at = [key for key, _ in mine], [k for _, k in mine]
                routes.append(Route(r, [key for key, _ in theirs], keys, sent_at))
    return Plan(tuple(routes), consumers(program, rank, send_microbatches))

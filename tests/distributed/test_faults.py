"""A process that dies or freezes fails every survivor fast, with fpipe's own error naming it.

Each test spawns 2 to 4 gloo ranks (tests/_multiprocess.py). The victim runs one healthy step,
then dies (SIGKILL) or freezes (SIGSTOP) in its stage's forward, in its backward, or between
steps ("idle"); every survivor times its failing step and returns what it raised.
``python -m tests.distributed.test_faults`` runs the whole matrix and prints the table in notes/wire.md.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fpipe
from fpipe.schedules import OneFOneB
from tests._multiprocess import run_ranks
from tests.distributed._faults import DP_PP, PP_TP, SLACK, rank_name, timed_failure, wait_for

pytestmark = pytest.mark.timeout(120)

DEFAULT = None  # the pipeline's default timeout (300 s)


def scenario(rank, world, mesh, victim, where, sig, timeout):
    """One healthy step, then the victim's fault; a survivor returns ``(seconds, error type, message)``."""
    step, params, batch, arm = _faulty(world, mesh, victim, where, sig, timeout)
    arm()
    return timed_failure(step, params, batch)


def _faulty(world, mesh, victim, where, sig, timeout, group=None):
    """A pipeline (over ``group``, by default every rank, or a mesh) after one healthy step: its
    step, params and batch, and ``arm``, which sends the victim ``sig`` in its stage's next
    ``where`` ("forward", "backward"; at once for "idle"), once."""
    if mesh is None:
        num_stages, place = world, {"group": dist.group.WORLD if group is None else group}
    else:
        from torch.distributed.device_mesh import init_device_mesh

        num_stages = dict(mesh)["pp"]
        names, shape = zip(*mesh)
        place = {"mesh": init_device_mesh("cpu", shape, mesh_dim_names=names)}
    armed = [False]

    def fault():
        if armed[0] and dist.get_rank() == victim:
            armed[0] = False
            os.kill(os.getpid(), sig)

    def stage(p, x):
        if where == "forward":
            fault()
        y = torch.tanh(x @ p)
        if where == "backward" and y.requires_grad:
            y.register_hook(lambda g: fault())
        return y

    def loss_fn(y, mb):
        return (y**2).mean()

    options = {} if timeout is None else {"timeout": timeout}
    step = fpipe.pipeline(loss_fn, [stage] * num_stages, OneFOneB(4), parallel=fpipe.Parallelism(**place, **options))
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(3, 3, generator=g, dtype=torch.float64) for _ in range(num_stages)]
    params = [p if s in step.local_stages else None for s, p in enumerate(params)]
    batch = torch.randn(8, 3, generator=g, dtype=torch.float64) if step.rank == 0 else None
    step(params, batch)

    def arm():
        armed[0] = True
        if where == "idle":
            fault()

    return step, params, batch, arm


CASES = [  # (ranks or mesh, victim, where, signal, timeout)
    (2, 1, "forward", signal.SIGKILL, DEFAULT),
    (3, 2, "backward", signal.SIGSTOP, 4),
    (4, 3, "backward", signal.SIGKILL, DEFAULT),
    (4, 2, "idle", signal.SIGSTOP, 4),
    (3, 1, "idle", signal.SIGKILL, DEFAULT),
    (DP_PP, 3, "backward", signal.SIGKILL, DEFAULT),
    (DP_PP, 2, "forward", signal.SIGSTOP, 4),
    # The store's host (global rank 0): no board, no heartbeats (NOTE [the store's host]).
    (4, 0, "idle", signal.SIGKILL, DEFAULT),
    (DP_PP, 0, "forward", signal.SIGSTOP, 4),
    # A tensor-parallel partner that needs no collective in the failed backward (and the
    # store's host), or that froze: no rank returns a loss (NOTE [a step ends together]).
    (PP_TP, 0, "backward", signal.SIGKILL, DEFAULT),
    (PP_TP, 1, "backward", signal.SIGSTOP, 4),
]


def run_case(setup, victim, where, sig, timeout):
    """Every survivor's ``(seconds, error type, message)``, by global rank (the victim's is None)."""
    world, mesh = (setup, None) if isinstance(setup, int) else (setup[0][1] * setup[1][1], setup)
    args = (mesh, victim, where, sig, timeout)
    return run_ranks(world, scenario, *args, timeout=90, may_die=frozenset({victim}))


@pytest.mark.parametrize(("setup", "victim", "where", "sig", "timeout"), CASES)
def test_every_survivor_fails_fast_naming_the_victim(setup, victim, where, sig, timeout):
    results = run_case(setup, victim, where, sig, timeout)
    names = rank_name(setup, victim)
    limit = SLACK if timeout is None else timeout + SLACK  # either way far below the default 300 s
    for rank, result in enumerate(results):
        if rank == victim:
            continue
        seconds, kind, message = result
        assert seconds < limit, (rank, seconds, message)
        if sig == signal.SIGKILL:
            assert kind == "PipelineError" and f"because {names} died" in message, (rank, message)
        else:
            assert kind == "PipelineTimeoutError" and f"because {names} stopped answering" in message, (rank, message)


def _continued(rank, world, mesh, faults, timeout, directory):
    """Each of ``faults``, ``(where, victim)``, in turn, on groups of its own: the victim freezes
    (SIGSTOP) in its stage's ``where`` in a step; each survivor times its step. The first
    survivor continues the victim (SIGCONT) once every survivor has raised (told by the others
    through files, not by a sleep), so its stage goes on in a step the board has declared
    failed, and the next fault runs on the same processes. Returns ``[(seconds, error type,
    message), or for the victim (None, error type, message) of its step once continued]``, one
    per fault."""
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    out = []
    for i, (where, victim) in enumerate(faults):
        survivors = sorted(set(range(world)) - {victim})
        group = None if mesh is not None else dist.new_group(list(range(world)))
        step, params, batch, arm = _faulty(world, mesh, victim, where, signal.SIGSTOP, timeout, group)
        dist.barrier()  # (the default group: never one of the job's groups here)
        arm()
        start = time.monotonic()
        try:
            step(params, batch)
            result = [time.monotonic() - start, "no error", ""]
        except fpipe.PipelineError as error:
            result = [time.monotonic() - start, type(error).__name__, str(error)]
        if rank == victim:
            result[0] = None
        else:
            Path(directory, f"{i} raised {rank}").touch()
            if rank == survivors[0]:
                for r in survivors:
                    wait_for(Path(directory, f"{i} raised {r}"))
                os.kill(pids[victim], signal.SIGCONT)
        out.append(tuple(result))
        dist.barrier()
    return out


@pytest.mark.parametrize(
    ("setup", "faults"),
    [
        # Then the store's host: no record on the board, it names itself from its own clock.
        (2, [("forward", 1), ("forward", 0)]),
        # The victim's tensor-parallel partner (rank 0) runs its row to the end: it must not return.
        (PP_TP, [("backward", 1)]),
    ],
)
def test_a_victim_continued_after_the_survivors_failed_raises_too(setup, faults, tmp_path):
    """A rank frozen mid-step (its forward or backward) and continued (SIGCONT) after every
    survivor has raised must raise fpipe's error naming itself, never return a loss: the
    survivors aborted the job's groups (NOTE [a continued rank] in
    fpipe/_distributed/_collectives.py). Rank 0, the store's host, frozen, leaves no record on
    the board (NOTE [the store's host]): continued, it says that it was stopped (NOTE [a stopped
    process]); it blamed its peer ("because rank 1 died") before."""
    world, mesh = (setup, None) if isinstance(setup, int) else (setup[0][1] * setup[1][1], setup)
    results = run_ranks(world, _continued, mesh, faults, 3, str(tmp_path), timeout=90)
    for i, (where, victim) in enumerate(faults):
        said = f"because {rank_name(setup, victim)} stopped answering"
        for rank, result in enumerate(results):
            seconds, kind, message = result[i]
            assert kind == "PipelineTimeoutError" and said in message, (where, rank, kind, message)
            if rank == victim == 0:
                assert "stopped answering: it was stopped (frozen) for" in message, (where, message)
            if rank != victim:
                assert seconds < 3 + SLACK, (where, rank, seconds, message)


class _Beats:
    """A store whose heartbeat counters are ``counts`` (global rank -> count; 0 if absent)."""

    def __init__(self, counts):
        self.counts = counts

    def add(self, key, amount):
        return self.counts.get(int(key.rsplit("/", 1)[1]), 0)


def test_a_rank_not_yet_seen_beating_a_new_board_is_not_silent():
    """A rank beats a new board only from its next beat (every BEAT s): right after a job began,
    a live rank that had not beaten yet was named as the rank that died (a dp 2 x pp 2 save
    blamed rank 3 for rank 1's death, about 1 run in 5). It counts as silent only once the
    heartbeats have been read for STALE s without it."""
    from fpipe._distributed._board import STALE, Board
    from fpipe._distributed._faults import Watchdog

    names = {g: (g, None) for g in range(3)}
    board = Board("fpipe/test/", (0, 1, 2), 0, [], names, {g: f"rank {g}" for g in range(3)})
    Watchdog()._read_beats(board, _Beats({1: 4}))  # rank 2 has not beaten this board yet
    assert board.silent() == []
    board.first_read -= 2 * STALE  # read for longer than STALE, and rank 2 never beat
    assert board.silent() == [2]


def _two_stages(rank, timeout, stage_fault=None, loss_fault=None):
    def stage(p, x):
        if stage_fault is not None:
            stage_fault(x)
        return torch.tanh(x @ p)

    def loss_fn(y, mb):
        if loss_fault is not None:
            loss_fault()
        return (y**2).mean()

    step = fpipe.pipeline(
        loss_fn, [stage, stage], OneFOneB(4), parallel=fpipe.Parallelism(group=dist.group.WORLD, timeout=timeout)
    )
    params = [torch.eye(3, dtype=torch.float64) if s == rank else None for s in range(2)]
    batch = torch.ones(8, 3, dtype=torch.float64) if rank == 0 else None
    return step, params, batch


def _late(rank, world, directory):
    """Rank 1 calls the step only after rank 0 has given up on it (a 2 s timeout). Files, not
    sleeps, order the two, so the order holds however slow the machine; rank 1's own timeout is
    30 s, so only a failure at its handshake (within the watchdog's poll) is fast."""
    gave_up, done = Path(directory, "rank 0 gave up"), Path(directory, "rank 1 is done")
    step, params, batch = _two_stages(rank, timeout=2 if rank == 0 else 30)
    if rank == 1:
        wait_for(gave_up)
    start = time.monotonic()
    with pytest.raises(fpipe.PipelineError) as info:
        step(params, batch)
    took = time.monotonic() - start
    if rank == 0:
        gave_up.touch()
        wait_for(done)  # keep the store (hosted here) up while rank 1 arrives
    else:
        done.touch()
    return took, type(info.value).__name__, str(info.value)


def test_a_rank_that_arrives_after_the_others_gave_up_fails_at_its_handshake(tmp_path):
    (took0, kind0, message0), (took1, _, message1) = run_ranks(2, _late, str(tmp_path), timeout=90)
    assert kind0 == "PipelineTimeoutError" and "timed out after 2 s" in message0 and 2 <= took0 < 2 + SLACK
    assert "went silent" in message0 and "every rank still answers" in message0
    assert took1 < SLACK and "rank 1 stopped while waiting for the other pipeline ranks" in message1


def _raises_in(rank, world, where):
    def fault(*_):
        if where == "interrupt" and rank == 1:
            raise KeyboardInterrupt
        if where == "stage" and rank == 1:
            raise ValueError("bad stage")

    def loss_fault():
        if where == "loss_fn":
            raise ValueError("bad loss")

    step, params, batch = _two_stages(rank, timeout=30, stage_fault=fault, loss_fault=loss_fault)
    try:
        step(params, batch)
    except (fpipe.PipelineError, KeyboardInterrupt) as error:
        return type(error).__name__, str(error), getattr(error, "in_loss_fn", None)
    return None


@pytest.mark.parametrize(
    ("where", "own", "others"),
    [
        (
            "loss_fn",
            "fpipe: loss_fn in forward of stage 1 on microbatch 0 (1F0) failed on rank 1: ValueError: bad loss",
            "rank 1 loss_fn failed in forward of stage 1 on microbatch 0 (1F0)",
        ),
        (
            "stage",
            "fpipe: forward of stage 1 on microbatch 0 (1F0) failed on rank 1: ValueError: bad stage",
            "rank 1 failed in forward of stage 1 on microbatch 0 (1F0)",
        ),
        ("interrupt", "", "rank 1 was interrupted (KeyboardInterrupt) in forward of stage 1 on microbatch 0 (1F0)"),
    ],
)
def test_the_other_ranks_are_told_what_failed_where(where, own, others):
    (kind0, message0, _), (kind1, message1, in_loss_fn) = run_ranks(2, _raises_in, where, timeout=60)
    assert kind0 == "PipelineError" and "rank 0 stopped" in message0 and others in message0, message0
    if where == "interrupt":
        assert kind1 == "KeyboardInterrupt"
    else:
        assert message1.startswith(own) and in_loss_fn == (where == "loss_fn")


def _transport_fails(rank, world, call):
    """After a healthy step, ``dist.<call>`` of this process raises as a closed connection does:
    rank 0's ``isend``, or rank 1's ``irecv``."""
    step, params, batch = _two_stages(rank, timeout=10)
    step(params, batch)
    if rank == (0 if call == "isend" else 1):

        def closed(*args, **kwargs):
            raise RuntimeError("Connection closed by peer [127.0.0.1]:1")

        setattr(dist, call, closed)  # this process only
    with pytest.raises(fpipe.PipelineError) as info:
        step(params, batch)
    return str(info.value)


def test_a_failed_send_blames_the_peer_not_the_stage():
    message, _ = run_ranks(2, _transport_fails, "isend", timeout=60)
    assert (
        "rank 0 stopped while waiting for microbatch 0 (for the last stage's loss_fn) to be sent to rank 1" in message
    )
    assert "because rank 1 died" in message and "failed on rank 0" not in message


def test_a_refused_receive_blames_the_peer():
    # gloo refuses a receive as it is posted when the peer's connection has closed; rank 1 posts
    # the receive of its first message as its transport starts, before any action.
    _, message = run_ranks(2, _transport_fails, "irecv", timeout=60)
    assert "rank 1 stopped while waiting for microbatch 0 (for the last stage's loss_fn) from rank 0" in message
    assert "because rank 0 died" in message and "failed on rank 1" not in message


def _abort_after_the_peer(rank, world):
    """Rank 1 aborts a group first (as a survivor's watchdog does); rank 0's watchdog then aborts
    that group, whose pair is closed already, and a second one, on which rank 0 waits."""
    from datetime import timedelta

    from fpipe._distributed._board import RAISED
    from fpipe._distributed._collectives import wait
    from fpipe._distributed._faults import WATCHDOG, abort_group

    first, second = dist.new_group([0, 1]), dist.new_group([0, 1])
    if rank == 1:
        abort_group(first)
    dist.barrier()
    time.sleep(0.2)  # rank 0's side of the first group sees its pair close
    out = None
    if rank == 0:
        board = WATCHDOG.board((0, 1), [first, second], {0: (0, None), 1: (1, None)}, {0: "rank 0", 1: "rank 1"})
        WATCHDOG.report(board, board.failure_of(1, RAISED, "failed in a test"))
        start = time.monotonic()
        with pytest.raises(fpipe.PipelineError) as info:
            work = dist.irecv(torch.empty(1), 1, group=second)
            wait(work, board, timedelta(seconds=20), 0, "a message that never comes", peer=1)
        out = (time.monotonic() - start, str(info.value))
    # The default group was not aborted: its barrier completes on both ranks.
    dist.barrier(async_op=True).wait(timeout=timedelta(seconds=10))
    return out


def test_an_abort_after_the_peer_closed_a_group_still_aborts_the_others():
    """A survivor's abort of a gloo group its peer aborted first used to raise (the closed pair
    refuses the abort's receive), which ended the watchdog before it aborted the next group:
    the rank sat out its whole timeout and the others' barrier on the default group timed out."""
    (seconds, message), _ = run_ranks(2, _abort_after_the_peer, timeout=60)
    assert "rank 0 stopped while waiting for a message that never comes because rank 1 failed in a test" in message
    assert seconds < SLACK, seconds  # not the wait's 20 s


def _malformed_record(rank, world):
    """Rank 1 writes a record that is not JSON on the step's board, then keeps rank 0 waiting:
    rank 0's watchdog reads it, and its decoding error (a bug, not a gone store) ends the thread."""
    import warnings

    from fpipe._distributed._faults import WATCHDOG

    armed = [False]

    def plant(x):
        if armed[0] and rank == 1:
            armed[0] = False
            board = step.topology.board
            WATCHDOG.ask(lambda store: store.set(board.key(), "not a record"))
            time.sleep(0.5)  # rank 0 waits for this stage's output meanwhile

    step, params, batch = _two_stages(rank, timeout=30, stage_fault=plant)
    step(params, batch)
    armed[0] = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(params, batch)  # the step itself still completes
        deadline = time.monotonic() + 5
        while rank == 0 and WATCHDOG.stopped_by is None and time.monotonic() < deadline:
            time.sleep(0.05)
    dist.barrier()
    if rank == 1:
        return None
    with pytest.raises(TimeoutError) as info:
        WATCHDOG.ask(lambda store: 1)
    return type(WATCHDOG.stopped_by).__name__, [(w.category.__name__, str(w.message)) for w in caught], str(info.value)


@pytest.mark.timeout(60)
def test_a_watchdog_stopped_by_an_unexpected_error_warns_and_says_why():
    (stopped_by, caught, message), _ = run_ranks(2, _malformed_record, timeout=30)
    assert stopped_by == "JSONDecodeError"
    warned = [text for kind, text in caught if kind == "RuntimeWarning" and "watchdog" in text]
    assert len(warned) == 1, caught
    assert "rank 0 stopped on an unexpected error (JSONDecodeError: Expecting value" in warned[0], warned
    assert "only when its own waits time out (fpipe.Parallelism(timeout=))" in warned[0], warned
    assert message.startswith("fpipe: the watchdog has stopped: it failed (JSONDecodeError: "), message


def _store_gone(rank, world):
    """Rank 0, which hosts the store, exits after a step; rank 1's watchdog loses the store."""
    import warnings

    from fpipe._distributed._faults import WATCHDOG

    step, params, batch = _two_stages(rank, timeout=30)
    step(params, batch)
    dist.barrier()
    if rank == 0:
        return None  # the process exits, and the store with it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        deadline = time.monotonic() + 10
        while WATCHDOG.stopped_by is None and time.monotonic() < deadline:
            time.sleep(0.05)
    with pytest.raises(TimeoutError) as info:
        WATCHDOG.ask(lambda store: 1)
    return WATCHDOG.stopped_by, [str(w.message) for w in caught], str(info.value)


@pytest.mark.timeout(60)
def test_a_watchdog_whose_store_is_gone_stops_without_a_warning():
    _, (stopped_by, caught, message) = run_ranks(2, _store_gone, timeout=30)
    assert isinstance(stopped_by, RuntimeError | OSError), repr(stopped_by)
    assert not [text for text in caught if "watchdog" in text], caught
    assert message.startswith("fpipe: the watchdog has stopped: the job's store is gone ("), message


def matrix(setups=((2, 1), (3, 2), (4, 3), (DP_PP, 1)), timeouts=(4, DEFAULT)):
    """Every setup x fault place x signal x timeout: the survivors' seconds, as a markdown table."""
    print("| ranks | victim | fault | signal | timeout | survivors' seconds | error | names the victim |")
    print("|---|---|---|---|---|---|---|---|")
    for setup, victim in setups:
        names = rank_name(setup, victim)
        for where in ("forward", "backward", "idle"):
            for sig in (signal.SIGKILL, signal.SIGSTOP):
                for timeout in timeouts:
                    if sig == signal.SIGSTOP and timeout is DEFAULT:
                        continue  # 300 s each: run separately (see notes/wire.md)
                    survivors = [r for r in run_case(setup, victim, where, sig, timeout) if r is not None]
                    shown = " x ".join(f"{n} {k}" for n, k in setup) if isinstance(setup, tuple) else str(setup)
                    seconds = ", ".join(f"{r[0]:.2f}" for r in survivors)
                    kinds = "/".join(sorted({r[1] for r in survivors}))
                    named = all(f"because {names} " in r[2] for r in survivors)
                    t = "300 (default)" if timeout is DEFAULT else timeout
                    print(
                        f"| {shown} | {victim} | {where} | {sig.name} | {t} | {seconds} | {kinds} | {named} |",
                        flush=True,
                    )


if __name__ == "__main__":
    matrix(*([(DP_PP, 1)],) if "--mesh" in sys.argv else ())

"""A rank that dies or freezes outside a step's own waits fails every survivor fast, naming it.

The collectives fpipe runs outside a step's own waits (``global_norm``, the loss scaling's
inf/nan agreement, ``save``, ``load``, ``save_state``, ``load_state``, ``save_hf``,
``load_hf``) and those of an ``AsyncSaver``'s background thread
are under the job's failure board too (NOTE [failure board] in fpipe/_distributed/_faults.py).
The victim dies or freezes as it enters the collective (its ``torch.distributed`` collectives
are replaced by the signal), so the survivor is waiting in it. A frozen victim can be continued
(SIGCONT) and the next case run on the same processes (``_in_turn``): continued, it raises the
board's record, never returning from the call (NOTE [a continued rank] in
fpipe/_distributed/_collectives.py): its collective fails on the groups the survivors aborted,
or, when it finished before their aborts, the board read before the call returns fails it. With a timeout of 12 s,
"never twice the timeout" is checked for a survivor whose wait began late, with a rank and with
the store's host frozen. The store's host and tensor-parallel partners in a step are in
tests/distributed/test_faults.py's cases.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fpipe
from fpipe.schedules import OneFOneB
from tests._multiprocess import run_ranks
from tests.distributed._faults import DP_PP, LATE, NEVER_TWICE, PP_TP, SLACK, WITHIN, rank_name, wait_for

pytestmark = pytest.mark.timeout(120)


def _fault_at_collectives(sig, thread=None, collectives=("all_gather", "all_reduce"), skip=0):
    """This process gets ``sig`` as it enters one of ``collectives`` (on ``thread`` only, if
    given) after ``skip`` calls of them, once: a process frozen there and continued (SIGCONT)
    goes on with the collectives put back."""
    originals = {f: getattr(dist, f) for f in collectives}
    calls = [0]

    def fault(collective):
        def faulty(*args, **kwargs):
            if thread is None or threading.current_thread().name == thread:
                calls[0] += 1
            if calls[0] > skip and (thread is None or threading.current_thread().name == thread):
                for f, original in originals.items():
                    setattr(dist, f, original)
                os.kill(os.getpid(), sig)
            return collective(*args, **kwargs)

        return faulty

    for f, collective in originals.items():
        setattr(dist, f, fault(collective))


def _pipeline(rank, world, mesh, timeout, precision=None, group=None):
    """A small float64 pipeline (over ``group``, by default every rank, or a mesh) after one
    healthy step: its step, params, batch and grads."""
    if mesh is None:
        num_stages, place = world, {"group": dist.group.WORLD if group is None else group}
    else:
        from torch.distributed.device_mesh import init_device_mesh

        names, shape = zip(*mesh)
        num_stages, place = dict(mesh)["pp"], {"mesh": init_device_mesh("cpu", shape, mesh_dim_names=names)}

    def stage(p, x):
        (w,) = p.values()  # named after its stage: a save keeps them apart
        return torch.tanh(x.to(w.dtype) @ w)

    def loss_fn(y, mb):
        return (y**2).mean()

    parallel = fpipe.Parallelism(**place, timeout=timeout)
    step = fpipe.pipeline(loss_fn, [stage] * num_stages, OneFOneB(4), parallel=parallel, precision=precision)
    g = torch.Generator().manual_seed(0)
    params = [{f"w{s}": torch.randn(3, 3, generator=g, dtype=torch.float64)} for s in range(num_stages)]
    params = [p if s in step.local_stages else None for s, p in enumerate(params)]
    batch = torch.randn(8, 3, generator=g, dtype=torch.float64) if step.rank == 0 else None
    _, grads = step(params, batch)
    return step, params, batch, grads


def _collective(rank, world, what, directory):
    """Rank 1 dies as it enters ``what``; rank 0 returns ``(seconds, error type, message)``."""
    scaled = fpipe.Precision(compute=torch.float16, loss_scale=fpipe.LossScale()) if what == "precision" else None
    step, params, batch, grads = _pipeline(rank, world, None, timeout=30, precision=scaled)
    template = [None if p is None else {k: torch.zeros_like(w) for k, w in p.items()} for p in params]
    fpipe.save(directory, params, parallel=step)  # (for load)
    fpipe.save_state(f"{directory}/state", fpipe.TrainState(params), parallel=step)  # (for load_state)
    fpipe.save_hf(f"{directory}/hf", params, config={"model_type": "x"}, parallel=step)  # (for load_hf)
    calls = {
        "global_norm": lambda: step.global_norm(grads),
        "save": lambda: fpipe.save(directory, params, parallel=step),
        "load": lambda: fpipe.load(directory, template, parallel=step),
        "save_state": lambda: fpipe.save_state(directory, fpipe.TrainState(params), parallel=step),
        "load_state": lambda: fpipe.load_state(f"{directory}/state", template, parallel=step),
        "save_hf": lambda: fpipe.save_hf(f"{directory}/hf2", params, config={"model_type": "x"}, parallel=step),
        "load_hf": lambda: fpipe.load_hf(f"{directory}/hf", template, parallel=step),
        "precision": lambda: step(params, batch),  # its only all-reduce: the inf/nan agreement
    }
    if rank == 1:
        _fault_at_collectives(
            signal.SIGKILL, collectives=("all_reduce",) if what == "precision" else ("all_gather", "all_reduce")
        )
    start = time.monotonic()
    try:
        calls[what]()
    except fpipe.PipelineError as error:
        return time.monotonic() - start, type(error).__name__, str(error)
    return time.monotonic() - start, "no error", ""


@pytest.mark.parametrize(
    "what", ["global_norm", "precision", "save", "load", "save_state", "load_state", "save_hf", "load_hf"]
)
def test_a_rank_that_dies_in_a_collective_between_steps_is_named(what, tmp_path):
    (seconds, kind, message), _ = run_ranks(2, _collective, what, str(tmp_path), timeout=60, may_die=frozenset({1}))
    assert kind == "PipelineError" and "because rank 1 died" in message, message
    assert seconds < SLACK, (seconds, message)  # not the 30 s timeout


def _saving(rank, world, mesh, victim, sig, timeout, directory):
    """The victim dies or freezes as its ``AsyncSaver``'s thread enters a collective, while the
    training thread steps on; a survivor returns ``(seconds, error type, message)``: from the
    save's start until the error leaves the ``with`` block."""
    step, params, batch, _ = _pipeline(rank, world, mesh, timeout)
    if rank == victim:
        _fault_at_collectives(sig, thread="fpipe-save")
    start = time.monotonic()
    try:
        with fpipe.AsyncSaver(parallel=step) as saver:
            saver.save(directory, params)
            for _ in range(1000):  # training goes on until the failure reaches this rank
                step(params, batch)
    except fpipe.PipelineError as error:
        return time.monotonic() - start, type(error).__name__, str(error)
    return time.monotonic() - start, "no error", ""


@pytest.mark.parametrize(
    ("setup", "victim", "sig", "timeout"),
    [(2, 1, signal.SIGSTOP, 4), (DP_PP, 3, signal.SIGSTOP, 4), (DP_PP, 3, signal.SIGKILL, 30)],
)
def test_a_save_in_flight_does_not_hold_the_error(setup, victim, sig, timeout, tmp_path):
    """The saver's own timeout (30 s) is never waited out: its groups are aborted with the job's."""
    world, mesh = (setup, None) if isinstance(setup, int) else (setup[0][1] * setup[1][1], setup)
    args = (mesh, victim, sig, timeout, str(tmp_path))
    results = run_ranks(world, _saving, *args, timeout=90, may_die=frozenset({victim}))
    limit = SLACK if sig == signal.SIGKILL else timeout + SLACK
    for rank, result in enumerate(results):
        if rank == victim:
            continue
        seconds, kind, message = result
        assert seconds < limit, (rank, seconds, message)
        said = "died" if sig == signal.SIGKILL else "stopped answering"
        assert kind.startswith("Pipeline") and f"because {rank_name(setup, victim)} {said}" in message, (rank, message)


def _call(what, step, params, batch, grads, directory, timeout):
    """``what`` (one of fpipe's collectives outside a step, or ``"precision"``: a step of a
    float16 pipeline, whose only all-reduce is the inf/nan agreement) as a function of no
    arguments, after writing what it reads, if anything."""
    template = [None if p is None else {k: torch.zeros_like(w) for k, w in p.items()} for p in params]
    if what == "load":
        fpipe.save(directory, params, parallel=step)
    if what == "load_state":
        fpipe.save_state(f"{directory}/state", fpipe.TrainState(params), parallel=step)
    if what == "load_hf":
        fpipe.save_hf(f"{directory}/hf", params, config={"model_type": "x"}, parallel=step)
    calls = {
        "global_norm": lambda: step.global_norm(grads),
        "save": lambda: fpipe.save(directory, params, parallel=step),
        "load": lambda: fpipe.load(directory, template, parallel=step),
        "save_state": lambda: fpipe.save_state(directory, fpipe.TrainState(params), parallel=step),
        "load_state": lambda: fpipe.load_state(f"{directory}/state", template, parallel=step),
        "save_hf": lambda: fpipe.save_hf(directory, params, config={"model_type": "x"}, parallel=step),
        "load_hf": lambda: fpipe.load_hf(f"{directory}/hf", template, parallel=step),
        "precision": lambda: step(params, batch),
        "step": lambda: step(params, batch),
    }
    return calls[what]


def _collectives_of(call):
    """How many ``all_gather`` and ``all_reduce`` calls ``call()`` makes (every rank must call it)."""
    originals, calls = {f: getattr(dist, f) for f in ("all_gather", "all_reduce")}, [0]

    def counted(collective):
        def counting(*args, **kwargs):
            calls[0] += 1
            return collective(*args, **kwargs)

        return counting

    for f, collective in originals.items():
        setattr(dist, f, counted(collective))
    try:
        call()
    finally:
        for f, collective in originals.items():
            setattr(dist, f, collective)
    return calls[0]


def _in_turn(rank, world, mesh, faults, timeout, directory, aborts=True):
    """Each of ``faults``, ``(collective, victim, signal)``, in turn, on groups of its own: the
    victim dies or freezes as it enters the collective (for ``"step"``: the step's last one);
    each survivor times it from its call. A frozen victim is continued (SIGCONT) once every
    survivor has raised, so the next fault runs on the same processes; a killed one must come
    last. Without ``aborts`` the survivors abort no group, as if their aborts came after the
    victim's collective finished. Returns ``[(seconds, error type, message), or for the victim
    (None, error type, message) of its call once continued]``, one per fault."""
    from fpipe._distributed import _faults

    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    if not aborts and rank not in {victim for _, victim, _ in faults}:
        _faults.abort_group = lambda group: None
    out = []
    for i, (what, victim, sig) in enumerate(faults):
        here = os.path.join(directory, str(i))
        os.makedirs(here, exist_ok=True)
        group = None if mesh is not None else dist.new_group(list(range(world)))
        scaled = fpipe.Precision(compute=torch.float16, loss_scale=fpipe.LossScale()) if what == "precision" else None
        step, params, batch, grads = _pipeline(rank, world, mesh, timeout, precision=scaled, group=group)
        call = _call(what, step, params, batch, grads, here, timeout)
        skip = _collectives_of(call) - 1 if what == "step" else 0
        dist.barrier()  # (the default group: never one of the job's groups here)
        if rank == victim:
            # (a step's handshake is an all-gather: the inf/nan agreement is its only all-reduce)
            _fault_at_collectives(
                sig, collectives=("all_reduce",) if what == "precision" else ("all_gather", "all_reduce"), skip=skip
            )
            # Continued, it must raise (the survivors aborted the groups it finds them on), never
            # finish the collective or return a loss: the board declared it failed.
            try:
                call()
                out.append((None, "no error", ""))
            except fpipe.PipelineError as error:
                out.append((None, type(error).__name__, str(error)))
        else:
            start = time.monotonic()
            try:
                call()
                out.append((time.monotonic() - start, "no error", ""))
            except fpipe.PipelineError as error:
                out.append((time.monotonic() - start, type(error).__name__, str(error)))
            if sig == signal.SIGSTOP:
                Path(here, f"raised {rank}").touch()
                if rank == min(set(range(world)) - {victim}):
                    for r in set(range(world)) - {victim}:
                        wait_for(Path(here, f"raised {r}"))
                    os.kill(pids[victim], signal.SIGCONT)
        if sig == signal.SIGSTOP:
            dist.barrier()
    return out


def _check_in_turn(setup, faults, timeout, results):
    for i, (what, victim, sig) in enumerate(faults):
        limit = SLACK if sig == signal.SIGKILL else timeout + SLACK  # far below twice 30 s
        said = "died" if sig == signal.SIGKILL else "stopped answering"
        for rank, result in enumerate(results):
            if result is None:
                continue
            seconds, kind, message = result[i]
            if rank == victim:  # continued (SIGCONT): it raises the board's record, naming itself
                assert kind.startswith("Pipeline") and f"because {rank_name(setup, victim)} {said}" in message, (
                    what,
                    rank,
                    message,
                )
                continue
            named = f"because {rank_name(setup, victim)} {said}"
            assert kind.startswith("Pipeline") and named in message, (what, rank, message)
            assert seconds < limit, (what, rank, seconds, message)


def test_a_rank_that_freezes_in_a_collective_between_steps_is_named(tmp_path):
    """global_norm, save and load_state on 2 processes, rank 1 frozen in each in turn."""
    faults = [("global_norm", 1, signal.SIGSTOP), ("save", 1, signal.SIGSTOP), ("load_state", 1, signal.SIGSTOP)]
    results = run_ranks(2, _in_turn, None, faults, 4, str(tmp_path), timeout=90)
    _check_in_turn(2, faults, 4, results)
    assert all(kind == "PipelineTimeoutError" for _, kind, _ in results[0])


def test_a_rank_that_freezes_in_the_other_collectives_between_steps_is_named(tmp_path):
    """save_state, load, save_hf, load_hf and the inf/nan agreement of a float16 step on 2
    processes, rank 1 frozen in each in turn (timeout 3 s): rank 0 raises naming it within the
    timeout, and rank 1, continued, raises too."""
    faults = [(what, 1, signal.SIGSTOP) for what in ("save_state", "load", "save_hf", "load_hf", "precision")]
    results = run_ranks(2, _in_turn, None, faults, 3, str(tmp_path), timeout=90)
    _check_in_turn(2, faults, 3, results)
    assert all(kind == "PipelineTimeoutError" for _, kind, _ in results[0])
    assert "while waiting for the loss scaling's inf/nan check" in results[0][-1][2], results[0][-1]


def test_a_victim_whose_collective_finishes_after_the_survivors_timed_out_raises_too(tmp_path):
    """The survivors abort no group here, as if the victim, continued, finished its collective
    in the moment between their timeouts and their aborts (gloo keeps a survivor's side of a
    timed-out collective posted): the victim still raises the board's record naming itself, read
    before the call returns, never a loss, a norm or a save (NOTE [a continued rank] in
    fpipe/_distributed/_collectives.py, point 2). 3 ranks, so that the victim (rank 1, the middle
    stage) has received the step's loss before it freezes in the step's last collective, the
    closing all-gather, where both survivors wait for it."""
    faults = [("step", 1, signal.SIGSTOP), ("global_norm", 1, signal.SIGSTOP), ("save", 1, signal.SIGSTOP)]
    results = run_ranks(3, _in_turn, None, faults, 3, str(tmp_path), False, timeout=90)
    _check_in_turn(3, faults, 3, results)
    # The step's closing all-gather finished on the victim: the board, read at the end, failed it.
    assert "rank 1 stopped while waiting for the end of the step because" in results[1][0][2], results[1][0]


def test_every_survivor_of_a_tensor_parallel_mesh_fails_in_a_collective_between_steps(tmp_path):
    """pp 2 x tp 2: rank 1 (pp 0, tp 1) frozen in save_state, then rank 2 (pp 1, tp 0) in
    global_norm; every other rank raises within the timeout naming the victim by its mesh
    coordinates, and the victim, continued, raises too."""
    faults = [("save_state", 1, signal.SIGSTOP), ("global_norm", 2, signal.SIGSTOP)]
    results = run_ranks(4, _in_turn, PP_TP, faults, 3, str(tmp_path), timeout=90)
    _check_in_turn(PP_TP, faults, 3, results)


def test_every_survivor_of_a_mesh_fails_in_a_collective_between_steps(tmp_path):
    """dp 2 x pp 2: rank 1 (dp 0, pp 1) frozen in save, then rank 3 (dp 1, pp 1) killed in load;
    every other rank raises, naming the victim by its mesh coordinates (the killed rank is the
    one frozen first, so every survivor's result of both comes back)."""
    faults = [("save", 1, signal.SIGSTOP), ("load", 3, signal.SIGKILL)]
    results = run_ranks(4, _in_turn, DP_PP, faults, 4, str(tmp_path), timeout=90, may_die=frozenset({3}))
    assert [r is None for r in results] == [False, False, False, True]
    _check_in_turn(DP_PP, faults, 4, results)


def _late_survivor(rank, world, victim, directory):
    """3 ranks, one pipeline: the victim freezes as it enters ``global_norm``'s all-reduce, rank
    ``late`` (the other survivor but one) enters it only LATE seconds after the others, as a rank
    busy elsewhere does. A survivor returns ``(seconds since the fault, error type, message)``."""
    step, _, _, grads = _pipeline(rank, world, None, NEVER_TWICE)
    late = 2 if victim != 2 else 1
    dist.barrier()  # before the fault: every rank's clock starts here
    start = time.monotonic()
    if rank == victim:
        _fault_at_collectives(signal.SIGSTOP)
    if rank == late:
        time.sleep(LATE)
    try:
        step.global_norm(grads)
        out = time.monotonic() - start, "no error", ""
    except fpipe.PipelineError as error:
        out = time.monotonic() - start, type(error).__name__, str(error)
    # Both survivors stay until both have raised: one that exits closes its connections, which
    # would tell the other at once.
    Path(directory, f"raised {rank}").touch()
    for r in set(range(world)) - {victim}:
        wait_for(Path(directory, f"raised {r}"))
    return out


@pytest.mark.parametrize("victim", [1, 0])
def test_a_frozen_rank_fails_a_late_survivor_within_the_timeout_not_twice(victim, tmp_path):
    """The first survivor times out NEVER_TWICE s after the fault; the late one, in the same
    all-reduce, reads it on the board then, not at the end of its own timeout (LATE +
    NEVER_TWICE). With rank 0, the store's host, frozen there is no board to read: the late
    survivor's wait is bounded by the store's silence instead, which began at the fault (NOTE
    [the store's host]; the same host frozen on dp 2 x pp 2, where the late rank waits on a
    survivor: the next test)."""
    results = run_ranks(3, _late_survivor, victim, str(tmp_path), timeout=90, may_die=frozenset({victim}))
    for rank, result in enumerate(results):
        if rank == victim:
            continue
        seconds, kind, message = result
        assert kind == "PipelineTimeoutError" and f"because rank {victim} stopped answering" in message, (rank, message)
        assert seconds < WITHIN, (rank, seconds, message)


def _host_frozen_in_load(rank, world, directory):
    """dp 2 x pp 2, ``load`` (an all-gather over the dp group, then one over the pp group; two
    ``dist.all_gather`` calls each): rank 0, the store's host, freezes as it enters it. Ranks 1
    and 2 wait on it from the start; rank 3 is descheduled LATE s between its two all-gathers,
    then waits on rank 2, which waits on rank 0 in a collective (a collective that times out
    closes no connection, so nothing but rank 2's abort of its groups tells rank 3). A survivor
    returns ``(seconds since the fault, error type, message)`` once every survivor has raised."""
    step, params, batch, grads = _pipeline(rank, world, DP_PP, NEVER_TWICE)
    call = _call("load", step, params, batch, grads, directory, NEVER_TWICE)
    dist.barrier()
    start = time.monotonic()
    if rank == 0:
        _fault_at_collectives(signal.SIGSTOP)
    if rank == 3:
        all_gather, calls = dist.all_gather, [0]

        def late_all_gather(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 3:  # the pp group's first
                time.sleep(LATE)
            return all_gather(*args, **kwargs)

        dist.all_gather = late_all_gather
    try:
        call()
        out = time.monotonic() - start, "no error", ""
    except fpipe.PipelineError as error:
        out = time.monotonic() - start, type(error).__name__, str(error)
    Path(directory, f"raised {rank}").touch()
    for r in (1, 2, 3):
        wait_for(Path(directory, f"raised {r}"))
    return out


def test_the_store_s_host_frozen_fails_a_late_survivor_within_the_timeout_not_twice(tmp_path):
    """Rank 2 times out NEVER_TWICE s after the fault, finds the store silent and aborts its
    groups (NOTE [the store's host]), so rank 3 fails then too, not at the end of its own
    timeout (LATE + NEVER_TWICE s): no board can tell it."""
    _, *survivors = run_ranks(4, _host_frozen_in_load, str(tmp_path), timeout=90, may_die=frozenset({0}))
    for rank, (seconds, kind, message) in enumerate(survivors, start=1):
        assert kind == "PipelineTimeoutError" and "because rank 0 (dp 0, pp 0) stopped answering" in message, (
            rank,
            message,
        )
        assert seconds < WITHIN, (rank, seconds, message)

"""Run a function on N local processes joined by a gloo process group (127.0.0.1, a free port).

Each rank runs with one torch thread; results come back pickled through ``torch.save``. A rank
that raises fails the call with its traceback; a rank that exits without a result fails it
within a second or so; ranks that do not finish within ``timeout`` seconds are killed and the
call fails, so a hang costs seconds, not CI.

The ranks are fresh processes forked from a forkserver that has imported torch, fpipe and the
test libraries once (``PRELOAD``). A spawned rank imports them itself, several CPU seconds per
rank, which on 2 busy cores made a 4-rank call cost 20 s before its first step; a forked one
starts in well under a second. The server imports only (it never computes, starts no thread
and touches no accelerator), so forking it is safe, and each call still gets processes of its
own: nothing a rank does (a monkeypatch, a signal, a dead process group) reaches another call.
"""

from __future__ import annotations

import io
import os
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp

# What the forkserver imports once, for every rank it forks (the module docstring).
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.device_mesh",
    "torch.distributed.tensor",
    "fpipe",
    "pytest",
    "hypothesis",
    "tests._multiprocess",
]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts, at the first call
    return ctx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bootstrap(
    rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], queue: Any
) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
        result = fn(rank, world_size, *args)
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, True, buffer.getvalue()))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 90.0, may_die: frozenset[int] = frozenset()
) -> list[Any]:
    """``[fn(rank, world_size, *args) for rank in ranks]``, each in its own process.

    Ranks in ``may_die`` may exit without a result (their entry is ``None``).
    """
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_bootstrap, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    reported: set[int] = set()
    deadline = time.monotonic() + timeout
    try:
        while not set(range(world_size)) - may_die <= reported:
            try:
                rank, ok, payload = queue.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except queue_module.Empty:
                # A rank that exited without reporting (killed, or dead before its try) fails the
                # call now; its message, if any, would have been in the queue before it exited.
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in reported | may_die]
                if dead and queue.empty():
                    codes = {r: procs[r].exitcode for r in dead}
                    failures.append(f"ranks {dead} exited without a result (exit codes {codes})")
                    break
                if time.monotonic() >= deadline:
                    raise
                continue
            reported.add(rank)
            if ok:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                failures.append(f"rank {rank}:\n{payload}")
    except queue_module.Empty as error:  # some rank hung
        failures.append(
            f"ranks {sorted(set(range(world_size)) - set(results))} did not finish in {timeout} s ({error!r})"
        )
    finally:
        for r, p in enumerate(procs):
            if r in may_die and p.is_alive():
                p.kill()  # stopped or hung on purpose
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        raise AssertionError("\n".join(failures))
    return [results.get(r) for r in range(world_size)]


def run_processes(num: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0) -> list[int]:
    """Run ``fn(index, *args)`` in ``num`` processes of their own, forked as ``run_ranks``' ranks are
    but with no process group (``fn`` makes one if it needs one); their exit codes once every one
    has exited (negative: killed by that signal, as ``subprocess`` says). What they return is
    dropped: they report through files. Processes still running after ``timeout`` seconds are
    killed and the call fails.
    """
    procs = [start_process(fn, i, *args) for i in range(num)]
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        hung = [i for i, p in enumerate(procs) if p.is_alive()]
        if hung:
            raise AssertionError(f"processes {hung} did not finish in {timeout} s")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    return [int(p.exitcode) for p in procs]


def start_process(fn: Callable[..., Any], *args: Any) -> Any:
    """A started process of its own running ``fn(*args)``, forked as ``run_ranks``' ranks are (a
    ``multiprocessing.Process``: the caller joins or kills it)."""
    process = _context().Process(target=fn, args=args)
    process.start()
    return process


def exec_script(script: str, argv: list[str]) -> None:
    """``python -c script *argv``, in a forked process (``start_process(exec_script, ...)``)."""
    import sys

    sys.argv = ["-c", *argv]
    exec(compile(script, "<script>", "exec"), {"__name__": "__main__"})

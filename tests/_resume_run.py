"""A small training run that saves its whole state every few steps, for tests/saving/test_state.py.

Two stages (the first draws a dropout mask, the second noise, both from torch's global
generator), ``fpipe.optim.adamw``, and a data stream whose position is the save's metadata::

    python -m tests._resume_run DIRECTORY OUT {full,killed,resume} --steps 12 --every 3 --kill-at 7 \\
        [--world 2 --rank 0 --port 29500] [--no-random] [--asynchronous]

``full`` trains ``--steps`` steps and saves nothing; ``killed`` saves after every ``--every``
steps and sends itself SIGKILL before step ``--kill-at`` (every rank, after a barrier);
``resume`` loads the last save and trains to the end. ``full`` and ``resume`` write the loss of
each step they ran and the final parameters to OUT (``OUT.rank<r>`` with ``--world`` > 1).
The tests run it through ``run``, in processes forked from tests/_multiprocess.py's server.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import fpipe
import fpipe.optim
from fpipe.schedules import OneFOneB

D = 6


def _batch(position: int) -> dict[str, torch.Tensor]:
    """Batch ``position`` of the data stream."""
    g = torch.Generator().manual_seed(1000 + position)
    x = torch.randn(8, D, generator=g, dtype=torch.float64)
    return {"x": x, "y": x.sum(1, keepdim=True).sin()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("out")
    parser.add_argument("mode", choices=["full", "killed", "resume"])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--no-random", action="store_true")
    parser.add_argument("--asynchronous", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    distributed = args.world > 1
    if distributed:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
        dist.init_process_group("gloo", rank=args.rank, world_size=args.world, timeout=timedelta(seconds=60))
    torch.manual_seed(1234 + args.rank)  # the generators the stages draw from, one per process
    drop = 0.0 if args.no_random else 0.2

    def body(p: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        h = torch.tanh(batch["x"] @ p["w"] + p["b"])
        return h * (torch.rand(h.shape, dtype=h.dtype) >= drop) / (1 - drop)

    def head(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        return (h + drop * torch.randn(h.shape, dtype=h.dtype)) @ p["head"]

    def loss_fn(y: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return ((y - batch["y"]) ** 2).mean()

    group = dist.group.WORLD if distributed else None
    step = fpipe.pipeline(loss_fn, [body, head], OneFOneB(num_microbatches=2), parallel=fpipe.Parallelism(group=group))
    g = torch.Generator().manual_seed(0)
    full = [
        {"w": torch.randn(D, 16, generator=g, dtype=torch.float64), "b": torch.zeros(16, dtype=torch.float64)},
        {"head": torch.randn(16, 1, generator=g, dtype=torch.float64)},
    ]
    params: list[Any] = [p if s in step.local_stages else None for s, p in enumerate(full)]
    opt = fpipe.optim.adamw(1e-2, weight_decay=0.01)
    state = opt.init(params)
    on = {"step": step} if distributed else {}
    position = 0
    if args.mode == "resume":
        resumed = fpipe.load_state(args.directory, params, optimizer_state=state, **on)
        params, state, position = resumed.params, resumed.optimizer_state, resumed.metadata["data_position"]
        assert resumed.step == position
    saver = fpipe.AsyncSaver(**on) if args.asynchronous else None
    losses = {}
    for i in range(position, args.steps):
        if i == args.kill_at:
            if saver is not None:
                saver.wait()
            if distributed:
                dist.barrier()  # every rank has finished step i - 1
            os.kill(os.getpid(), signal.SIGKILL)
        loss, grads = step(params, _batch(i) if not distributed or step.rank == 0 else None)
        params, state = opt.update(params, grads, state)
        losses[i] = loss
        if args.mode == "killed" and (i + 1) % args.every == 0:
            train_state = fpipe.TrainState(params, state, step=i + 1, metadata={"data_position": i + 1})
            if saver is not None:
                saver.save_state(args.directory, train_state)
            else:
                fpipe.save_state(args.directory, train_state, **on)
    out = f"{args.out}.rank{args.rank}" if distributed else args.out
    torch.save({"losses": losses, "params": params}, out)
    if distributed:
        dist.destroy_process_group()
        # Interpreter teardown with fpipe's watchdog thread still running sometimes aborts
        # ("terminate called without an active exception", seen without any save too): skip it.
        sys.stderr.flush()
        os._exit(0)


def run(rank: int, argv: list[str], stderr: str) -> None:
    """``python -m tests._resume_run *argv --rank rank 2> stderr``, in a forked process."""
    with open(stderr, "w") as file:
        os.dup2(file.fileno(), 2)  # warnings and tracebacks, as a subprocess's stderr
    main([*argv, "--rank", str(rank)])


if __name__ == "__main__":
    main()

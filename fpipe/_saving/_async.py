"""``fpipe.AsyncSaver``: saves written by a background thread while training goes on.

NOTE [asynchronous saves]
A save is two parts of very different cost::

    training thread  | step k | snapshot | step k+1 | step k+2 | ... | next save: wait, snapshot
    saver thread     |        |          hash, write, fsync, agree, commit |

1. The snapshot, on the caller's thread: every tensor copied to host memory (pinned for CUDA
   tensors, one synchronize), the arguments checked, the random generators captured
   (``save_state``). After it returns the caller may update its parameters in place.
2. The rest of ``fpipe.save`` on one background thread: hashing, writing, fsync, the ranks'
   agreement and the atomic commit, unchanged (NOTE [the save protocol] in
   ``fpipe/_saving/_save.py``), so the directory always holds a complete save and a process
   killed mid-write leaves the previous one loadable.

Distributed, the protocol's all-gathers run on the background thread while the training
thread runs the step's collectives. Two threads must not issue collectives on one process
group (the order in which they reach the other ranks is not defined), so the saver makes its
own copies of the pipeline and data-parallel groups (``dist.new_group`` over the same ranks)
once, when it is built, and saves only over them.

One save is in flight at a time: a new ``save`` first waits for the previous one. An error in
the background is raised by the next ``wait``, ``save`` or ``close`` (and the context manager's
exit), on every rank, as ``fpipe.save`` raises it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from .._distributed import Topology
from .._parallelism import Parallelism
from .._pytree import PyTree, map_tensors, stage_list
from .._sharding import ParallelView
from .._tensor_parallel import is_dtensor
from ._boxes import HostPiece, host_piece
from ._ranks import resolve
from ._save import prepare, save_ranks, write
from ._state import TrainState, prepare_state, write_state


class AsyncSaver:
    """Saves that are written in the background while training goes on (NOTE [asynchronous saves]).

    ``save`` and ``save_state`` take a snapshot of the tensors in host memory, return, and leave
    the writing and the atomic commit to a background thread; the result is what
    ``fpipe.save`` / ``fpipe.save_state`` would have written at the call, bitwise.

    Args:
        parallel: the ranks, as for ``fpipe.save``: the ``Step``, or an ``fpipe.Parallelism``
            (its ``timeout`` too). Distributed, every rank builds its saver at the same point (it
            creates process groups of its own for saving) and calls its ``save`` the same number
            of times, with the same directories.
        step: deprecated, as for ``fpipe.save``: ``parallel=``.
        group: deprecated, as for ``fpipe.save``: ``parallel=``.
        mesh: deprecated, as for ``fpipe.save``: ``parallel=``.
        timeout: deprecated, as for ``fpipe.save``: ``parallel=``.

    Examples:
        >>> import tempfile, torch, fpipe
        >>> directory = tempfile.mkdtemp()
        >>> params = [{"w": torch.zeros(3)}]
        >>> with fpipe.AsyncSaver() as saver:
        ...     saver.save(directory, params, metadata={"step": 1})
        ...     _ = params[0]["w"].add_(1.0)  # training goes on: the save keeps the values it was given
        >>> fpipe.load(directory, params).params[0]["w"]
        tensor([0., 0., 0.])
    """

    def __init__(
        self,
        *,
        parallel: Parallelism | ParallelView | None = None,
        step: Any = None,
        group: Any = None,
        mesh: Any = None,
        timeout: float | None = None,
    ):
        self._setup = resolve("AsyncSaver", parallel, step=step, group=group, mesh=mesh, timeout=timeout)
        self._topology = _own_groups(self._setup.topology)  # its saves' collectives: on groups of its own
        self._thread: threading.Thread | None = None
        self._result: Path | None = None
        self._error: BaseException | None = None

    def save(
        self,
        directory: str | os.PathLike[str],
        params: Sequence[PyTree],
        /,
        *,
        optimizer_state: Sequence[PyTree] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        """Start ``fpipe.save(directory, params, ...)`` in the background, after the previous save.

        Raises:
            Exception: the previous save's error, if it failed; ``fpipe.save``'s errors for the
                arguments.
        """
        self.wait()
        params = _snapshot("params", params)
        optimizer_state = None if optimizer_state is None else _snapshot("optimizer_state", optimizer_state)
        prepared = prepare(directory, params, optimizer_state, metadata, self._setup)
        ranks = save_ranks(self._topology, self._setup.timeout, prepared)
        self._start(lambda: write(prepared, ranks))

    def save_state(self, directory: str | os.PathLike[str], state: TrainState, /) -> None:
        """Start ``fpipe.save_state(directory, state)`` in the background, after the previous save.

        The random generators are captured now, at the call.

        Raises:
            Exception: the previous save's error, if it failed; ``fpipe.save_state``'s errors for
                the arguments.
        """
        self.wait()
        if isinstance(state, TrainState):
            optimizer_state = state.optimizer_state
            state = replace(
                state,
                params=_snapshot("params", state.params),
                optimizer_state=None if optimizer_state is None else _snapshot("optimizer_state", optimizer_state),
                extra=_snapshot("extra", [state.extra])[0] if isinstance(state.extra, dict) else state.extra,
            )
        prepared, mine = prepare_state(directory, state, self._setup)
        ranks = save_ranks(self._topology, self._setup.timeout, prepared)
        self._start(lambda: write_state(prepared, mine, ranks))

    def wait(self) -> Path | None:
        """Wait for the save in flight; the last committed version's directory (``None``: none yet).

        Raises:
            Exception: the error of the save in flight, once (the next ``wait`` does not raise it
                again).
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        return self._result

    def done(self) -> bool:
        """Whether no save is in flight (``wait`` would not block)."""
        return self._thread is None or not self._thread.is_alive()

    def close(self) -> None:
        """Wait for the save in flight, raising its error."""
        self.wait()

    def __enter__(self) -> AsyncSaver:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if error is None:
            self.wait()
        elif self._thread is not None:
            self._thread.join()  # the body's error is the one to raise

    def _start(self, work: Any) -> None:
        def run() -> None:
            try:
                self._result = work()
            except BaseException as error:  # raised by the next wait()
                self._error = error

        self._thread = threading.Thread(target=run, name="fpipe-save", daemon=False)
        self._thread.start()


def _own_groups(topology: Topology | None) -> Topology | None:
    """``topology`` with copies of its groups, for the saver's thread alone."""
    if topology is None:
        return None

    def copy(group: Any) -> Any:
        ranks = dist.get_process_group_ranks(group)
        return dist.new_group(ranks, use_local_synchronization=True)

    data_group, tensor_group, group, expert_group, expert_data_group = (
        None if g is None else copy(g)
        for g in (
            topology.data_group,
            topology.tensor_group,
            topology.group,
            topology.expert_group,
            topology.expert_data_group,
        )
    )
    # A failure of the job aborts them too, so a save in flight fails with it (NOTE [failure board]).
    topology.board.watch(
        [g for g in (group, data_group, tensor_group, expert_group, expert_data_group) if g is not None]
    )
    return replace(
        topology,
        group=group,
        data_group=data_group,
        tensor_group=tensor_group,
        expert_group=expert_group,
        expert_data_group=expert_data_group,
    )


def _snapshot(argument: str, trees: Sequence[PyTree]) -> list[PyTree]:
    """Host-memory copies of every tensor of ``trees`` (pinned for CUDA tensors)."""
    copies = [map_tensors(_host_copy, tree) for tree in stage_list("fpipe.save", argument, trees)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # no CUDA start
        torch.cuda.synchronize()  # the non-blocking copies are done
    return copies


def _host_copy(t: torch.Tensor) -> torch.Tensor | HostPiece:
    if is_dtensor(t):  # its local piece, with what the save needs to place it (NOTE [tensor-parallel saves])
        return host_piece(t, _host_copy)
    if t.device.type != "cuda":
        return t.detach().to("cpu", copy=True)
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t.detach(), non_blocking=True)

"""Waits and collectives (fpipe/_distributed/_collectives.py), their parts that need no peer: a
wait's failure as a ``PipelineError`` saying what was awaited, and a group marked unusable after a
failed step (device types in the handshake: tests/test_devices.py; multi-process runs:
tests/test_distributed.py)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fpipe import PipelineError, PipelineTimeoutError
from fpipe._distributed import Board, Topology, resolve_topology
from fpipe._distributed._collectives import check_usable, mark_broken, wait


class Work:
    """A posted operation whose ``wait`` returns, or raises ``error``."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.timeouts: list[timedelta] = []

    def wait(self, timeout: timedelta) -> None:
        self.timeouts.append(timeout)
        if self.error is not None:
            raise self.error


@pytest.fixture(scope="module")
def world() -> Iterator[None]:
    """A one-rank gloo group of this process alone (a store nobody else reads), destroyed after the module."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _board(world: None) -> Board:
    """A fresh job's failure board: one per process group (``resolve_topology``)."""
    topology = resolve_topology(None, dist.new_group([0]))
    assert topology is not None
    return topology.board


def test_a_wait_that_ends_says_nothing(world: None) -> None:
    work, asked = Work(), []
    wait(work, _board(world), timedelta(seconds=2), 0, lambda: asked.append(1) or "the loss")
    assert work.timeouts == [timedelta(seconds=2)] and asked == []  # ``what`` is only built on failure


def test_a_timed_out_wait_is_the_jobs_record_naming_what_was_awaited(world: None) -> None:
    """The first failure is the job's record (NOTE [failure board]): a later wait of the job,
    whatever its own error, reports it. Here no store answers, so the culprit is unknown."""
    board = _board(world)
    timed_out = RuntimeError("Timed out waiting 2500ms for recv")
    with pytest.raises(PipelineTimeoutError, match=r"rank 0 stopped while waiting for the loss because") as raised:
        wait(Work(timed_out), board, timedelta(seconds=2.5), 0, lambda: "the loss")
    assert "rank 0 timed out after 2.5 s" in str(raised.value) and raised.value.__cause__ is timed_out
    closed = RuntimeError("Connection closed by peer [127.0.0.1]:1234\nmore details")
    with pytest.raises(PipelineError, match=r"rank 0 stopped while waiting for x because .* timed out after 2.5 s"):
        wait(Work(closed), board, timedelta(seconds=1), 0, "x")


def _topology(group: Any) -> Topology:
    return Topology(group, 1, 2, (0, 1), None, 1, torch.device("cpu"), board=None)  # type: ignore[arg-type]


def test_a_failed_step_marks_its_group_unusable() -> None:
    group, other = object(), object()
    check_usable(_topology(group))
    mark_broken(_topology(group), ValueError("bad batch\nsecond line"))
    with pytest.raises(PipelineError, match=r"rank 1 cannot run a step: .* \(ValueError: bad batch\)"):
        check_usable(_topology(group))
    check_usable(_topology(other))  # another group is not affected


def test_sum_over_any_rank_and_one_writes_on_one_rank(world: None) -> None:
    """The collectives written once over a topology: a sum over the mesh dimensions it has (a
    group alone: only "pp"), an agreement on a flag, and one writer telling its outcome."""
    from fpipe._distributed import any_rank, one_writes, sum_over

    topology = resolve_topology(None, dist.new_group([0]))
    assert topology is not None and topology.data_group is None and topology.tensor_group is None
    total = torch.tensor([2.0, 3.0])
    sum_over(topology, ("pp", "dp", "tp"), [total], 5.0, "the test's sum")
    assert torch.equal(total, torch.tensor([2.0, 3.0]))  # one rank: the sum is its own
    assert any_rank(topology, ("pp", "dp", "tp"), True, 5.0, "the test's flag")
    assert not any_rank(topology, ("pp",), False, 5.0, "the test's flag")
    assert one_writes(topology, topology.group, lambda: "v1", 5.0, "the writer", "the others") == (True, "v1")
    assert one_writes(None, None, lambda: 7, 5.0, "the writer", "the others") == (True, 7)
    assert one_writes(topology, None, lambda: 8, 5.0, "the writer", "the others") == (True, 8)
    for alone in (None, topology):  # no group: this rank is the writer, so write= is needed
        with pytest.raises(ValueError, match=r"one_writes without a group has no writer to wait for \(the writer\)"):
            one_writes(alone, None, None, 5.0, "the writer", "the others")

    def fail() -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):  # the writer raises its own error once it has told
        one_writes(topology, topology.group, fail, 5.0, "the writer", "the others")


def test_norm_over_and_any_inf_nan_on_one_rank_and_in_one_process(world: None) -> None:
    """The global norm and the inf/nan agreement, over a topology (one rank: its own sums) and
    without one (one process: the values themselves)."""
    from fpipe._distributed import any_inf_nan, norm_over

    topology = resolve_topology(None, dist.new_group([0]))
    square_sum, five = torch.tensor(25.0, dtype=torch.float64), torch.tensor(5.0, dtype=torch.float64)
    for where in (topology, None):
        assert torch.equal(norm_over(where, ("pp", "tp", "dp"), square_sum, 5.0), five)
        assert any_inf_nan(where, 5.0, True) and not any_inf_nan(where, 5.0, False)

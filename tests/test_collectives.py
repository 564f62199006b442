"""Waits and collectives (fpipe/_distributed/_collectives.py), their parts that need no peer: a
wait's failure as a ``PipelineError`` saying what was awaited, and a group marked unusable after a
failed step (device types in the handshake: tests/test_devices.py; multi-process runs:
tests/test_distributed.py)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch

from fpipe import PipelineError, PipelineTimeoutError
from fpipe._distributed._collectives import check_usable, mark_broken, wait
from fpipe._distributed._topology import Topology


class Work:
    """A posted operation whose ``wait`` returns, or raises ``error``."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.timeouts: list[timedelta] = []

    def wait(self, timeout: timedelta) -> None:
        self.timeouts.append(timeout)
        if self.error is not None:
            raise self.error


def test_a_wait_that_ends_says_nothing() -> None:
    work, asked = Work(), []
    wait(work, timedelta(seconds=2), 0, lambda: asked.append(1) or "the loss")
    assert work.timeouts == [timedelta(seconds=2)] and asked == []  # ``what`` is only built on failure


def test_a_timed_out_wait_is_a_timeout_error_naming_what_was_awaited() -> None:
    with pytest.raises(PipelineTimeoutError, match=r"rank 3 timed out after 2.5 s waiting for the loss\.") as raised:
        wait(Work(RuntimeError("Timed out waiting 2500ms for recv")), timedelta(seconds=2.5), 3, lambda: "the loss")
    assert raised.value.rank == 3 and isinstance(raised.value.__cause__, RuntimeError)


def test_a_lost_peer_is_a_pipeline_error_with_the_backends_first_line() -> None:
    error = RuntimeError("Connection closed by peer [127.0.0.1]:1234\nmore details")
    with pytest.raises(PipelineError, match=r"rank 1 lost a peer while waiting for x \(Connection closed by peer") as e:
        wait(Work(error), timedelta(seconds=1), 1, "x")
    assert not isinstance(e.value, PipelineTimeoutError) and "more details" not in str(e.value)


def _topology(group: Any) -> Topology:
    return Topology(group, 1, 2, (0, 1), None, 1, torch.device("cpu"), board=None)  # type: ignore[arg-type]


def test_a_failed_step_marks_its_group_unusable() -> None:
    group, other = object(), object()
    check_usable(_topology(group))
    mark_broken(_topology(group), ValueError("bad batch\nsecond line"))
    with pytest.raises(PipelineError, match=r"rank 1 cannot run a step: .* \(ValueError: bad batch\)"):
        check_usable(_topology(group))
    check_usable(_topology(other))  # another group is not affected

"""The failure board's data (fpipe/_distributed/_board.py): a ``Failure`` crosses the store as
JSON unchanged and becomes the error each rank raises, the ``Board`` names ranks as messages do
and tells which ranks fell silent, and ``waiting`` marks a thread's outermost wait. In this
process, no group (whole failing jobs: test_faults.py)."""

from __future__ import annotations

import threading
import time

import pytest

from fpipe import PipelineError, PipelineTimeoutError
from fpipe._distributed._board import DIED, RAISED, SILENT, STALE, Board, Failure, waiting
from fpipe.schedules import Action


def board(me: int = 4) -> Board:
    """A job of global ranks 4 to 7: a dp 2 x pp 2 mesh, global rank 4 + 2 d + p."""
    names = {4 + 2 * d + p: (p, d) for d in range(2) for p in range(2)}
    labels = {g: f"rank {g - 4} (dp {d}, pp {p})" for g, (p, d) in names.items()}
    return Board("fpipe/0/", (4, 5, 6, 7), me, [], names, labels)


@pytest.mark.parametrize(
    "failure",
    [
        Failure(2, Action(3, "I", 1), RAISED, "raised ValueError", replica=1, name="rank 2 (dp 1, pp 0)"),
        Failure(0, Action(0, "W", 7), DIED, "died"),
        Failure(None, None, SILENT, "stopped answering"),
    ],
    ids=str,
)
def test_a_failure_crosses_the_store_unchanged(failure: Failure) -> None:
    assert Failure.from_json(failure.to_json()) == failure


def test_a_failure_is_named_by_the_board_s_labels() -> None:
    b = board()
    assert b.failure_of(7, DIED, "died") == Failure(1, None, DIED, "died", 1, "rank 3 (dp 1, pp 1)")
    assert b.failure_of(9, DIED, "died").subject() == "global rank 9"  # outside the job
    assert b.failure_of(None, SILENT, "went silent").subject() == "an unknown rank"
    assert Failure(3, None, DIED, "died").subject() == "rank 3"
    assert b.label() == "rank 0 (dp 0, pp 0)" and b.key() == "fpipe/0/failed"


def test_the_error_names_both_ranks_the_action_and_its_kind() -> None:
    b, action = board(me=5), Action(2, "F", 0)
    error = b.failure_of(6, RAISED, "raised ValueError", action).error(b, 1, while_="a cotangent")
    assert type(error) is PipelineError
    assert (error.rank, error.action, error.stage, error.microbatch) == (0, action, 2, 0)
    assert str(error) == (
        "fpipe: rank 1 (dp 0, pp 1) stopped while waiting for a cotangent "
        "because rank 2 (dp 1, pp 0) raised ValueError."
    )
    silent = b.failure_of(None, SILENT, "went silent").error(b, 1)
    assert type(silent) is PipelineTimeoutError and silent.rank == 1  # an unknown rank: this one's
    assert str(silent) == "fpipe: rank 1 (dp 0, pp 1) stopped because an unknown rank went silent."


def test_silent_ranks_are_those_whose_heartbeat_is_stale() -> None:
    now, b = time.monotonic(), board()
    assert b.silent() is None  # never read: unknown
    b.read_at, b.first_read = now, now
    b.beats = {5: (3, now), 6: (1, now - 10 * STALE)}  # 7 not seen yet, 4 is this rank
    assert b.silent() == [6]  # 7 may not have beaten this board yet
    b.first_read = now - 10 * STALE
    assert b.silent() == [6, 7]
    b.read_at = now - 10 * STALE
    assert b.silent() is None  # the store has not answered for that long


def test_waiting_marks_the_outermost_wait_of_each_thread() -> None:
    b = board()
    me = threading.get_ident()
    with waiting(b):
        began = b.waits[me]
        with waiting(b):  # a row inside a step: the outer wait goes on
            assert b.waits == {me: began}
        assert b.waits == {me: began}
        other: dict[int, float] = {}

        def elsewhere() -> None:
            with waiting(b):
                other.update(b.waits)

        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
        assert set(other) == {me, thread.ident}
    assert b.waits == {}
    with waiting(None):  # no board: nothing to mark
        pass

"""Programs as CSV, in the format of ``torch.distributed.pipelining``'s schedules.

``PipelineScheduleMulti._dump_csv`` writes one row per rank with ``csv.writer``: each cell an
action in the same compact notation as fpipe's (``2F0``, ``1I3``), an empty cell for an idle
slot. Its ``_load_csv`` reads rows back with ``csv.reader``. The lowered ("compute_comms") form
adds communication and sharding actions (``1SEND_F0``, ``0RECV_B2``, ``3UNSHARD``,
``2REDUCE_GRAD``; from torch 2.15 also the waits ``1WAIT_SEND_F0`` and ``2WAIT_REDUCE_GRAD``),
and DualPipe's schedules group a forward and a backward that overlap as ``(0F1;3B0)OVERLAP_F_B``.
For example, 1F1B with 2 ranks and 2 microbatches::

    0F0,0F1,0B0,0B1
    1F0,1B0,1F1,1B1

``load_csv`` reads all of that (idle cells skipped, overlapped pairs run one after the other,
communication dropped on request: fpipe's executors send and receive themselves); ``dump_csv``
writes the compute-only form, which torch's ``_load_csv`` reads.
"""

from __future__ import annotations

import contextlib
import csv
import os
import re
from typing import Literal, TextIO

from ._action import Action
from ._program import Program, ScheduleError, checked_program

_COMPUTE = re.compile(r"(\d+)([FBIW])(\d+)")
# torch 2.15 adds the waits that close a send or a gradient reduction (``0WAIT_SEND_F1``,
# ``1WAIT_REDUCE_GRAD``) to the lowered form; older releases write none, and the pattern reads both.
_COMMUNICATION = re.compile(
    r"(\d+)(WAIT_REDUCE_GRAD|WAIT_SEND_F|WAIT_SEND_B|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)"
)
_OVERLAP = re.compile(r"\((.*)\)OVERLAP_F_B")

PathOrFile = str | os.PathLike[str] | TextIO


def dump_csv(program: Program, file: PathOrFile) -> None:
    """Write ``program`` as CSV, one row per rank, in torch's compute-only format.

    Args:
        program: the program to write.
        file: a path, or a text file opened with ``newline=""`` (as the ``csv`` module wants).
    """
    program = checked_program("dump_csv", program)
    with _opened(file, "w") as f:
        csv.writer(f).writerows([str(a) for a in row] for row in program.ranks)


def load_csv(
    file: PathOrFile,
    *,
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    skip_communication: bool = False,
) -> Program:
    """Read a program from CSV in torch's format: row ``r`` is rank ``r``'s actions.

    Args:
        file: a path, or a text file opened with ``newline=""``.
        num_stages: the stage count; default one more than the largest stage mentioned.
        num_microbatches: the microbatch count; default one more than the largest used.
        skip_communication: drop torch's communication and sharding actions (``SEND_F``,
            ``RECV_B``, ``WAIT_SEND_F``, ``UNSHARD``, ``REDUCE_GRAD``...) instead of rejecting them.

    Returns:
        The program, not validated (``fpipe.pipeline`` validates; or call ``validate``).

    Raises:
        ScheduleError: on a cell that is not an action, or a communication action without
            ``skip_communication``.
    """
    with _opened(file, "r") as f:
        rows = list(csv.reader(f))
    ranks = [
        [a for column, cell in enumerate(row) for a in _parse_cell(cell.strip(), r, column, skip_communication)]
        for r, row in enumerate(rows)
    ]
    return Program.from_lists(ranks, num_stages=num_stages, num_microbatches=num_microbatches)


def _opened(file: PathOrFile, mode: Literal["r", "w"]) -> contextlib.AbstractContextManager[TextIO]:
    """``file`` opened as the ``csv`` module wants it, or left open when it is a file already."""
    if isinstance(file, (str, os.PathLike)):
        return open(file, mode, newline="", encoding="utf-8")
    return contextlib.nullcontext(file)


def _parse_cell(cell: str, rank: int, column: int, skip_communication: bool) -> list[Action]:
    if not cell:
        return []  # an idle slot
    if match := _COMPUTE.fullmatch(cell):
        return [Action(int(match.group(1)), match.group(2), int(match.group(3)))]
    if match := _OVERLAP.fullmatch(cell):
        return [a for part in match.group(1).split(";") for a in _parse_cell(part.strip(), rank, column, False)]
    if _COMMUNICATION.fullmatch(cell):
        if skip_communication:
            return []
        raise ScheduleError(
            f"fpipe.schedules.load_csv: rank {rank}, column {column} holds the communication action {cell!r}. "
            "fpipe sends and receives by itself: pass skip_communication=True, or dump torch's schedule "
            'with format="compute_only".'
        )
    raise ScheduleError(
        f"fpipe.schedules.load_csv: rank {rank}, column {column} holds {cell!r}, which is not an action. "
        "Cells are <stage><F|B|I|W><microbatch> such as '2F0', or empty for an idle slot."
    )

"""What every built-in schedule checks of its arguments: positive counts, and the ranks its placement needs.

The schedules are frozen dataclasses of counts (``num_microbatches``, ``stages_per_rank``) built on
``BuiltinSchedule``, which checks each. Two placements serve every built-in schedule: looped (stage
``s`` on rank ``s % p``: GPipe, 1F1B, interleaved 1F1B, looped BFS) and the V (rank ``r`` holds
stages ``r`` and ``2p - 1 - r``: ZB-V, DualPipeV). ``looped_ranks`` and ``v_ranks`` give the rank
count of each, or a ``ScheduleError`` that names the schedule, both counts and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from .._plural import plural
from ._program import ScheduleError


@dataclass(frozen=True)
class BuiltinSchedule:
    """The base of the built-in schedules: every field is a count, rejected unless a positive int
    (or left at ``None`` where that is the field's default)."""

    num_microbatches: int

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if value is None and field.default is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ScheduleError(
                    f"fpipe.schedules.{type(self).__name__}: {field.name} must be a positive int "
                    f"({field.name}: {value!r})."
                )


def looped_ranks(name: str, num_stages: int, num_ranks: int | None, stages_per_rank: int = 1) -> int:
    """The rank count of a looped placement (stage ``s`` on rank ``s % p``), checked; by default
    ``num_stages // stages_per_rank``, which must then divide evenly."""
    if num_ranks is None and num_stages % stages_per_rank:
        v = stages_per_rank
        raise ScheduleError(
            f"fpipe.schedules.{name}: {plural(num_stages, 'stage')} cannot be spread {v} per rank "
            f"(stages_per_rank: {v}). Use a stage count divisible by {v}."
        )
    p = num_stages // stages_per_rank if num_ranks is None else num_ranks
    if p < 1 or num_stages < 1 or num_stages % p:
        raise ScheduleError(
            f"fpipe.schedules.{name}: {plural(num_stages, 'stage')} cannot be laid out on {plural(p, 'rank')} "
            f"(num_stages: {num_stages}, num_ranks: {p}). Use a stage count that is a positive multiple "
            "of the number of ranks."
        )
    return p


def v_ranks(name: str, num_stages: int, num_ranks: int | None) -> int:
    """The rank count of a V placement (rank ``r`` holds stages ``r`` and ``2p-1-r``), checked."""
    if num_stages < 2 or num_stages % 2:
        raise ScheduleError(
            f"fpipe.schedules.{name}: the V places two stages on each rank, so the stage count must "
            f"be even (num_stages: {num_stages}). Split the model into 2 x (number of ranks) stages."
        )
    p = num_stages // 2
    if num_ranks is not None and num_ranks != p:
        raise ScheduleError(
            f"fpipe.schedules.{name}: {num_stages} stages in a V need {plural(p, 'rank')} "
            f"(num_stages: {num_stages}, num_ranks: {num_ranks}). Use 2 x {num_ranks} = {2 * num_ranks} stages."
        )
    return p

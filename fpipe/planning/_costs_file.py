"""Per-stage costs on disk: ``save_costs`` writes what ``fit_costs`` measured, ``load_costs`` reads it
back (for ``python -m fpipe plan --costs``).

The file is JSON, one object per stage with ``Costs``' fields::

    {"format": "fpipe.costs", "version": 1,
     "stages": [{"forward": 0.0012, "backward_input": 0.0013, "backward_weight": 0.0011,
                 "backward": null, "send": 0.0001, "overhead": 0.00002, "receive": 0.0003}, ...]}

A stage without ``overhead`` or ``receive`` (a file written before they existed) gets 0.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, fields
from typing import Any

from .._plural import brief
from ..schedules import Costs, ScheduleError

_FORMAT, _VERSION = "fpipe.costs", 1
_FIELDS = tuple(f.name for f in fields(Costs))


def save_costs(path: str | os.PathLike[str], costs: Sequence[Costs]) -> None:
    """Write one ``Costs`` per stage to ``path`` as JSON (the module docstring's format).

    Measured costs (``fit_costs(recording.timelines)``) saved this way feed
    ``python -m fpipe plan --costs costs.json``.

    Examples:
        >>> import os, tempfile
        >>> from fpipe.planning import load_costs, save_costs
        >>> from fpipe.schedules import Costs
        >>> path = os.path.join(tempfile.mkdtemp(), "costs.json")
        >>> save_costs(path, [Costs(forward=1.5, send=0.25), Costs(forward=2.0, backward=3.0)])
        >>> [(c.forward, c.of("B"), c.send) for c in load_costs(path)]
        [(1.5, 2.0, 0.25), (2.0, 3.0, 0.0)]

    Raises:
        TypeError: if ``costs`` is not a sequence of ``Costs``.
        ValueError: if it is empty (``load_costs`` would refuse the file).
        OSError: if the file cannot be written.
    """
    if isinstance(costs, Costs) or not isinstance(costs, Sequence) or not all(isinstance(c, Costs) for c in costs):
        raise TypeError(
            f"fpipe.planning.save_costs: costs must be a sequence of one Costs per stage (costs: {brief(costs)}). "
            "Pass what fit_costs returns."
        )
    if not costs:
        raise ValueError("fpipe.planning.save_costs: costs is empty; a file needs one Costs per stage (costs: []).")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"format": _FORMAT, "version": _VERSION, "stages": [asdict(c) for c in costs]}, f, indent=1)
        f.write("\n")


def load_costs(path: str | os.PathLike[str]) -> tuple[Costs, ...]:
    """The per-stage ``Costs`` that ``save_costs`` wrote to ``path``.

    Raises:
        ScheduleError: for a file that is not such JSON, or a cost ``Costs`` rejects (negative,
            zero or not finite), naming the stage.
        OSError: if the file cannot be read.
    """
    with open(path, encoding="utf-8") as f:
        try:
            data: Any = json.load(f)
        except json.JSONDecodeError as error:
            raise ScheduleError(f"fpipe.planning.load_costs: {os.fspath(path)} is not JSON ({error}).") from None
    ours = isinstance(data, dict) and data.get("format") == _FORMAT and data.get("version") == _VERSION
    stages = data.get("stages") if ours else None
    if not isinstance(stages, list) or not stages:
        raise ScheduleError(
            f"fpipe.planning.load_costs: {os.fspath(path)} holds no {_FORMAT} version {_VERSION} costs "
            "(a JSON object with a non-empty list under 'stages'). Write it with fpipe.planning.save_costs."
        )
    costs = []
    for s, stage in enumerate(stages):
        if not isinstance(stage, dict) or not set(stage) <= set(_FIELDS) or "forward" not in stage:
            raise ScheduleError(
                f"fpipe.planning.load_costs: stage {s} of {os.fspath(path)} is not a Costs (stage {s}: {stage!r}). "
                f"Its fields are {', '.join(_FIELDS)}."
            )
        try:
            costs.append(Costs(**stage))
        except ScheduleError as error:
            raise ScheduleError(f"fpipe.planning.load_costs: stage {s} of {os.fspath(path)}: {error}") from None
    return tuple(costs)

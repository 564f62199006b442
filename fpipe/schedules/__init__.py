"""Schedules as data: actions, programs, their validation and pictures, and the schedules themselves.

A schedule is a value (``GPipe(num_microbatches=8)``) whose ``program(num_stages)`` returns a
``Program``: one ordered list of ``Action`` per rank. Programs can be written by hand too, or read
from torch's CSV format (``load_csv``). ``placement(schedule, num_stages)`` says which rank holds
each stage; ``simulate`` replays a program with costs to measure its bubble and memory (and
``replay`` reruns a measured timeline with its own durations, e.g. to find its critical path);
and ``terminal_grid``, ``chrome_trace`` and ``svg`` draw it (also ``python -m fpipe show``).
Finding programs for measured costs (``search``, ``tune``, ``fit_costs``) is
``fpipe.planning``'s, which this package never imports.
"""

import importlib as _importlib
import warnings as _warnings

from ._action import Action as Action
from ._controllable_memory import VHalf as VHalf
from ._controllable_memory import VMin as VMin
from ._csv import dump_csv as dump_csv
from ._csv import load_csv as load_csv
from ._dual_pipe import DualPipe as DualPipe
from ._dual_pipe_v import DualPipeV as DualPipeV
from ._gpipe import GPipe as GPipe
from ._interleaved import Interleaved1F1B as Interleaved1F1B
from ._interleaved_zero_bubble import InterleavedZeroBubble as InterleavedZeroBubble
from ._looped_bfs import LoopedBFS as LoopedBFS
from ._one_f_one_b import OneFOneB as OneFOneB
from ._overlapped import Overlapped as Overlapped
from ._pictures import chrome_trace as chrome_trace
from ._pictures import svg as svg
from ._pictures import terminal_grid as terminal_grid
from ._program import Program as Program
from ._program import Schedule as Schedule
from ._program import ScheduleError as ScheduleError
from ._program import execution_order as execution_order
from ._program import placement as placement
from ._program import render as render
from ._program import ticks_of as ticks_of
from ._program import validate as validate
from ._simulate import Costs as Costs
from ._simulate import Simulation as Simulation
from ._simulate import replay as replay
from ._simulate import simulate as simulate
from ._zero_bubble_h1 import ZeroBubbleH1 as ZeroBubbleH1
from ._zero_bubble_h2 import ZeroBubbleH2 as ZeroBubbleH2
from ._zero_bubble_v import ZeroBubbleV as ZeroBubbleV

__all__ = [
    "Action",
    "Costs",
    "DualPipe",
    "DualPipeV",
    "GPipe",
    "Interleaved1F1B",
    "InterleavedZeroBubble",
    "LoopedBFS",
    "OneFOneB",
    "Overlapped",
    "Program",
    "Schedule",
    "ScheduleError",
    "Simulation",
    "VHalf",
    "VMin",
    "ZeroBubbleH1",
    "ZeroBubbleH2",
    "ZeroBubbleV",
    "chrome_trace",
    "dump_csv",
    "execution_order",
    "load_csv",
    "placement",
    "render",
    "replay",
    "simulate",
    "svg",
    "terminal_grid",
    "ticks_of",
    "validate",
]


# Moved to fpipe.planning; their old names here work for one release, with a warning. The
# package is reached by name on first use, never at import: schedules imports nothing from it.
_MOVED = ("Measured", "Searched", "Tuned", "fit_costs", "load_costs", "save_costs", "search", "tune")
# Renamed so that each word has one meaning ("timeline": a Simulation, as Recording.timeline).
_RENAMED = {"timeline": "ticks_of"}


def __getattr__(name: str) -> object:
    """The names that moved to ``fpipe.planning`` (``fpipe.schedules.search``, ...) or were renamed
    (``timeline``, now ``ticks_of``): the new one, with a ``DeprecationWarning`` naming it."""
    if name in _RENAMED:
        new = _RENAMED[name]
        _warnings.warn(
            f"fpipe.schedules.{name} is now fpipe.schedules.{new} (each action's tick at unit cost; a timeline is "
            f"a Simulation, as Recording.timeline); the old name goes in the next release.",
            DeprecationWarning,
            stacklevel=2,
        )
        return globals()[new]
    if name not in _MOVED:
        raise AttributeError(f"module 'fpipe.schedules' has no attribute {name!r}")
    _warnings.warn(
        f"fpipe.schedules.{name} moved to fpipe.planning.{name}; the old name goes in the next release. "
        f"Import it from there: from fpipe.planning import {name}.",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(_importlib.import_module("fpipe.planning"), name)

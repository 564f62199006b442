"""Schedules as data: actions, programs, their validation and pictures, and the schedules themselves.

A schedule is a value (``GPipe(num_microbatches=8)``) whose ``program(num_stages)`` returns a
``Program``: one ordered list of ``Action`` per rank. Programs can be written by hand too, or read
from torch's CSV format (``load_csv``). ``placement(schedule, num_stages)`` says which rank holds
each stage; ``simulate`` replays a program with costs to measure its bubble and memory (and
``fit_costs`` reads per-stage costs off a measured timeline, ``save_costs`` and ``load_costs``
keep them in a JSON file, ``replay`` reruns one with its own durations, e.g. to find its critical
path); ``search`` finds the fastest program it can for given costs, placement and memory limit,
never slower than a built-in schedule that fits, and ``tune`` times its fastest few with
the caller's step and keeps the measured fastest; and ``terminal_grid``, ``chrome_trace`` and
``svg`` draw it (also ``python -m fpipe show``).
"""

from ._action import Action as Action
from ._controllable_memory import VHalf as VHalf
from ._controllable_memory import VMin as VMin
from ._costs_file import load_costs as load_costs
from ._costs_file import save_costs as save_costs
from ._csv import dump_csv as dump_csv
from ._csv import load_csv as load_csv
from ._dual_pipe_v import DualPipeV as DualPipeV
from ._gpipe import GPipe as GPipe
from ._interleaved import Interleaved1F1B as Interleaved1F1B
from ._interleaved_zero_bubble import InterleavedZeroBubble as InterleavedZeroBubble
from ._looped_bfs import LoopedBFS as LoopedBFS
from ._one_f_one_b import OneFOneB as OneFOneB
from ._pictures import chrome_trace as chrome_trace
from ._pictures import svg as svg
from ._pictures import terminal_grid as terminal_grid
from ._program import Program as Program
from ._program import Schedule as Schedule
from ._program import ScheduleError as ScheduleError
from ._program import execution_order as execution_order
from ._program import placement as placement
from ._program import render as render
from ._program import timeline as timeline
from ._program import validate as validate
from ._search import Searched as Searched
from ._search import search as search
from ._simulate import Costs as Costs
from ._simulate import Simulation as Simulation
from ._simulate import fit_costs as fit_costs
from ._simulate import replay as replay
from ._simulate import simulate as simulate
from ._tune import Measured as Measured
from ._tune import Tuned as Tuned
from ._tune import tune as tune
from ._zero_bubble_h1 import ZeroBubbleH1 as ZeroBubbleH1
from ._zero_bubble_h2 import ZeroBubbleH2 as ZeroBubbleH2
from ._zero_bubble_v import ZeroBubbleV as ZeroBubbleV

__all__ = [
    "Action",
    "Costs",
    "DualPipeV",
    "GPipe",
    "Interleaved1F1B",
    "InterleavedZeroBubble",
    "LoopedBFS",
    "Measured",
    "OneFOneB",
    "Program",
    "Schedule",
    "ScheduleError",
    "Searched",
    "Simulation",
    "Tuned",
    "VHalf",
    "VMin",
    "ZeroBubbleH1",
    "ZeroBubbleH2",
    "ZeroBubbleV",
    "chrome_trace",
    "dump_csv",
    "execution_order",
    "fit_costs",
    "load_costs",
    "load_csv",
    "placement",
    "render",
    "replay",
    "save_costs",
    "search",
    "simulate",
    "svg",
    "terminal_grid",
    "timeline",
    "tune",
    "validate",
]

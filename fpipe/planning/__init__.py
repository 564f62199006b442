"""Planning: programs and splits found for measured costs, on top of the schedules as data.

``fit_costs`` reads per-stage ``Costs`` off a measured timeline (``save_costs`` and
``load_costs`` keep them in a file); ``search`` finds the fastest program it can for given
costs, placement and memory limit, never slower than a built-in schedule that fits, with a
lower bound to judge it by (and an exact search on small problems); ``tune`` times its fastest
few with the caller's step and keeps the measured fastest; ``partition`` and ``split_for`` cut
layers into stages (evenly, or fastest for a program); ``plan`` predicts every schedule's step
for a transformer on a device or for measured costs (``python -m fpipe plan``). README.md says
what each module owns.
"""

from ._cost_model import Device as Device
from ._cost_model import Experts as Experts
from ._cost_model import Transformer as Transformer
from ._costs_file import load_costs as load_costs
from ._costs_file import save_costs as save_costs
from ._fit import fit_costs as fit_costs
from ._partition import partition as partition
from ._plan import Plan as Plan
from ._plan import plan as plan
from ._ranking import PlanError as PlanError
from ._ranking import PlanRow as PlanRow
from ._schedule_split import split_for as split_for
from ._search import Searched as Searched
from ._search import search as search
from ._tune import Measured as Measured
from ._tune import Tuned as Tuned
from ._tune import tune as tune

__all__ = [
    "Device",
    "Experts",
    "Measured",
    "Plan",
    "PlanError",
    "PlanRow",
    "Searched",
    "Transformer",
    "Tuned",
    "fit_costs",
    "load_costs",
    "partition",
    "plan",
    "save_costs",
    "search",
    "split_for",
    "tune",
]

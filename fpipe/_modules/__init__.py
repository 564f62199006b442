"""From ``nn.Module`` to pipeline stages: what the rest of fpipe may use.

``functionalize`` (a module as a pure function), ``split_module`` (a module into stages),
``sum_tied`` (gradients of parameters shared by stages), ``balance`` (split points), and for the
planner ``partition`` (the min-max split) and ``split_for`` (the split for a schedule). README.md
says what each module owns.
"""

from ._balance import balance as balance
from ._functionalize import functionalize as functionalize
from ._partition import partition as partition
from ._schedule_split import split_for as split_for
from ._split import split_module as split_module
from ._tied import sum_tied as sum_tied

__all__ = [
    "balance",
    "functionalize",
    "partition",
    "split_for",
    "split_module",
    "sum_tied",
]

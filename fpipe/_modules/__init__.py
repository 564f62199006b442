"""From ``nn.Module`` to pipeline stages: what the rest of fpipe may use.

``functionalize`` (a module as a pure function), ``split_module`` (a module into stages),
``sum_tied`` (gradients of parameters shared by stages) and ``balance`` (split points, by
``fpipe.planning``'s ``partition`` and ``split_for``). README.md says what each module owns.
"""

from ._balance import balance as balance
from ._functionalize import functionalize as functionalize
from ._split import split_module as split_module
from ._tied import sum_tied as sum_tied

__all__ = [
    "balance",
    "functionalize",
    "split_module",
    "sum_tied",
]

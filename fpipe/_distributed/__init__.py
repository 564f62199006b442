"""A step as one rank of many over torch.distributed: what the rest of fpipe may use.

Where a process sits (``Topology``), the waits and collectives every distributed part of fpipe
goes through, the wire's byte views, and the runtime ``Step`` calls. README.md says what each
module owns.
"""

from ._board import Board as Board
from ._collectives import all_gather_json as all_gather_json
from ._collectives import all_reduce_sum as all_reduce_sum
from ._collectives import any_inf_nan as any_inf_nan
from ._collectives import any_rank as any_rank
from ._collectives import gather_over as gather_over
from ._collectives import norm_over as norm_over
from ._collectives import one_writes as one_writes
from ._collectives import sum_over as sum_over
from ._collectives import wait as wait
from ._collectives import watched as watched
from ._compiled import CompiledRows as CompiledRows
from ._rank_step import average_loss as average_loss
from ._rank_step import replica_mean as replica_mean
from ._rank_step import run_distributed as run_distributed
from ._status import Status as Status
from ._topology import Topology as Topology
from ._topology import mesh_roles as mesh_roles
from ._topology import resolve_topology as resolve_topology
from ._transport import WireState as WireState
from ._wire import as_bytes as as_bytes
from ._wire import tensor_bytes as tensor_bytes

__all__ = [
    "Board",
    "CompiledRows",
    "Status",
    "Topology",
    "WireState",
    "all_gather_json",
    "all_reduce_sum",
    "any_inf_nan",
    "any_rank",
    "as_bytes",
    "average_loss",
    "gather_over",
    "mesh_roles",
    "norm_over",
    "one_writes",
    "replica_mean",
    "resolve_topology",
    "run_distributed",
    "sum_over",
    "tensor_bytes",
    "wait",
    "watched",
]

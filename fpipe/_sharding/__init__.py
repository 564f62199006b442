"""Sharded data parallel under the pipeline: what the rest of fpipe may use.

``fpipe.shard`` and ``fpipe.gather``, the shard layouts ``Step`` keeps, the sharded stage runs it
builds, and ``ParallelView``: what sharding and saving read of a step. README.md says what each module owns.
"""

from ._layout import StageLayout as StageLayout
from ._layout import check_shards as check_shards
from ._layout import cut_range as cut_range
from ._layout import data_parallel as data_parallel
from ._layout import norm_leaves as norm_leaves
from ._public import ParallelView as ParallelView
from ._public import gather as gather
from ._public import shard as shard
from ._stages import ShardedStages as ShardedStages
from ._stages import gather_stages as gather_stages
from ._stages import gathered as gathered
from ._stages import reduce_scattered as reduce_scattered
from ._stages import shard_stages as shard_stages

__all__ = [
    "ParallelView",
    "ShardedStages",
    "StageLayout",
    "check_shards",
    "cut_range",
    "data_parallel",
    "gather",
    "gather_stages",
    "gathered",
    "norm_leaves",
    "reduce_scattered",
    "shard",
    "shard_stages",
]

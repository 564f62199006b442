"""fpipe: pipeline-parallel training in PyTorch as a functional transform.

``step = fpipe.pipeline(loss_fn, stages, schedule)`` turns pure stage functions
``stage(params_i, x) -> y`` and a schedule (plain data, see ``fpipe.schedules``) into
``loss, grads = step(params, batch)``.
"""

from . import schedules as schedules
from ._api import Step as Step
from ._api import pipeline as pipeline
from ._errors import PipelineError as PipelineError
from ._errors import PipelineTimeoutError as PipelineTimeoutError
from ._microbatch import Microbatches as Microbatches
from ._modules._balance import balance as balance
from ._modules._functionalize import functionalize as functionalize
from ._modules._split import split_module as split_module
from ._modules._tied import sum_tied as sum_tied
from ._record import Recording as Recording
from ._record import record as record
from ._saving._load import load as load
from ._saving._save import save as save
from ._sharding._public import gather as gather
from ._sharding._public import shard as shard

__all__ = [
    "Microbatches",
    "PipelineError",
    "PipelineTimeoutError",
    "Recording",
    "Step",
    "balance",
    "functionalize",
    "gather",
    "load",
    "pipeline",
    "record",
    "save",
    "schedules",
    "shard",
    "split_module",
    "sum_tied",
]

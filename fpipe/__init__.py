"""fpipe: pipeline-parallel training in PyTorch as a functional transform.

``step = fpipe.pipeline(loss_fn, stages, schedule)`` turns pure stage functions
``stage(params_i, x) -> y`` and a schedule (plain data, see ``fpipe.schedules``) into
``loss, grads = step(params, batch)``. ``fpipe.planning`` finds programs and splits for measured
costs (``search``, ``tune``, ``fit_costs``, ``plan``).
"""

from . import moe as moe
from . import optim as optim
from . import planning as planning
from . import schedules as schedules
from ._api import Step as Step
from ._api import pipeline as pipeline
from ._compile import Compile as Compile
from ._errors import PipelineError as PipelineError
from ._errors import PipelineTimeoutError as PipelineTimeoutError
from ._microbatch import Microbatches as Microbatches
from ._modules import balance as balance
from ._modules import functionalize as functionalize
from ._modules import split_module as split_module
from ._modules import sum_tied as sum_tied
from ._pairs import communication_point as communication_point
from ._parallelism import Parallelism as Parallelism
from ._precision import LossScale as LossScale
from ._precision import LossScaleState as LossScaleState
from ._precision import Precision as Precision
from ._random import StageInfo as StageInfo
from ._random import stage_info as stage_info
from ._record import Recording as Recording
from ._record import record as record
from ._saving import AsyncSaver as AsyncSaver
from ._saving import TrainState as TrainState
from ._saving import load as load
from ._saving import load_hf as load_hf
from ._saving import load_state as load_state
from ._saving import save as save
from ._saving import save_hf as save_hf
from ._saving import save_state as save_state
from ._sharding import gather as gather
from ._sharding import shard as shard

__all__ = [
    "AsyncSaver",
    "Compile",
    "LossScale",
    "LossScaleState",
    "Microbatches",
    "Parallelism",
    "PipelineError",
    "PipelineTimeoutError",
    "Precision",
    "Recording",
    "StageInfo",
    "Step",
    "TrainState",
    "balance",
    "communication_point",
    "functionalize",
    "gather",
    "load",
    "load_hf",
    "load_state",
    "moe",
    "optim",
    "pipeline",
    "planning",
    "record",
    "save",
    "save_hf",
    "save_state",
    "schedules",
    "shard",
    "split_module",
    "stage_info",
    "sum_tied",
]
